"""Run by tests/distributed/test_fsdp.py: the functions of ``headwatch.distributed.sharded`` on a DTensor split by rows over 2 CPU
processes (gloo) against the one-process functions on the full matrix, including the edge cases: no
query, duplicate rows (tied cosines), a NaN row, a zero row, rows of an uneven split. Rank 0 writes "ok".

usage: python tests/workers/fsdp_ops.py OUT_DIR PORT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def check(rank: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from headwatch.core import TorchDistributedReducer
    from headwatch.distributed import sharded
    from headwatch.functional import collision as fc
    from headwatch.functional.adapters import zero_rows
    from headwatch.functional.neighbors import nearest_neighbours
    from headwatch.functional.tied import row_group_statistics

    reducer = TorchDistributedReducer()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    V, d = 101, 8
    full = torch.randn(V, d, generator=g)
    full[7] = full[60]  # a duplicate across the two shards: cosine 1 with two candidates
    full[90] = full[60]
    full[33] = 0.0  # a zero row
    full[44, 3] = float("nan")  # a NaN row: nobody's neighbour
    full[12] = full[5] * 3.0  # same direction, other scale: cosine 1 (rank 0 only)
    w = distribute_tensor(full, mesh, [Shard(0)])
    rows = sharded.local_rows(w)
    assert rows.sharded and rows.num_rows == V and rows.local.shape[0] == (51 if rank == 0 else 50), rows
    assert torch.equal(rows.local.nan_to_num(), full[rows.offset : rows.offset + rows.local.shape[0]].nan_to_num())
    valid = torch.ones(V, dtype=torch.bool)
    valid[100] = False
    for queries in (torch.tensor([], dtype=torch.long), torch.tensor([60, 7, 90, 5, 12, 33, 44, 100, 0]), torch.arange(V)):
        got = sharded.nearest_neighbours_sharded(w, queries, valid, 1 << 12, reducer)
        ref = nearest_neighbours(full, queries, valid, 1 << 12)
        assert torch.equal(got.index, ref.index), (queries, got.index, ref.index)
        assert torch.allclose(got.cosine, ref.cosine, atol=1e-6, equal_nan=True), (got.cosine, ref.cosine)
    groups = {"all": valid, "low": torch.arange(V) < 40, "none": torch.zeros(V, dtype=torch.bool)}
    stats, norms = sharded.row_statistics(w, groups, reducer)
    ref_stats = row_group_statistics(full, groups)
    for k, v in ref_stats.items():
        assert torch.allclose(stats[k], v, equal_nan=True), (k, stats[k], v)
    assert torch.equal(sharded.zero_rows_full(w, reducer), zero_rows(full))
    assert torch.equal(sharded.gather_rows(w, torch.tensor([100, 0, 51, 50]), reducer), full[[100, 0, 51, 50]])
    rate, count = sharded.synonym_pair_rate(w, [[60, 7, 90], [5, 12]], torch.ones(V, dtype=torch.bool), 0.99, reducer)
    ref_rate, ref_count = fc.synonym_pair_rate(full, [[60, 7, 90], [5, 12]], torch.ones(V, dtype=torch.bool), 0.99)
    assert count == ref_count and torch.allclose(rate, ref_rate), (rate, ref_rate)
    # the lookup flow: each rank's ids and output gradients; the mean over ranks of the one-process lookup
    ids = torch.randint(0, V, (2, 4, 6), generator=g)
    grads = torch.randn(2, 4, 6, d, generator=g)
    lookup = sharded.ShardedLookup()
    lookup.add(ids[rank, :2], grads[rank, :2], padding_idx=3)  # two micro-batches
    lookup.add(ids[rank, 2:], grads[rank, 2:], padding_idx=3)
    mine = lookup.rows(rows.with_local(rows.local.float()), reducer)
    g_all = grads.reshape(-1, d) * (ids.reshape(-1) != 3).unsqueeze(-1)
    expected = torch.zeros(V, d).index_add_(0, ids.reshape(-1), g_all) / 2
    assert torch.allclose(mine.local, rows.select(expected), atol=1e-6)


def work(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    check(rank)
    dist.barrier()
    if rank == 0:
        Path(out_dir, "ops.txt").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
