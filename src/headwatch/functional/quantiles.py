"""Quantiles without torch.quantile's input-size limit, and of the non-NaN entries without a host sync."""

from __future__ import annotations

import math

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
    out = []
    for q in qs:  # positions in Python: no index tensor copied to the device
        pos = q * (v.numel() - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(v[lo] + (v[hi] - v[lo]) * (pos - lo))
    return torch.stack(out)


def nanquantiles(values: Tensor, qs: tuple[float, ...]) -> Tensor:
    """:func:`quantiles` of the non-NaN entries of ``values`` (any shape), float64 ``(len(qs),)``.

    No host sync: the values are sorted with the NaNs last and the positions ``q (n - 1)`` are
    computed on the device from the count ``n`` of non-NaN entries (the same numbers as
    :func:`quantiles` of those entries). NaN for every ``q`` when there is none.
    """
    v = values.reshape(-1).double().sort().values  # NaN sorts last
    n = (~torch.isnan(v)).sum(dtype=torch.float64)
    if v.numel() == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float64, device=v.device)
    pos = torch.stack([q * (n - 1) for q in qs]).clamp(min=0.0)
    lo, hi = pos.floor(), pos.ceil()
    low = v.index_select(0, lo.long())
    out = low + (v.index_select(0, hi.long()) - low) * (pos - lo)
    return torch.where(n > 0, out, float("nan"))
