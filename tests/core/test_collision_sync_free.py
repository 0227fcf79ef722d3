"""The collision measurement without host reads: fixed-size selections against
independent references (float64 numpy brute force and eigh, counted inclusion frequencies), the per-row
results' trip through the one transfer, and the monitor's handling of too few pairable rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headwatch import HeadwatchError
from headwatch.core.monitor import Media
from headwatch.core.publish import to_host
from headwatch.functional.collision import sample_mask, top_colliding_pairs_fixed
from headwatch.functional.drift import principal_directions_masked
from headwatch.functional.drift_pairs import corrected_collision_masked
from headwatch.functional.neighbors import nearest_neighbours_masked
from tests.helpers.collision import brute_force, collision_monitor, corrected_reference, planted, snapshot


@pytest.mark.parametrize("budget", [2_000, 50_000, 64 * 2**20])
def test_masked_nearest_neighbours_match_float64_brute_force(budget):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 24, generator=g)
    w[17] = 0.0  # a zero row: cosine 0 with everything
    w[40, 3] = math.nan  # a non-finite row: nobody's neighbour, NaN as a query
    valid = torch.rand(300, generator=g) > 0.2
    valid[40] = True
    queries = torch.tensor([0, 5, 17, 299, 150, 151, 3, 40, 0])  # repeated ids, a padded slot (0) at the end
    got = nearest_neighbours_masked(w, queries, valid, max_chunk_bytes=budget)
    ok = valid.clone()
    ok[40] = False  # the reference excludes the NaN row by hand
    w_ref = w.clone()
    w_ref[40] = 0.0
    cos, idx = brute_force(w_ref, queries, ok)
    finite = [i for i, q in enumerate(queries.tolist()) if q not in (17, 40)]  # the zero row ties everywhere at 0
    np.testing.assert_allclose(got.cosine[finite].double().numpy(), cos[finite], atol=1e-6)
    assert got.index[finite].tolist() == idx[finite].tolist()
    assert math.isnan(got.cosine[7].item()) and got.index[7].item() == -1
    assert got.cosine[2].item() == pytest.approx(0.0, abs=1e-7)
    assert torch.isfinite(w).sum() == w.numel() - 1  # the weights were not normalised in place


def test_masked_nearest_neighbours_without_keys():
    w = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    only = torch.zeros(10, dtype=torch.bool)
    only[4] = True
    got = nearest_neighbours_masked(w, torch.tensor([4, 5]), only)
    assert got.cosine[0].item() == -math.inf and got.index[0].item() == -1  # its only key is itself
    assert got.index[1].item() == 4


def test_sample_mask_is_a_seeded_uniform_subset():
    mask = torch.zeros(200, dtype=torch.bool)
    mask[torch.arange(10, 200, 4)] = True  # 48 rows
    ids, taken = sample_mask(mask, 100, torch.Generator().manual_seed(0))  # no more than k: all, ascending
    assert ids.numel() == 100 and taken.sum().item() == 48
    assert ids[taken].tolist() == mask.nonzero().flatten().tolist() and not taken[48:].any()
    a = sample_mask(mask, 12, torch.Generator().manual_seed(1))
    b = sample_mask(mask, 12, torch.Generator().manual_seed(1))
    c = sample_mask(mask, 12, torch.Generator().manual_seed(2))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert a[1].all() and a[0].unique().numel() == 12 and mask[a[0]].all() and torch.equal(a[0], a[0].sort().values)
    # uniform without replacement: each of the 48 rows is drawn with probability 12 / 48 (counted over 4000 seeds)
    hits = torch.zeros(200)
    for seed in range(4000):
        ids, _ = sample_mask(mask, 12, torch.Generator().manual_seed(seed))
        hits[ids] += 1
    freq = hits[mask] / 4000
    assert hits[~mask].sum() == 0
    assert (freq - 0.25).abs().max() < 5 * math.sqrt(0.25 * 0.75 / 4000)  # 5 sigma


def test_top_colliding_pairs_fixed_are_the_most_similar_measured_first():
    cos = torch.tensor([0.95, 0.5, 0.99, 0.9, -math.inf, 0.97, math.nan])
    measured = torch.tensor([True, True, True, True, True, False, True])  # 0.97 is padding
    at, taken = top_colliding_pairs_fixed(cos, measured, 0.9, 5)
    assert at[taken].tolist() == [2, 0, 3]
    at, taken = top_colliding_pairs_fixed(cos, measured, 0.9, 2)
    assert at[taken].tolist() == [2, 0]
    at, taken = top_colliding_pairs_fixed(cos, measured, 0.999, 3)
    assert not taken.any()


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_masked_principal_directions_match_float64_eigh(method):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 40, generator=g, dtype=torch.float64)
    w[:, :3] *= torch.tensor([20.0, 10.0, 6.0], dtype=torch.float64)
    w += 3.0
    valid = torch.rand(500, generator=g) > 0.1
    w[~valid] = 1e6  # rows outside the mask must not count (not even through the centring)
    mean, dirs, variances, total, n = principal_directions_masked(w.float(), valid, 3, method=method, max_chunk_bytes=20_000)
    x = w[valid].numpy()
    xc = x - x.mean(0)
    evals, evecs = np.linalg.eigh(xc.T @ xc)
    assert n.item() == valid.sum().item()
    np.testing.assert_allclose(mean.double().numpy(), x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(variances.numpy(), evals[::-1][:3], rtol=1e-4)
    np.testing.assert_allclose(total.item(), np.trace(xc.T @ xc), rtol=1e-5)
    np.testing.assert_allclose(np.abs(np.sum(dirs.double().numpy() * evecs[:, ::-1][:, :3], axis=0)), 1.0, atol=1e-4)


def test_masked_corrected_collision_matches_float64_reference():
    w, plants = planted(V=1024, d=48)
    pairable = torch.rand(1024, generator=torch.Generator().manual_seed(5)) > 0.1
    pairable[list(plants) + [i for i, _ in plants.values()]] = True
    queries = torch.tensor([1000, 1001, 1002, 1003, 1004, 7, 8, 0, 0])  # two padded slots
    given = torch.tensor([True] * 7 + [False, False])
    not_pairable = int((~pairable[:10]).nonzero()[0])
    queries[6] = not_pairable  # given but not pairable: not measured
    res, _ = corrected_collision_masked(w, queries, given, pairable, tau=0.9, k=1, max_chunk_bytes=30_000)
    measured = given & pairable[queries]
    assert res.measured.tolist() == measured.tolist()
    ref_cos, ref_idx = corrected_reference(w, queries[measured], pairable)
    np.testing.assert_allclose(res.cosine[measured].double().numpy(), ref_cos, atol=1e-5)
    assert res.neighbour[measured].tolist() == ref_idx.tolist()
    assert res.rate.item() == (ref_cos >= 0.9).mean()
    raw_cos, _ = brute_force(w, queries[measured], pairable)
    assert res.raw_rate.item() == (raw_cos >= 0.9).mean()
    x = w.double()[queries[measured]]
    units = (x / x.norm(dim=1, keepdim=True)).mean(0)
    assert res.drift_mean_cos.item() == pytest.approx(units.norm().item(), rel=1e-6)
    assert res.basis_rows.item() == pairable.sum().item()
    none, _ = corrected_collision_masked(w, queries, torch.zeros(9, dtype=torch.bool), pairable, 0.9, 1)
    assert math.isnan(none.rate.item()) and math.isnan(none.drift_mean_cos.item())


def test_host_tensors_cross_the_one_transfer_in_their_dtype():
    ids = torch.tensor([0, 5, 2**40 + 3])
    taken = torch.tensor([True, False, True])
    cos = torch.tensor([0.25, -math.inf, math.nan])
    media = Media(histograms={"h": torch.tensor([1, 2])}, host={"ids": ids, "taken": taken, "cos": cos})
    numbers = to_host({"x": torch.tensor(2.5)}, [media])
    assert numbers == {"x": 2.5}
    assert media.host["ids"].dtype == torch.int64 and media.host["ids"].tolist() == ids.tolist()
    assert media.host["taken"].dtype == torch.bool and media.host["taken"].tolist() == [True, False, True]
    assert media.host["cos"].dtype == torch.float32 and media.host["cos"][:2].tolist() == [0.25, -math.inf]
    assert math.isnan(media.host["cos"][2].item())
    assert media.histograms["h"].dtype == torch.float64  # histograms as before


def test_too_few_pairable_rows_raise_and_drop_the_values():
    w = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    counts = torch.zeros(50, dtype=torch.long)
    counts[4] = 1  # one seen row: no mean and directions to remove
    snap = snapshot(counts, torch.ones(50, dtype=torch.bool), max_count=1)
    monitor = collision_monitor(w)
    with pytest.raises(HeadwatchError, match="at least 2 valid rows, got 1"):
        monitor.measure(snap)
    # through compute/published (the orchestrator's path): the values are removed, the cause raised
    scalars, monitor.media.host = monitor._measure_on_device(snap, 0)
    numbers = to_host({**scalars, "other/x": torch.tensor(1.0)}, [monitor.media])
    with pytest.raises(HeadwatchError, match="at least 2 valid rows"):
        monitor.published(numbers)
    assert numbers == {"other/x": 1.0}
