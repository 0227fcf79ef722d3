"""Row-sharded statistics (headwatch.distributed.sharded, .sharded_drift) on W simulated processes in this one
(threads sharing a :class:`tests.helpers.distributed.ThreadReducer`): each "process" holds rows
``[offset, offset + n)`` of a ``(V, d_model)`` matrix as :class:`~headwatch.distributed.sharded.Rows`, and
every combined result must equal the one-process function on the whole matrix (itself checked against
float64 references in tests/functional/test_rows_reference.py and tests/functional/test_neighbours_reference.py), on every rank.
Uneven shards, an empty shard and ties across shards included; the real FSDP2 runs are tests/distributed/test_fsdp.py."""

from __future__ import annotations

import math

import pytest
import torch

from headwatch import HeadwatchError
from headwatch.distributed import sharded as sh
from headwatch.distributed import sharded_drift as sd
from headwatch.distributed.reduce import NoReducer
from headwatch.functional import collision as fcollision
from headwatch.functional import drift as fdrift
from headwatch.functional import drift_pairs as fpairs
from headwatch.functional import lookup_gradient, nearest_neighbours, pair_cosine, row_group_statistics, row_norms
from headwatch.functional import tied_flow_statistics, zero_rows
from tests.helpers.distributed import run_ranks

V, D = 23, 6
LAYOUTS = {"even": [8, 8, 7], "uneven": [2, 14, 7], "empty": [12, 0, 11]}


def _gen(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def shard(matrix: torch.Tensor, sizes: list[int], rank: int) -> sh.Rows:
    offset = sum(sizes[:rank])
    return sh.Rows(matrix[offset : offset + sizes[rank]].clone(), offset, matrix.shape[0], True)


def on_ranks(sizes: list[int], fn):
    return run_ranks(len(sizes), fn)


def assert_same_dict(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key].double().cpu(), want[key].double().cpu(), atol=atol, rtol=1e-6, equal_nan=True, msg=key)


# ---------------------------------------------------------------- Rows and the one-process path
def test_rows_of_a_plain_tensor_are_the_whole_matrix_without_a_copy():
    w = _gen(V, D)
    rows = sh.local_rows(w)
    assert rows.local.data_ptr() == w.data_ptr() and (rows.offset, rows.num_rows, rows.sharded) == (0, V, False)
    assert sh.local_rows(rows) is rows and not sh.is_sharded(w) and not sh.is_sharded(rows)
    part = sh.Rows(w[5:9], 5, V, True)
    assert sh.is_sharded(part)
    assert torch.equal(part.select(torch.arange(V)), torch.arange(5, 9))
    moved = part.with_local(w[5:9] * 2)
    assert (moved.offset, moved.num_rows, moved.sharded) == (5, V, True) and torch.equal(moved.local, w[5:9] * 2)


def test_plain_tensors_take_the_one_process_functions():
    w = _gen(V, D, seed=1)
    w[4] = 0.0
    reducer = NoReducer()
    groups = {"all": torch.ones(V, dtype=torch.bool), "low": torch.arange(V) < 7}
    stats, norms = sh.row_statistics(w, groups, reducer)
    assert_same_dict(stats, row_group_statistics(w, groups))
    assert torch.equal(norms, row_norms(w))
    assert torch.equal(sh.row_norms_full(w, reducer), row_norms(w))
    assert torch.equal(sh.zero_rows_full(w, reducer), zero_rows(w))
    ids = torch.tensor([3, 3, 0, 22])
    assert torch.equal(sh.gather_rows(w, ids, reducer), w[ids])


# ---------------------------------------------------------------- per-row statistics
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_row_statistics_norms_and_zero_rows_combine_exactly(layout):
    sizes = LAYOUTS[layout]
    w = _gen(V, D, seed=2)
    w[[3, 9, 20]] = 0.0
    w[15, 2] = 1e-30  # non-zero, with a float32 norm that underflows
    groups = {"all": torch.ones(V, dtype=torch.bool), "odd": torch.arange(V) % 2 == 1, "none": torch.zeros(V, dtype=torch.bool)}
    want_stats = row_group_statistics(w, groups)

    def body(rank, reducer):
        rows = shard(w, sizes, rank)
        stats, norms = sh.row_statistics(rows, groups, reducer)
        return stats, norms, sh.row_norms_full(rows, reducer), sh.zero_rows_full(rows, reducer)

    for stats, norms, full, zero in on_ranks(sizes, body):
        assert_same_dict(stats, want_stats)
        torch.testing.assert_close(norms, row_norms(w))
        torch.testing.assert_close(full, row_norms(w))
        assert torch.equal(zero, zero_rows(w))


def test_rows_that_do_not_cover_the_matrix_once_are_refused_on_every_rank():
    w = _gen(V, D, seed=3)

    def body(rank, reducer):
        overlapping = sh.Rows(w[rank * 5 : rank * 5 + 10], rank * 5, V, True)  # rows 5-9 held twice, 20-22 by nobody
        with pytest.raises(HeadwatchError, match=r"hold 20 rows of a matrix of 23 rows"):
            sh.row_norms_full(overlapping, reducer)
        return True

    assert on_ranks([10, 10], body) == [True, True]


@pytest.mark.parametrize("layout", ["uneven", "empty"])
def test_tied_flow_statistics_sum_over_processes(layout):
    sizes = LAYOUTS[layout]
    lookup, scoring = _gen(V, D, seed=4), _gen(V, D, seed=5)
    lookup[[1, 2, 17]] = 0.0
    valid = torch.arange(V) != 6
    na, nb = row_norms(lookup), row_norms(scoring)
    want = tied_flow_statistics(lookup, scoring, valid, na, nb)

    def body(rank, reducer):
        return sh.tied_flow_statistics(shard(lookup, sizes, rank), shard(scoring, sizes, rank), valid, reducer, na, nb)

    for got in on_ranks(sizes, body):
        assert_same_dict(got, want)
    assert want["tied_flow_rows"].item() == V - 4


# ---------------------------------------------------------------- the lookup flow of a sharded tied matrix
def test_sharded_lookup_keeps_each_rank_its_rows_of_the_process_average():
    """Each process adds its micro-batches; every rank ends with its rows of mean_r(E_r), as FSDP averages .grad."""
    sizes = LAYOUTS["uneven"]
    g = torch.Generator().manual_seed(6)
    batches = [[(torch.randint(0, V, (2, 5), generator=g), torch.randn(2, 5, D, generator=g)) for _ in range(2)] for _ in sizes]
    batches[0][0][0][0, :2] = 4  # padding positions: no gradient
    want = torch.zeros(V, D, dtype=torch.float64)
    for rank_batches in batches:
        for ids, grad in rank_batches:
            want += lookup_gradient(ids, grad.double(), V, padding_idx=4).double()
    want /= len(sizes)
    like = sh.Rows(torch.zeros(V, D), 0, V, True)

    def body(rank, reducer):
        flow = sh.ShardedLookup()
        for ids, grad in batches[rank]:
            flow.add(ids, grad, padding_idx=4)
        return flow.rows(shard(like.local, sizes, rank), reducer)

    parts = on_ranks(sizes, body)
    assert [p.offset for p in parts] == [0, 2, 16]
    torch.testing.assert_close(torch.cat([p.local for p in parts]).double(), want, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.cat([p.local for p in parts])[4], torch.zeros(D))


def test_sharded_lookup_with_no_micro_batch_on_one_rank_and_bad_shapes():
    sizes = [10, 13]
    ids, grad = torch.tensor([[0, 12, 12]]), torch.ones(1, 3, D)

    def body(rank, reducer):
        flow = sh.ShardedLookup()
        if rank == 1:
            flow.add(ids, grad)
        return flow.rows(shard(torch.zeros(V, D), sizes, rank), reducer)

    first, second = on_ranks(sizes, body)
    assert first.local[0].tolist() == [0.5] * D  # one process of two saw token 0 once: the average is 1/2
    assert second.local[2].tolist() == [1.0] * D  # token 12 (row 2 of rank 1) twice, averaged over 2 processes
    assert first.local[1:].abs().sum().item() == 0 and second.local[[0, 1, *range(3, 13)]].abs().sum().item() == 0
    with pytest.raises(HeadwatchError, match=r"grad_output of shape \(1, 3\) \+ \(d_model,\), got \(1, 2, 6\)"):
        sh.ShardedLookup().add(ids, torch.ones(1, 2, D))


# ---------------------------------------------------------------- gathering rows, nearest neighbours
def test_gather_rows_returns_every_requested_row_on_every_rank_in_its_dtype():
    sizes = LAYOUTS["empty"]
    w = _gen(V, D, seed=7).to(torch.bfloat16)
    ids = torch.tensor([22, 0, 11, 12, 11, 5])  # repeats, both shard edges

    def body(rank, reducer):
        return sh.gather_rows(shard(w, sizes, rank), ids, reducer)

    for got in on_ranks(sizes, body):
        assert got.dtype == torch.bfloat16 and torch.equal(got, w[ids])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_nearest_neighbours_sharded_equal_one_process(layout):
    sizes = LAYOUTS[layout]
    w = _gen(V, D, seed=8)
    w[19] = w[1] * 2.0  # a copy on another shard (exact in float32): a tie between rows 1 and 19
    w[0] = w[1] + 1e-3 * _gen(D, seed=9)
    w[7, 0] = math.nan  # non-finite: nobody's neighbour, NaN for itself
    valid = torch.ones(V, dtype=torch.bool)
    valid[[5, 21]] = False
    queries = torch.tensor([0, 1, 19, 7, 5, 22, 12, 12])
    want = nearest_neighbours(w, queries, valid, 2**20)

    def body(rank, reducer):
        return sh.nearest_neighbours_sharded(shard(w, sizes, rank), queries, valid, 700, reducer)

    for got in on_ranks(sizes, body):
        assert got.index.tolist() == want.index.tolist()
        torch.testing.assert_close(got.cosine, want.cosine, atol=1e-6, rtol=0, equal_nan=True)
    assert want.index[0].item() == 1  # the tie goes to the lowest row id, on one process and sharded
    assert math.isnan(want.cosine[3].item())


def test_collision_statistics_and_synonym_pair_rate_sharded_equal_one_process():
    sizes = LAYOUTS["uneven"]
    w = _gen(V, D, seed=10)
    w[18:21] = w[2:5] + 0.05 * _gen(3, D, seed=11)
    rare = torch.arange(15, V)
    groups = {"rare": rare, "top": torch.tensor([0, 1, 2]), "none": torch.zeros(0, dtype=torch.long)}
    valid = torch.arange(V) != 10
    want, want_nn, want_cos = fcollision.collision_statistics(w, rare, groups, valid, 0.9)
    synonyms = [[2, 18, 7], [3, 19], [0, 1]]
    rare_mask = torch.zeros(V, dtype=torch.bool)
    rare_mask[15:] = True
    want_rate, want_pairs = fcollision.synonym_pair_rate(w, synonyms, rare_mask, 0.9)

    def body(rank, reducer):
        rows = shard(w, sizes, rank)
        return (
            sh.collision_statistics(rows, rare, groups, valid, 0.9, 600, reducer),
            sh.synonym_pair_rate(rows, synonyms, rare_mask, 0.9, reducer),
        )

    for (scalars, nn_rare, cosines), (rate, pairs) in on_ranks(sizes, body):
        assert_same_dict(scalars, want)
        assert nn_rare.index.tolist() == want_nn.index.tolist()
        for name in groups:
            torch.testing.assert_close(cosines[name], want_cos[name], atol=1e-6, rtol=0)
        assert pairs == want_pairs == 3 and rate.item() == pytest.approx(want_rate.item())  # (18, 2), (18, 7), (19, 3)
    assert want["rare_rate"].item() == pytest.approx(3 / 8) and want_rate.item() == pytest.approx(2 / 3)


# ---------------------------------------------------------------- drift-corrected collision
def _drifted(seed: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sharing a common direction, two planted pairs, and valid / seen masks with exclusions."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3 + 2.0 * common
    w[17] = w[3] + 0.01 * torch.randn(D, generator=g)
    w[20] = w[9] + 0.01 * torch.randn(D, generator=g)
    w[13] = 0.0
    valid = torch.arange(V) != 22
    seen = torch.arange(V) != 1
    return w, valid, seen


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pairable_rows_and_principal_directions_sharded_equal_one_process(layout):
    sizes = LAYOUTS[layout]
    w, valid, seen = _drifted()
    want = fdrift.pairable_rows(w, valid, seen)
    ids = want.mask.nonzero().flatten()
    mean, directions, variances, trace = fdrift.principal_directions_of(w, ids, 2, "exact")

    def body(rank, reducer):
        rows = shard(w, sizes, rank)
        pairable = sd.pairable_rows_sharded(rows, valid, seen, False, 2**20, reducer)
        return pairable, sd.principal_directions_sharded(rows, pairable.mask, 2, 2**20, reducer, method="exact")

    results = on_ranks(sizes, body)
    for pairable, (m, u, var, tr) in results:
        assert torch.equal(pairable.mask, want.mask)
        assert [int(x) for x in pairable[1:]] == [int(x) for x in want[1:]] == [1, 1, 1, 0]
        torch.testing.assert_close(m, mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(u @ u.T, directions @ directions.T, atol=1e-5, rtol=0)  # the subspace, whatever the signs
        torch.testing.assert_close(var, variances, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(tr, trace, atol=1e-9, rtol=1e-9)
    first = results[0][1]
    for _, other in results[1:]:  # rank 0's values everywhere: bitwise the same
        assert all(torch.equal(a, b) for a, b in zip(first, other))


def test_principal_directions_need_two_rows_over_every_process():
    w, _, _ = _drifted()
    basis = torch.zeros(V, dtype=torch.bool)
    basis[4] = True  # one row in all

    def body(rank, reducer):
        with pytest.raises(HeadwatchError, match="at least 2 valid rows, got 1"):
            sd.principal_directions_sharded(shard(w, [11, 12], rank), basis, 1, 2**20, reducer)
        return True

    assert on_ranks([11, 12], body) == [True, True]


@pytest.mark.parametrize("layout", ["even", "empty"])
def test_corrected_collision_and_synonym_statistics_sharded_equal_one_process(layout):
    sizes = LAYOUTS[layout]
    w, valid, seen = _drifted()
    pairable = fdrift.pairable_rows(w, valid, seen).mask
    queries = torch.tensor([17, 20, 13, 1, 5, 11, 0])  # 13 (zero) and 1 (unseen) are skipped
    want, correction = fpairs.corrected_collision(w, queries, pairable, 0.9, 2)
    groups = {"low": torch.tensor([0, 1, 2]), "high": torch.tensor([18, 19, 20, 21])}
    want_nn = {name: nearest_neighbours(correction.rows, ids[pairable[ids]], pairable).cosine for name, ids in groups.items()}
    synonyms = [[3, 17], [9, 20, 5], [13, 2]]
    want_syn = fpairs.synonym_statistics(correction.rows, synonyms, pairable, 0.9)
    a, b = torch.tensor([3, 9, 0]), torch.tensor([17, 20, 22])
    want_pairs = pair_cosine(correction.rows, a, b)

    def body(rank, reducer):
        rows = shard(w, sizes, rank)
        res, fixed = sd.corrected_collision_rows(rows, queries, pairable, 0.9, 2, 2**20, reducer)
        return (
            res,
            fixed,
            sd.nn_cosines_rows(fixed, groups, pairable, 600, reducer),
            sd.synonym_statistics_rows(fixed, synonyms, pairable, 0.9, 600, reducer),
            sd.pair_cosine_rows(fixed, a, b, reducer),
        )

    for rank, (res, fixed, nn, syn, pairs) in enumerate(on_ranks(sizes, body)):
        assert res.queries.tolist() == want.queries.tolist() == [17, 20, 5, 11, 0]
        assert res.skipped_queries.item() == want.skipped_queries.item() == 2
        assert res.neighbour.tolist() == want.neighbour.tolist() and res.raw_neighbour.tolist() == want.raw_neighbour.tolist()
        torch.testing.assert_close(res.cosine, want.cosine, atol=1e-5, rtol=0)
        torch.testing.assert_close(res.raw_cosine, want.raw_cosine, atol=1e-6, rtol=0)
        for name in ("rate", "raw_rate", "drift_mean_cos", "removed_variance"):
            torch.testing.assert_close(getattr(res, name), getattr(want, name), atol=1e-6, rtol=1e-6, msg=name)
        torch.testing.assert_close(fixed.local, shard(correction.rows, sizes, rank).local, atol=1e-5, rtol=0)
        for name in groups:
            torch.testing.assert_close(nn[name], want_nn[name], atol=1e-5, rtol=0)
        assert_same_dict(syn, want_syn, atol=1e-6)
        torch.testing.assert_close(pairs, want_pairs, atol=1e-5, rtol=0)
    assert want.neighbour[:2].tolist() == [3, 9] and want.rate.item() >= 0.4  # the planted pairs, after correction


def test_sharded_drift_functions_on_plain_tensors_are_the_one_process_ones():
    w, valid, seen = _drifted()
    reducer = NoReducer()
    pairable = sd.pairable_rows_sharded(sh.local_rows(w), valid, seen, True, 2**20, reducer)
    want = fdrift.pairable_rows(w, valid, seen, include_unseen=True)
    assert torch.equal(pairable.mask, want.mask) and pairable.unseen.item() == 1 and bool(pairable.mask[1])
    res, fixed = sd.corrected_collision_rows(w, torch.tensor([17, 20]), pairable.mask, 0.9, 2, 2**20, reducer)
    want_res, correction = fpairs.corrected_collision(w, torch.tensor([17, 20]), pairable.mask, 0.9, 2)
    assert torch.equal(fixed, correction.rows) and res.neighbour.tolist() == want_res.neighbour.tolist()
    assert_same_dict(
        sd.synonym_statistics_rows(fixed, [[3, 17]], pairable.mask, 0.9, 2**20, reducer),
        fpairs.synonym_statistics(correction.rows, [[3, 17]], pairable.mask, 0.9),
    )
    torch.testing.assert_close(sd.pair_cosine_rows(fixed, torch.tensor([3]), torch.tensor([17]), reducer),
                               pair_cosine(correction.rows, torch.tensor([3]), torch.tensor([17])))


def test_sharded_synonym_statistics_refuse_ids_outside_the_matrix_and_count_skipped_pairs():
    w, valid, seen = _drifted()
    pairable = fdrift.pairable_rows(w, valid, seen).mask

    def body(rank, reducer):
        rows = shard(w, [11, 12], rank)
        with pytest.raises(HeadwatchError, match=r"synonym group ids must be in \[0, 23\)"):
            sd.synonym_statistics_rows(rows, [[2, 23]], pairable, 0.9, 2**20, reducer)
        return sd.synonym_statistics_rows(rows, [[13, 2], [1, 4]], pairable, 0.9, 2**20, reducer)

    for got in on_ranks([11, 12], body):
        assert math.isnan(got["pair_rate"].item()) and got["pairs"].item() == 0 and got["skipped_pairs"].item() == 4
