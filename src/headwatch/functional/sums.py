"""Sums and counts of per-position logit statistics: the exact, distributable state of a metric.

Means are formed only at the end (``total / count``), so sums from several batches or
processes combine exactly (torchmetrics' ``dist_reduce_fx="sum"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.functional.logits import LogitStatistics


class LogitStatSums(NamedTuple):
    """Sums and counts over the valid positions of one batch: the state of a distributed metric."""

    positions: Tensor
    """Number of valid positions (float64 scalar)."""
    entropy: Tensor
    kl_to_uniform: Tensor
    kl_from_uniform: Tensor
    max_prob: Tensor
    target_positions: Tensor
    """Number of valid positions with a target (equal to ``positions`` when targets are given, else 0)."""
    nll: Tensor
    target_is_argmax: Tensor
    nonfinite_positions: Tensor
    invalid_target_positions: Tensor


def logit_stats_update(stats: LogitStatistics) -> LogitStatSums:
    """Reduce per-position statistics to float64 sums over the valid positions (no host sync)."""
    valid = stats.valid

    def _sum(t: Tensor) -> Tensor:
        return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device)).sum(dtype=torch.float64)

    count = valid.sum(dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    has_targets = stats.nll is not None
    return LogitStatSums(
        positions=count,
        entropy=_sum(stats.entropy),
        kl_to_uniform=_sum(stats.kl_to_uniform),
        kl_from_uniform=_sum(stats.kl_from_uniform),
        max_prob=_sum(stats.max_prob),
        target_positions=count if has_targets else zero,
        nll=_sum(stats.nll) if stats.nll is not None else zero,
        target_is_argmax=stats.target_is_argmax.sum(dtype=torch.float64)
        if stats.target_is_argmax is not None
        else zero,
        nonfinite_positions=stats.nonfinite.sum(dtype=torch.float64),
        invalid_target_positions=stats.invalid_target.sum(dtype=torch.float64),
    )


def logit_stats_compute(sums: LogitStatSums) -> dict[str, Tensor]:
    """Means from sums: NaN when there were no valid positions (an explicit 'no data')."""
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=sums.positions.device)

    def _mean(total: Tensor, count: Tensor) -> Tensor:
        return torch.where(count > 0, total / count.clamp(min=1), nan)

    return {
        "entropy": _mean(sums.entropy, sums.positions),
        "kl_to_uniform": _mean(sums.kl_to_uniform, sums.positions),
        "kl_from_uniform": _mean(sums.kl_from_uniform, sums.positions),
        "max_prob": _mean(sums.max_prob, sums.positions),
        "target_nll": _mean(sums.nll, sums.target_positions),
        "target_argmax_rate": _mean(sums.target_is_argmax, sums.target_positions),
        "positions": sums.positions,
        "nonfinite_positions": sums.nonfinite_positions,
        "invalid_target_positions": sums.invalid_target_positions,
    }
