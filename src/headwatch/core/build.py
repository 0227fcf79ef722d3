"""The monitors of a run from the names a front door accepts, and their figure settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headwatch.core.collision import SynonymCollision
from headwatch.core.figures import resolve_figure_interval
from headwatch.core.frequency import TokenCounts
from headwatch.core.gradients import GradientDensity
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import Monitor
from headwatch.errors import check_sequence
from headwatch.model.batch import BatchFormat

MONITOR_NAMES: dict[str, type[Monitor]] = {
    "logits": LogitStats,
    "gradients": GradientDensity,
    "tokens": TokenCounts,
    "collision": SynonymCollision,
}
"""The names a front door accepts in ``monitors=`` (default: all four)."""


def build_monitors(monitors: Sequence[Monitor | str] | None, batch_format: BatchFormat | None, prefix: str) -> list[Monitor]:
    """Monitors from names (:data:`MONITOR_NAMES`) or core objects; those that need token counts share one.

    Raises:
        HeadwatchError: an entry that is neither a core monitor nor one of :data:`MONITOR_NAMES`.
    """
    if isinstance(monitors, (str, Monitor)):
        monitors = [monitors]
    if monitors is None:
        items: list[Any] = ["tokens", "logits", "gradients", "collision"]
    else:
        what = f"core monitors or names among {sorted(MONITOR_NAMES)}"
        items = check_sequence("monitors", monitors, what, lambda m: isinstance(m, Monitor) or m in MONITOR_NAMES)
    counts = next((m for m in items if isinstance(m, TokenCounts)), None)
    needs_counts = ("tokens", "gradients", "collision")
    if counts is None and any(m in needs_counts or isinstance(m, (GradientDensity, SynonymCollision)) for m in items):
        counts = TokenCounts(prefix=prefix, batch_format=batch_format)
    built: list[Monitor] = [counts] if counts is not None else []
    for m in items:
        if m == "tokens" or m is counts:
            continue
        if isinstance(m, str):
            cls = MONITOR_NAMES[m]
            if cls in (GradientDensity, SynonymCollision):
                m = cls(frequency=counts, prefix=prefix)
            elif cls is LogitStats:  # counts, when kept, give the calibration's target buckets
                m = cls(prefix=prefix, batch_format=batch_format, frequency=counts)
            else:
                m = cls(prefix=prefix, batch_format=batch_format)
            if batch_format is not None:
                m.batch_format = batch_format
        elif getattr(m, "frequency", counts) is None:
            m.frequency = counts  # type: ignore[attr-defined]
        built.append(m)
    return built


def set_figures(monitors: Sequence[Monitor], figure_every_n_steps: int | str | None) -> None:
    """Set the figure interval of configured monitors (``"auto"``: 10 of each monitor's logging intervals
    when matplotlib is installed; see :func:`headwatch.core.figures.resolve_figure_interval`).

    ``LogitStats`` and ``GradientDensity`` draw every ``figure_every`` steps; ``SynonymCollision``
    draws at each of its measurements when the interval is not 0.

    Raises:
        HeadwatchError: an explicit interval without matplotlib, or a bad value.
    """
    for m in monitors:
        interval = resolve_figure_interval(figure_every_n_steps, m.schedule.every)
        if isinstance(m, (LogitStats, GradientDensity)):
            m.figure_every = interval
        elif isinstance(m, SynonymCollision):
            m.draw_figures = interval > 0
