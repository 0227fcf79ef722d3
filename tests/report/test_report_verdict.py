"""The statistics of the verdicts, against independent references.

Paired and Welch t-tests against ``scipy.stats.ttest_rel`` / ``ttest_ind(equal_var=False)`` and a
float64 NumPy reference; the t quantile against ``scipy.stats.t.ppf``; Holm's adjustment against the
step-down rule written out; Wilson intervals against ``scipy.stats.binomtest(...).proportion_ci``.
Then the family-wise rule by simulation (seeded NumPy draws): a null of one configuration says "no
difference" on every headline in at least 90% of replicates, and a planted gap of 4 standard
deviations of the per-seed difference, at 5 seeds a side, is found in at least 80%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from headwatch import HeadwatchError
from headwatch.report.verdict import (
    BETTER,
    NO_DIFFERENCE,
    WORSE,
    detectable_gap,
    holm,
    paired_test,
    student_t_quantile,
    student_t_sf,
    verdict_word,
    welch_test,
    wilson_interval,
)

# --------------------------------------------------------------------------- t distribution


@pytest.mark.parametrize("df", [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 7.3, 10.0, 29.5, 100.0, 1e4])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995, 0.99875, 0.9995, 1 - 1e-7, 0.025, 1e-4])
def test_t_quantile_matches_scipy(p, df):
    assert student_t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-10)


@pytest.mark.parametrize("df", [1.0, 2.0, 3.5, 12.0])
@pytest.mark.parametrize("t", [-30.0, -2.5, 0.0, 0.3, 1.96, 9.9, 250.0])
def test_t_tail_matches_scipy(t, df):
    assert student_t_sf(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-10, abs=1e-300)


# --------------------------------------------------------------------------- tests against SciPy

CASES = [  # (reference, other): seeds in order
    ([5.41, 5.28, 5.77], [5.49, 5.31, 5.60]),
    ([1.0, 2.0], [1.5, 2.75]),
    ([0.013, 0.021, 0.008, 0.017, 0.011], [0.004, 0.009, 0.002, 0.012, 0.003]),
    ([7.0, 7.1, 6.9, 7.3, 7.2, 6.8, 7.05], [7.4, 7.2, 7.5, 7.1, 7.6, 7.3, 7.45]),
    ([-1e3, 2e3, 5e2], [-1e3 + 1, 2e3 - 3, 5e2 + 7]),
]


def float64_paired(r, o):
    d = np.asarray(o, np.float64) - np.asarray(r, np.float64)
    n = d.size
    se = d.std(ddof=1) / math.sqrt(n)
    return d.mean(), se, n - 1


@pytest.mark.parametrize(("ref", "other"), CASES)
def test_paired_test_matches_scipy_and_float64(ref, other):
    test = paired_test(dict(enumerate(ref)), dict(enumerate(other)))
    res = stats.ttest_rel(other, ref)
    mean, se, df = float64_paired(ref, other)
    assert test.method == "paired-t" and test.n_reference == test.n_other == len(ref)
    assert test.difference == pytest.approx(mean, rel=1e-12, abs=1e-15)
    assert test.se == pytest.approx(se, rel=1e-12) and test.df == df == res.df
    assert test.p == pytest.approx(res.pvalue, rel=1e-9)
    for level in (0.95, 0.99, 1 - 0.05 / 7):
        ci = res.confidence_interval(level)
        assert test.interval(level) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))


@pytest.mark.parametrize(("ref", "other"), CASES + [([1.0, 2.0, 4.0], [3.0, 3.5]), ([2.0, 2.0, 2.0], [1.0, 2.0, 4.0, 8.0])])
def test_welch_test_matches_scipy(ref, other):
    test = welch_test(ref, other)
    res = stats.ttest_ind(other, ref, equal_var=False)
    assert test.method == "welch-t" and (test.n_reference, test.n_other) == (len(ref), len(other))
    assert test.difference == pytest.approx(np.mean(other) - np.mean(ref), rel=1e-12, abs=1e-15)
    assert test.df == pytest.approx(res.df, rel=1e-9) and test.p == pytest.approx(res.pvalue, rel=1e-9)
    ci = res.confidence_interval(0.95)
    assert test.interval(0.95) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))


def test_pairs_by_key_and_leaves_out_what_is_missing():
    # seeds 0, 1, 2 on the reference; 2, 0, 5 on the other: pairs 0 and 2 only, in whatever order
    test = paired_test({0: 1.0, 1: 9.0, 2: 3.0}, {2: 4.0, 0: 1.5, 5: 100.0})
    assert test.n_reference == 2 and test.difference == pytest.approx(0.75)
    assert stats.ttest_rel([1.5, 4.0], [1.0, 3.0]).pvalue == pytest.approx(test.p, rel=1e-9)
    assert paired_test({0: 1.0, 1: float("nan")}, {0: 2.0, 1: 3.0}) is None  # one finite pair
    assert welch_test([1.0], [2.0, 3.0]) is None and welch_test([1.0, float("inf")], [2.0, 3.0]) is None


def test_no_spread_gets_the_exact_permutation_p():
    # every seed moved by +1: sign flips of 3 equal differences, 2 of 2^3 as extreme
    t = paired_test({0: 0.0, 1: 1.0, 2: 2.0}, {0: 1.0, 1: 2.0, 2: 3.0})
    assert (t.method, t.p, t.se, t.interval(0.95)) == ("paired-sign-flip", 0.25, 0.0, (1.0, 1.0))
    assert paired_test({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}).p == 1.0
    # both sides constant, 3 and 3 runs: 2 of C(6, 3) = 20 relabellings; 2 and 3: 1 of 10
    assert welch_test([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]).p == pytest.approx(0.1)
    assert welch_test([0.0, 0.0], [1.0, 1.0, 1.0]).p == pytest.approx(0.1)
    assert welch_test([2.0, 2.0], [2.0, 2.0]).p == 1.0
    assert detectable_gap(t, 5) is None


# --------------------------------------------------------------------------- Holm, verdicts, Wilson


def holm_by_the_rule(p, alpha):
    """Reject H_(i) when p_(j) <= alpha / (m - j + 1) for every j <= i (Holm 1979)."""
    order = np.argsort(p, kind="stable")
    reject = np.zeros(len(p), bool)
    for rank, i in enumerate(order):
        if p[i] > alpha / (len(p) - rank):
            break
        reject[i] = True
    return reject


@pytest.mark.parametrize("p", [
    [0.01, 0.04, 0.03, 0.005],
    [0.2, 0.001, 0.0125, 0.9, 0.011],
    [0.05, 0.05],
    [0.0],
    [1.0, 1.0, 0.0001],
])  # fmt: skip
def test_holm_adjusted_p_rejects_as_the_step_down_rule(p):
    q = holm(p)
    m = len(p)
    order = np.argsort(p, kind="stable")
    expected = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * np.asarray(p)[order]))
    assert np.allclose(np.asarray(q)[order], expected, rtol=1e-15)
    for alpha in (0.01, 0.05, 0.1):
        assert list(np.asarray(q) <= alpha) == list(holm_by_the_rule(np.asarray(p), alpha))
    with pytest.raises(HeadwatchError, match=r"p-values must be in \[0, 1\]"):
        holm([0.1, float("nan")])


@pytest.mark.parametrize(("diff", "q", "better", "word"), [
    (-0.2, 0.01, "lower", BETTER), (-0.2, 0.01, "higher", WORSE), (0.2, 0.01, "lower", WORSE),
    (0.2, 0.01, "higher", BETTER), (-0.2, 0.05, "lower", NO_DIFFERENCE), (0.0, 0.0, "lower", NO_DIFFERENCE),
    (-0.2, 0.01, None, None),
])  # fmt: skip
def test_a_verdict_needs_the_adjusted_test_and_the_direction(diff, q, better, word):
    assert verdict_word(diff, q, better) == word
    with pytest.raises(HeadwatchError, match="`better` must be"):
        verdict_word(diff, q, "smaller")


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 361), (10, 10), (50, 100), (1, 1), (997, 1000)])
@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_wilson_matches_scipy(k, n, level):
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    low, high = wilson_interval(k, n, level)
    assert (low, high) == (pytest.approx(ci.low, abs=1e-12), pytest.approx(ci.high, abs=1e-12))
    assert 0.0 <= low <= k / n <= high <= 1.0
    with pytest.raises(HeadwatchError, match="0 <= k <= n"):
        wilson_interval(n + 1, n)


# --------------------------------------------------------------------------- the family-wise rule, simulated

HEADLINES = 5  # the headlines with a good direction: validation loss, rare NLL, ECE, collision, alerts
REPLICATES = 2000


def family_verdicts(ref: np.ndarray, other: np.ndarray, paired: bool) -> list[str]:
    """The verdict of every headline (columns) for seeds (rows), as the report decides them."""
    tests = [paired_test(dict(enumerate(r)), dict(enumerate(o))) if paired else welch_test(r, o) for r, o in zip(ref.T, other.T)]
    q = holm([t.p for t in tests])
    return [verdict_word(t.difference, qi, "lower") for t, qi in zip(tests, q)]


def correlated_draws(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` seeds x 5 headlines, correlated as a run's losses are (one shared seed effect, rho 0.6)."""
    shared = rng.standard_normal((n, 1))
    return math.sqrt(0.6) * shared + math.sqrt(0.4) * rng.standard_normal((n, HEADLINES))


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("n", [3, 5])
def test_the_null_says_no_difference_on_every_headline(n, paired):
    rng = np.random.default_rng(1000 * n + paired)
    clean = 0
    for _ in range(REPLICATES):
        seed_effect = correlated_draws(rng, n)  # one configuration: a run is its seed's effect plus noise
        ref = seed_effect + 0.5 * correlated_draws(rng, n) if paired else correlated_draws(rng, n)
        other = seed_effect + 0.5 * correlated_draws(rng, n) if paired else correlated_draws(rng, n)
        clean += all(v == NO_DIFFERENCE for v in family_verdicts(ref, other, paired))
    low, _ = wilson_interval(clean, REPLICATES)
    assert low >= 0.90, (clean, REPLICATES)


@pytest.mark.parametrize(("n", "paired", "at_least"), [(5, True, 0.80), (5, False, 0.80), (3, True, 0.20)])
def test_a_gap_of_4_sd_of_the_per_seed_difference_is_found(n, paired, at_least):
    rng = np.random.default_rng(7 + n + paired)
    found = wrong = 0
    for _ in range(REPLICATES // 2):
        if paired:
            seed_effect = correlated_draws(rng, n)
            ref, other = seed_effect + correlated_draws(rng, n), seed_effect + correlated_draws(rng, n)
            sd_difference = math.sqrt(2.0)  # the per-seed difference: two unit-variance noises
        else:
            ref, other = correlated_draws(rng, n), correlated_draws(rng, n)
            sd_difference = math.sqrt(2.0)  # the difference of two independent runs
        other[:, 0] -= 4.0 * sd_difference  # the other side is better (lower) on the first headline
        verdicts = family_verdicts(ref, other, paired)
        found += verdicts[0] == BETTER
        wrong += verdicts[0] == WORSE
    low, _ = wilson_interval(found, REPLICATES // 2)
    assert low >= at_least and wrong == 0, (found, wrong)


def test_the_gap_three_seeds_could_show_is_large():
    """At 3 paired seeds the family-wise rule calls only a gap beyond t_{1-0.05/10, 2} / sqrt(3) = 5.73 SD."""
    rng = np.random.default_rng(3)
    d = rng.standard_normal(3)
    test = paired_test({i: 0.0 for i in range(3)}, dict(enumerate(d)))
    sd = d.std(ddof=1)
    gap = detectable_gap(test, HEADLINES)
    assert gap / sd == pytest.approx(stats.t.ppf(1 - 0.05 / (2 * HEADLINES), 2) / math.sqrt(3), rel=1e-9)
    assert gap / sd == pytest.approx(5.730, abs=1e-3)
    five = paired_test({i: 0.0 for i in range(5)}, dict(enumerate(rng.standard_normal(5))))
    assert detectable_gap(five, HEADLINES) / (five.se * math.sqrt(5)) == pytest.approx(2.059, abs=1e-3)
