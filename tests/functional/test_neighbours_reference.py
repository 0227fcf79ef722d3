"""Nearest neighbours, collision statistics and synonym tables (headwatch.functional.neighbors, .collision,
.drift_pairs) against a brute-force float64 search, hand-built matrices and their documented errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwatch import HeadwatchError
from headwatch.functional import (
    chunk_sizes,
    collision_statistics,
    nearest_neighbours,
    pair_cosine,
    partner_ranks,
    rate_above,
    sample_rows,
    synonym_confusion,
    synonym_pair_rate,
    synonym_statistics,
    synonym_table,
    top_colliding_pairs,
)
from headwatch.functional.neighbors import (
    Neighbours,
    merge_maxima,
    nearest_neighbours_masked_sets,
    row_max,
    similarity_chunks,
)


def brute_force(matrix: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``max_{j valid, j != q} cos(W_q, W_j)`` and its lowest arg, by the full similarity matrix."""
    w = matrix.double()
    unit = w / w.norm(dim=1, keepdim=True).clamp(min=1e-300)
    sims = unit[queries] @ unit.T  # (Q, V)
    sims[:, ~valid] = -math.inf
    sims[torch.arange(len(queries)), queries] = -math.inf
    best, arg = sims.max(dim=1)
    return best, torch.where(torch.isinf(best), torch.full_like(arg, -1), arg)


def _gen(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- chunk sizes
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 200_000), st.integers(1, 8192), st.integers(1, 2**28))
def test_chunk_sizes_fit_the_budget_whenever_one_query_fits(Q, K, d, budget):
    """Working set ``4 q k + 4 q d + 8 k d`` bytes (similarities, queries, keys counted twice)."""
    q, k = chunk_sizes(Q, K, d, budget)
    assert 1 <= q <= Q and 1 <= k <= min(K, 8192)
    fits_one = (budget - 8 * k * d) // (4 * (k + d)) >= 1
    if fits_one:
        assert 4 * q * k + 4 * q * d + 8 * k * d <= budget
    if k < min(K, 8192):  # keys were halved (from 2k or 2k + 1) only because fewer than min(Q, 1024) queries fit
        before = 2 * k + 1
        assert (budget - 8 * before * d) // (4 * (before + d)) < min(Q, 1024)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 200_000), st.integers(1, 8192), st.integers(2**20, 2**28))
def test_similarity_chunks_keep_a_cpu_block_within_16_mib(Q, K, d, budget):
    """On the CPU the similarity block is cache-sized (16 MiB) and never larger than the budget's."""
    q, k = similarity_chunks(Q, K, d, budget, torch.device("cpu"))
    q_any, k_any = chunk_sizes(Q, K, d, budget)
    assert 1 <= q <= q_any and 1 <= k <= k_any
    assert q * k * 4 <= 16 * 2**20 or q == 1
    if Q >= 2048 and K >= 2048 and q_any >= 2048 and k_any >= 2048:
        assert (q, k) == (2048, 2048)  # square: both sides of the product large


def _max_reference(sims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maxima and the first index holding each, read element by element in float64 (NaN wins)."""
    values, indices = [], []
    for row in sims.double().tolist():
        nan = [j for j, x in enumerate(row) if math.isnan(x)]
        j = nan[0] if nan else max(range(len(row)), key=lambda j: (row[j], -j))
        values.append(row[j])
        indices.append(j)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(indices)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 300), st.integers(0, 2**31 - 1), st.sampled_from(["plain", "ties", "inf", "nan"]))
def test_row_max_is_the_first_maximum_of_each_row(q, k, seed, kind):
    g = torch.Generator().manual_seed(seed)
    sims = torch.randint(-3, 4, (q, k), generator=g).float() if kind == "ties" else torch.randn(q, k, generator=g)
    if kind in ("inf", "nan"):
        special = torch.rand(q, k, generator=g) < 0.3
        sims[special] = float("-inf") if kind == "inf" else float("nan")
        sims[0] = float("-inf")  # a row with no finite value: index 0
    value, index = row_max(sims)
    ref_value, ref_index = _max_reference(sims)
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(value.double(), ref_value, equal_nan=True, atol=0, rtol=0)


# ---------------------------------------------------------------- exact search
@settings(max_examples=20, deadline=None)
@given(st.integers(2, 40), st.integers(1, 9), st.integers(0, 2**31 - 1), st.sampled_from([1200, 5000, 2**26]))
def test_nearest_neighbours_equal_brute_force_at_every_chunking(V, d, seed, budget):
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(V, d, generator=g)
    valid = torch.rand(V, generator=g) > 0.3
    queries = torch.randint(0, V, (min(V, 12),), generator=g)
    got = nearest_neighbours(matrix, queries, valid, max_chunk_bytes=budget)
    best, arg = brute_force(matrix, queries, valid)
    none = torch.isinf(best)
    assert torch.equal(got.index[none], torch.full_like(arg[none], -1))
    assert torch.isinf(got.cosine[none]).all() and (got.cosine[none] < 0).all()
    torch.testing.assert_close(got.cosine[~none].double(), best[~none], atol=2e-6, rtol=0)
    # the index is a maximiser: its float64 cosine equals the best (ties may pick another maximiser)
    w = matrix.double() / matrix.double().norm(dim=1, keepdim=True)
    at = (w[queries[~none]] * w[got.index[~none]]).sum(1)
    torch.testing.assert_close(at, best[~none], atol=2e-6, rtol=0)
    assert valid[got.index[~none]].all() and (got.index != queries).all()


@pytest.mark.parametrize("budget", [1, 2**26])
def test_on_a_tie_the_lowest_row_id_is_the_neighbour_across_key_chunks(budget):
    """Rows 3 and 9 are copies: every query nearest to them gets 3 (the first maximum), whatever the chunking."""
    matrix = _gen(12, 5, seed=1)
    matrix[9] = matrix[3] * 2.0  # the same direction
    matrix[0] = matrix[3] + 1e-3 * _gen(5, seed=2)  # nearest to both
    got = nearest_neighbours(matrix, torch.tensor([0, 3, 9]), max_chunk_bytes=budget)
    assert got.index.tolist()[0] == 3
    assert got.index.tolist()[1:] == [9, 3]  # each copy's neighbour is the other one, never itself
    assert got.cosine[1:].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)


@pytest.mark.parametrize("budget", [1200, 2**26])
@pytest.mark.parametrize("threads", [1, 2])
def test_query_sets_searched_in_one_pass_equal_brute_force_per_set(budget, threads):
    """Several sets in one pass over the keys (each thread its own chunks of keys, merged): each set's values are
    the float64 search's, a tie goes to the lowest row id across threads, a NaN query has none, an empty set is empty."""
    matrix = _gen(40, 6, seed=4)
    matrix[29] = matrix[3] * 2.0  # the same direction (exactly: a power of two), far from row 3 in the keys
    matrix[0] = matrix[3] + 1e-3 * _gen(6, seed=5)  # nearest to both copies: row 3 must win
    matrix[7] = math.nan
    valid = torch.ones(40, dtype=torch.bool)
    valid[[5, 11]] = False
    sets = [torch.tensor([0, 3, 29, 7]), torch.zeros(0, dtype=torch.long), torch.arange(40), torch.tensor([5, 5, 11])]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        found = nearest_neighbours_masked_sets(matrix, sets, valid, max_chunk_bytes=budget)
    finally:
        torch.set_num_threads(previous)
    finite = torch.isfinite(matrix).all(dim=1)
    for queries, got in zip(sets, found):
        assert got.cosine.shape == queries.shape and got.index.shape == queries.shape
        ok = finite[queries]
        best, arg = brute_force(matrix[finite], torch.searchsorted(finite.nonzero().flatten(), queries[ok]), valid[finite])
        torch.testing.assert_close(got.cosine[ok].double(), best, atol=2e-6, rtol=0)
        assert got.index[ok].tolist() == finite.nonzero().flatten()[arg].tolist()
        assert got.cosine[~ok].isnan().all() and (got.index[~ok] == -1).all()
    assert found[0].index.tolist()[:3] == [3, 29, 3]  # the tie: the lowest id, whichever thread read it


def test_running_maxima_merge_to_the_largest_with_the_lowest_id_on_a_tie():
    inf = math.inf
    values = torch.tensor([[0.5, 0.25, -inf, 0.125, -inf], [0.5, 0.75, 0.0, 0.125, -inf], [0.25, 0.75, -inf, 0.375, -inf]])
    ids = torch.tensor([[8, 1, -1, 3, -1], [2, 6, 4, 9, -1], [0, 5, -1, 7, -1]])
    value, index = merge_maxima(values, ids)
    assert value.tolist() == [0.5, 0.75, 0.0, 0.375, -inf]
    assert index.tolist() == [2, 5, 4, 7, -1]


def test_queries_need_not_be_valid_and_edge_rows():
    matrix = _gen(6, 4, seed=3)
    matrix[2] = 0.0  # a zero row: cosine 0 with every row
    matrix[4, 1] = math.nan  # a NaN row: nobody's neighbour, its own cosine NaN
    valid = torch.tensor([True, False, True, True, True, False])
    got = nearest_neighbours(matrix, torch.tensor([1, 2, 4, 5]), valid)
    # the reference searches the finite rows only: ids 0, 1, 2, 3, 5 with 0, 2, 3 valid
    ids = torch.tensor([0, 1, 2, 3, 5])
    best, arg = brute_force(matrix[ids], torch.tensor([1, 2, 4]), torch.tensor([True, False, True, True, False]))
    assert got.index[[0, 3]].tolist() == ids[arg[[0, 2]]].tolist()  # invalid queries still get a valid neighbour
    torch.testing.assert_close(got.cosine[[0, 3]].double(), best[[0, 2]], atol=2e-6, rtol=0)
    assert got.cosine[1].item() == 0.0 and got.index[1].item() == 0  # zero row: cosine 0 with all, the first wins
    assert math.isnan(got.cosine[2].item()) and got.index[2].item() == -1  # NaN query: no neighbour
    lonely = nearest_neighbours(matrix, torch.tensor([3]), torch.tensor([False, False, False, True, False, False]))
    assert lonely.index.item() == -1 and lonely.cosine.item() == -math.inf
    empty = nearest_neighbours(matrix, torch.zeros(0, dtype=torch.long))
    assert empty.cosine.shape == (0,) and empty.index.shape == (0,)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(5), torch.tensor([0])), r"shape \[vocab_size, d_model\], got \(5,\)"),
        ((torch.zeros(5, 2, dtype=torch.long), torch.tensor([0])), "floating matrix"),
        (("rows", torch.tensor([0])), "`matrix` must be a torch.Tensor, got 'rows'"),
        ((torch.zeros(5, 2), torch.tensor([0.0])), "integer tensor"),
        ((torch.zeros(5, 2), torch.tensor([[0]])), "1-D integer tensor"),
        ((torch.zeros(5, 2), torch.tensor([0]), torch.ones(4, dtype=torch.bool)), r"valid` of shape \(5,\)"),
        ((torch.zeros(5, 2), torch.tensor([0]), torch.ones(5)), "dtype bool"),
        ((torch.zeros(5, 2), torch.tensor([0]), None, 0), "max_chunk_bytes"),
        ((torch.zeros(5, 2), torch.tensor([0, 5])), r"\[0, 5\), got values from 0 to 5"),
        ((torch.zeros(5, 2), torch.tensor([-1, 2])), r"got values from -1 to 2"),
    ],
)
def test_nearest_neighbours_bad_arguments(args, match):
    with pytest.raises(HeadwatchError, match=match):
        nearest_neighbours(*args)


def test_pair_cosine_against_float64_and_bad_ids():
    matrix = _gen(8, 6, seed=4).to(torch.bfloat16)
    a, b = torch.tensor([0, 1, 2, 7, 7]), torch.tensor([1, 1, 5, 3, 0])
    w = matrix.double()
    want = (w[a] * w[b]).sum(1) / (w[a].norm(dim=1) * w[b].norm(dim=1))
    got = pair_cosine(matrix, a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    assert got[1].item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(HeadwatchError, match=r"same length, got \(2,\) and \(3,\)"):
        pair_cosine(matrix, torch.tensor([0, 1]), torch.tensor([0, 1, 2]))


# ---------------------------------------------------------------- collision statistics
def _planted(V: int = 40, d: int = 16, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian rows, with rows 30-34 planted close to rows 0-4 (cos about 0.995)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, d, generator=g)
    w[30:35] = w[0:5] + 0.1 * torch.randn(5, d, generator=g)
    return w, torch.arange(30, 40)


def test_collision_statistics_equal_a_brute_force_search():
    w, rare = _planted()
    valid = torch.ones(40, dtype=torch.bool)
    valid[39] = False
    groups = {"rare": rare, "top": torch.arange(0, 5), "none": torch.zeros(0, dtype=torch.long)}
    scalars, nn_rare, cosines = collision_statistics(w, rare, groups, valid, tau=0.9, max_chunk_bytes=2000)
    best, arg = brute_force(w, rare, valid)
    torch.testing.assert_close(nn_rare.cosine.double(), best, atol=2e-6, rtol=0)
    assert torch.equal(nn_rare.index, arg)
    assert scalars["rare_rate"].item() == pytest.approx((best >= 0.9).double().mean().item())
    assert scalars["rare_rate"].item() == pytest.approx(0.5)  # the five planted rows out of ten
    assert scalars["rare_nn_cosine_mean"].item() == pytest.approx(best.mean().item(), abs=2e-6)
    top_best, _ = brute_force(w, torch.arange(0, 5), valid)
    assert scalars["top_nn_cosine_mean"].item() == pytest.approx(top_best.mean().item(), abs=2e-6)
    assert math.isnan(scalars["none_nn_cosine_mean"].item())
    assert torch.equal(cosines["rare"], nn_rare.cosine) and cosines["none"].numel() == 0
    assert scalars["rare_rate"].dtype == torch.float64


def test_collision_statistics_leave_nonfinite_cosines_out_of_the_means():
    w, rare = _planted()
    w[33, 0] = math.inf  # a rare row holding inf: NaN cosine, not a collision, not in the mean
    scalars, nn_rare, _ = collision_statistics(w, rare, {"rare": rare}, torch.ones(40, dtype=torch.bool), 0.9)
    assert math.isnan(nn_rare.cosine[3].item())
    finite = nn_rare.cosine[torch.isfinite(nn_rare.cosine)].double()
    assert scalars["rare_nn_cosine_mean"].item() == pytest.approx(finite.mean().item())
    assert scalars["rare_rate"].item() == pytest.approx(0.4)  # 4 of 10: the NaN row is measured, does not collide
    empty, nn_none, _ = collision_statistics(w, torch.zeros(0, dtype=torch.long), {}, torch.ones(40, dtype=torch.bool), 0.9)
    assert math.isnan(empty["rare_rate"].item()) and nn_none.cosine.numel() == 0


def test_top_colliding_pairs_are_the_most_similar_first():
    rare = torch.tensor([10, 11, 12, 13, 14])
    nb = Neighbours(torch.tensor([0.95, 0.5, 0.99, 0.9, -math.inf]), torch.tensor([1, 2, 3, 4, -1]))
    assert top_colliding_pairs(rare, nb, tau=0.9, k=2) == [(12, 3, pytest.approx(0.99)), (10, 1, pytest.approx(0.95))]
    assert [p[0] for p in top_colliding_pairs(rare, nb, tau=0.9, k=10)] == [12, 10, 13]  # only the colliding ones
    assert top_colliding_pairs(rare, nb, tau=0.999, k=3) == []
    assert top_colliding_pairs(rare, nb, tau=0.9, k=0) == []


def test_sample_rows_is_a_seeded_sorted_subset():
    rows = torch.arange(100, 200)
    assert sample_rows(rows, 100, torch.Generator().manual_seed(0)) is rows  # no more than k: all of them
    a = sample_rows(rows, 10, torch.Generator().manual_seed(1))
    b = sample_rows(rows, 10, torch.Generator().manual_seed(1))
    c = sample_rows(rows, 10, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 10 and a.unique().numel() == 10
    assert torch.equal(a, a.sort().values) and bool(((a >= 100) & (a < 200)).all())


def test_synonym_pair_rate_counts_ordered_pairs_from_rare_members():
    w = _gen(10, 4, seed=6)
    w[5] = w[1] * 3  # cos 1
    w[6] = -w[1]  # cos -1
    rare = torch.zeros(10, dtype=torch.bool)
    rare[[1, 6]] = True
    groups = [[1, 5, 6], [2, 3]]  # rare 1: (1,5) (1,6); rare 6: (6,1) (6,5); group [2, 3] has no rare member
    rate, pairs = synonym_pair_rate(w, groups, rare, tau=0.9)
    assert pairs == 4
    assert rate.item() == pytest.approx(1 / 4)  # only (1, 5) has cos >= 0.9
    nothing, zero = synonym_pair_rate(w, [[2, 3]], rare, tau=0.9)
    assert math.isnan(nothing.item()) and zero == 0


# ---------------------------------------------------------------- synonym tables and confusion
def test_synonym_table_by_hand():
    table = synonym_table([[1, 3, 4], [4, 6], [7]], vocab_size=8)
    assert table.shape == (8, 3)
    assert table[4].tolist() == [1, 3, 6]  # 4 is in two groups: the union of their other members
    assert table[1].tolist() == [3, 4, -1]
    assert table[7].tolist() == [-1, -1, -1]  # alone in its group: no synonym
    assert table[0].tolist() == [-1, -1, -1]
    assert synonym_table([], vocab_size=3).tolist() == [[-1], [-1], [-1]]
    with pytest.raises(HeadwatchError, match=r"id 9 outside \[0, 8\)"):
        synonym_table([[1, 9]], vocab_size=8)


def test_synonym_confusion_against_a_loop_over_positions():
    g = torch.Generator().manual_seed(7)
    V = 9
    logits = torch.randn(4, 6, V, generator=g)
    targets = torch.randint(0, V, (4, 6), generator=g)
    targets[0, 0] = -100
    logits[1, 1, 4] = logits[1, 1, 1] = 7.0  # a tie counts as confused
    targets[1, 1] = 1
    table = synonym_table([[1, 4], [2, 5, 8]], V)
    eligible = torch.tensor([False, True, True, False, True, False, False, False, True])
    positions, confused = synonym_confusion(logits, targets, table, eligible)
    want_p = want_c = 0
    syn = {1: [4], 4: [1], 2: [5, 8], 5: [2, 8], 8: [2, 5]}
    for x, t in zip(logits.reshape(-1, V), targets.reshape(-1).tolist()):
        if 0 <= t < V and eligible[t] and t in syn:
            want_p += 1
            want_c += int(max(x[s].item() for s in syn[t]) >= x[t].item())
    assert (positions.item(), confused.item()) == (want_p, want_c)
    assert want_c >= 1 and want_p > want_c
    with pytest.raises(HeadwatchError, match="synonym table with 9 rows"):
        synonym_confusion(logits, targets, table[:8], eligible)


# ---------------------------------------------------------------- partner ranks and synonym statistics
def test_partner_ranks_against_a_float64_count_and_empty_pairs():
    w = _gen(15, 5, seed=8)
    valid = torch.ones(15, dtype=torch.bool)
    valid[[2, 11]] = False
    a, b = torch.tensor([0, 3, 7, 7]), torch.tensor([1, 4, 2, 14])
    got = partner_ranks(w, a, b, valid, max_chunk_bytes=600)
    u = w.double() / w.double().norm(dim=1, keepdim=True)
    for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        target = (u[x] * u[y]).sum()
        closer = sum(1 for j in range(15) if valid[j] and j not in (x, y) and (u[x] * u[j]).sum() > target)
        assert got[i].item() == 1 + closer
    assert partner_ranks(w, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), valid).numel() == 0
    with pytest.raises(HeadwatchError, match=r"one length, got \(2,\) and \(1,\)"):
        partner_ranks(w, torch.tensor([0, 1]), torch.tensor([2]), valid)


def test_synonym_statistics_skip_unpairable_members_and_check_ids():
    w = _gen(12, 4, seed=9)
    w[3] = w[2] * 1.5
    pairable = torch.ones(12, dtype=torch.bool)
    pairable[10] = False
    got = synonym_statistics(w, [[2, 3], [4, 10]], pairable, tau=0.9)
    assert got["pairs"].item() == 2 and got["skipped_pairs"].item() == 2  # (4, 10) and (10, 4)
    assert got["pair_rate"].item() == 1.0 and got["median_rank"].item() == 1.0
    none = synonym_statistics(w, [[4, 10]], pairable)
    assert math.isnan(none["pair_rate"].item()) and math.isnan(none["median_rank"].item()) and none["pairs"].item() == 0
    with pytest.raises(HeadwatchError, match=r"synonym group ids must be in \[0, 12\)"):
        synonym_statistics(w, [[2, 12]], pairable)
    assert math.isnan(rate_above(torch.zeros(0), 0.5).item())
    assert rate_above(torch.tensor([0.2, 0.5, 0.9]), 0.5).item() == pytest.approx(2 / 3)


def test_partner_ranks_count_an_exact_copy_of_the_partner_as_a_tie_at_any_scale():
    """Row y + 1 copies the partner y: a tie (in the partner's favour), so the rank equals the rank with the copy
    masked (the target cosine and the competitors' come from different products and could differ by an ulp:
    the copy counted as closer in 134 of 360 such pairs before); rows at 1e30 / 1e-30 rank as at scale 1 (a
    plain norm's squares overflow / underflow float32)."""
    base = _gen(2049, 7, seed=13)
    valid = torch.ones(2049, dtype=torch.bool)
    for x, y in zip(range(0, 24), range(1000, 1048, 2)):
        w = base.clone()
        w[y + 1] = w[y]
        without = valid.clone()
        without[y + 1] = False
        a, b = torch.tensor([x]), torch.tensor([y])
        assert partner_ranks(w, a, b, valid, 2**26).item() == partner_ranks(w, a, b, without, 2**26).item()
    a, b = torch.arange(0, 24), torch.arange(1000, 1024)
    got = partner_ranks(base, a, b, valid, 2**26)
    u = base.double() / base.double().norm(dim=1, keepdim=True)
    sims = u[a] @ u.T  # float64 reference: 1 + competitors strictly closer (no near-tie in this draw)
    sims[torch.arange(24), a] = -math.inf
    sims[torch.arange(24), b] = -math.inf
    assert torch.equal(got, 1 + (sims > (u[a] * u[b]).sum(dim=1, keepdim=True)).sum(dim=1))
    for scale in (1e30, 1e-30):
        assert torch.equal(partner_ranks(base * scale, a, b, valid, 2**26), got)
