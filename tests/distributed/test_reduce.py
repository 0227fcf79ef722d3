"""Reducers (headwatch.distributed.reduce): the one-process identities, ``torch.distributed`` when no process
group is up, and a thread-backed reducer that runs W simulated processes in this one (used by
tests/distributed/test_sharded_rows.py to check the row-sharded combinations against the one-process functions)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headwatch.distributed.reduce import NoReducer, Reducer, TorchDistributedReducer
from headwatch.errors import HeadwatchError
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


# ---------------------------------------------------------------- a logging step's sums, reduced together
def test_reduce_step_sums_by_dtype_and_concatenates_values_in_rank_order():
    """3 simulated processes: sums of each dtype in one reduction (float64 stays float64, int64 exact), values of
    every process concatenated in rank order whatever their lengths (one empty), failure flags agreed; 3 exchanges:
    the int64 block (with the flags and the values' lengths), the float64 block, one gather of the float32 values."""
    from headwatch.distributed.reduce import Values, reduce_step

    def body(rank: int, reducer: ThreadReducer) -> tuple:
        parts = [
            {
                "a": torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1),
                "n": torch.tensor(rank + 1),
                "v": Values(torch.arange(rank + 1, dtype=torch.float32) + 10 * rank),
            },
            {
                "b": torch.full((2, 2), 0.1, dtype=torch.float64) * rank,
                "w": Values(torch.zeros(0) if rank == 1 else torch.tensor([float(rank)])),
            },
        ]
        before = reducer.world.calls
        out, failed = reduce_step(parts, reducer, [False, rank == 2])
        return out, failed, reducer.world.calls - before

    results = run_ranks(3, body)
    reference = torch.tensor(0.1, dtype=torch.float64) * 1 + torch.tensor(0.1, dtype=torch.float64) * 2  # rank order
    for out, failed, _ in results:
        assert out[0]["a"].dtype == torch.float64 and out[0]["a"].tolist() == [6.0, 12.0]
        assert out[0]["n"].dtype == torch.int64 and out[0]["n"].item() == 6
        assert out[0]["v"].dtype == torch.float32 and out[0]["v"].tolist() == [0.0, 10.0, 11.0, 20.0, 21.0, 22.0]
        assert out[1]["b"].shape == (2, 2) and torch.equal(out[1]["b"], torch.full((2, 2), reference.item(), dtype=torch.float64))
        assert out[1]["w"].tolist() == [0.0, 2.0]
        assert failed == [False, True]  # part 1 failed on rank 2: every rank knows
    assert results[0][2] == 3


def test_reduce_step_on_one_process_hands_the_entries_back_and_refuses_a_boolean_sum():
    from headwatch.distributed.reduce import Values, reduce_step

    a, v = torch.tensor([1.5, 2.5], dtype=torch.float64), torch.tensor([3.0])
    out, failed = reduce_step([{"a": a, "v": Values(v)}], NoReducer(), [True])
    assert out[0]["a"] is a and out[0]["v"] is v and failed == [True]  # no copy, no collective
    with pytest.raises(HeadwatchError, match="`flag` must be a numeric tensor"):
        reduce_step([{"flag": torch.ones(2, dtype=torch.bool)}], NoReducer())
