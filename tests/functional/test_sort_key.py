"""``sort_key``: integer keys whose order is the floats' (NaN last, -0.0 and 0.0 equal), against numpy's sort and
against the float64 keys they replace in the summaries and ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from headwatch.functional.quantiles import sort_key
from headwatch.functional.rows import selected_ranks, summarize_groups

SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]


@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(np.float64, st.integers(1, 80), elements=st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True))),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_keys_sort_as_the_values(values, dtype):
    x = torch.from_numpy(values).to(dtype)
    order = torch.sort(sort_key(x), stable=True).indices
    got = x.double()[order].numpy()
    want = np.sort(x.double().numpy(), kind="stable")  # numpy: NaN last, -0.0 == 0.0
    np.testing.assert_array_equal(got, want)  # NaN == NaN here; -0.0 == 0.0
    key = sort_key(x)
    same = x.double().numpy()[:, None] == x.double().numpy()[None, :]
    nan = np.isnan(x.double().numpy())
    assert ((key[:, None] == key[None, :]).numpy() == (same | (nan[:, None] & nan[None, :]))).all()  # equal keys: equal values


def test_integer_values_are_their_own_keys():
    counts = torch.tensor([3, 0, 7, 3], dtype=torch.int32)
    assert sort_key(counts).dtype == torch.int64 and sort_key(counts).tolist() == [3, 0, 7, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ranks_and_summaries_match_float64_references(dtype):
    g = torch.Generator().manual_seed(0)
    values = (torch.randint(0, 50, (500,), generator=g).double() / 7).to(dtype)  # many ties
    values[::37] = float("nan")
    selected = torch.rand(500, generator=g) < 0.7
    ok = selected & ~values.isnan()
    ranks = selected_ranks(values, ok)
    a = values[ok].double().numpy()
    # the tie-averaged rank by its definition: the values below, plus the mean position among the equal ones
    want = (a[None, :] < a[:, None]).sum(1) + ((a[None, :] == a[:, None]).sum(1) + 1) / 2
    np.testing.assert_array_equal(ranks[ok].numpy(), want)
    assert (ranks[~ok] == 0).all()
    summary = summarize_groups(values, {"ok": ok})["ok"]
    picked = np.sort(values[ok].double().numpy())
    assert summary.max.item() == picked[-1] and summary.count.item() == picked.size
    assert summary.p50.item() == pytest.approx(np.quantile(picked, 0.5), rel=1e-15)
    assert summary.p95.item() == pytest.approx(np.quantile(picked, 0.95), rel=1e-15)
    assert summary.mean.item() == pytest.approx(picked.mean(), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2**63 - 1, -(2**63), 0, 1, 2**63 - 2]), st.booleans()), max_size=12))
def test_a_selected_value_with_the_largest_key_is_not_tied_with_the_entries_left_out(pairs):
    # int64 values are their own keys: 2**63 - 1 is the key the entries not selected are given
    values = torch.tensor([v for v, _ in pairs], dtype=torch.int64).reshape(-1)
    selected = torch.tensor([s for _, s in pairs], dtype=torch.bool).reshape(-1)
    a = np.array([v for v, s in pairs if s], dtype=object)  # exact integers
    want = np.array([sum(b < x for b in a) + (sum(b == x for b in a) + 1) / 2 for x in a], dtype=np.float64)
    ranks = selected_ranks(values, selected)
    np.testing.assert_array_equal(ranks[selected].numpy(), want)
    assert (ranks[~selected] == 0).all()
