"""Run by tests/distributed/test_fsdp.py: every monitor on a tiny LM, tied and untied, either on one process or on
2 CPU processes under Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, gloo) or ``FSDPStrategy``
(FSDP1, ``use_orig_params=True``; see :class:`CPUFSDPStrategy`), on the same
global batches (8 sequences a step: 4 per rank). Each run dumps the headwatch values it published per
step, and what the sharded run saw (the head weight's type, this rank's rows, the work buffers' shapes).

usage: python tests/workers/fsdp_monitors.py {single,fsdp,fsdp1} OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Sampler  # noqa: E402

from headwatch import GradientDensityMonitor, LogitStatsMonitor, SynonymCollisionMonitor, TokenFrequency  # noqa: E402
from tests.helpers import TinyCausalLM, TokenDataset, shutdown_distributed  # noqa: E402

VOCAB = 63  # odd: the two shards differ (32 and 31 rows)
GLOBAL_BATCH = 8
STEPS = 4


class ShardedLM(TinyCausalLM):
    """``configure_model`` applies FSDP2 when the strategy gives a device mesh (rows split over ranks)."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.mix, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])  # embedding and head (one group: the tie survives)


def _cpu_fsdp1_strategy():
    """Lightning's ``FSDPStrategy`` with one change: FSDP1 on the CPU.

    Lightning refuses ``FSDPStrategy`` without CUDA (``type(strategy) is FSDPStrategy``, a subclass
    passes) and wraps with ``device_id=None``, which FSDP1 refuses without an accelerator; this
    wraps first with ``device_id=cpu`` (the ``mix`` layer as its own unit, the root holding the
    embedding and the head) and hands the wrapped model to Lightning's own ``_setup_model``.
    """
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    import functools

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is getattr(model, "mix", None))
            wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
            return super()._setup_model(wrapped)

    return CPUFSDPStrategy()


class RankSlice(Sampler):
    """Sequences ``rank, rank + world, ...`` in order (Lightning's distributed sampler shuffled them here)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _rank_world(self) -> tuple[int, int]:
        dist = torch.distributed
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def __iter__(self):
        rank, world = self._rank_world()
        return iter(range(rank, self.n, world))

    def __len__(self) -> int:
        return self.n // self._rank_world()[1]


class Recorder(pl.Callback):
    def __init__(self, gd: GradientDensityMonitor) -> None:
        self.gd = gd
        self.steps: dict[int, dict[str, float]] = {}
        self.seen: dict[str, object] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        w = pl_module.lm_head.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        self.seen = {"weight": type(w).__name__, "grad": type(w.grad).__name__, "local_rows": int(local.shape[0])}
        if local.ndim == 1:  # FSDP1: a flat 1-D view of this process's part
            self.seen["local_shape"] = list(local.shape)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step - 1] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/")
        }
        self.seen["buffers"] = sorted({tuple(b.shape) for b in self.gd._scratch_buffers.values()})


def run(mode: str, tied: bool) -> tuple[dict, dict, int]:
    pl.seed_everything(0, verbose=False)
    model = ShardedLM(vocab_size=VOCAB, d_model=16, tie_weights=tied)
    gd = GradientDensityMonitor(figure_every_n_steps=0)
    recorder = Recorder(gd)
    callbacks = [
        TokenFrequency(),
        LogitStatsMonitor(figure_every_n_steps=0),
        gd,
        SynonymCollisionMonitor(every_n_steps=2, figures=False, tau=0.5, synonym_groups=[[1, 2, 3], [10, 11], [40, 62]]),
        recorder,
    ]
    if mode == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        kw = {"devices": 2, "strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), "use_distributed_sampler": False}
        batch = GLOBAL_BATCH // 2
    elif mode == "fsdp1":
        kw = {"devices": 2, "strategy": _cpu_fsdp1_strategy(), "use_distributed_sampler": False}
        batch = GLOBAL_BATCH // 2
    else:
        kw, batch = {"devices": 1}, GLOBAL_BATCH
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kw,
    )
    # rank r reads the sequences r, r + 2, ...: a step's two local batches are the one-process batch
    data = TokenDataset(n=STEPS * GLOBAL_BATCH, pad=False, vocab_size=VOCAB)
    trainer.fit(model, DataLoader(data, batch_size=batch, sampler=RankSlice(len(data))))
    return recorder.steps, recorder.seen, trainer.global_rank


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    result, rank = {}, 0
    for tied in (True, False):
        steps, seen, rank = run(mode, tied)
        result["tied" if tied else "untied"] = {"steps": steps, "seen": seen}
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    shutdown_distributed()
