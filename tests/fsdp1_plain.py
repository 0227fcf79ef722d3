"""Run by tests/test_fsdp.py: the plain-loop front door ``headwatch.Headwatch`` on 2 CPU processes under FSDP1
(``FullyShardedDataParallel``, ``device_id=cpu``, the ``mix`` layer its own unit), created on the wrapped
model, tied and untied, ``use_orig_params`` True and False; rank 0 also trains a one-process twin on the
same global batches and writes both runs' values and the warnings each run gave.

usage: python tests/fsdp1_plain.py OUT_DIR PORT
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_plain import LM, MONITORS, STEPS, V, train  # noqa: E402


def wrap(model: LM, orig: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is model.mix)
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig, auto_wrap_policy=policy)


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
            if rank == 0:
                torch.manual_seed(0)
                twin = LM(tied)
                single = train(twin, Headwatch(twin, monitors=MONITORS, log_every_n_steps=1, reducer=NoReducer()), data, 0, 1)
                result[f"{'tied' if tied else 'untied'}-{'orig' if orig else 'flat'}"] = {
                    "sharded": sharded, "single": single, "seen": seen, "warnings": [str(w.message) for w in caught],
                }
            hw.close()
    if rank == 0:
        Path(out_dir, "fsdp1_plain.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
