"""Sums and counts of per-position logit statistics: the exact, distributable state of a metric.

Means are formed only at the end (``total / count``), so sums from several batches or
processes combine exactly (torchmetrics' ``dist_reduce_fx="sum"``).

The sums, the values and their names follow from the fields of
:class:`~headwatch.functional.LogitStatistics` and two small tables, so a per-position
statistic added there is summed, averaged and published with no change here:

- the boolean fields of :data:`COUNTS` are counted (``valid`` is ``positions``);
- the fields of :data:`TARGET_MEANS` exist only with targets and are averaged over the
  positions with a target, under a published name of their own;
- every other field is one float per position, published as its mean over the valid
  positions under the field's own name (:data:`MEANS`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.functional.logits import LogitStatistics

__all__ = ["LogitStatSums", "logit_stats_compute", "logit_stats_update"]  # COUNTS, MEANS, ...: building blocks of core.metrics

COUNTS = {"valid": "positions", "nonfinite": "nonfinite_positions", "invalid_target": "invalid_target_positions"}
"""Boolean fields of :class:`LogitStatistics` published as float64 counts: field -> published name."""
TARGET_MEANS = {"nll": "target_nll", "target_is_argmax": "target_argmax_rate"}
"""Fields that are None without targets, published as their mean over the positions with a target: field -> name."""
MEANS = tuple(f for f in LogitStatistics._fields if f not in COUNTS and f not in TARGET_MEANS)
"""Every other field of :class:`LogitStatistics`: a float per position, published as its mean over the valid
positions under its own name (``entropy``, ``kl_to_uniform``, ``kl_from_uniform``, ``max_prob``, ...)."""
KEYS = (*MEANS, *TARGET_MEANS.values(), *COUNTS.values())
"""The names of :func:`logit_stats_compute`'s values, in order."""

LogitStatSums = NamedTuple(  # type: ignore[misc]  # fields derived from LogitStatistics
    "LogitStatSums",
    [(name, Tensor) for name in (*COUNTS.values(), "target_positions", *MEANS, *TARGET_MEANS)],
)
LogitStatSums.__doc__ = """Float64 scalar sums and counts over the valid positions of one batch: the state of a
distributed metric. Fields: the counts of :data:`COUNTS` (``positions``, ``nonfinite_positions``,
``invalid_target_positions``), ``target_positions`` (``positions`` when targets were given, else 0), then
the sum of every field of :data:`MEANS` and :data:`TARGET_MEANS` under the field's name."""


def logit_stats_update(stats: LogitStatistics) -> LogitStatSums:
    """Reduce per-position statistics to float64 sums over the valid positions (no host sync)."""
    valid = stats.valid
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)

    def _sum(t: Tensor | None) -> Tensor:
        if t is None:  # a target field without targets
            return zero
        return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device)).sum(dtype=torch.float64)

    sums = {name: getattr(stats, field).sum(dtype=torch.float64) for field, name in COUNTS.items()}
    sums["target_positions"] = sums["positions"] if stats.nll is not None else zero
    sums.update({field: _sum(getattr(stats, field)) for field in (*MEANS, *TARGET_MEANS)})
    return LogitStatSums(**sums)


def logit_stats_compute(sums: LogitStatSums) -> dict[str, Tensor]:
    """Means from sums (names :data:`KEYS`): NaN when there were no valid positions (an explicit 'no data')."""
    def _mean(total: Tensor, count: Tensor) -> Tensor:
        return torch.where(count > 0, total / count.clamp(min=1), float("nan"))

    out = {field: _mean(getattr(sums, field), sums.positions) for field in MEANS}
    out.update({name: _mean(getattr(sums, field), sums.target_positions) for field, name in TARGET_MEANS.items()})
    out.update({name: getattr(sums, name) for name in COUNTS.values()})
    return out
