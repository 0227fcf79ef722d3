"""LogitStatsMetric: accumulation over batches, quantiles, state as sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headwatch import HeadwatchError, LogitStatsMetric
from headwatch.functional.quantiles import quantiles
from tests.helpers.references import reference


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5, 9, 1):
        logits = torch.randn(2, n, 33, generator=g) * 2
        mask = torch.rand(2, n, generator=g) > 0.3
        targets = torch.randint(0, 33, (2, n), generator=g)
        targets[0, 0] = -100
        out.append((logits, mask, targets))
    out[1][0][1, 2, 4] = float("nan")
    out[1][1][1, 2] = True
    return out


def test_accumulates_like_one_concatenated_batch():
    metric = LogitStatsMetric()
    refs = []
    for logits, mask, targets in _batches():
        metric.update(logits, mask, targets)
        refs.append(reference(logits, mask, targets))
    got = metric.compute()
    cat = {k: np.concatenate([r[k].reshape(-1) for r in refs]) for k in refs[0]}
    valid = cat["valid"]
    assert got["positions"].item() == valid.sum()
    assert got["nonfinite_positions"].item() == cat["nonfinite"].sum() == 1
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob"):
        assert got[name].item() == pytest.approx(cat[name][valid].mean(), rel=1e-6)
    assert got["target_nll"].item() == pytest.approx(cat["nll"][valid].mean(), rel=1e-6)
    assert got["target_argmax_rate"].item() == pytest.approx(cat["target_is_argmax"].sum() / valid.sum())
    ent = cat["entropy"][valid]
    for q in (5, 50, 95):
        assert got[f"entropy_p{q:02d}"].item() == pytest.approx(np.percentile(ent, q), rel=1e-6)
    np.testing.assert_allclose(np.sort(got["entropy_values"].double().numpy()), np.sort(ent), rtol=1e-6)


def test_reset_and_empty():
    metric = LogitStatsMetric()
    logits, mask, targets = _batches()[0]
    metric.update(logits, torch.zeros_like(mask), targets)
    got = metric.compute()
    assert got["positions"].item() == 0
    assert math.isnan(got["entropy"].item()) and math.isnan(got["entropy_p50"].item())
    metric.reset()
    metric.update(logits)
    assert metric.compute()["positions"].item() == logits.shape[0] * logits.shape[1]


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_quantiles_match_numpy(n):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    qs = (0.0, 0.05, 0.5, 0.95, 1.0)
    np.testing.assert_allclose(quantiles(values, qs).numpy(), np.percentile(values.double().numpy(), [q * 100 for q in qs]))


def test_bad_arguments():
    with pytest.raises(HeadwatchError, match="max_chunk_bytes"):
        LogitStatsMetric(max_chunk_bytes=-1)
    with pytest.raises(HeadwatchError, match="ignore_index"):
        LogitStatsMetric(ignore_index="x")
