"""Run by tests/test_reduce_once.py: the plain-loop door ``headwatch.Headwatch`` with its four monitors on 2 CPU
processes (gloo) under DDP, FSDP2 ``fully_shard`` or DeepSpeed ZeRO-3, tied and untied, 4 steps logging every 2
(steps 1 and 3; the collision measured at step 3 only). Every collective of a step is recorded by a dispatch mode
that sees each ``torch.distributed`` operation (``c10d.*``, and the ``_c10d_functional.*`` of DTensors); one is
headwatch's when a frame of the ``headwatch`` package is on the Python stack that issued it (the engines' own
collectives of forward, backward and optimizer step have none). Each rank writes, per run and step, headwatch's
collectives in order (operation, dtype, elements, the headwatch function that asked, whether it is the step's
packed reduction), how many the engine made, and the values ``step_end`` returned.

``ddp-fail``: DDP, untied, with rank 1 failing where the others succeed: its logit sums at step 1 (before any
collective of the step), its gradient statistics' second phase at step 3 (after the sums were reduced).

usage: python tests/workers/collectives_worker.py OUT_DIR PORT ENGINE [ENGINE ...]   (ddp, ddp-fail, fsdp2, zero3)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_plain import LM, V  # noqa: E402  # the tiny LM of the FSDP tests

STEPS, EVERY = 4, 2
NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class Collectives(TorchDispatchMode):
    """Records every collective operation dispatched inside it, with the headwatch function that asked for it."""

    def __init__(self, package: str) -> None:
        super().__init__()
        self.package = package
        self.seen: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in NAMESPACES:
            frame, chain = sys._getframe(1), []
            while frame is not None:
                if frame.f_code.co_filename.startswith(self.package):
                    chain.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")
                frame = frame.f_back
            first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
            self.seen.append({
                "op": func.__name__.split(".")[0].strip("_"),
                "site": next((c for c in chain if not c.startswith("reduce.")), chain[0]) if chain else None,
                "packed": "reduce.reduce_step" in chain,
                "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
                "numel": first.numel() if first is not None else 0,
            })  # fmt: skip
        return func(*args, **(kwargs or {}))


def monitors() -> list:
    from headwatch.core import SynonymCollision

    collision = SynonymCollision(tau=0.5, synonym_groups=[[1, 2, 3], [10, 11], [40, 62]])
    collision.every_factor = 2  # every 2 logging intervals: step 3
    return ["tokens", "logits", "gradients", collision]


def fail_on_rank1(hw) -> None:
    """Rank 1 only: the logit sums fail at step 1 (phase one), the gradient statistics' phase two at step 3."""
    from headwatch.core import GradientDensity, LogitStats

    logits = next(m for m in hw.run.monitors if isinstance(m, LogitStats))
    grads = next(m for m in hw.run.monitors if isinstance(m, GradientDensity))
    local_sums, from_sums = logits.local_sums, grads.from_sums

    def failing_sums(val=False):
        if hw.step_index == 1:
            raise RuntimeError("injected: logit sums on rank 1")
        return local_sums(val)

    def failing_finish(total, val=False):
        if hw.step_index == 3:
            raise RuntimeError("injected: gradient statistics on rank 1")
        return from_sums(total, val)

    logits.local_sums, grads.from_sums = failing_sums, failing_finish


def run(engine: str, tied: bool, data: list[torch.Tensor], rank: int) -> list[dict]:
    import headwatch
    from headwatch import Headwatch

    torch.manual_seed(0)
    model = LM(tied)
    hw = Headwatch(model, monitors=monitors(), log_every_n_steps=EVERY, figure_every_n_steps=0)
    if engine == "ddp-fail" and rank == 1:
        fail_on_rank1(hw)
    if engine.startswith("ddp"):
        trained = torch.nn.parallel.DistributedDataParallel(model)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.mix)
        trained = fully_shard(model)
    else:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": data[0].shape[0] // 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0, "steps_per_print": 10**6,
        }  # fmt: skip
        trained, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if engine != "zero3" else None
    out = []
    for step, batch in enumerate(data):
        x = batch[rank::2]  # this process's half of the global batch
        with Collectives(str(Path(headwatch.__file__).parent)) as seen:
            hw.step_start({"input_ids": x, "labels": x}, step)
            loss = F.cross_entropy(trained(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
            if opt is None:
                trained.backward(loss)
                hw.before_optimizer_step()  # DeepSpeed holds the gradients until engine.step()
                trained.step()
            else:
                loss.backward()
                hw.before_optimizer_step()
                opt.step()
                opt.zero_grad()
            hw.after_optimizer_step()
            values = hw.step_end()
        ours = [c for c in seen.seen if c["site"] is not None]
        out.append({"collectives": ours, "engine_collectives": len(seen.seen) - len(ours), "values": values})
    hw.close()
    return out


def work(rank: int, out_dir: str, port: str, engines: list[str]) -> None:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    if "zero3" in engines:
        import deepspeed
        from deepspeed_plain import without_shared_memory_all_reduce

        without_shared_memory_all_reduce()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, V, (8, 10), generator=g) for _ in range(STEPS)]
    runs = [(e, t) for e in engines for t in ((False,) if e == "ddp-fail" else (True, False))]
    result = {f"{e}/{'tied' if t else 'untied'}": run(e, t, data, rank) for e, t in runs}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2], sys.argv[3:]), nprocs=2)
