"""Row statistics and frequency buckets against NumPy/SciPy or hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from headwatch import HeadwatchError
from headwatch.functional.frequency import BUCKETS, frequency_buckets, frequency_snapshot, rare_tokens, seen_count_ranks
from headwatch.functional.rows import (
    lookup_gradient,
    rankdata,
    row_cosine,
    row_density,
    row_nonzero,
    row_nonzero_given_norms,
    row_norms,
    selected_ranks,
    spearman,
    spearman_of_ranks,
    summarize,
    summarize_groups,
)


def test_row_norms_and_nonzero_dense_and_sparse():
    g = torch.zeros(6, 3)
    g[1] = torch.tensor([3.0, 4.0, 0.0])
    g[4, 2] = -1e-30  # tiny but non-zero
    # float32 norms underflow below ~1e-19 (the square is below the smallest float)...
    np.testing.assert_allclose(row_norms(g).numpy(), np.linalg.norm(g.double().numpy(), axis=1), rtol=1e-6, atol=1e-12)
    # ...so density uses an exact non-zero test instead of norm > 0
    assert row_nonzero(g).tolist() == [False, True, False, False, True, False]
    # a sparse COO gradient with a duplicated index, as nn.Embedding(sparse=True) produces
    sparse = torch.sparse_coo_tensor(torch.tensor([[1, 1, 3]]), torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 5.0]]), (6, 3))
    assert row_norms(sparse).tolist() == pytest.approx([0, math.sqrt(5), 0, 5, 0, 0])
    assert row_nonzero(sparse).tolist() == [False, True, False, True, False, False]


@pytest.mark.parametrize("zero_rows", [0, 2, 5])
def test_row_nonzero_given_norms_is_exact(zero_rows):
    g = torch.randn(8, 4, generator=torch.Generator().manual_seed(zero_rows))
    g[:zero_rows] = 0.0
    if zero_rows:
        g[0, 1] = 1e-30  # its float32 norm underflows to 0, yet the row is not zero
    g[7, 0] = float("nan")
    norms = row_norms(g)
    want = [bool((row != 0).any()) for row in g]
    assert row_nonzero_given_norms(g, norms).tolist() == want == row_nonzero(g).tolist()


def test_row_density_hand_computed():
    nonzero = torch.tensor([True, False, True, True, False])
    assert row_density(nonzero).item() == pytest.approx(3 / 5)
    valid = torch.tensor([True, True, True, False, False])
    assert row_density(nonzero, valid).item() == pytest.approx(2 / 3)
    assert math.isnan(row_density(nonzero, torch.zeros(5, dtype=torch.bool)).item())
    with pytest.raises(HeadwatchError, match="same shape"):
        row_density(nonzero, torch.ones(4, dtype=torch.bool))


def test_lookup_gradient_equals_embedding_backward():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (3, 7), generator=g)
    for padding_idx in (None, 4):
        emb = torch.nn.Embedding(10, 5, padding_idx=padding_idx)
        out = emb(ids)
        upstream = torch.randn(3, 7, 5, generator=g)
        out.backward(upstream)
        got = lookup_gradient(ids, upstream, 10, padding_idx)
        torch.testing.assert_close(got, emb.weight.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(HeadwatchError, match="grad_output of shape"):
        lookup_gradient(ids, torch.zeros(3, 6, 5), 10)


def test_row_cosine_against_numpy():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 4, generator=g)
    b = torch.randn(8, 4, generator=g)
    a[2] = 0
    b[5] = 0
    cos, both = row_cosine(a, b)
    an, bn = a.double().numpy(), b.double().numpy()
    for i in range(8):
        if i in (2, 5):
            assert not both[i]
        else:
            want = an[i] @ bn[i] / (np.linalg.norm(an[i]) * np.linalg.norm(bn[i]))
            assert cos[i].item() == pytest.approx(want, rel=1e-5)
    assert row_cosine(a, -a)[0][0].item() == pytest.approx(-1.0)


def test_summarize_against_numpy():
    v = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0, 100.0])
    select = torch.tensor([True, True, True, True, True, False])
    s = summarize(v, select)
    assert (s.mean.item(), s.max.item(), s.p50.item()) == (3.0, 5.0, 3.0)
    assert s.p95.item() == pytest.approx(np.percentile([5, 1, 3, 2, 4], 95))
    assert s.count.item() == 5
    assert math.isnan(summarize(v, torch.zeros(6, dtype=torch.bool)).mean.item())


INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    "values",
    [[NAN, 1.0, 2.0], [INF, 1.0, NAN], [-INF, NAN, 2.0], [INF, -INF, 1.0], [INF, 1.0, 2.0], [-INF, 1.0, 2.0],
     [NAN, NAN, NAN], [-0.0, 0.0, 3.0]],
)  # fmt: skip
def test_summaries_with_nan_and_infinities_against_numpy(values):
    """Each group of three masks (all, none, the last two): mean and max as numpy's; a group holding a NaN is NaN in
    every field; p50 and p95 as numpy's where the group has no infinity; an empty group NaN with count 0."""
    v = torch.tensor(values, dtype=torch.float64)
    groups = {"all": torch.ones(3, dtype=torch.bool), "none": torch.zeros(3, dtype=torch.bool)}
    groups["last2"] = torch.tensor([False, True, True])
    got = summarize_groups(v, groups)
    for name, mask in groups.items():
        x = np.asarray(values)[mask.numpy()]
        fields = [got[name].mean.item(), got[name].max.item(), got[name].p50.item(), got[name].p95.item()]
        assert got[name].count.item() == x.size
        if x.size == 0 or np.isnan(x).any():
            assert all(math.isnan(f) for f in fields), (name, fields)
            continue
        with np.errstate(invalid="ignore"):
            want = [x.mean(), x.max(), np.percentile(x, 50), np.percentile(x, 95)]
        n = 2 if np.isinf(x).any() else 4
        np.testing.assert_array_equal(fields[:n], want[:n])


def test_a_group_of_infinite_norms_has_infinite_quantiles():
    """Norms that overflowed to inf (no NaN): a quantile between two equal neighbours is their value, inf, where
    numpy's interpolation computes inf - inf = NaN (its median, inf, agrees)."""
    s = summarize(torch.tensor([1.0, INF, INF, INF]))
    assert (s.max.item(), s.p50.item(), s.p95.item()) == (INF, INF, INF)


_NARROW = [[0], [5], [0, 0], [3, 3], [0, 2], [2**30, 2**30, 1, 0], [7] * 9]


@pytest.mark.parametrize(
    ("counts", "dtype"),
    [(c, torch.int32) for c in _NARROW] + [(c, torch.int64) for c in _NARROW]
    + [([2**40 + 1, 2**40, 2**40 + 1, 0, 2**40], torch.int64)],
)  # fmt: skip
def test_count_ranks_of_narrow_wide_and_tied_counts(counts, dtype):
    """V = 1 and 2, all equal, all zero, int32 and int64 counts up to 2**40 (ranked exactly, not as floats)."""
    c = torch.tensor(counts, dtype=dtype)
    valid = torch.ones(len(counts), dtype=torch.bool)
    valid[-1] = len(counts) < 3  # a hole in the valid rows where there are enough
    snap = frequency_snapshot(c, valid)
    seen = (valid & (c > 0)).numpy()
    want = np.zeros(len(counts))
    want[seen] = stats.rankdata(np.asarray(counts)[seen])
    assert seen_count_ranks(snap).tolist() == want.tolist() == selected_ranks(c, snap.seen).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=2, max_size=40), st.integers(0, 10_000))
def test_rankdata_and_spearman_match_scipy(values, seed):
    x = torch.tensor(values, dtype=torch.float64)
    np.testing.assert_allclose(rankdata(x).numpy(), stats.rankdata(values))
    y = torch.randn(len(values), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = spearman(x, y).item()
    want = stats.spearmanr(values, y.numpy()).statistic
    if np.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=2, max_size=40), st.integers(0, 10_000))
def test_spearman_of_selected_pairs_matches_scipy_on_them(values, seed):
    """``select=``: SciPy on the selected pairs only; NaN outside the selection changes nothing."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(len(values), generator=g, dtype=torch.float64)
    select = torch.rand(len(values), generator=g) < 0.6
    x = torch.tensor(values, dtype=torch.float64).masked_fill(~select, float("nan"))
    got = spearman(x, y, select=select).item()
    kept = select.numpy()
    want = stats.spearmanr(np.asarray(values)[kept], y.numpy()[kept]).statistic if kept.sum() >= 2 else np.nan
    if np.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, abs=1e-9)


def test_spearman_perfect_and_undefined():
    x = torch.arange(10.0)
    assert spearman(x, x.exp()).item() == pytest.approx(1.0)
    assert spearman(x, -x).item() == pytest.approx(-1.0)
    assert math.isnan(spearman(x, torch.ones(10)).item())
    assert math.isnan(spearman(x[:1], x[:1]).item())


def test_frequency_buckets_hand_computed():
    # 200 rows: rows 0..99 seen with count 1000 - i (distinct), rows 100..189 unseen, rows 190.. not valid
    counts = torch.zeros(200, dtype=torch.long)
    counts[:100] = 1000 - torch.arange(100)
    counts[195] = 7  # not valid: never counted in any bucket
    valid = torch.ones(200, dtype=torch.bool)
    valid[190:] = False
    b = frequency_buckets(counts, valid)
    names = [BUCKETS[i] if i >= 0 else "invalid" for i in b.tolist()]
    assert names[:1] == ["top1"]  # ceil(0.01 * 100) = 1 token
    assert names[1:10] == ["top10"] * 9
    assert names[10:50] == ["top50"] * 40
    assert names[50:100] == ["tail"] * 50
    assert names[100:190] == ["unseen"] * 90
    assert names[190:] == ["invalid"] * 10
    rare = rare_tokens(counts, valid)
    assert rare.nonzero().flatten().tolist() == list(range(50, 100))  # default: the tail bucket
    rare = rare_tokens(counts, valid, max_count=905)
    assert rare.nonzero().flatten().tolist() == list(range(95, 100))


def test_frequency_bucket_ties_broken_by_token_id():
    counts = torch.tensor([5, 5, 5, 5, 0])
    valid = torch.ones(5, dtype=torch.bool)
    assert [BUCKETS[i] for i in frequency_buckets(counts, valid).tolist()] == ["top1", "top50", "tail", "tail", "unseen"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=40), st.integers(0, 10_000))
def test_spearman_of_shared_count_ranks_matches_scipy_of_log_counts(counts, seed):
    """The gradient monitor ranks the counts once and correlates them with several matrices' norms: the
    same as SciPy's rho of log(count) and each norm over the seen rows (count > 0)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts, dtype=torch.float64)
    seen = c > 0
    ranks = selected_ranks(c, seen)
    for _ in range(2):
        y = torch.randn(len(counts), generator=g, dtype=torch.float64).round(decimals=1)  # ties too
        got = spearman_of_ranks(ranks, y, seen).item()
        kept = seen.numpy()
        want = stats.spearmanr(np.log(np.asarray(counts)[kept]), y.numpy()[kept]).statistic if kept.sum() >= 2 else np.nan
        if np.isnan(want):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(want, abs=1e-9)
    # a NaN norm among the seen rows: undefined, as SciPy
    if seen.any():
        y[int(seen.nonzero()[0, 0])] = float("nan")
        assert math.isnan(spearman_of_ranks(ranks, y, seen).item())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(0, 10_000))
def test_count_ranks_read_from_the_snapshot_order_are_scipys_rankdata_of_the_seen_counts(counts, seed):
    """The count ranks the gradient monitor reads from its frequency snapshot's order (no second sort): SciPy's
    rankdata of the seen rows' counts (ties averaged), 0 at the rows not seen (count 0, or not valid); the same
    bits as ranking them afresh."""
    c = torch.tensor(counts, dtype=torch.long)
    valid = torch.rand(len(counts), generator=torch.Generator().manual_seed(seed)) > 0.2
    snap = frequency_snapshot(c, valid)
    got = seen_count_ranks(snap)
    seen = (valid & (c > 0)).numpy()
    want = np.zeros(len(counts))
    if seen.any():
        want[seen] = stats.rankdata(c.numpy()[seen])
    assert got.dtype == torch.float64 and got.tolist() == want.tolist()
    assert torch.equal(got, selected_ranks(c, snap.seen))
    assert torch.equal(seen_count_ranks(snap._replace(order=None)), got)  # a snapshot without its order: ranked afresh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_norms_and_nonzero_match_float64_and_an_exact_zero_test(dtype):
    """One fixed-size float64 recomputation covers float32 overflow (1e30 entries), underflow to 0 (1e-30) and
    lost precision (1e-21): every finite row gets its float64 norm; a norm is 0 only for a zero row."""
    from headwatch.functional.rows import row_norms_and_nonzero

    m = torch.zeros(8, 5, dtype=torch.float64)
    m[1] = torch.tensor([3.0, 4.0, 0, 0, 0])
    m[2, :3] = 1e30
    m[3, 1] = -1e-30
    m[4, 2:] = 1e-21
    m[5, 0] = float("nan")
    m[6] = torch.linspace(-2, 2, 5)
    m = m.to(dtype)
    norms, nonzero = row_norms_and_nonzero(m)
    want = np.linalg.norm(m.double().numpy(), axis=1)
    np.testing.assert_allclose(norms.double().numpy(), want, rtol=1e-6)
    assert nonzero.tolist() == ((m.double() != 0).any(dim=1) | m.isnan().any(dim=1)).tolist()
    assert (norms[nonzero.logical_not()] == 0).all() and (norms[1:5] > 0).all()
