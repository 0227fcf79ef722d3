"""Statistics of a :class:`~headwatch.model.capture.Captured`: either path, the same numbers.

The logits path calls :func:`headwatch.functional.logit_statistics` on the model's logits.
The hidden-state path computes ``transform(hidden @ weight.T + bias)`` a chunk of rows at a
time (float32, a low-precision head converted a slice of rows at a time) and measures each
chunk, so the extra memory is one ``(rows, V)`` block, never ``(B, T, V)``. Both give, per
position, the :class:`~headwatch.functional.LogitStatistics` of the full softmax the loss
uses and, when the tokenizer's ``vocab_size`` is known and smaller than ``V``, the padded
columns' mass (:func:`headwatch.functional.padding.padded_mass`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.hidden import logit_statistics_from_hidden
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES, LogitStatistics, logit_statistics, rows_per_chunk
from headwatch.functional.padding import padded_mass
from headwatch.functional.precision import full_precision
from headwatch.model.capture import Captured
from headwatch.model.sources import FinalTransform


class CapturedStatistics(NamedTuple):
    statistics: LogitStatistics
    """Per-position statistics, fields of shape ``(B, T)`` (the capture's leading shape)."""
    padded_mass: Tensor | None
    """``(B, T)`` probability on columns ``>= vocab_size`` (None when ``vocab_size`` was not given)."""


@torch.no_grad()
def captured_statistics(
    captured: Captured,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    temperature: float = 1.0,
) -> CapturedStatistics:
    """Per-position statistics of what one forward gave, whichever path it came by.

    Args:
        captured: from a :class:`~headwatch.model.capture.LogitsCapture`.
        mask, targets: ``(B, T)`` aligned with the logits (``BatchFormat.for_alignment(alignment).read(batch)``'s
            ``mask`` and ``targets``, :class:`headwatch.model.batch.BatchFormat`); moved to the tensor's device.
        ignore_index: target value of positions that are not predictions.
        vocab_size: the tokenizer's vocabulary size, when known; with ``V > vocab_size``
            the padded mass is computed too.
        max_chunk_bytes: memory bound of one chunk, as in :func:`~headwatch.functional.logit_statistics`.
        temperature: the sampling temperature ``T`` of an RL policy: the statistics are those of
            ``softmax(logits / T)`` (the logits after the model's final transform, multiplied by ``1 / T``
            one chunk at a time, as TRL's fused head does: ``docs/rl.md``); 1: the logits as they are.
            On the logits path the padded mass stays that of ``softmax(logits)``.

    Returns:
        :class:`CapturedStatistics`; entropy etc. in nats, of the softmax over all ``V`` columns.

    Raises:
        HeadwatchError: as the functional statistics (shapes that do not agree).
    """
    if temperature != 1.0:
        captured = replace(captured, transform=_with_temperature(captured.transform, temperature))
    measured = captured.logits if captured.path == "logits" else captured.hidden
    # a capture missing its tensor is refused below (a HeadwatchError), not here by an AttributeError
    device = measured.device if isinstance(measured, Tensor) else torch.device("cpu")
    mask = mask.to(device, non_blocking=True) if mask is not None else None
    targets = targets.to(device, non_blocking=True) if targets is not None else None
    # hooks run inside the trainer's autocast: the statistics' matmuls and sums stay float32
    with full_precision(device):
        if captured.path == "logits":
            logits = captured.logits
            if logits is None:
                raise HeadwatchError("a logits-path capture holds no logits")
            stats = logit_statistics(logits, mask, targets, ignore_index, max_chunk_bytes, transform=captured.transform)
            mass = padded_mass(logits, vocab_size, max_chunk_bytes) if vocab_size is not None else None
            return CapturedStatistics(stats, mass)
        hidden, weight = captured.hidden, captured.weight
        if hidden is None or weight is None:
            raise HeadwatchError("a hidden-path capture needs both `hidden` and `weight`")
        if vocab_size is None:
            stats = logit_statistics_from_hidden(
                hidden, weight, captured.bias, mask, targets, ignore_index, max_chunk_bytes, transform=captured.transform
            )
            return CapturedStatistics(stats, None)
        return _chunked_from_hidden(captured, mask, targets, ignore_index, vocab_size, max_chunk_bytes)


def _with_temperature(transform: FinalTransform | None, temperature: float) -> FinalTransform:
    """``transform`` (None: identity) then a multiplication by ``1 / temperature`` (in place, on a float32 chunk)."""
    inverse = 1.0 / temperature
    first = transform.fn if transform is not None else None
    described = f"{transform.description} then " if transform is not None else ""

    def fn(x: Tensor) -> Tensor:
        return (first(x) if first is not None else x).mul_(inverse)

    return FinalTransform(f"{described}x / {temperature} (sampling temperature)", fn)


def _project(h: Tensor, weight: Tensor, bias: Tensor | None, max_chunk_bytes: int) -> Tensor:
    """``h @ weight.T + bias`` in float32, ``(n, d) -> (n, V)``, converting the head a slice of rows at a time."""
    V, d = weight.shape
    if weight.dtype == torch.float32:
        x = h @ weight.T
    else:
        x = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device)
        step = max(1, min(V, max_chunk_bytes // (4 * 4 * d)))
        for v0 in range(0, V, step):
            x[:, v0 : v0 + step] = h @ weight[v0 : v0 + step].float().T
    return x + bias.float() if bias is not None else x


def _chunked_from_hidden(
    captured: Captured, mask: Tensor | None, targets: Tensor | None, ignore_index: int, vocab_size: int,
    max_chunk_bytes: int,
) -> CapturedStatistics:
    """The hidden-state path when the padded mass is wanted too: each ``(n, V)`` chunk of logits is
    measured by :func:`logit_statistics` and :func:`padded_mass` (``logit_statistics_from_hidden``
    does not hand its chunks out)."""
    hidden, weight = captured.hidden, captured.weight
    assert hidden is not None and weight is not None  # checked by the caller
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise HeadwatchError(
            f"expected hidden of shape [..., d_model] and weight of shape [vocab_size, d_model], got "
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    lead = hidden.shape[:-1]
    N, V = math.prod(lead), weight.shape[0]
    for what, t in (("mask", mask), ("targets", targets)):
        if t is not None and tuple(t.shape) != tuple(lead):
            raise HeadwatchError(f"expected {what} of shape {tuple(lead)} (the hidden states' leading shape), got {tuple(t.shape)}")
    flat = hidden.detach().reshape(N, hidden.shape[-1])
    flat_mask = mask.reshape(N) if mask is not None else None
    flat_targets = targets.reshape(N) if targets is not None else None
    rows = max(1, rows_per_chunk(V, torch.bfloat16, hidden.device, max_chunk_bytes))
    parts: list[LogitStatistics] = []
    masses: list[Tensor] = []
    for start in range(0, N, rows):
        x = _project(flat[start : start + rows].float(), weight.detach(), captured.bias, max_chunk_bytes)  # (n, V)
        if captured.transform is not None:
            x = captured.transform(x)
        m = flat_mask[start : start + rows] if flat_mask is not None else None
        t = flat_targets[start : start + rows] if flat_targets is not None else None
        parts.append(logit_statistics(x, m, t, ignore_index, max_chunk_bytes))
        masses.append(padded_mass(x, vocab_size, max_chunk_bytes))
    if not parts:  # no position at all
        return CapturedStatistics(
            logit_statistics(flat.new_zeros(*lead, V), mask, targets, ignore_index, max_chunk_bytes),
            flat.new_zeros(lead),
        )
    fields = {
        name: torch.cat([getattr(p, name) for p in parts]).reshape(lead) if getattr(parts[0], name) is not None else None
        for name in LogitStatistics._fields
    }
    return CapturedStatistics(LogitStatistics(**fields), torch.cat(masses).reshape(lead))
