"""Per-row statistics (headwatch.functional.rows, .tied, .frequency, .adapters, .precision) against float64
references, autograd on an untied twin, hand-computed values and their documented errors."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from headwatch import HeadwatchError
from headwatch.functional import (
    BUCKETS,
    add_low_rank_,
    dense_rows,
    frequency_buckets,
    frequency_snapshot,
    head_weight_gradient,
    lookup_gradient,
    rankdata,
    rare_tokens,
    row_cosine,
    row_density,
    row_group_statistics,
    row_nonzero,
    row_nonzero_given_norms,
    row_norms,
    spearman,
    summarize,
    summarize_groups,
    tied_flow_statistics,
    token_scalars,
    zero_rows,
)
from headwatch.functional.frequency import bucket_capacity
from headwatch.functional.precision import full_precision, map_rows_single_threaded


def _gen(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def np_quantile(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q, method="linear"))


# ---------------------------------------------------------------- norms, non-zero rows, density
def test_row_norms_of_float64_input_and_sparse_duplicates():
    m = _gen(7, 5, seed=1).double() * 1e3
    got = row_norms(m)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.sqrt((m * m).sum(1)), atol=0, rtol=1e-15)
    # a sparse COO gradient with a repeated index: the entries are summed before the norm
    idx = torch.tensor([[0, 0, 3], [1, 1, 2]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([3.0, 1.0, -2.0]), (5, 4), check_invariants=True)  # (0, 1) holds 3 + 1
    assert row_norms(sparse).tolist() == [4.0, 0.0, 0.0, 2.0, 0.0]
    assert row_nonzero(sparse).tolist() == [True, False, False, True, False]
    assert torch.equal(dense_rows(sparse), sparse.to_dense())


def test_row_norms_above_float32_range_are_exact_in_float64_on_request():
    m = torch.zeros(3, 4)
    m[0] = 3e38  # each entry is a finite float32; the norm 6e38 is not
    m[1, 0] = 1e-21  # its square is a float32 subnormal: precision lost, recomputed in float64
    got32 = row_norms(m)
    got64 = row_norms(m, dtype=torch.float64)
    assert math.isinf(got32[0].item())
    assert got64[0].item() == pytest.approx(2 * float(torch.tensor(3e38).item()), rel=1e-15)
    assert got32[1].item() == pytest.approx(float(torch.tensor(1e-21).item()), rel=1e-6)
    assert got64[2].item() == 0.0


@pytest.mark.parametrize("bad", [torch.zeros(5), torch.zeros(2, 3, 4), [[1.0]]])
def test_row_functions_refuse_what_is_not_a_matrix(bad):
    # through headwatch.functional a non-tensor is refused first, naming the argument
    with pytest.raises(HeadwatchError, match=r"shape \[vocab_size, d_model\]|`matrix` must be a torch\.Tensor"):
        dense_rows(bad)
    with pytest.raises(HeadwatchError, match=r"expected a of shape \[vocab_size, d_model\]|`a` must be a torch\.Tensor"):
        row_cosine(bad, torch.zeros(2, 3))


def test_row_nonzero_given_norms_when_most_norms_are_zero():
    """More than a quarter of zero norms: the whole matrix is re-checked; entries whose squares underflow count."""
    m = torch.zeros(8, 3)
    m[1, 2] = 1e-30  # norm 1e-30 in float32 is 0 only if computed naively
    m[5, 0] = -2.0
    norms = torch.zeros(8)  # pretend every norm rounded to 0
    norms[5] = 2.0
    got = row_nonzero_given_norms(m, norms)
    assert got.tolist() == [False, True, False, False, False, True, False, False]
    # a NaN row is non-zero (its norm is NaN, not 0)
    m[7, 1] = math.nan
    assert row_nonzero_given_norms(m, row_norms(m))[7].item()


def test_row_density_without_valid_rows_and_shape_mismatch():
    nonzero = torch.tensor([True, False, True, True])
    assert row_density(nonzero).item() == pytest.approx(0.75)
    assert math.isnan(row_density(nonzero, torch.zeros(4, dtype=torch.bool)).item())
    with pytest.raises(HeadwatchError, match=r"same shape \(V,\), got \(4,\) and \(3,\)"):
        row_density(nonzero, torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------- lookup gradient: autograd of nn.Embedding
def test_lookup_gradient_with_padding_idx_over_micro_batches_equals_embedding_backward():
    V, d = 11, 4
    emb = nn.Embedding(V, d, padding_idx=2).double()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (3, 5), generator=g)]
    batches[0][0, :3] = 2  # padding positions get no gradient
    out = torch.zeros(V, d)
    for ids in batches:
        y = emb(ids)
        y.retain_grad()
        (y.sin() * torch.arange(d, dtype=torch.float64)).sum().backward()
        lookup_gradient(ids, y.grad, V, padding_idx=2, out=out)
    torch.testing.assert_close(out.double(), emb.weight.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[2], torch.zeros(d))


def test_lookup_gradient_refuses_mismatched_shapes():
    with pytest.raises(HeadwatchError, match=r"grad_output of shape \(2, 3\) \+ \(d_model,\), got \(2, 4, 5\)"):
        lookup_gradient(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), 10)
    with pytest.raises(HeadwatchError, match=r"out of shape \(10, 5\), got \(9, 5\)"):
        lookup_gradient(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5), 10, out=torch.zeros(9, 5))


# ---------------------------------------------------------------- row cosine
def test_row_cosine_against_float64_with_given_norms_and_zero_rows():
    a, b = _gen(9, 6, seed=4), _gen(9, 6, seed=5)
    a[2] = 0.0
    b[4] = 0.0
    b[6] = -3 * a[6]  # exactly opposite: -1
    cos, both = row_cosine(a, b, row_norms(a), row_norms(b))
    ad, bd = a.double(), b.double()
    want = (ad * bd).sum(1) / (ad.norm(dim=1) * bd.norm(dim=1))
    assert both.tolist() == [i not in (2, 4) for i in range(9)]
    assert cos[2].item() == 0.0 and cos[4].item() == 0.0
    torch.testing.assert_close(cos[both].double(), want[both], atol=1e-6, rtol=1e-6)
    assert cos[6].item() == pytest.approx(-1.0, abs=1e-6)
    with pytest.raises(HeadwatchError, match=r"same shape, got \(9, 6\) and \(9, 5\)"):
        row_cosine(a, b[:, :5])


# ---------------------------------------------------------------- summaries, ranks
def test_summarize_and_summarize_groups_match_numpy():
    values = _gen(40, seed=6).abs()
    select = torch.arange(40) % 3 == 0
    got = summarize(values, select)
    v = values[select].double().numpy()
    assert got.count.item() == len(v)
    assert got.mean.item() == pytest.approx(v.mean(), rel=1e-12)
    assert got.max.item() == v.max()
    assert got.p50.item() == pytest.approx(np_quantile(v, 0.5), rel=1e-12)
    assert got.p95.item() == pytest.approx(np_quantile(v, 0.95), rel=1e-12)
    groups = {"thirds": select, "evens": torch.arange(40) % 2 == 0, "none": torch.zeros(40, dtype=torch.bool)}
    by_group = summarize_groups(values, groups)
    for name, mask in groups.items():
        s = by_group[name]
        v = values[mask].double().numpy()
        assert s.count.item() == len(v)
        if not len(v):
            assert all(math.isnan(x.item()) for x in (s.mean, s.max, s.p50, s.p95))
            continue
        assert s.mean.item() == pytest.approx(v.mean(), rel=1e-12)
        assert s.max.item() == v.max()
        assert s.p50.item() == pytest.approx(np_quantile(v, 0.5), rel=1e-12)
        assert s.p95.item() == pytest.approx(np_quantile(v, 0.95), rel=1e-12)
    empty = summarize(values, torch.zeros(40, dtype=torch.bool))
    assert empty.count.item() == 0 and math.isnan(empty.mean.item()) and math.isnan(empty.p95.item())


def test_a_group_holding_a_nan_is_nan_in_every_field_as_numpy():
    """numpy's mean, max and percentiles of values holding a NaN are NaN: so is every field of such a group (its
    quantiles are not those of its other values); a group without the NaN keeps its figures."""
    values = torch.tensor([3.0, float("nan"), 1.0, 2.0, 5.0, 4.0])
    groups = {"with_nan": torch.tensor([True, True, True, True, False, False]), "without": torch.tensor([True, False, True, True, True, True])}
    got = summarize_groups(values, groups)
    v = values[groups["with_nan"]].double().numpy()
    want = (v.mean(), v.max(), np.percentile(v, 50), np.percentile(v, 95))
    assert all(math.isnan(w) for w in want)
    assert all(math.isnan(x.item()) for x in got["with_nan"][:4]) and got["with_nan"].count.item() == 4
    w = values[groups["without"]].double().numpy()
    assert [x.item() for x in got["without"][:4]] == pytest.approx([w.mean(), w.max(), np_quantile(w, 0.5), np_quantile(w, 0.95)], rel=1e-12)


def test_groups_summarized_together_equal_each_alone_bitwise():
    """summarize_groups measures every group in one pass of small ops: each group's values are those of a call
    for that group alone, bit for bit (ties, NaN values, an empty and a full group, groups of 1 and 2 rows)."""
    values = torch.cat([_gen(300, seed=9).abs(), torch.tensor([0.0, 0.0, float("nan"), 2.0, 2.0])])
    n = values.numel()
    idx = torch.arange(n)
    groups = {"thirds": idx % 3 == 0, "none": torch.zeros(n, dtype=torch.bool), "all": torch.ones(n, dtype=torch.bool),
              "one": idx == 7, "two": (idx == 5) | (idx == n - 1), "tail": idx >= n - 6}  # fmt: skip
    together = summarize_groups(values, groups)
    for name, mask in groups.items():
        alone = summarize_groups(values, {name: mask})[name]
        for got, want in zip(together[name], alone):
            assert got.shape == () and torch.equal(got.view(torch.int64), want.view(torch.int64)), name
    want = values[groups["one"]].double().item()
    assert together["one"].p50.item() == together["one"].p95.item() == together["one"].max.item() == want


def test_rankdata_and_spearman_edge_cases():
    assert rankdata(torch.zeros(0)).numel() == 0
    assert rankdata(torch.tensor([5.0, 1.0, 5.0, 3.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    with pytest.raises(HeadwatchError, match=r"1-D tensor, got shape \(2, 2\)"):
        rankdata(torch.zeros(2, 2))
    with pytest.raises(HeadwatchError, match=r"same length, got \(3,\) and \(4,\)"):
        spearman(torch.zeros(3), torch.zeros(4))
    assert math.isnan(spearman(torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1.0, 2.0, 3.0])).item())
    assert math.isnan(spearman(torch.tensor([1.0]), torch.tensor([2.0])).item())
    # monotone transforms keep rho = 1; reversing the order gives -1
    x = _gen(30, seed=7)
    assert spearman(x, x.exp() * 5 + 2).item() == pytest.approx(1.0)
    assert spearman(x, -(x**3)).item() == pytest.approx(-1.0)


# ---------------------------------------------------------------- tied flows: autograd on an untied twin
class _Twin(nn.Module):
    """``logits = tanh(E[ids] A) @ H.T``: tied when ``H is E``."""

    def __init__(self, weight: torch.Tensor, mix: torch.Tensor, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(*weight.shape)
        self.emb.weight = nn.Parameter(weight.clone())
        self.mix = nn.Parameter(mix.clone())
        self.head = self.emb.weight if tied else nn.Parameter(weight.clone())

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        x.retain_grad()
        return torch.tanh(x @ self.mix) @ self.head.T, x


def test_tied_flow_statistics_equal_the_untied_twins_gradients():
    """A tied matrix gets G = E + H; E from the lookup (lookup_gradient), H = G - E: equal to the untied twin's
    embedding and head gradients, and the statistics equal a float64 recomputation from the twin's."""
    V, d = 13, 6
    weight, mix = _gen(V, d, seed=8) * 0.5, _gen(d, d, seed=9)
    ids = torch.tensor([[1, 4, 4, 7, 0, 12], [3, 3, 9, 1, 5, 6]])
    targets = torch.tensor([[4, 4, 7, 0, 12, 2], [3, 9, 1, 5, 6, 10]])
    tied, twin = _Twin(weight, mix, True), _Twin(weight, mix, False)
    for model in (tied, twin):
        logits, x = model(ids)
        nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).backward()
        model.x_grad = x.grad
    lookup = lookup_gradient(ids, tied.x_grad, V)
    scoring = tied.emb.weight.grad - lookup
    torch.testing.assert_close(lookup, twin.emb.weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(scoring, twin.head.grad, atol=1e-6, rtol=1e-5)
    valid = torch.ones(V, dtype=torch.bool)
    valid[1] = False  # a row that cannot occur is left out
    got = tied_flow_statistics(lookup, scoring, valid)
    E, H = twin.emb.weight.grad.double(), twin.head.grad.double()
    nE, nH = E.norm(dim=1), H.norm(dim=1)
    rows = (nE > 0) & (nH > 0) & valid
    cos = (E * H).sum(1)[rows] / (nE * nH)[rows]
    assert rows.sum().item() == 8  # rows both looked up and scored: 9 distinct ids, one (1) not valid
    assert got["tied_flow_rows"].item() == rows.sum().item()
    assert got["tied_flow_cosine_mean"].item() == pytest.approx(cos.mean().item(), abs=1e-6)
    assert got["tied_flow_conflict_fraction"].item() == pytest.approx((cos < 0).double().mean().item())
    same = tied_flow_statistics(lookup, scoring, valid, row_norms(lookup), row_norms(scoring))
    assert all(torch.equal(same[k], got[k]) for k in got)


def test_tied_flow_statistics_without_a_row_of_both_flows_are_nan():
    lookup, scoring = torch.zeros(4, 3), _gen(4, 3, seed=10)
    lookup[0] = 1.0
    got = tied_flow_statistics(lookup, scoring, torch.tensor([False, True, True, True]))
    assert got["tied_flow_rows"].item() == 0
    assert math.isnan(got["tied_flow_cosine_mean"].item()) and math.isnan(got["tied_flow_conflict_fraction"].item())


def test_row_group_statistics_match_numpy_per_group():
    m = _gen(30, 4, seed=11)
    m[::4] = 0.0  # zero rows: count against density, norm 0 in the quantiles
    groups = {"a": torch.arange(30) < 17, "b": torch.arange(30) % 3 == 1, "none": torch.zeros(30, dtype=torch.bool)}
    got = row_group_statistics(m, groups)
    norms = m.double().norm(dim=1).numpy()
    nonzero = (m != 0).any(1).numpy()
    for name, mask in groups.items():
        sel = mask.numpy()
        if not sel.any():
            assert all(math.isnan(got[f"none_{k}"].item()) for k in ("row_density", "row_norm_mean", "row_norm_p95"))
            continue
        assert got[f"{name}_row_density"].item() == pytest.approx(nonzero[sel].mean())
        assert got[f"{name}_row_norm_mean"].item() == pytest.approx(norms[sel].mean(), rel=1e-6)
        assert got[f"{name}_row_norm_max"].item() == pytest.approx(norms[sel].max(), rel=1e-6)
        assert got[f"{name}_row_norm_p50"].item() == pytest.approx(np_quantile(norms[sel], 0.5), rel=1e-6)
        assert got[f"{name}_row_norm_p95"].item() == pytest.approx(np_quantile(norms[sel], 0.95), rel=1e-6)
    assert set(got) == {f"{g}_{k}" for g in groups for k in ("row_density", "row_norm_mean", "row_norm_max", "row_norm_p50", "row_norm_p95")}


# ---------------------------------------------------------------- frequency: buckets and the one "rare"
def test_bucket_sizes_of_one_hundred_seen_tokens_by_hand():
    """100 seen tokens: ranks 0 (top1), 1-9 (top10), 10-49 (top50), 50-99 (tail); unseen and invalid rows apart."""
    V = 110
    counts = torch.zeros(V, dtype=torch.long)
    counts[:100] = torch.arange(1000, 900, -1)  # distinct counts, highest first
    valid = torch.ones(V, dtype=torch.bool)
    valid[105:] = False
    counts[107] = 5000  # a count on an invalid row changes nothing
    bucket = frequency_buckets(counts, valid)
    sizes = {name: int((bucket == i).sum()) for i, name in enumerate(BUCKETS)}
    assert sizes == {"top1": 1, "top10": 9, "top50": 40, "tail": 50, "unseen": 5}
    assert int((bucket == -1).sum()) == 5
    assert bucket[0].item() == BUCKETS.index("top1") and bucket[99].item() == BUCKETS.index("tail")
    snap = frequency_snapshot(counts, valid)
    assert torch.equal(snap.rare, bucket == BUCKETS.index("tail"))
    scalars = token_scalars(snap)
    assert scalars["seen_fraction"].item() == pytest.approx(100 / 105)
    assert scalars["total"].item() == counts.sum().item()
    assert scalars["rare_count"].item() == 50
    with pytest.raises(HeadwatchError, match=r"counts and valid of shape \(V,\)"):
        frequency_buckets(counts, valid[:-1])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_no_bucket_holds_more_rows_than_its_capacity_and_a_fully_seen_vocabulary_fills_it(V, seen_share, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 50, (V,), generator=g) * (torch.rand(V, generator=g) < seen_share)
    full = torch.randint(1, 50, (V,), generator=g)  # every row seen
    valid = torch.ones(V, dtype=torch.bool)
    for c in (counts, full):
        bucket = frequency_buckets(c, valid)
        for i, name in enumerate(BUCKETS):
            assert int((bucket == i).sum()) <= bucket_capacity(name, V)
    top1 = int((frequency_buckets(full, valid) == 0).sum())
    assert top1 == bucket_capacity("top1", V)  # the bound is reached: no slot more than needed
    with pytest.raises(HeadwatchError, match="`bucket` must be one of"):
        bucket_capacity("rare", V)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=80), st.integers(0, 2**31 - 1))
def test_default_rare_tokens_are_exactly_the_tail_bucket(counts_list, seed):
    counts = torch.tensor(counts_list, dtype=torch.long)
    valid = torch.rand(len(counts_list), generator=torch.Generator().manual_seed(seed)) > 0.1
    bucket = frequency_buckets(counts, valid)
    rare = rare_tokens(counts, valid)
    assert torch.equal(rare, bucket == BUCKETS.index("tail"))
    seen = valid & (counts > 0)
    assert not (rare & ~seen).any()  # never-seen tokens are never rare
    # every rare token's count is at most every non-rare seen token's count
    if rare.any() and (seen & ~rare).any():
        assert counts[rare].max() <= counts[seen & ~rare].min()


def test_rare_by_max_count_and_by_fraction():
    counts = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    valid = torch.ones(10, dtype=torch.bool)
    valid[2] = False
    assert rare_tokens(counts, valid, max_count=3).tolist() == [False, True, False, True] + [False] * 6
    # 8 seen valid tokens; the bottom quarter by count are ranks 6, 7: counts 3 and 1
    assert rare_tokens(counts, valid, fraction=0.25).nonzero().flatten().tolist() == [1, 3]
    assert rare_tokens(counts, valid, fraction=1.0).sum().item() == 8
    assert not rare_tokens(counts, valid, fraction=0.0).any()


# ---------------------------------------------------------------- adapters' math
def test_add_low_rank_in_chunks_and_head_weight_gradient_against_float64():
    g = torch.Generator().manual_seed(12)
    out = torch.randn(37, 8, generator=g)
    left, right = torch.randn(37, 3, generator=g).to(torch.bfloat16), torch.randn(3, 8, generator=g)
    want = out.double() + 0.75 * left.double() @ right.double()
    got = add_low_rank_(out, left, right, 0.75, max_chunk_bytes=50)  # one row per chunk
    assert got is out
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    hidden, grad = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 37, generator=g)
    acc = head_weight_gradient(hidden, grad, max_chunk_bytes=1)
    acc = head_weight_gradient(hidden[:1], grad[:1], out=acc)  # a second micro-batch adds in
    want = grad.reshape(-1, 37).double().T @ hidden.reshape(-1, 8).double() + grad[0].double().T @ hidden[0].double()
    torch.testing.assert_close(acc.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: add_low_rank_(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(3, 3), 1.0), r"got \(4, 3\), \(4, 2\), \(3, 3\)"),
        (lambda: add_low_rank_(torch.zeros(4, 3), torch.zeros(5, 2), torch.zeros(2, 3), 1.0), r"left \[V, r\]"),
        (lambda: add_low_rank_(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(2, 3), 1.0, max_chunk_bytes=0), "max_chunk_bytes"),
        (lambda: head_weight_gradient(torch.zeros(2, 3, 4), torch.zeros(2, 4, 5)), "same leading shape"),
        (lambda: head_weight_gradient(torch.zeros(2, 4), torch.zeros(2, 5), out=torch.zeros(4, 5)), r"out of shape \(5, 4\)"),
        (lambda: zero_rows(torch.zeros(4)), r"shape \[vocab_size, d_model\]"),
        (lambda: zero_rows(torch.zeros(4, 2), rtol=-0.1), "`rtol` must be a float >= 0"),
    ],
)
def test_adapter_math_refuses_bad_shapes(call, match):
    with pytest.raises(HeadwatchError, match=match):
        call()


def test_zero_rows_exact_and_relative_to_the_median_norm():
    m = _gen(9, 4, seed=13)
    m[2] = 0.0
    m[5] = 1e-30  # not zero: its squares underflow, the exact test still sees it
    m[7] *= 1e-3
    assert zero_rows(m).nonzero().flatten().tolist() == [2]
    median = float(np.median(m.double().norm(dim=1).numpy()))
    want = (m.double().norm(dim=1) <= 0.01 * median).nonzero().flatten().tolist()
    assert zero_rows(m, rtol=0.01).nonzero().flatten().tolist() == want == [2, 5, 7]


# ---------------------------------------------------------------- precision helpers
def test_full_precision_disables_cpu_autocast_inside_and_restores_it():
    a, b = _gen(4, 8, seed=14), _gen(8, 3, seed=15)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
        with full_precision(torch.device("cpu")):
            inside = a @ b
        assert (a @ b).dtype == torch.bfloat16
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside.double(), a.double() @ b.double(), atol=1e-5, rtol=1e-5)


def test_map_rows_single_threaded_runs_every_task_once_carries_modes_and_reraises():
    previous = torch.get_num_threads()
    seen: list[tuple[int, int, bool, bool]] = []
    lock = threading.Lock()

    def fn(task: int, worker: int) -> None:
        with lock:
            seen.append((task, torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    with torch.inference_mode():
        map_rows_single_threaded(fn, list(range(9)), workers=3)
    assert sorted(t for t, *_ in seen) == list(range(9))
    assert all(threads == 1 and not grad and inference for _, threads, grad, inference in seen)
    assert torch.get_num_threads() == previous

    def boom(task: int, worker: int) -> None:
        if task == 4:
            raise ValueError("task 4 failed")

    with pytest.raises(ValueError, match="task 4 failed"):
        map_rows_single_threaded(boom, list(range(6)), workers=2)
    assert torch.get_num_threads() == previous  # restored after a failure too
    order: list[int] = []
    map_rows_single_threaded(lambda t, w: order.append((t, w)), [0, 1, 2], workers=1)
    assert order == [(0, 0), (1, 0), (2, 0)]  # one worker: in order, on the caller's thread


def test_rows_of_tiny_entries_get_their_norm_not_zero():
    """A statistic must stay right at extreme finite magnitudes. Entries of 1e-30 square to
    1e-60, below float32: the float32 norm is 0 though the row is not; the gradient statistics recompute it."""
    from headwatch.distributed.reduce import NoReducer
    from headwatch.distributed.sharded import row_statistics

    m = torch.zeros(6, 8)
    m[1] = 1e-30
    m[2, 3] = -3e-25
    m[4] = 2.0
    want = torch.linalg.vector_norm(m.double(), dim=1)
    assert row_norms(m)[1] == 0  # what float32 alone gives
    stats, norms = row_statistics(m, {"all": torch.ones(6, dtype=torch.bool)}, NoReducer())
    assert torch.allclose(norms.double(), want, rtol=1e-6, atol=0) and norms[1] > 0 and norms[2] > 0
    assert stats["all_row_density"].item() == 0.5
    assert stats["all_row_norm_max"].item() == pytest.approx(want.max().item(), rel=1e-6)
