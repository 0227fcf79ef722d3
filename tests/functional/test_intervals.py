"""The Wilson score interval on tensors: an independent float64 recomputation, published values, shapes, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from headwatch import HeadwatchError
from headwatch.functional import Z95, intervals, wilson_interval
from headwatch.report import verdict
from tests.helpers.references import wilson_roots

CASES = [(0, 1), (1, 1), (0, 20), (1, 29), (15, 148), (81, 263), (512, 1024), (3, 10_000), (9_999, 10_000), (7, 1_500)]


@pytest.mark.parametrize("z", [Z95, 1.0, 2.5758293035489])
def test_matches_an_independent_float64_recomputation(z):
    k = torch.tensor([c[0] for c in CASES])
    n = torch.tensor([c[1] for c in CASES])
    low, high = wilson_interval(k, n, z)
    assert low.dtype == high.dtype == torch.float64 and low.shape == (len(CASES),)
    for i, (ki, ni) in enumerate(CASES):
        want_low, want_high = wilson_roots(ki, ni, z)
        assert low[i].item() == pytest.approx(want_low, abs=1e-12), (ki, ni)
        assert high[i].item() == pytest.approx(want_high, abs=1e-12), (ki, ni)
        assert 0.0 <= low[i].item() <= ki / ni <= high[i].item() <= 1.0


def test_textbook_values():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table II, method 3
    published = {
        (81, 263): (0.2553, 0.3662),
        (15, 148): (0.0624, 0.1605),
        (0, 20): (0.0, 0.1611),
        (1, 29): (0.0061, 0.1718),
    }
    for (k, n), (want_low, want_high) in published.items():
        low, high = wilson_interval(torch.tensor(k), torch.tensor(n))
        assert (round(low.item(), 4), round(high.item(), 4)) == (want_low, want_high)
    ci = stats.binomtest(81, 263).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson_interval(torch.tensor(81.0), torch.tensor(263.0))
    assert (low.item(), high.item()) == (pytest.approx(ci.low, abs=1e-12), pytest.approx(ci.high, abs=1e-12))


def test_ends_are_exact_and_the_half_width_shrinks_as_one_over_root_n():
    low, high = wilson_interval(torch.tensor([0, 50]), torch.tensor([50, 50]))
    assert low.tolist() == [0.0, pytest.approx(1 - high[0].item(), abs=1e-15)] and high[1].item() == 1.0
    half = [
        ((h - lo) / 2).item() for lo, h in zip(*wilson_interval(torch.tensor([512, 2048]), torch.tensor([1024, 4096])))
    ]
    assert half[0] / half[1] == pytest.approx(2.0, rel=2e-3)


def test_shapes_broadcast_and_stay_on_the_device_of_the_counts():
    k = torch.arange(3, dtype=torch.int32).reshape(3, 1)  # (3, 1)
    n = torch.tensor([4.0, 8.0, 16.0, 32.0])  # (4,)
    low, high = wilson_interval(k, n)
    assert low.shape == high.shape == (3, 4) and low.device == k.device
    want = wilson_roots(2, 16, Z95)
    assert (low[2, 2].item(), high[2, 2].item()) == (
        pytest.approx(want[0], abs=1e-12),
        pytest.approx(want[1], abs=1e-12),
    )


def test_invalid_counts_give_nan_without_a_host_read():
    low, high = wilson_interval(torch.tensor([0.0, 5.0, -1.0, math.nan]), torch.tensor([0.0, 4.0, 4.0, 4.0]))
    assert torch.isnan(low).all() and torch.isnan(high).all()


@pytest.mark.parametrize(("args", "match"), [
    ((torch.tensor(1), torch.tensor(2), 0.0), "`z` must be a finite number > 0"),
    ((torch.tensor(1), torch.tensor(2), math.inf), "`z` must be a finite number > 0"),
    ((torch.tensor(1), torch.tensor(2), True), "`z` must be a finite number > 0"),
    ((torch.tensor(True), torch.tensor(2)), "`successes` must be a real"),
    ((torch.tensor(1), torch.tensor(2 + 0j)), "`n` must be a real"),
    ((1, torch.tensor(2)), "successes"),
])  # fmt: skip
def test_refusals_are_headwatch_errors(args, match):
    with pytest.raises(HeadwatchError, match=match):
        wilson_interval(*args)


def test_the_report_delegates_to_the_functional_interval(monkeypatch):
    for k, n in CASES:
        want = wilson_interval(torch.tensor(k), torch.tensor(n))
        got = verdict.wilson_interval(k, n)  # its z, from NormalDist, may differ from Z95 in the last bit
        assert got == (pytest.approx(want[0].item(), abs=1e-15), pytest.approx(want[1].item(), abs=1e-15))
    calls = []

    def spy(successes, n, z):
        calls.append((successes.item(), n.item(), z))
        return torch.tensor(0.25, dtype=torch.float64), torch.tensor(0.75, dtype=torch.float64)

    monkeypatch.setattr(intervals, "wilson_interval", spy)
    assert verdict.wilson_interval(3, 10, 0.95) == (0.25, 0.75)
    assert calls == [(3.0, 10.0, pytest.approx(Z95, abs=1e-12))]
