"""The statistics of a verdict over seeds, pure and in float64: t-tests, Holm's step-down, Wilson intervals.

Everything here is plain Python (``math``, ``statistics``) but the Wilson interval, which the collision probe
shares (:mod:`headwatch.functional.intervals`); SciPy is only the tests' reference.

* :func:`paired_test`: runs of one seed share data and order, so a setting is compared by the
  per-seed differences ``d_i = other_i - reference_i``: ``t = mean(d) / (sd(d) / sqrt(n))`` with
  ``n - 1`` degrees of freedom (Student 1908; ``scipy.stats.ttest_rel``).
* :func:`welch_test`: runs of different seeds are independent draws: ``t = (mean_o - mean_r) / se``,
  ``se^2 = s_o^2 / n_o + s_r^2 / n_r``, Welch-Satterthwaite degrees of freedom (Welch 1947;
  ``scipy.stats.ttest_ind(equal_var=False)``).
* :func:`holm`: Holm's (1979) step-down adjustment of a family's p-values; rejecting where the
  adjusted p is below ``alpha`` keeps the family-wise error rate at ``alpha`` under any dependence
  between the tests.
* :func:`wilson_interval`: the Wilson (1927) score interval of a rate ``k / n``.

When every difference is the same number (no spread: alert counts, say), the t statistic is not
defined; the p-value is then the exact one of the permutation test on the same data (sign flips of
the ``n`` paired differences: ``2 / 2^n``; relabellings of the ``n_r + n_o`` runs:
``2 / C(n_r + n_o, n_r)`` for equal sides, else ``1 / C``), and the interval is the point.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch

from headwatch.errors import HeadwatchError
from headwatch.functional import intervals

ALPHA = 0.05
"""The family-wise error rate of the verdicts (Holm)."""
LEVEL = 0.95
"""The confidence level of an interval outside the family."""

BETTER, WORSE, NO_DIFFERENCE = "better", "worse", "no difference at this evidence"
VERDICTS = (BETTER, WORSE, NO_DIFFERENCE)
"""The verdict words, for a side compared with the reference on a headline with a good direction."""
DIRECTIONS = ("lower", "higher", None)
"""A headline's good direction: a lower value is better, a higher one is, or no preferred direction."""


# --------------------------------------------------------------------------- Student's t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes ``betacf``)."""
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((a - 1.0 + m2) * (a + m2)), -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (DLMF 8.17.2), for ``a, b > 0``, ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here (NR 6.4)
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: float) -> float:
    """``P(T > t)`` for Student's t with ``df > 0`` degrees of freedom.

    ``P(T > t) = I_{df / (df + t^2)}(df / 2, 1 / 2) / 2`` for ``t >= 0`` (DLMF 8.17.22 with the t CDF,
    Abramowitz & Stegun 26.7.1); symmetric for ``t < 0``.
    """
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(0.5 * df, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def _t_pdf(t: float, df: float) -> float:
    log_c = math.lgamma(0.5 * (df + 1.0)) - math.lgamma(0.5 * df) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - 0.5 * (df + 1.0) * math.log1p(t * t / df))


@functools.lru_cache(maxsize=4096)
def student_t_quantile(p: float, df: float) -> float:
    """The ``p``-quantile of Student's t with ``df`` (real, > 0) degrees of freedom.

    Closed forms for 1 and 2 degrees of freedom; otherwise Newton's method on
    ``P(T > t)`` (:func:`student_t_sf`) from the normal quantile, kept inside a bracket that
    bisection shrinks whenever a Newton step would leave it; relative accuracy about ``1e-13``.
    Checked against ``scipy.stats.t.ppf`` in the tests.

    Raises:
        HeadwatchError: ``p`` is not in (0, 1) or ``df`` is not positive.
    """
    if not 0.0 < p < 1.0:
        raise HeadwatchError(f"`p` must be in (0, 1), got {p!r}")
    if not df > 0.0:
        raise HeadwatchError(f"`df` must be positive, got {df!r}")
    if p == 0.5:
        return 0.0
    tail = min(p, 1.0 - p)  # find t > 0 with P(T > t) = tail
    sign = 1.0 if p > 0.5 else -1.0
    if df == 1.0:  # Cauchy: t = tan(pi (1/2 - tail)) = 1 / tan(pi tail)
        return sign / math.tan(math.pi * tail)
    if df == 2.0:  # P(|T| <= t) = t / sqrt(2 + t^2) = 1 - 2 tail
        return sign * (1.0 - 2.0 * tail) / math.sqrt(2.0 * tail * (1.0 - tail))
    lo, hi = 0.0, math.inf
    t = max(NormalDist().inv_cdf(1.0 - tail), 1e-3)
    for _ in range(200):
        excess = student_t_sf(t, df) - tail  # > 0: t is too small
        if excess == 0.0:
            break
        if excess > 0.0:
            lo = t
        else:
            hi = t
        step = t + excess / _t_pdf(t, df)
        if not lo < step < hi:  # Newton left the bracket: bisect (double while there is no upper end)
            step = 2.0 * t if math.isinf(hi) else 0.5 * (lo + hi)
        if abs(step - t) <= 1e-14 * t:
            t = step
            break
        t = step
    return sign * t


def t_pvalue(t: float, df: float) -> float:
    """The two-sided p-value ``2 P(T > |t|)`` of a t statistic with ``df`` degrees of freedom."""
    return min(1.0, 2.0 * student_t_sf(abs(t), df))


# --------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class TTest:
    """One side compared with the reference on one headline.

    ``difference`` is ``mean(other) - mean(reference)`` (for a paired test the mean of the per-seed
    differences, the same number), ``se`` its standard error, ``df`` the degrees of freedom.
    """

    method: str
    """``"paired-t"`` or ``"welch-t"``; with no spread, ``"paired-sign-flip"`` or ``"permutation"`` (exact p)."""
    n_reference: int
    n_other: int
    """Runs on each side (for a paired test: the pairs, the same on both)."""
    difference: float
    se: float
    df: float
    p: float
    """Two-sided p-value of "no difference"."""

    def half_width(self, level: float) -> float:
        """Half the width of the two-sided ``level`` t-interval: ``t_{(1 + level) / 2, df} * se`` (0 with no spread)."""
        if not 0.0 < level < 1.0:
            raise HeadwatchError(f"`level` must be in (0, 1), got {level!r}")
        return 0.0 if self.se == 0.0 else student_t_quantile(0.5 + level / 2.0, self.df) * self.se

    def interval(self, level: float) -> tuple[float, float]:
        """The two-sided ``level`` t-interval of the difference."""
        half = self.half_width(level)
        return self.difference - half, self.difference + half


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    mean = math.fsum(xs) / n
    return mean, math.fsum((x - mean) ** 2 for x in xs) / (n - 1)


def paired_test(reference: Mapping[Hashable, float], other: Mapping[Hashable, float]) -> TTest | None:
    """The paired t-test of ``other - reference`` over the keys (seeds) both have a finite value for.

    Args:
        reference: seed -> the reference side's value.
        other: seed -> the other side's value.

    Returns:
        ``None`` with fewer than 2 pairs.
    """
    keys = [k for k in reference if k in other and _finite(reference[k]) and _finite(other[k])]
    n = len(keys)
    if n < 2:
        return None
    d = [float(other[k]) - float(reference[k]) for k in keys]
    mean, var = _mean_var(d)
    if var == 0.0:  # every seed moved by the same amount: the exact sign-flip p
        p = 1.0 if mean == 0.0 else min(1.0, 2.0 / 2.0**n)
        return TTest("paired-sign-flip", n, n, mean, 0.0, n - 1.0, p)
    se = math.sqrt(var / n)
    return TTest("paired-t", n, n, mean, se, n - 1.0, t_pvalue(mean / se, n - 1.0))


def welch_test(reference: Sequence[float], other: Sequence[float]) -> TTest | None:
    """Welch's unequal-variance t-test of ``mean(other) - mean(reference)`` over the finite values.

    Returns:
        ``None`` when a side has fewer than 2 finite values.
    """
    r = [float(x) for x in reference if _finite(x)]
    o = [float(x) for x in other if _finite(x)]
    if len(r) < 2 or len(o) < 2:
        return None
    (mr, vr), (mo, vo) = _mean_var(r), _mean_var(o)
    diff = mo - mr
    ar, ao = vr / len(r), vo / len(o)
    se2 = ar + ao
    if se2 == 0.0:  # both sides constant: the exact permutation p
        splits = math.comb(len(r) + len(o), len(r))
        p = 1.0 if diff == 0.0 else min(1.0, (2.0 if len(r) == len(o) else 1.0) / splits)
        return TTest("permutation", len(r), len(o), diff, 0.0, len(r) + len(o) - 2.0, p)
    df = se2**2 / (ar**2 / (len(r) - 1) + ao**2 / (len(o) - 1))
    se = math.sqrt(se2)
    return TTest("welch-t", len(r), len(o), diff, se, df, t_pvalue(diff / se, df))


# --------------------------------------------------------------------------- the family


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given.

    With the ``m`` p-values sorted, ``p_(1) <= ... <= p_(m)``: ``q_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``.
    Rejecting every hypothesis with ``q < alpha`` is Holm's procedure at family-wise error ``alpha``.

    Raises:
        HeadwatchError: a p-value outside [0, 1] or NaN.
    """
    for p in pvalues:
        if not 0.0 <= p <= 1.0:
            raise HeadwatchError(f"p-values must be in [0, 1], got {p!r}")
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def verdict_word(difference: float, p_adjusted: float, better: str | None, alpha: float = ALPHA) -> str | None:
    """``"better"`` / ``"worse"`` when the adjusted test rejects (``p_adjusted < alpha``) and the difference
    points that way for the good direction ``better``; ``"no difference at this evidence"`` otherwise;
    ``None`` when there is no preferred direction.

    Raises:
        HeadwatchError: ``better`` is not ``"lower"``, ``"higher"`` or None.
    """
    if better not in DIRECTIONS:
        raise HeadwatchError(f"`better` must be 'lower', 'higher' or None, got {better!r}")
    if better is None:
        return None
    if not p_adjusted < alpha or difference == 0.0:
        return NO_DIFFERENCE
    return BETTER if (difference < 0.0) == (better == "lower") else WORSE


def detectable_gap(test: TTest, family_size: int, alpha: float = ALPHA) -> float | None:
    """The smallest |difference| these runs would call whatever the other headlines show.

    The half-width of the interval at level ``1 - alpha / family_size``: an observed difference beyond it
    rejects at Holm's most stringent step, ``alpha / m``. ``None`` with no spread (no such gap).
    """
    if family_size < 1:
        raise HeadwatchError(f"`family_size` must be >= 1, got {family_size!r}")
    return None if test.se == 0.0 else test.half_width(1.0 - alpha / family_size)


def wilson_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval of the rate ``k / n`` at ``level``.

    ``(p + z^2 / 2n -/+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n)``, ``p = k / n``,
    ``z`` the normal ``(1 + level) / 2`` quantile (Wilson 1927); it stays in [0, 1] and is not
    degenerate at ``k = 0`` or ``k = n``. Computed by :func:`headwatch.functional.intervals.wilson_interval`
    (the collision probe's interval), in float64.

    Raises:
        HeadwatchError: ``n < 1``, ``k`` outside ``[0, n]``, or ``level`` outside (0, 1).
    """
    if n < 1 or not 0 <= k <= n:
        raise HeadwatchError(f"a rate needs 0 <= k <= n and n >= 1, got k={k!r}, n={n!r}")
    if not 0.0 < level < 1.0:
        raise HeadwatchError(f"`level` must be in (0, 1), got {level!r}")
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    low, high = intervals.wilson_interval(torch.tensor(float(k), dtype=torch.float64), torch.tensor(float(n), dtype=torch.float64), z)
    return float(low), float(high)
