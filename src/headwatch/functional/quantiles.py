"""Quantiles without torch.quantile's input-size limit."""

from __future__ import annotations

import torch
from torch import Tensor


def quantiles(values: Tensor, qs: tuple[float, ...]) -> Tensor:
    """Quantiles of a 1-D tensor with linear interpolation (NumPy's default ``"linear"`` method).

    Unlike ``torch.quantile`` there is no limit on the input size. Returns ``(len(qs),)``
    float64, NaN for an empty input.
    """
    if values.numel() == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float64, device=values.device)
    return sorted_quantiles(values.reshape(-1).double().sort().values, qs)


def sorted_quantiles(v: Tensor, qs: tuple[float, ...]) -> Tensor:
    """:func:`quantiles` of an already ascending 1-D tensor (no sort), float64 ``(len(qs),)``."""
    if v.numel() == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float64, device=v.device)
    v = v.double()
    pos = torch.tensor(qs, dtype=torch.float64, device=v.device) * (v.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = pos - lo
    return v[lo] + (v[hi] - v[lo]) * frac
