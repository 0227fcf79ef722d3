"""Confidence intervals of rates ``k / n`` (pure torch, float64, no host read).

* :func:`wilson_interval`: the Wilson (1927) score interval, the interval the collision probe publishes
  with its rate and the one the report (:mod:`headwatch.report.verdict`) gives a count of successes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError

__all__ = ["Z95", "wilson_interval"]

Z95 = 1.959963984540054
"""The standard normal 0.975 quantile: the ``z`` of a two-sided 95% interval."""


def _check_counts(name: str, value: Tensor) -> None:
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise HeadwatchError(f"`{name}` must be a real (integer or floating) tensor, got dtype {value.dtype}")


def wilson_interval(successes: Tensor, n: Tensor, z: float = Z95) -> tuple[Tensor, Tensor]:
    """The Wilson score interval ``(low, high)`` of the rate ``p = successes / n``.

    ``(p + z^2 / 2n -/+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n)`` (Wilson 1927, "Probable
    inference, the law of succession, and statistical inference", JASA 22; Newcombe 1998, method 3). It
    stays inside [0, 1] and is not degenerate at ``successes = 0`` or ``successes = n``, where its ends
    are exactly 0 and 1 (the formula gives them up to rounding). Unit: a fraction, as the rate.

    Nothing is read on the host: invalid counts (``n <= 0``, ``successes`` outside ``[0, n]``, NaN) give a
    NaN interval instead of an error, so that a measurement with nothing measured stays on the device.

    Args:
        successes: ``(*)`` real tensor, the count ``k`` (integral values).
        n: ``(*)`` real tensor broadcastable with ``successes``, the number of trials.
        z: the normal quantile of the level (default :data:`Z95`: 95%, two-sided).

    Returns:
        ``(low, high)``, float64 tensors of the broadcast shape, on ``successes``' device.

    Raises:
        HeadwatchError: ``z`` not a finite number > 0, or a bool or complex tensor.
    """
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z <= 0:
        raise HeadwatchError(f"`z` must be a finite number > 0, got {z!r}")
    _check_counts("successes", successes)
    _check_counts("n", n)
    k = successes.to(torch.float64)
    m = n.to(device=k.device, dtype=torch.float64)
    ok = (m > 0) & (k >= 0) & (k <= m)
    m_safe = torch.where(ok, m, 1.0)
    p = torch.where(ok, k, 0.0) / m_safe  # (*)
    z2 = z * z
    scale = 1.0 + z2 / m_safe
    centre = (p + z2 / (2.0 * m_safe)) / scale
    half = z * torch.sqrt(p * (1.0 - p) / m_safe + z2 / (4.0 * m_safe * m_safe)) / scale
    low = torch.where(k == 0, 0.0, (centre - half).clamp(min=0.0))
    high = torch.where(k == m, 1.0, (centre + half).clamp(max=1.0))
    nan = torch.full_like(p, math.nan)
    return torch.where(ok, low, nan), torch.where(ok, high, nan)
