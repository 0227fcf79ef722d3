"""Run by tests/distributed/test_fsdp.py: ``SynonymCollision.measure`` (drift-corrected collision) on row-sharded matrices
(DTensor ``Shard(0)``, 2 CPU processes, gloo) against one process on the full matrices, for the exact
covariance path and the randomized subspace path of the principal directions.

The matrices have a planted drift (the rare rows share two strong directions, so their raw cosines
pass tau while the corrected ones do not), 50 planted colliding pairs and a synonym pair among the rare rows, a zero row,
never-seen rows and a padded row. While the sharded measurement runs, a dispatch mode records every
plain tensor that any op returns (DTensors hold only their local rows and are skipped): none may
have a dimension of ``V`` rows and ``V x d_model`` elements. The one-process run is recorded the same
way (it does hold ``(V, d_model)`` tensors: the recorder can see them).

usage: python tests/workers/fsdp_drift.py OUT_DIR PORT; each rank writes drift_rank{r}.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

V, D, K = 1001, 32, 2  # V odd: the shards hold 501 and 500 rows
SYNONYMS = [[310, 420], [5, 6], [7, 8]]  # 310 ~ 420 planted (rare); 5-8 independent: median rank > 1


class LargestTensors(TorchDispatchMode):
    """Records the shape of every plain tensor an op returns; ``full`` lists those as large as ``(V, D)``."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, ...] = ()
        self.most_rows = 0  # rows of the largest (rows, D) tensor
        self.full: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch.distributed.tensor import DTensor

        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                shape = tuple(t.shape)
                if t.numel() > (torch.Size(self.largest).numel() if self.largest else -1):
                    self.largest = shape
                if len(shape) == 2 and shape[1] == D:
                    self.most_rows = max(self.most_rows, shape[0])
                if len(shape) >= 2 and max(shape) >= V and t.numel() >= V * D:
                    self.full.add(shape)
        return out


def matrices() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(head, embedding, counts, valid)``: rows 0-299 frequent, 300-1000 rare (450-470 never seen, 1000 padded)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (30.0, 20.0):  # head, embedding: drift of different strength (raw rare cosines about 0.95)
        w = torch.randn(V, D, generator=g)
        drift = torch.linalg.qr(torch.randn(D, 2, generator=g)).Q  # two common directions
        w[300:] += scale * drift[:, 0] + 0.1 * scale * drift[:, 1] * torch.randn(V - 300, 1, generator=g)
        w[700:750] = w[600:650] + 0.1 * torch.randn(50, D, generator=g)  # 50 planted colliding pairs
        w[420] = w[310] + 0.1 * torch.randn(D, generator=g)  # the planted synonym pair
        w[77] = 0.0  # an untrained (zero) frequent row
        out.append(w)
    counts = torch.ones(V, dtype=torch.long)
    counts[:300] = 100 + torch.arange(300)
    counts[450:471] = 0
    valid = torch.ones(V, dtype=torch.bool)
    valid[V - 1] = False
    return out[0], out[1], counts, valid


def monitor(head: torch.Tensor, emb: torch.Tensor, reducer):
    from headwatch.core.collision import SynonymCollision

    m = SynonymCollision(tau=0.9, max_rare=200, max_per_bucket=16, synonym_groups=SYNONYMS, k=K)
    m.configure(reducer=reducer)
    m.tied, m._group_ids = False, SYNONYMS
    m._head, m._emb = torch.nn.Linear(D, V, bias=False), torch.nn.Embedding(V, D)
    m._head.weight, m._emb.weight = torch.nn.Parameter(head), torch.nn.Parameter(emb)
    return m


def measure(m, snap) -> dict:
    from headwatch.functional import drift

    calls = {"exact": 0, "randomized": 0}
    exact, randomized = drift._exact_directions, drift._randomized_directions

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    drift._exact_directions, drift._randomized_directions = count("exact", exact), count("randomized", randomized)
    try:
        with LargestTensors() as rec:
            scalars, tables = m.measure(snap, step=3)
    finally:
        drift._exact_directions, drift._randomized_directions = exact, randomized
    return {
        "scalars": {k: float(v) for k, v in scalars.items()},
        "tables": tables,
        "pairs": {name: m.last_result[name]["pairs"] for name in ("head", "embedding")},
        "largest": list(rec.largest),
        "most_rows": rec.most_rows,
        "full": sorted(rec.full),
        "calls": calls,
    }


def check(rank: int, out_dir: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from headwatch.core import NoReducer, TorchDistributedReducer
    from headwatch.functional import drift
    from headwatch.functional.frequency import frequency_snapshot

    mesh = init_device_mesh("cpu", (2,))
    head, emb, counts, valid = matrices()
    snap = frequency_snapshot(counts, valid, rare_max_count=1)
    result: dict = {}
    exact = drift._EXACT_MACS
    try:  # restored: the workers run after this one in the same process (tests/workers/fsdp_loops.py) take the default
        for path, macs in (("exact", exact), ("randomized", 0)):  # 0: every size takes the randomized path
            drift._EXACT_MACS = macs
            sharded = monitor(*(distribute_tensor(w, mesh, [Shard(0)]) for w in (head, emb)), TorchDistributedReducer())
            result[path] = {"sharded": measure(sharded, snap)}
            if rank == 0:
                result[path]["single"] = measure(monitor(head, emb, NoReducer()), snap)
    finally:
        drift._EXACT_MACS = exact
    Path(out_dir, f"drift_rank{rank}.json").write_text(json.dumps(result))


def work(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    check(rank, out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
