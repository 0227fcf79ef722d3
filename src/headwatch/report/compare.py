"""Groups of runs (seeds) compared fairly: at matched steps and at matched validation loss.

For every metric, each run contributes one value, read at an anchor:

* **matched step**: the step ``--at-step N``, or by default the *last common step* of the
  metric: the smallest last logged step over the runs that logged it;
* **matched validation loss**: the first step at which the run's loss curve (``--loss-tag``,
  default Lightning's ``val_loss``, else the Trainer's ``eval/loss``) reaches a common value ``L*``; by default ``L*`` is the
  highest of the runs' lowest losses, i.e. the lowest loss that every run reaches (``--at-loss``
  sets it). A run that is sharper only because it trained further is then compared with the
  others at the same loss, not at the same step.

A value between two logged points is linearly interpolated in the step (see :func:`value_at`
and :func:`first_crossing`); no value is extrapolated. Non-finite values are left out. Each
group is summarised by its number of runs ``n``, mean, sample standard deviation (``n - 1``
in the denominator) and min-max; each other group is compared with the first (the reference)
by the difference of means ``mean(other) - mean(reference)`` and its two-sided Welch
t-interval (:func:`welch_interval`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from headwatch.errors import HeadwatchError
from headwatch.report.events import Points
from headwatch.report.verdict import betainc, student_t_quantile  # noqa: F401  (their home before; kept importable)

METHOD = "welch-t"
METHOD_TEXT = (
    "Welch t-interval on the difference of group means (Welch-Satterthwaite degrees of freedom; "
    "Student t quantile by bisection on the regularized incomplete beta function, "
    "DLMF 8.17.22 / Numerical Recipes 3rd ed. section 6.4)"
)
SPREAD_TEXT = "sd = sample standard deviation over the runs (denominator n - 1); [min, max] over the runs; n = runs with a value"


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class GroupStats:
    """One group's values of one metric at one anchor."""

    n: int
    mean: float | None
    std: float | None
    """Sample standard deviation (denominator ``n - 1``); ``None`` with fewer than 2 runs."""
    min: float | None
    max: float | None
    values: dict[str, float] = field(default_factory=dict)
    """Run name -> its value."""


def group_stats(values: Mapping[str, float]) -> GroupStats:
    """Number, mean, sample standard deviation (``n - 1``) and min-max of the finite ``values``, in float64."""
    kept = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
    xs = list(kept.values())
    n = len(xs)
    if n == 0:
        return GroupStats(0, None, None, None, None, kept)
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n >= 2 else None
    return GroupStats(n, mean, std, min(xs), max(xs), kept)


@dataclass(frozen=True)
class Difference:
    """``mean(other) - mean(reference)`` with its two-sided Welch t-interval."""

    diff: float
    low: float | None
    high: float | None
    df: float | None
    """Welch-Satterthwaite degrees of freedom; ``None`` when the interval is degenerate or undefined."""
    level: float
    excludes_zero: bool
    """The interval lies entirely above or below 0."""


def welch_interval(reference: GroupStats, other: GroupStats, level: float = 0.95) -> Difference | None:
    """The difference ``other.mean - reference.mean`` and its Welch t-interval at ``level``.

    ``se^2 = s_o^2 / n_o + s_r^2 / n_r``; ``df = se^4 / ((s_o^2/n_o)^2/(n_o-1) + (s_r^2/n_r)^2/(n_r-1))``
    (Welch 1947, Satterthwaite 1946); interval ``diff -/+ t_{(1+level)/2, df} * se``. When both
    groups have no spread the interval is the point ``[diff, diff]``. The interval needs at
    least 2 runs in each group (``low``/``high`` are ``None`` otherwise).

    Returns:
        ``None`` when either group has no value.
    """
    if reference.mean is None or other.mean is None:
        return None
    diff = other.mean - reference.mean
    if reference.std is None or other.std is None:
        return Difference(diff, None, None, None, level, False)
    vr, vo = reference.std**2 / reference.n, other.std**2 / other.n
    se2 = vr + vo
    if se2 == 0.0:
        return Difference(diff, diff, diff, None, level, diff != 0.0)
    df = se2**2 / (vr**2 / (reference.n - 1) + vo**2 / (other.n - 1))
    half = student_t_quantile(0.5 + level / 2.0, df) * math.sqrt(se2)
    low, high = diff - half, diff + half
    return Difference(diff, low, high, df, level, low > 0.0 or high < 0.0)


# --------------------------------------------------------------------------- anchors


def value_at(points: Points, step: float) -> float | None:
    """The value at ``step``: logged, or linearly interpolated between the two logged points around it.

    Returns:
        ``None`` when ``step`` is outside ``[first step, last step]`` (no extrapolation) or the
        value is not finite.
    """
    if not points or step < points[0][0] or step > points[-1][0]:
        return None
    i = bisect.bisect_left([s for s, _ in points], step)
    s1, v1 = points[i]
    if s1 == step:
        value = v1
    else:
        s0, v0 = points[i - 1]
        value = v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return value if math.isfinite(value) else None


def first_crossing(points: Points, target: float) -> float | None:
    """The first step at which the curve ``points`` reaches ``target`` or below (interpolated).

    With finite points ``(s_i, L_i)`` in step order, ``i`` the first index with ``L_i <= target``:
    ``s_0`` when ``i = 0``, else ``s_{i-1} + (L_{i-1} - target) / (L_{i-1} - L_i) * (s_i - s_{i-1})``.

    Returns:
        ``None`` when the curve never reaches ``target``.
    """
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    for i, (s, v) in enumerate(finite):
        if v <= target:
            if i == 0:
                return float(s)
            s0, v0 = finite[i - 1]
            return s0 + (v0 - target) / (v0 - v) * (s - s0)
    return None


def common_loss_target(curves: Mapping[str, Points]) -> float | None:
    """The lowest loss every run reaches: the highest of the runs' lowest finite losses."""
    lows = [min(v for _, v in pts if math.isfinite(v)) for pts in curves.values() if any(math.isfinite(v) for _, v in pts)]
    return max(lows) if lows else None


# --------------------------------------------------------------------------- comparison

DEFAULT_LOSS_TAG = "val_loss"
"""The validation loss Lightning's ``self.log("val_loss", ...)`` writes (the headwatch examples do)."""
DEFAULT_LOSS_TAGS = (DEFAULT_LOSS_TAG, "eval/loss")
"""The loss curves tried, in order, when no ``--loss-tag`` is given: Lightning's ``val_loss``, then
the Hugging Face Trainer's ``eval/loss``; the first that some run logged is used."""


@dataclass(frozen=True)
class MetricComparison:
    """One metric at one anchor: every group's statistics and each group's difference to the reference."""

    tag: str
    step: float | None
    """The matched step (``None`` at matched loss, where each run has its own step)."""
    groups: dict[str, GroupStats]
    diffs: dict[str, Difference | None]
    """Group name (not the reference) -> ``mean(group) - mean(reference)``."""


@dataclass(frozen=True)
class Comparison:
    """The grouped comparison; ``reference`` is the first group."""

    groups: dict[str, list[str]]
    level: float
    step_rule: str
    at_step: list[MetricComparison]
    loss_tag: str | None
    loss_target: float | None
    loss_steps: dict[str, float | None]
    """Run name -> the step where its loss first reaches ``loss_target``."""
    at_loss: list[MetricComparison]
    notes: list[str]

    @property
    def reference(self) -> str:
        return next(iter(self.groups))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``None`` for missing numbers), with the method and the spread named."""
        data = asdict(self)
        data["reference"] = self.reference
        data["interval"] = {"method": METHOD, "level": self.level, "description": METHOD_TEXT}
        data["spread"] = SPREAD_TEXT
        return data


def _compare_at(
    groups: Mapping[str, Mapping[str, Mapping[str, Points]]], tag: str, steps: Mapping[str, float | None], level: float, step: float | None
) -> MetricComparison:
    stats = {}
    for group, runs in groups.items():
        values = {}
        for name, scalars in runs.items():
            at = steps.get(name)
            value = value_at(scalars[tag], at) if tag in scalars and at is not None else None
            if value is not None:
                values[name] = value
        stats[group] = group_stats(values)
    ref, *others = stats
    return MetricComparison(tag, step, stats, {g: welch_interval(stats[ref], stats[g], level) for g in others})


def _check_groups(groups: Mapping[str, Mapping[str, Any]], level: float) -> None:
    if len(groups) < 2:
        raise HeadwatchError(f"a grouped comparison needs at least 2 groups, got {len(groups)}: {list(groups)}")
    empty = [g for g, runs in groups.items() if not runs]
    if empty:
        raise HeadwatchError(f"the group(s) {empty} hold no run")
    names = [name for runs in groups.values() for name in runs]
    shared = sorted({name for name in names if names.count(name) > 1})
    if shared:
        raise HeadwatchError(f"run names must differ across groups; in more than one group: {shared}")
    if not 0.0 < level < 1.0:
        raise HeadwatchError(f"`level` must be in (0, 1), got {level!r}")


def compare_groups(
    groups: Mapping[str, Mapping[str, Mapping[str, Points]]],
    tags: Sequence[str],
    *,
    at_step: int | None = None,
    loss_tag: str | None = None,
    at_loss: float | None = None,
    level: float = 0.95,
) -> Comparison:
    """Compare groups of runs metric by metric, at matched steps and at matched loss.

    Args:
        groups: group name -> run name -> tag -> points; the first group is the reference.
        tags: the metrics to compare, in order.
        at_step: the matched step; ``None``: each metric's last common step.
        loss_tag: the loss curve that defines matched loss; ``None``: the first of :data:`DEFAULT_LOSS_TAGS`
            (``val_loss``, ``eval/loss``) that a run has.
        at_loss: the common loss ``L*``; ``None``: the lowest loss every run reaches.
        level: the confidence level of the intervals.

    Raises:
        HeadwatchError: fewer than 2 groups, an empty group, a run name in two groups, ``level``
            outside (0, 1), or an explicit ``loss_tag`` that no run logged.
    """
    _check_groups(groups, level)
    every = {name: scalars for runs in groups.values() for name, scalars in runs.items()}
    by_step = []
    for tag in tags:
        logged = {name: scalars[tag][-1][0] for name, scalars in every.items() if scalars.get(tag)}
        step = at_step if at_step is not None else (min(logged.values()) if logged else None)
        by_step.append(_compare_at(groups, tag, {name: step for name in every}, level, step))
    rule = f"step {at_step}" if at_step is not None else "last common step (the smallest last logged step over the runs)"
    notes: list[str] = []
    tag = loss_tag or next((t for t in DEFAULT_LOSS_TAGS if any(s.get(t) for s in every.values())), DEFAULT_LOSS_TAG)
    curves = {name: scalars[tag] for name, scalars in every.items() if scalars.get(tag)}
    if not curves:
        if loss_tag is not None:
            raise HeadwatchError(f"--loss-tag {loss_tag!r}: no run logged this tag")
        notes.append(f"no run logged {' or '.join(map(repr, DEFAULT_LOSS_TAGS))}: no comparison at matched loss (pass --loss-tag)")
        return Comparison({g: list(r) for g, r in groups.items()}, level, rule, by_step, None, None, {}, [], notes)
    missing = sorted(set(every) - set(curves))
    if missing:
        notes.append(f"runs without {tag!r}, left out at matched loss: {', '.join(missing)}")
    target = at_loss if at_loss is not None else common_loss_target(curves)
    crossing = {name: (first_crossing(pts, target) if target is not None else None) for name, pts in curves.items()}
    never = sorted(name for name, s in crossing.items() if s is None)
    if never:
        reach = f"never reaches {target:.6g}" if target is not None else "has no finite value"
        notes.append(f"runs whose {tag!r} {reach}, left out at matched loss: {', '.join(never)}")
    by_loss = [_compare_at(groups, t, crossing, level, None) for t in tags]
    return Comparison({g: list(r) for g, r in groups.items()}, level, rule, by_step, tag, target, crossing, by_loss, notes)
