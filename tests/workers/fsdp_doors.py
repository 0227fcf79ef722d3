"""Run by tests/distributed/test_fsdp_doors.py: a fused loss (the hidden-state path: no logits, the head never runs)
under FSDP2 ``fully_shard`` through each door (the Hugging Face Trainer, TRL's ``SFTTrainer`` with its own fused
head, Lightning's ``ModelParallelStrategy``, the plain loop), on 2 CPU processes (gloo), for each resharding setting
of the root and of the decoder layer, ``reshard_after_forward`` given as an int too; or the same doors on one process
without sharding, on the same global batches, with the float64 reference of what each loss scored.

The Trainers are handed a model already sharded by ``fully_shard``: accelerate runs FSDP on accelerators only (on a
CPU its ``fsdp_config`` trains under DDP), so its own ``fsdp=`` cannot run here.

usage: python tests/workers/fsdp_doors.py {single,sharded,sharded4} OUT_DIR PORT
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

# (door, root reshard_after_forward, layer reshard_after_forward): the Trainers and Lightning under each pair, the
# plain loop under ints (its bool pairs: tests/model/test_matrix_contract.py). On 2 processes FSDP2 takes the int 2
# (the world size) as True and 1 as False: (2, 1) is the pair (True, False), given as ints. On 4 processes
# (``<door>4``: 4 rows a step) the int 2 reshards to groups of 2 after the forward (FSDP2's post-forward mesh).
DOORS = ("hf_trainer", "sft_trainer", "lightning", "loop")
SETTINGS = [(d, r, l) for d in DOORS[:3] for r, l in ((True, True), (False, False), (2, 1), (False, True))] + [("loop", 2, 1)]
SETTINGS4 = [(f"{d}4", 2, 2) for d in DOORS]
WORLD = {"single": 1, "sharded": 2, "sharded4": 4}
STEPS, B = 2, 2  # global batch: B rows a step


def fused_model():
    """The matrix's tied Llama whose forward computes a fused cross-entropy from ``last_hidden_state`` and
    ``lm_head.weight``, returning no logits (Liger's and Cut Cross-Entropy's shape)."""
    import transformers

    from tests.helpers.matrices import tiny

    class FusedLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
            h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, d)
            n = h.shape[-1]
            loss = F.cross_entropy(h[:, :-1].reshape(-1, n) @ self.lm_head.weight.T, labels[:, 1:].reshape(-1), reduction="sum")
            loss = loss / (num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum())
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss)

    model = tiny("llama", tied=True)
    fused = FusedLlama(model.config)
    fused.load_state_dict(model.state_dict())
    return fused


def global_mean_loss(model, batch: dict):
    """The loss as the Hugging Face Trainer averages it: over the global batch's labelled positions (every process
    alike; FSDP2 then averages the processes' gradients), so that 2 processes train on the gradient of one."""
    n = (batch["labels"][:, 1:] != -100).sum()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(n)
    return model(**batch, num_items_in_batch=n / world).loss


def shard(model, root, layer) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, reshard_after_forward=layer)
    fully_shard(model, reshard_after_forward=root)


class HiddenReference:
    """float64 logits ``last_hidden_state @ W.T`` of each training forward with gradient, at forward time."""

    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self.model = model
        self.handle = model.model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            w = self.model.lm_head.weight
            self.logits.append(output.last_hidden_state.detach().double() @ w.detach().double().T)


def run_door(door: str, root, layer, rank: int, world: int, out: str) -> tuple[list[dict], list[str], list | None, list | None]:
    """(values published on each step, headwatch's warnings, the float64 reference on one process, the shape of the
    root's post-forward mesh under FSDP2)."""
    from tests.helpers.matrices import tiny
    from tests.helpers.trainer_matrix import (
        SeenCollator,
        headwatch_warnings,
        logits_reference,
    )

    door, rows = door.rstrip("4"), 4 if door.endswith("4") else B  # "<door>4": 4 rows a step (for 4 processes)
    torch.manual_seed(0)
    model = fused_model() if door != "sft_trainer" else tiny("llama", tied=True)  # TRL: its own fused head
    recorder = HiddenReference(model) if world == 1 else None
    held_after_forward = None
    if world > 1 and door != "lightning":
        shard(model, root, layer)
        # the root's post-forward mesh: the processes that hold a Parameter between forward and backward
        group = model._get_fsdp_state()._fsdp_param_groups[0]
        info = group.post_forward_mesh_info
        held_after_forward = list(info.mesh.mesh.shape) if info is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if door == "loop":
            values, batches = loop(model, rank, world, rows)
        elif door == "lightning":
            values, batches = lightning(model, root, layer, world, out, rows)
        else:
            values, batches = trainer(door, model, world, out, SeenCollator, rows)
    reference = [logits_reference([x], [b]) for x, b in zip(recorder.logits, batches[:STEPS], strict=True)] if recorder else None
    return values, headwatch_warnings(caught), reference, held_after_forward


def loop(model, rank: int, world: int, rows: int) -> tuple[list[dict], list[dict]]:
    from headwatch.core import NoReducer
    from headwatch.integrations.loop import Headwatch
    from tests.helpers.trainer_matrix import Rows

    full = Rows(rows * STEPS, seed=3).batch()
    batches = [{k: v[s * rows : (s + 1) * rows] for k, v in full.items()} for s in range(STEPS)]
    extra = {} if world > 1 else {"reducer": NoReducer()}
    values = []
    with Headwatch(model, monitors=["tokens", "logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=0, **extra) as hw:
        for step, batch in enumerate(batches):
            mine = {k: v[rank::world] for k, v in batch.items()}
            hw.step_start(mine, step)
            global_mean_loss(model, mine).backward()
            hw.before_optimizer_step()
            hw.after_optimizer_step()
            model.zero_grad()
            values.append(hw.step_end())
    return values, batches


class Presharded:
    """A Trainer mixin: a model already sharded by ``fully_shard`` is trained as it is (on a CPU, accelerate would wrap
    it in DDP, which cannot broadcast DTensor Parameters); on accelerators accelerate's FSDP2 leaves it as is too."""

    def create_accelerator_and_postprocess(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().create_accelerator_and_postprocess()
        prepare = self.accelerator.prepare_model
        self.accelerator.prepare_model = lambda m, *a, **k: m if isinstance(m, FSDPModule) else prepare(m, *a, **k)


def trainer(door: str, model, world: int, out: str, seen_collator, rows: int) -> tuple[list[dict], list[dict]]:
    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.trainer_matrix import (
        H,
        Rows,
        hf_args,
        sft_rows,
        word_ids_tokenizer,
    )

    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0)
    kw = {"per_device_train_batch_size": rows // world, "ddp_backend": "gloo" if world > 1 else None}
    if door == "hf_trainer":
        from transformers import Trainer

        run = type("PreshardedTrainer", (Presharded, Trainer), {})(model=model, args=hf_args(out, **kw), train_dataset=Rows(rows * STEPS, seed=3), callbacks=[cb])
    else:
        import trl

        config = hf_args(out, trl.SFTConfig, completion_only_loss=True, bf16=False, **kw)
        run = type("PreshardedSFT", (Presharded, trl.SFTTrainer), {})(model=model, args=config, train_dataset=sft_rows(rows * STEPS, seed=3),
                             processing_class=word_ids_tokenizer(), callbacks=[cb])  # fmt: skip
    seen = seen_collator(run.data_collator)
    run.data_collator = seen
    run.train()
    logged = [{k: v for k, v in r.items() if k.startswith(f"{H}/")} for r in run.state.log_history if f"{H}/logits/entropy" in r]
    return logged, seen.seen


def lightning(model, root, layer, world: int, out: str, rows: int) -> tuple[list[dict], list[dict]]:
    import lightning.pytorch as pl

    from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
    from tests.helpers.trainer_matrix import H, LitLoss, Rows

    class Sharded(LitLoss):
        def configure_model(self) -> None:
            if self.device_mesh is not None:
                shard(self.model, root, layer)

    class Values(pl.Callback):
        def __init__(self) -> None:
            self.values: list[dict] = []
            self.batches: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{H}/")})

    values = Values()
    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0), GradientDensityMonitor(log_every_n_steps=1), values]
    if world > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        kw = {"devices": world, "strategy": ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), "use_distributed_sampler": False}
    else:
        kw = {"devices": 1}
    run = pl.Trainer(default_root_dir=out, max_steps=STEPS, log_every_n_steps=1, logger=False, callbacks=callbacks, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", limit_val_batches=0, **kw)  # fmt: skip
    data = Rows(rows * STEPS, seed=3)
    # rank r takes rows r, r + world, ...: a step's local batches are one process's batch, in order
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False) if world > 1 else None
    run.fit(Sharded(model, global_mean_loss), torch.utils.data.DataLoader(data, batch_size=rows // world, sampler=sampler))
    full = data.batch()
    return values.values, [{k: v[s * rows : (s + 1) * rows] for k, v in full.items()} for s in range(STEPS)]


def work(rank: int, mode: str, out: str, port: str) -> None:
    world = WORLD[mode]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = []
    for door, root, layer in {"single": [(d, None, None) for d in (*DOORS, *(f"{d}4" for d in DOORS))], "sharded": SETTINGS, "sharded4": SETTINGS4}[mode]:
        values, said, reference, held = run_door(door, root, layer, rank, world, str(Path(out, f"{mode}{rank}-{door}")))
        result.append({"door": door, "root": root, "layer": layer, "values": values, "warnings": said, "reference": reference, "held": held})
    Path(out, f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    mode, out, port = sys.argv[1], sys.argv[2], sys.argv[3]
    # the processes are forked from this one once it imported the heavy modules (spawned, each would import them:
    # most of the run's time on 4 processes)
    import trl  # noqa: F401

    import tests.helpers.trainer_matrix  # noqa: F401 - Lightning, transformers, headwatch
    mp.start_processes(work, args=(mode, out, port), nprocs=WORLD[mode], start_method="fork")
