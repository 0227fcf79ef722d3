"""Statistics of a :class:`~headwatch.model.capture.Captured`: either path, the same numbers.

The logits path calls :func:`headwatch.functional.logit_statistics` on the model's logits (or on the
logits a loss received). The hidden-state path computes ``transform(hidden @ weight.T + bias)`` a chunk of
rows at a time and measures each chunk, so the extra memory is one ``(rows, V)`` block, never ``(B, T, V)``:
in float32 (a low-precision head converted a slice of rows at a time), or, for a capture taken at a fused
loss, at that loss's own precision (:attr:`Captured.precision`: the inputs rounded to its dtype, the product
rounded as it rounds it, then float32), which reproduces the tensor it scored. Both give, per position, the
:class:`~headwatch.functional.LogitStatistics` of the full softmax the loss uses and, when the tokenizer's
``vocab_size`` is known and smaller than ``V``, the padded columns' mass
(:func:`headwatch.functional.padding.padded_mass`).

Where the loss gave its own per-token values (TRL's fused LM head, :attr:`Captured.given`) they are used as
they are: ``nll``, ``entropy``, the top-1 flag and ``kl_to_uniform = log V - H`` are the loss's. What they do
not determine (the top-1 probability, hence calibration; the Rényi entropy; ``KL(U || p)``; the padded mass;
the top-1 flag where the loss computed none) comes from the reproduction at the loss's precision, checked
against the loss's own NLL: where the two differ by more than :data:`REPRODUCTION_RTOL` (summed over the
forward's positions, relative), those figures are NaN for the forward (refused) and
:attr:`CapturedStatistics.reproduction_gap` says by how much.
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


REPRODUCTION_RTOL = 1e-4
"""Largest relative gap, ``sum |nll_reproduced - nll_loss| / sum |nll_loss|`` over a forward's positions, at which
a reproduction is the loss's tensor: the same dtype rounds alike (measured 1e-6 on a CPU, float32 row math of
the same bf16 products); a float32 recomputation of bf16 logits is off by about 1e-3, a wrong transform by far more."""


class CapturedStatistics(NamedTuple):
    statistics: LogitStatistics
    """Per-position statistics, fields of shape ``(B, T)`` (the capture's leading shape)."""
    padded_mass: Tensor | None
    """``(B, T)`` probability on columns ``>= vocab_size`` (None when ``vocab_size`` was not given)."""
    reproduction_gap: Tensor | None = None
    """0-dim: the reproduction's relative NLL gap to the loss's own values (with :attr:`Captured.given`; NaN: no
    reproduction); the figures it gives are NaN when it exceeds :data:`REPRODUCTION_RTOL`."""


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
    if temperature != 1.0:  # (values a loss gave are at its temperature already)
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
        if captured.given is not None:
            return _with_given(captured, mask, targets, ignore_index, vocab_size, max_chunk_bytes)
        if hidden is None or weight is None:
            raise HeadwatchError("a hidden-path capture needs both `hidden` and `weight`")
        if vocab_size is None and captured.precision is None:
            stats = logit_statistics_from_hidden(
                hidden, weight, captured.bias, mask, targets, ignore_index, max_chunk_bytes, transform=captured.transform
            )
            return CapturedStatistics(stats, None)
        return _chunked_from_hidden(captured, mask, targets, ignore_index, vocab_size, max_chunk_bytes)


def _with_given(
    captured: Captured, mask: Tensor | None, targets: Tensor | None, ignore_index: int, vocab_size: int | None,
    max_chunk_bytes: int,
) -> CapturedStatistics:
    """The loss's own per-position values, completed by a reproduction at its precision where one is possible."""
    given, weight = captured.given, captured.weight
    assert given is not None  # checked by the caller
    if weight is None:
        raise HeadwatchError("a capture of a loss's values needs the head's weight (its number of columns)")
    V = weight.shape[0]
    nan = torch.full((), float("nan"), device=given.nll.device)
    valid = given.valid & torch.isfinite(given.nll) & (mask if mask is not None else True)
    if targets is not None and targets.shape == valid.shape:  # rows the door left out (a distributed split's repeats)
        valid = valid & (targets.long() != ignore_index)  # int64: -100 wraps in a uint8 compare
    reproduced = mass = gap = None
    if captured.hidden is not None:
        out = _chunked_from_hidden(captured, mask, targets, ignore_index, vocab_size, max_chunk_bytes)
        reproduced, mass = out.statistics, out.padded_mass
        rep_nll = reproduced.nll if reproduced.nll is not None else given.nll
        both = valid & reproduced.valid
        diff = torch.where(both, (rep_nll.float() - given.nll.float()).abs(), 0.0).sum(dtype=torch.float64)
        size = torch.where(both, given.nll.float().abs(), 0.0).sum(dtype=torch.float64)
        gap = torch.where(both.any(), diff / size.clamp(min=1e-12), float("nan"))
        agree = (gap <= REPRODUCTION_RTOL) & (both == valid).all()
    entropy = given.entropy.float() if given.entropy is not None else reproduced.entropy if reproduced is not None else None
    if entropy is None:
        entropy = torch.full_like(given.nll, float("nan"), dtype=torch.float32)

    def derived(field: str) -> Tensor:
        if reproduced is None:
            return torch.full_like(entropy, float("nan"))
        return torch.where(agree, getattr(reproduced, field).float(), nan)

    if given.is_top1 is not None:
        top1 = given.is_top1 & valid
    else:  # the reproduction's argmax (a monotone transform keeps it; only a near-tie can round differently)
        top1 = (reproduced.target_is_argmax & valid) if reproduced is not None and reproduced.target_is_argmax is not None else torch.zeros_like(valid)
    stats = LogitStatistics(
        entropy=torch.where(valid, entropy, nan),
        kl_to_uniform=torch.where(valid, math.log(V) - entropy, nan),
        kl_from_uniform=torch.where(valid, derived("kl_from_uniform"), nan),
        max_prob=torch.where(valid, derived("max_prob"), nan),
        renyi2_entropy=torch.where(valid, torch.minimum(derived("renyi2_entropy"), entropy), nan),
        nll=torch.where(valid, given.nll.float(), nan),
        target_is_argmax=top1,
        valid=valid,
        nonfinite=given.valid & ~torch.isfinite(given.nll),
        invalid_target=torch.zeros_like(valid),
    )
    if mass is not None:
        mass = torch.where(agree, mass, nan)
    return CapturedStatistics(stats, mass, gap if gap is not None else nan)


def _with_temperature(transform: FinalTransform | None, temperature: float) -> FinalTransform:
    """``transform`` (None: identity) then a multiplication by ``1 / temperature`` (in place, on a float32 chunk)."""
    inverse = 1.0 / temperature
    first = transform.fn if transform is not None else None
    described = f"{transform.description} then " if transform is not None else ""

    def fn(x: Tensor) -> Tensor:
        return (first(x) if first is not None else x).mul_(inverse)

    return FinalTransform(f"{described}x / {temperature} (sampling temperature)", fn)


def _project(
    h: Tensor, weight: Tensor, bias: Tensor | None, max_chunk_bytes: int,
    precision: tuple[torch.dtype, torch.dtype] | None = None,
) -> Tensor:
    """``h @ weight.T + bias`` in float32, ``(n, d) -> (n, V)``, converting the head a slice of rows at a time.

    ``precision=(inputs, product)``: as a loss computes it: ``h``, ``weight`` and ``bias`` rounded to ``inputs``,
    the product (and the bias added) in ``product``, then float32."""
    V, d = weight.shape
    if precision is not None and precision != (torch.float32, torch.float32):
        inputs, product = precision
        a = h.to(inputs).to(product)
        x = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device)
        step = max(1, min(V, max_chunk_bytes // (4 * 4 * d)))
        for v0 in range(0, V, step):
            y = a @ weight[v0 : v0 + step].to(inputs).to(product).T  # (n, step), rounded to `product` as the loss does
            if bias is not None:
                y = y + bias[v0 : v0 + step].to(inputs).to(product)
            x[:, v0 : v0 + step] = y
        return x
    if weight.dtype == torch.float32:
        x = h @ weight.T
    else:
        x = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device)
        step = max(1, min(V, max_chunk_bytes // (4 * 4 * d)))
        for v0 in range(0, V, step):
            x[:, v0 : v0 + step] = h @ weight[v0 : v0 + step].float().T
    return x + bias.float() if bias is not None else x


def _chunked_from_hidden(
    captured: Captured, mask: Tensor | None, targets: Tensor | None, ignore_index: int, vocab_size: int | None,
    max_chunk_bytes: int,
) -> CapturedStatistics:
    """The hidden-state path when the padded mass is wanted (``vocab_size``) or the loss's precision reproduced:
    each ``(n, V)`` chunk of logits is measured by :func:`logit_statistics` and :func:`padded_mass`
    (``logit_statistics_from_hidden`` does not hand its chunks out)."""
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
        h = flat[start : start + rows]
        x = _project(h if captured.precision is not None else h.float(), weight.detach(), captured.bias, max_chunk_bytes,
                     captured.precision)  # (n, V) float32  # fmt: skip
        if captured.transform is not None:
            x = captured.transform(x)
        m = flat_mask[start : start + rows] if flat_mask is not None else None
        t = flat_targets[start : start + rows] if flat_targets is not None else None
        parts.append(logit_statistics(x, m, t, ignore_index, max_chunk_bytes))
        if vocab_size is not None:
            masses.append(padded_mass(x, vocab_size, max_chunk_bytes))
    if not parts:  # no position at all
        return CapturedStatistics(
            logit_statistics(flat.new_zeros(*lead, V), mask, targets, ignore_index, max_chunk_bytes),
            flat.new_zeros(lead) if vocab_size is not None else None,
        )
    fields = {
        name: torch.cat([getattr(p, name) for p in parts]).reshape(lead) if getattr(parts[0], name) is not None else None
        for name in LogitStatistics._fields
    }
    return CapturedStatistics(LogitStatistics(**fields), torch.cat(masses).reshape(lead) if masses else None)
