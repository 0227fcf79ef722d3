"""Run by tests/distributed/test_fsdp.py: the plain-loop front door ``headwatch.Headwatch`` on 2 CPU processes under FSDP1
(``FullyShardedDataParallel``, ``device_id=cpu``, the ``mix`` layer its own unit), created on the wrapped
model, tied and untied, ``use_orig_params`` True and False; rank 0 also trains a one-process twin on the
same global batches and writes both runs' values and the warnings each run gave. Then, against those twins:
``before-wrap`` (Headwatch created on the model before FullyShardedDataParallel wrapped it), ``accum-headunit``
(untied, the head its own unit, 2 micro-batches per step, the first under ``no_sync()``) and ``fail-rank1``
(measurements made to fail on rank 1 only; rank 1 writes its published keys to fsdp1_plain_r1.json); and a tiny
tied ``LlamaForCausalLM`` wrapped with ``transformer_auto_wrap_policy`` against its own one-process twin.

usage: python tests/workers/fsdp1_plain.py OUT_DIR PORT
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_plain import LM, MONITORS, STEPS, V, train  # noqa: E402


def wrap(model: LM, orig: bool, units: tuple[torch.nn.Module, ...] = ()) -> torch.nn.Module:
    """FSDP1 with ``model.mix`` (or ``units``) as units of their own."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    own = units or (model.mix,)
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: any(m is u for u in own))
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig, auto_wrap_policy=policy)


def train_micro(model, hw, data, rank: int, world: int, micro: int) -> list[dict[str, float]]:
    """``fsdp_plain.train`` with ``micro`` micro-batches per step (loss / micro; all but the last under no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step, batch in enumerate(data):
        parts = batch[rank::world].chunk(micro)
        for i, x in enumerate(parts):
            hw.step_start({"input_ids": x, "labels": x}, step)
            with getattr(model, "no_sync", contextlib.nullcontext)() if i < micro - 1 else contextlib.nullcontext():
                logits = model(x)
                (F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)) / micro).backward()
        hw.before_optimizer_step()
        opt.step()
        hw.after_optimizer_step()
        opt.zero_grad()
        out.append(hw.step_end())
    return out


def fail_on_rank1() -> None:
    """Rank 1 only, in local math after the measurements' collectives: the gradient statistics fail on step 1,
    the update statistics on step 2, LogitStats's scalars on step 0."""
    from headwatch.core.gradients import GradientDensity
    from headwatch.core.logits import LogitStats

    def failing(method, step):
        def call(self, *args, **kwargs):
            if self._step == step:
                raise RuntimeError(f"injected failure on rank 1 at step {step}")
            return method(self, *args, **kwargs)
        return call

    scalars, calls = LogitStats._scalars_and_media, []

    def logit_scalars(self, *args, **kwargs):  # local math after LogitStats.compute's sums
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure on rank 1 at step 0")
        return scalars(self, *args, **kwargs)

    GradientDensity._matrices = failing(GradientDensity._matrices, 1)  # its first call: after the flows' collectives
    GradientDensity._update_stats = failing(GradientDensity._update_stats, 2)
    LogitStats._scalars_and_media = logit_scalars


def adversarial(rank: int, data, result: dict, out_dir: str) -> None:
    """The three scenarios of the module docstring, against the twins of the first part (accum: its own)."""
    from headwatch import Headwatch
    from headwatch.core import NoReducer

    for name in ("before-wrap", "accum-headunit", "fail-rank1"):
        torch.manual_seed(0)
        inner = LM(name != "accum-headunit")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "before-wrap":
                hw = Headwatch(inner, monitors=MONITORS, log_every_n_steps=1)  # on the inner model: the README says after
                values = train(wrap(inner, True), hw, data, rank, 2)
            elif name == "accum-headunit":
                model = wrap(inner, True, (inner.mix, inner.lm_head))
                hw = Headwatch(model, monitors=MONITORS, log_every_n_steps=1)
                values = train_micro(model, hw, data, rank, 2, 2)
            else:
                if rank == 1:
                    fail_on_rank1()
                model = wrap(inner, True)
                hw = Headwatch(model, monitors=MONITORS, log_every_n_steps=1)
                values = train(model, hw, data, rank, 2)
        hw.close()
        if rank == 0:
            result[name] = {"sharded": values, "warnings": [str(w.message) for w in caught]}
            if name == "accum-headunit":  # buckets follow the counts micro-batch by micro-batch: the twin accumulates too
                torch.manual_seed(0)
                twin = LM(False)
                one = Headwatch(twin, monitors=MONITORS, log_every_n_steps=1, reducer=NoReducer())
                result[name]["single"] = train_micro(twin, one, data, 0, 1, 2)
        elif name == "fail-rank1":
            Path(out_dir, "fsdp1_plain_r1.json").write_text(json.dumps({name: values}))


def llama(rank: int, data, result: dict) -> None:
    """A tiny tied LlamaForCausalLM, LlamaDecoderLayer units (transformer_auto_wrap_policy): the root holds the
    embedding, the final norm and the head; headwatch's defaults, the loss the model computes from ``labels``."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from headwatch import Headwatch
    from headwatch.core import NoReducer

    def build() -> LlamaForCausalLM:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True)  # fmt: skip
        return LlamaForCausalLM(config)

    def run(model, hw, rank: int, world: int) -> list[dict[str, float]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        out = []
        for step, batch in enumerate(data):
            x = batch[rank::world]
            hw.step_start({"input_ids": x, "labels": x}, step)
            model(input_ids=x, labels=x).loss.backward()
            hw.before_optimizer_step()
            opt.step()
            hw.after_optimizer_step()
            opt.zero_grad()
            out.append(hw.step_end())
        return out

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FullyShardedDataParallel(build(), device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
    hw = Headwatch(model, log_every_n_steps=1)
    sharded = run(model, hw, rank, 2)
    hw.close()
    if rank == 0:
        twin = build()
        result["llama-tied"] = {"sharded": sharded, "single": run(twin, Headwatch(twin, log_every_n_steps=1, reducer=NoReducer()), 0, 1)}


def work(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from headwatch import Headwatch
    from headwatch.core import NoReducer

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, V, (8, 10), generator=g) for _ in range(STEPS)]
    result = {}
    for tied in (True, False):
        for orig in (True, False):
            torch.manual_seed(0)
            inner = LM(tied)
            model = wrap(inner, orig)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hw = Headwatch(model, monitors=MONITORS, log_every_n_steps=1)  # on the wrapped model
                sharded = train(model, hw, data, rank, 2)
            seen = {"head_weight_shape": list(inner.lm_head.weight.shape)}  # outside a measurement: the flat part
            seen["tying"] = next(m.tying_text for m in hw.monitors if hasattr(m, "tying_text"))
            if rank == 0:
                torch.manual_seed(0)
                twin = LM(tied)
                single = train(twin, Headwatch(twin, monitors=MONITORS, log_every_n_steps=1, reducer=NoReducer()), data, 0, 1)
                result[f"{'tied' if tied else 'untied'}-{'orig' if orig else 'flat'}"] = {
                    "sharded": sharded, "single": single, "seen": seen, "warnings": [str(w.message) for w in caught],
                }
            hw.close()
    llama(rank, data, result)
    adversarial(rank, data, result, out_dir)
    if rank == 0:
        Path(out_dir, "fsdp1_plain.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
