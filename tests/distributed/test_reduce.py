"""Reducers (headwatch.distributed.reduce): the one-process identities, ``torch.distributed`` when no process
group is up, and a thread-backed reducer that runs W simulated processes in this one (used by
tests/distributed/test_sharded_rows.py to check the row-sharded combinations against the one-process functions)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headwatch.distributed.reduce import NoReducer, Reducer, TorchDistributedReducer
from tests.helpers.distributed import ThreadReducer, run_ranks


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("reducer", [NoReducer(), TorchDistributedReducer()], ids=["none", "torch_not_initialized"])
def test_one_process_reductions_are_identities_on_new_tensors(reducer):
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is up in this process (left by another test)")
    assert isinstance(reducer, Reducer)
    assert (reducer.world_size, reducer.rank) == (1, 0)
    x = torch.tensor([1.5, -2.0, 3.0])
    for out in (reducer.sum(x), reducer.mean(x)):
        assert torch.equal(out, x) and out is not x
        out[0] = 99.0  # a new tensor: the caller's input is not modified
    assert x[0].item() == 1.5
    gathered = reducer.gather(x)
    assert len(gathered) == 1 and torch.equal(gathered[0], x)
    assert reducer.all(True) is True and reducer.all(False) is False
    assert reducer.all(1) is True  # truthy values are flags


def test_torch_reducer_keeps_its_group():
    group = object()
    assert TorchDistributedReducer(group).group is group
    assert TorchDistributedReducer().group is None


# ---------------------------------------------------------------- the thread reducer used by the sharded tests
def test_thread_reducer_sums_gathers_and_agrees_like_a_process_group():
    def body(rank: int, reducer: ThreadReducer) -> dict[str, Any]:
        x = torch.tensor([float(rank), 10.0 * rank])
        return {
            "sum": reducer.sum(x),
            "mean": reducer.mean(x),
            "gather": reducer.gather(torch.full((rank + 1,), rank)),  # first dimensions differ
            "all_true": reducer.all(True),
            "one_false": reducer.all(rank != 1),
            "int_sum": reducer.sum(torch.tensor(rank + 1)),
        }

    results = run_ranks(3, body)
    for r in results:
        assert r["sum"].tolist() == [3.0, 30.0]
        assert r["mean"].tolist() == [1.0, 10.0]
        assert [g.tolist() for g in r["gather"]] == [[0], [1, 1], [2, 2, 2]]
        assert r["all_true"] is True and r["one_false"] is False
        assert r["int_sum"].item() == 6 and r["int_sum"].dtype == torch.int64


def test_thread_reducer_reraises_a_rank_failure_instead_of_hanging():
    def body(rank: int, reducer: ThreadReducer) -> None:
        if rank == 1:
            raise ValueError("rank 1 failed before the collective")
        reducer.sum(torch.zeros(1))

    with pytest.raises(ValueError, match="rank 1 failed"):
        run_ranks(2, body)
