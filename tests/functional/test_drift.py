"""Collision beyond common drift: correction against float64 references, planted pairs under drift, memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from headwatch import HeadwatchError
from headwatch.functional.drift import (
    default_k,
    mean_resultant_length,
    pairable_rows,
    remove_top_directions,
    top_principal_directions,
)
from headwatch.functional.drift_pairs import (
    corrected_collision,
    nn_cosine_by_bucket,
    ordered_pairs,
    partner_ranks,
    synonym_statistics,
)
from tests.helpers.collision import drifted_head


def test_default_k():
    assert [default_k(d) for d in (16, 64, 128, 149, 151, 4096)] == [1, 1, 1, 1, 2, 41]


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_principal_directions_match_float64_eigh(method):
    g = torch.Generator().manual_seed(1)
    # a clear spectrum: 3 strong directions, then noise
    w = torch.randn(500, 40, generator=g, dtype=torch.float64)
    w[:, :3] *= torch.tensor([20.0, 10.0, 6.0], dtype=torch.float64)
    w += 3.0  # a common mean
    valid = torch.rand(500, generator=g) > 0.1
    mean, dirs, variances, total = top_principal_directions(w.float(), valid, k=3, method=method, max_chunk_bytes=20_000)
    x = w[valid].numpy()
    xc = x - x.mean(0)
    evals, evecs = np.linalg.eigh(xc.T @ xc)
    np.testing.assert_allclose(mean.double().numpy(), x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(variances.numpy(), evals[::-1][:3], rtol=1e-4)
    np.testing.assert_allclose(total.item(), np.trace(xc.T @ xc), rtol=1e-5)
    # same subspace: |cos| of each direction with the reference is 1
    np.testing.assert_allclose(np.abs(np.sum(dirs.double().numpy() * evecs[:, ::-1][:, :3], axis=0)), 1.0, atol=1e-4)


def test_removed_rows_match_float64_projection():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 32, generator=g).to(torch.bfloat16)
    corr = remove_top_directions(w, k=2, max_chunk_bytes=5_000)
    x = w.double().numpy()
    xc = x - x.mean(0)
    _, evecs = np.linalg.eigh(xc.T @ xc)
    u = evecs[:, ::-1][:, :2]
    expected = xc - xc @ u @ u.T
    assert corr.rows.dtype == torch.float32 and corr.rows.shape == (300, 32)
    np.testing.assert_allclose(corr.rows.double().numpy(), expected, atol=2e-5)
    evals = np.linalg.eigvalsh(xc.T @ xc)
    assert corr.removed_variance.item() == pytest.approx(evals[-2:].sum() / evals.sum(), rel=1e-5)


def test_planted_pairs_under_drift_are_found_exactly():
    w, rare, a, b = drifted_head()
    pairable = pairable_rows(w).mask
    result, corr = corrected_collision(w, rare, pairable)
    assert result.rate.item() == 200 / 1000  # the planted fraction, exactly
    assert result.raw_rate.item() >= 0.99  # raw cosine calls (nearly) every rare row a duplicate
    assert result.drift_mean_cos.item() > 0.95
    assert result.removed_variance.item() > 0.5
    flagged = set(result.queries[result.cosine >= 0.9].tolist())
    assert flagged == set(a.tolist()) | set(b.tolist())
    # each planted row's corrected nearest neighbour is its partner
    nn = dict(zip(result.queries.tolist(), result.neighbour.tolist()))
    assert all(nn[i] == j and nn[j] == i for i, j in zip(a.tolist(), b.tolist()))
    # float64 reference: mean and top principal direction removed, then exact cosines
    x = w.double().numpy()
    xc = x - x.mean(0)
    u = np.linalg.eigh(xc.T @ xc)[1][:, -1:]
    y = xc - xc @ u @ u.T
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    sims = y[rare.numpy()] @ y.T
    sims[np.arange(len(rare)), rare.numpy()] = -np.inf
    np.testing.assert_allclose(result.cosine.double().numpy(), sims.max(axis=1), atol=1e-4)
    # a correction computed once is reused as is
    again, same = corrected_collision(w, rare[:10], pairable, correction=corr)
    assert same is corr and torch.equal(again.neighbour, result.neighbour[:10])
    torch.testing.assert_close(again.cosine, result.cosine[:10])


def test_drift_without_planted_pairs_has_a_low_headline_rate():
    w, rare, _, _ = drifted_head(planted=0, seed=3)
    result, _ = corrected_collision(w, rare, pairable_rows(w).mask)
    assert result.rate.item() <= 0.01
    assert result.raw_rate.item() >= 0.99


def test_unseen_padded_and_zero_rows_are_not_pairs():
    w, rare, a, b = drifted_head(V=1200, n_rare=400, planted=20)
    valid = torch.ones(1200, dtype=torch.bool)
    valid[-10:] = False  # padded
    seen = torch.ones(1200, dtype=torch.bool)
    seen[b[:5]] = False  # the partners of 5 planted rows were never seen
    w[100] = 0.0
    p = pairable_rows(w, valid, seen)
    assert (p.padded.item(), p.unseen.item(), p.zero.item(), p.nonfinite.item()) == (10, 5, 1, 0)
    result, _ = corrected_collision(w, rare, p.mask)
    assert result.skipped_queries.item() == 5 + int((~valid[rare]).sum())
    assert result.rate.item() == pytest.approx((40 - 10) / result.queries.numel())
    assert not set(result.neighbour.tolist()) & set(b[:5].tolist() + [100] + list(range(1190, 1200)))
    assert pairable_rows(w, valid, seen, include_unseen=True).mask[b[:5]].all()


def test_mean_resultant_length_matches_float64():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 16, generator=g)
    ids = torch.arange(0, 200, 3)
    x = w[ids].double().numpy()
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    m = u.mean(0) / np.linalg.norm(u.mean(0))
    assert mean_resultant_length(w, ids, max_chunk_bytes=2_000).item() == pytest.approx((u @ m).mean(), rel=1e-6)


def test_nn_cosine_by_bucket_against_brute_force():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(400, 12, generator=g)
    bucket = torch.randint(-1, 3, (400,), generator=g)
    pairable = torch.rand(400, generator=g) > 0.1
    queries = torch.arange(0, 400, 2)
    sums, counts = nn_cosine_by_bucket(w, queries, bucket, pairable, 3)
    x = w.double().numpy()
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = xn @ xn.T
    sims[:, ~pairable.numpy()] = -np.inf
    np.fill_diagonal(sims, -np.inf)
    for k in range(3):
        sel = [q for q in queries.tolist() if pairable[q] and bucket[q] == k]
        assert counts[k].item() == len(sel)
        assert sums[k].item() == pytest.approx(sims[sel].max(axis=1).sum(), rel=1e-5)


def test_partner_ranks_known_answers_and_float64():
    # row 0's neighbours by cosine: 1 (0.99), 2 (0.8), 3 (0.6), 4 (orthogonal)
    w = torch.tensor([[1.0, 0.0], [0.99, 0.141], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    ranks = partner_ranks(w, torch.tensor([0, 0, 0, 0]), torch.tensor([1, 2, 3, 4]), torch.ones(5, dtype=torch.bool))
    assert ranks.tolist() == [1, 2, 3, 4]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(600, 20, generator=g)
    valid = torch.rand(600, generator=g) > 0.2
    a, b = torch.randint(0, 600, (50,), generator=g), torch.randint(0, 600, (50,), generator=g)
    b = torch.where(a == b, (b + 1) % 600, b)
    got = partner_ranks(w, a, b, valid, max_chunk_bytes=3_000)  # chunks of queries and of keys
    x = w.double().numpy()
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    tie = 8 * math.sqrt(20) * 2.0**-24  # the documented tie: float32 rounding of two cosines (2.1e-6 here)
    for i, (ai, bi) in enumerate(zip(a.tolist(), b.tolist())):
        sims = xn[ai] @ xn.T
        others = [j for j in range(600) if valid[j] and j not in (ai, bi)]
        assert got[i].item() == 1 + int((sims[others] > sims[bi] + tie).sum())


def test_synonym_statistics_on_corrected_rows():
    w, rare, a, b = drifted_head(V=1500, n_rare=500, planted=10)
    pairable = pairable_rows(w).mask
    _, corr = corrected_collision(w, rare, pairable)
    groups = [[int(i), int(j)] for i, j in zip(a, b)] + [[int(rare[-1]), int(rare[-2])]]  # last: not synonyms
    stats = synonym_statistics(corr.rows, groups, pairable)
    assert stats["pairs"].item() == 22 and stats["skipped_pairs"].item() == 0
    assert stats["pair_rate"].item() == pytest.approx(20 / 22)
    assert stats["median_rank"].item() == 1.0
    raw = synonym_statistics(w, groups, pairable)
    assert raw["pair_rate"].item() == 1.0  # raw cosine cannot tell the unrelated pair from the planted ones
    assert ordered_pairs([[3, 1, 2]])[0].tolist() == [1, 1, 2, 2, 3, 3]


def test_bad_arguments():
    w = torch.randn(10, 4)
    with pytest.raises(HeadwatchError, match="`k` must be an int in \\[1, d_model=4\\], got 5"):
        remove_top_directions(w, k=5)
    with pytest.raises(HeadwatchError, match="`method` must be"):
        top_principal_directions(w, method="svd")
    with pytest.raises(HeadwatchError, match="at least 2 valid rows"):
        remove_top_directions(w, torch.zeros(10, dtype=torch.bool))
    with pytest.raises(HeadwatchError, match="shape \\[vocab_size, d_model\\]"):
        remove_top_directions(torch.randn(10))
    with pytest.raises(HeadwatchError, match="`valid` of shape \\(10,\\)"):
        pairable_rows(w, torch.ones(9, dtype=torch.bool))
    with pytest.raises(HeadwatchError, match="`tau` must be a cosine"):
        corrected_collision(w, torch.tensor([1]), torch.ones(10, dtype=torch.bool), tau=2.0)
    with pytest.raises(HeadwatchError, match="query row ids must be in \\[0, 10\\)"):
        corrected_collision(w, torch.tensor([10]), torch.ones(10, dtype=torch.bool))


def test_llama3_sized_correction_in_bounded_memory():
    """V = 128256, d_model = 4096, bf16: the correction costs its (V, d) float32 output plus chunks."""
    code = """
import json, time, torch

from headwatch.functional.drift import remove_top_directions
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1])
w = torch.empty(128256, 4096, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
w[:, 0] *= 8.0  # one direction with 64x the variance of the others
remove_top_directions(w[:2048].clone())  # warm-up on the same (randomized) path: one-time library costs are not the call's
before = hwm()
t = time.perf_counter()
c = remove_top_directions(w)
print(json.dumps([(hwm() - before) / 1024, time.perf_counter() - t, c.directions.shape[1],
                  abs(c.directions[0, 0].item()), c.removed_variance.item()]))
"""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read the peak resident memory")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    grown_mib, seconds, k, first, share = json.loads(out)
    print(f"peak growth {grown_mib:.0f} MiB, {seconds:.1f} s")
    output_mib = 128256 * 4096 * 4 / 2**20  # 2004 MiB: the corrected rows
    assert grown_mib < output_mib + 160, grown_mib
    assert k == 41 and first > 0.99  # the planted common direction is found first
    assert share > 64 / (64 + 4095)  # at least the planted direction's share
