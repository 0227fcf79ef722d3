"""Run by tests/distributed/test_deepspeed.py: the plain-loop front door ``headwatch.Headwatch`` on 2 CPU processes (gloo)
under a DeepSpeed ZeRO engine (stages 1, 2, 3; fp32; a torch SGD client optimizer), tied and untied; rank 0
also trains a one-process twin without DeepSpeed on the same global batches and writes both runs' values,
the warnings headwatch gave, and what the engine did to the head's Parameter.

usage: python tests/workers/deepspeed_plain.py OUT_DIR PORT SCENARIO [SCENARIO ...] [--bf16]
  SCENARIO: a ZeRO stage, alone or with one of
  -after: create ``Headwatch`` after ``deepspeed.initialize`` (default: before), e.g. ``3-after``
  -late: call ``before_optimizer_step`` after ``engine.step()`` (a misuse: the gradient is gone), e.g. ``2-late``
  --bf16: DeepSpeed's bf16 mode (bf16 weights and forward; the twin stays float32)
Every scenario runs in the same 2 processes (one start of torch, DeepSpeed and gloo for all); each rank writes
``rank<r>.json``: the one-process twin's values under ``single/<tying>``, each scenario's under
``zero<SCENARIO>/<tying>`` (``zero2``, ``zero3-after``, ``zero2-late`` ...).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_plain import LM, STEPS, V  # noqa: E402  # the tiny LM of the FSDP tests


def without_shared_memory_all_reduce() -> None:
    """Mark DeepSpeed's shared-memory all_reduce as unavailable before ``deepspeed.init_distributed``, which then neither
    builds nor loads it: it serves ``inference_all_reduce`` only, never a training step (whose collectives are
    torch.distributed's, gloo here), and its C++ build (on a machine's first run, and again whenever another build of
    torch shares the extension cache) costs 30 s on 2 quiet cores, minutes on busy ones, behind a file lock."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def monitors() -> list:
    from headwatch.core import SynonymCollision

    collision = SynonymCollision(tau=0.5, synonym_groups=[[1, 2, 3], [10, 11], [40, 62]])
    collision.every_factor = 1  # measure on every logging step (default: every 10)
    return ["tokens", "logits", "gradients", collision]


def train(step_fn, hw, data, rank: int, world: int) -> list[dict[str, float]]:
    out = []
    for step, batch in enumerate(data):
        x = batch[rank::world]  # this process's half of the global batch
        hw.step_start({"input_ids": x, "labels": x}, step)
        step_fn(x, hw)
        out.append(hw.step_end())
    return out


def plain_step(model, opt):
    def step(x, hw):
        logits = model(x)
        F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).backward()
        hw.before_optimizer_step()
        opt.step()
        hw.after_optimizer_step()
        opt.zero_grad()

    return step


def engine_step(engine, late: bool):
    def step(x, hw):
        logits = engine(x)
        engine.backward(F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)))
        if not late:
            hw.before_optimizer_step()  # gradients final: reduced (stage 1, 2) or partitioned (stage 3) by ZeRO
        engine.step()  # optimizer step and zero_grad
        if late:
            hw.before_optimizer_step()
        hw.after_optimizer_step()

    return step


def run_zero(stage: int, tied: bool, data, rank: int, after: bool, late: bool) -> dict:
    import deepspeed

    from headwatch import Headwatch

    torch.manual_seed(0)
    model = LM(tied)
    config = {
        "train_micro_batch_size_per_gpu": data[0].shape[0] // 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},  # partition even tiny matrices
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default here: the plain twin does not clip
        "steps_per_print": 10**6,
        "bf16": {"enabled": "--bf16" in sys.argv},
    }
    result: dict = {"error": None, "values": [], "warnings": []}
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("headwatch").addHandler(handler)
    logging.getLogger("headwatch").setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hw = None if after else Headwatch(model, monitors=monitors(), log_every_n_steps=1, figure_every_n_steps=0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
            w = engine.module.lm_head.weight
            result["seen"] = {"shape": list(w.shape), "ds_id": hasattr(w, "ds_id"), "hp_mapping": hasattr(w, "_hp_mapping")}
            if after:
                hw = Headwatch(engine.module, monitors=monitors(), log_every_n_steps=1, figure_every_n_steps=0)
            result["values"] = train(engine_step(engine, late), hw, data, rank, 2)
            hw.close()
        except Exception as err:  # noqa: BLE001 - recorded for the test
            result["error"] = f"{type(err).__name__}: {err}"
    result["warnings"] = sorted({str(w.message) for w in caught if "headwatch" in str(w.message).lower() or "Monitor" in str(w.message)})
    result["info"] = [m for m in said if "DeepSpeed" in m]  # rank 0 only
    logging.getLogger("headwatch").removeHandler(handler)
    return result


def run_single(tied: bool, data) -> list[dict[str, float]]:
    from headwatch import Headwatch
    from headwatch.core import NoReducer

    torch.manual_seed(0)
    model = LM(tied)
    hw = Headwatch(model, monitors=monitors(), log_every_n_steps=1, figure_every_n_steps=0, reducer=NoReducer())
    out = train(plain_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), hw, data, 0, 1)
    hw.close()
    return out


def work(rank: int, out_dir: str, port: str, scenarios: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import deepspeed

    without_shared_memory_all_reduce()
    deepspeed.init_distributed(dist_backend="gloo")
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, V, (8, 10), generator=g) for _ in range(STEPS)]
    result: dict = {}
    for tied in (True, False):
        tying = "tied" if tied else "untied"
        if rank == 0:
            result[f"single/{tying}"] = run_single(tied, data)
        for scenario in scenarios:
            stage, _, variant = scenario.partition("-")
            assert variant in ("", "after", "late"), scenario
            result[f"zero{scenario}/{tying}"] = run_zero(int(stage), tied, data, rank, variant == "after", variant == "late")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    mp.spawn(work, args=(args[0], args[1], args[2:]), nprocs=2)
