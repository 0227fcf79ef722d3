"""Run by tests/model/test_matrix_contract.py: the hidden-state path (a fused linear cross-entropy that never calls the
head) and the gradient statistics under FSDP2 ``fully_shard`` on 2 CPU processes (gloo), for every resharding
setting of the root and of the layer, headwatch attached before and after ``fully_shard``, tied and untied, the fused
loss named by ``hidden_module=`` or the hidden states found as a Hugging Face model's (no argument); rank 0
also trains a one-process twin on the same global batches and writes both runs' values and warnings.

usage: python tests/workers/fsdp_fused.py OUT_DIR PORT
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

V, D, STEPS = 63, 16, 2
# (root reshard_after_forward, layer reshard_after_forward, attach before fully_shard)
SETTINGS = [(True, True, False), (True, True, True), (False, False, False), (True, False, False), (False, True, True)]


class FusedLoss(nn.Module):
    """Liger's / CCE's shape: the loss from the final hidden states and the head's weight, no logits kept."""

    reference: list[dict[str, float]] | None = None
    """When a list: float64 entropy and target NLL of each forward's logits, appended (the independent reference)."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (N, d): the positions that predict a label
        y = labels[:, 1:].reshape(-1)
        if self.reference is not None:
            with torch.no_grad():
                logp = torch.log_softmax(h.double() @ weight.double().T, dim=-1)  # (N, V), float64
                entropy = -(logp.exp() * logp).sum(-1).mean()
                nll = -logp.gather(1, y.view(-1, 1)).mean()
                self.reference.append({"entropy": float(entropy), "target_nll": float(nll)})
        return F.cross_entropy(h @ weight.T, y)


class Base(nn.Module):
    """The inner model: its output's ``last_hidden_state`` is the head's full input (Hugging Face's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)

    def forward(self, input_ids: torch.Tensor) -> BaseModelOutput:
        h = self.embed_tokens(input_ids)  # (B, T, d)
        return BaseModelOutput(last_hidden_state=h + torch.tanh(self.mix(h)))


class LM(nn.Module):
    """A causal LM whose loss is fused; headwatch finds its head by name only (no owner: measured at the step's end)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = Base()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.loss_fn = FusedLoss()
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> CausalLMOutput:
        h = self.model(input_ids).last_hidden_state
        return CausalLMOutput(loss=self.loss_fn(h, self.lm_head.weight, labels))  # the head never runs, no logits


class HFShapedLM(LM):
    """The same, shaped as Hugging Face's (``base_model``, ``get_output_embeddings``): the hidden states are the base
    model's ``last_hidden_state``, measured in the owner's forward hook, without ``hidden_module=``."""

    base_model_prefix = "model"

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def monitors(named: bool):
    """``named``: the fused loss named by ``hidden_module=`` (on :class:`LM`); else none (on :class:`HFShapedLM`)."""
    from headwatch.core.gradients import GradientDensity
    from headwatch.core.logits import LogitStats

    return [LogitStats(hidden_module="loss_fn" if named else None), GradientDensity(frequency=None)]


def train(model, hw, data, rank: int, world: int) -> list[dict[str, float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step, batch in enumerate(data):
        x = batch[rank::world]  # this process's half of the global batch
        hw.step_start({"input_ids": x, "labels": x}, step)
        model(x, x).loss.backward()
        hw.before_optimizer_step()
        opt.step()
        hw.after_optimizer_step()
        opt.zero_grad()
        out.append(hw.step_end())
    return out


def work(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    from headwatch import Headwatch
    from headwatch.core import NoReducer

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, V, (8, 10), generator=g) for _ in range(STEPS)]
    result = []
    for named, tied, (root, layer, before) in itertools.product((True, False), (True, False), SETTINGS):
        torch.manual_seed(0)
        model = (LM if named else HFShapedLM)(tied)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hw = Headwatch(model, monitors=monitors(named), log_every_n_steps=1, figure_every_n_steps=0) if before else None
            fully_shard(model.model.mix, reshard_after_forward=layer)
            fully_shard(model, reshard_after_forward=root)
            if hw is None:
                hw = Headwatch(model, monitors=monitors(named), log_every_n_steps=1, figure_every_n_steps=0)
            sharded = train(model, hw, data, rank, 2)
            hw.close()
        said = [str(w.message) for w in caught if "headwatch" in str(w.message).lower() or "Monitor" in str(w.message)]
        entry = {"named": named, "tied": tied, "root": root, "layer": layer, "before": before, "sharded": sharded, "warnings": said}
        if rank == 0:
            torch.manual_seed(0)
            twin = (LM if named else HFShapedLM)(tied)
            twin.loss_fn.reference = []
            hw1 = Headwatch(twin, monitors=monitors(named), log_every_n_steps=1, figure_every_n_steps=0, reducer=NoReducer())
            entry["single"] = train(twin, hw1, data, 0, 1)
            entry["reference"] = twin.loss_fn.reference
            hw1.close()
        result.append(entry)
    Path(out_dir, f"fused_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import headwatch  # noqa: F401 - imported once, before the processes are forked (spawned, each would import it)

    mp.start_processes(work, args=(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "29541"), nprocs=2, start_method="fork")
