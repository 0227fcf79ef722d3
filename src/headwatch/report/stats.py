"""Per-run statistics of one tag (final value, mean of the last 10%, trend) and which tags to show."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from headwatch import names
from headwatch.errors import HeadwatchError
from headwatch.report.runs import Points

CONTEXT_TAGS = ("train_loss", "val_loss", "train/loss", "eval/loss")
"""Non-headwatch scalars shown, when present, as context for the headwatch metrics (Lightning's
``train_loss`` / ``val_loss`` as the examples log them; the Hugging Face Trainer's ``train/loss`` / ``eval/loss``)."""

GROUP_ORDER = ("loss", *(group.name for group in names.GROUPS), "other")
"""Display order of the groups: the context tags, one group per monitor (:data:`headwatch.names.GROUPS`),
then the tags under the prefix that :mod:`headwatch.names` does not declare."""
FLAT_TOLERANCE = 0.01
"""A trend is shown as flat (→) when the fitted change over its span is below 1% of the mean |value|."""



@dataclass(frozen=True)
class Summary:
    """The summary of one tag of one run.

    ``last10_mean`` and the trend use the finite values only; ``final`` is the value at
    the last step, whatever it is.
    """

    final: float
    final_step: int
    last10_mean: float | None
    """Mean of the last ``max(1, ceil(n / 10))`` points."""
    trend_per_1k: float | None
    """Least-squares slope of value on step over the last ``ceil(n / 2)`` points (at least 2), per 1000 steps."""
    trend: str | None
    """``"up"``, ``"down"`` or ``"flat"``: flat when the fitted change over the span is below 1% of mean |value|."""
    points: int
    first_step: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become ``None``."""
        return {
            "final": _finite_or_none(self.final),
            "last10_mean": _finite_or_none(self.last10_mean),
            "trend_per_1k": _finite_or_none(self.trend_per_1k),
            "trend": self.trend,
            "steps": self.points,
            "first_step": self.first_step,
            "last_step": self.final_step,
        }


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line ``value = a + b * step`` through ``points``, in float64.

    Returns ``None`` with fewer than 2 points or when all steps are equal.
    """
    n = len(points)
    if n < 2:
        return None
    mx = math.fsum(x for x, _ in points) / n
    my = math.fsum(y for _, y in points) / n
    sxx = math.fsum((x - mx) ** 2 for x, _ in points)
    if sxx == 0.0:
        return None
    sxy = math.fsum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx


def summarize(points: Points) -> Summary:
    """Final value, mean over the last 10% of the points and trend over the last 50%.

    With ``n`` points sorted by step: ``last10_mean`` is the mean of the last
    ``max(1, ceil(n / 10))``; the trend is the least-squares slope over the last
    ``ceil(n / 2)`` (at least 2, else ``None``), times 1000 (change per 1000 steps). Its
    direction is ``"flat"`` when ``|slope * (last_step - first_step of the span)|`` is
    below 1% of the mean ``|value|`` over the span, else ``"up"`` or ``"down"``.
    Non-finite values are left out of the mean and the trend.

    Raises:
        HeadwatchError: ``points`` is empty.
    """
    if not points:
        raise HeadwatchError("summarize needs at least one (step, value) point, got none")
    n = len(points)
    final_step, final = points[-1]
    tail = [v for _, v in points[n - max(1, -(-n // 10)) :] if math.isfinite(v)]
    last10_mean = math.fsum(tail) / len(tail) if tail else None
    span = [(float(s), v) for s, v in points[n - -(-n // 2) :] if math.isfinite(v)]
    slope = least_squares_slope(span)
    trend_per_1k = trend = None
    if slope is not None:
        trend_per_1k = slope * 1000.0
        change = abs(slope * (span[-1][0] - span[0][0]))
        scale = math.fsum(abs(v) for _, v in span) / len(span)
        if change == 0.0 or (scale > 0.0 and change / scale < FLAT_TOLERANCE):
            trend = "flat"
        else:
            trend = "up" if slope > 0 else "down"
    return Summary(final, final_step, last10_mean, trend_per_1k, trend, n, points[0][0])


def select_tags(
    tags: Iterable[str], *, show_all: bool = False, match: str | None = None, prefix: str = "headwatch"
) -> list[str]:
    """The tags to report, in display order (by group, then name).

    Kept: tags under ``<prefix>/`` and the context tags (:data:`CONTEXT_TAGS`). Unless
    ``show_all``, the declared names that are not headline (:func:`headwatch.names.is_headline`:
    the per-bucket declarations, the ``_p05`` / ``_max`` variants) are dropped; names that
    :mod:`headwatch.names` does not declare are kept (group ``other``). ``match`` (a regular
    expression, ``re.search``) filters what is left.

    Raises:
        HeadwatchError: ``match`` is not a valid regular expression.
    """
    try:
        pattern = re.compile(match) if match else None
    except re.error as err:
        raise HeadwatchError(f"--match {match!r} is not a valid regular expression: {err}") from err
    head = prefix + "/"
    keep = set()
    for tag in tags:
        if not (tag.startswith(head) or tag in CONTEXT_TAGS):
            continue
        if not show_all and names.is_headline(tag, prefix) is False:
            continue
        if pattern is not None and not pattern.search(tag):
            continue
        keep.add(tag)
    return sorted(keep, key=lambda t: _sort_key(t, prefix))


def tag_group(tag: str, prefix: str = "headwatch") -> str:
    """The display group of a tag: the group of the monitor that declares it (:data:`headwatch.names.GROUPS`).

    ``loss`` for the tags outside ``<prefix>/`` (the context tags), ``other`` for an undeclared
    tag under the prefix.
    """
    if not tag.startswith(prefix + "/"):
        return "loss"
    return names.report_group(tag, prefix) or "other"


def _sort_key(tag: str, prefix: str) -> tuple[int, str, str]:
    group = tag_group(tag, prefix)
    rank = GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)
    return rank, group, tag


def summarize_runs(runs: Mapping[str, Mapping[str, Points]], tags: Sequence[str]) -> dict[str, dict[str, Summary]]:
    """Run name -> tag -> :class:`Summary` for the ``tags`` each run has."""
    return {name: {tag: summarize(scalars[tag]) for tag in tags if scalars.get(tag)} for name, scalars in runs.items()}

