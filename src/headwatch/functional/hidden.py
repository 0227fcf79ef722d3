"""Logit statistics from final hidden states, for heads that never materialise the logits.

Fused linear cross-entropy losses (Liger Kernel, Apple's Cut Cross-Entropy) and
``logits_to_keep`` never hold the ``(..., V)`` logits; :func:`logit_statistics_from_hidden`
recomputes them chunk by chunk from ``hidden @ weight.T + bias``, applies the model's final
transform (Gemma 2's softcapping ``cap * tanh(x / cap)``, a scale, any callable), measures
them with :func:`headwatch.functional.logit_statistics`' row math and drops them.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.precision import full_precision
from headwatch.functional.logits import (
    DEFAULT_MAX_CHUNK_BYTES,
    LogitStatistics,
    LogitTransform,
    Task,
    check_inputs,
    check_transform,
    statistics_from_tasks,
)


def logit_softcap(cap: float) -> LogitTransform:
    """Gemma 2's final logit softcapping ``x -> cap * tanh(x / cap)`` (in place), as a ``transform=``.

    Raises:
        HeadwatchError: ``cap`` is not a positive finite number.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise HeadwatchError(f"expected `cap` to be a positive finite number, got {cap!r}")
    return partial(_softcap, float(cap))


def _softcap(cap: float, x: Tensor) -> Tensor:
    return x.div_(cap).tanh_().mul_(cap)


def logit_scale(factor: float) -> LogitTransform:
    """Multiply the logits by ``factor`` (in place; e.g. a ``logit_scale`` or ``1 / temperature``), as a ``transform=``.

    Raises:
        HeadwatchError: ``factor`` is not a finite number.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise HeadwatchError(f"expected `factor` to be a finite number, got {factor!r}")
    return partial(_scale, float(factor))


def _scale(factor: float, x: Tensor) -> Tensor:
    return x.mul_(factor)


def _check_head(hidden: object, weight: object, bias: object) -> None:
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor):
        raise HeadwatchError("expected `hidden` and `weight` to be torch.Tensors")
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise HeadwatchError(
            f"expected hidden of shape [..., d_model] and weight of shape [vocab_size, d_model], got "
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    V = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (V,)):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise HeadwatchError(f"expected bias of shape ({V},), got {got}")


def hidden_chunk_plan(vocab_size: int, d_model: int, weight_dtype: torch.dtype, max_chunk_bytes: int) -> tuple[int, int]:
    """``(rows, vocab_step)``: positions per chunk and head rows converted to float32 at a time.

    Working set of one chunk, float32: the projected logits ``(rows, V)`` plus the two
    buffers of the row math ``(rows, V)`` (12 bytes per row and vocabulary entry), the
    hidden rows ``(rows, d_model)``, and, for a head that is not float32, a float32 copy of
    ``vocab_step`` of its rows (at most a quarter of the budget) with its ``(rows, vocab_step)``
    product. At least one row.
    """
    vocab_step = vocab_size
    if weight_dtype != torch.float32:  # (float32 heads are used as they are, sliced or not)
        vocab_step = max(1, min(vocab_size, max_chunk_bytes // (4 * 4 * d_model)))
    weight_bytes = 0 if weight_dtype == torch.float32 else 4 * vocab_step * d_model
    per_row = 12 * vocab_size + 4 * d_model + (0 if weight_dtype == torch.float32 else 4 * vocab_step)
    rows = (max_chunk_bytes - weight_bytes) // per_row
    return max(1, rows), vocab_step


@torch.no_grad()
def logit_statistics_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    *,
    transform: LogitTransform | None = None,
) -> LogitStatistics:
    """:func:`logit_statistics` of ``transform(hidden @ weight.T + bias)`` without materialising the logits.

    Each chunk of positions is projected by the head in float32 (float32 matrix products
    with autocast disabled and, on CUDA, without TF32, whatever the caller's settings),
    transformed, measured and dropped, so the extra memory stays under ``max_chunk_bytes``
    (see :func:`hidden_chunk_plan`); the outputs are ``(...)``.

    Args:
        hidden: ``(..., d_model)`` final hidden states (any floating dtype), the input of the head.
        weight: ``(V, d_model)`` head weight, as stored by ``nn.Linear(d_model, V)`` (any floating dtype).
        bias: optional ``(V,)`` head bias.
        mask: as in :func:`logit_statistics`.
        targets: as in :func:`logit_statistics`.
        ignore_index: as in :func:`logit_statistics`.
        max_chunk_bytes: as in :func:`logit_statistics`.
        transform: the model's final transform of the logits, applied per ``(n, V)``
            float32 chunk (may work in place, must return ``(n, V)``):
            ``logit_softcap(30.0)`` for Gemma 2, ``logit_scale(s)``, or any callable.

    Returns:
        :class:`LogitStatistics`, each field of shape ``(...)``.

    Raises:
        HeadwatchError: shapes do not agree (``hidden``'s last dimension is not
            ``weight``'s second, ``bias`` is not ``(V,)``), or as :func:`logit_statistics`.
    """
    _check_head(hidden, weight, bias)
    check_transform(transform)
    V, d = weight.shape
    lead = hidden.shape[:-1]
    check_inputs(hidden.new_empty(()).expand(*lead, V), mask, targets, max_chunk_bytes)
    rows, vocab_step = hidden_chunk_plan(V, d, weight.dtype, max_chunk_bytes)
    w = weight.detach()
    b = bias.detach().float() if bias is not None else None
    flat = hidden.detach().reshape(-1, d)

    # one float32 slice of a low-precision head and its product, reused by every chunk
    wbuf = torch.empty(vocab_step, d, device=w.device) if w.dtype != torch.float32 else None
    pbuf = torch.empty(rows, vocab_step, device=w.device) if w.dtype != torch.float32 else None

    def project(start: int) -> Tensor:
        return projected(flat[start : start + rows].float())

    def rows_of(idx: Tensor) -> Tensor:  # rows read again (overflowed sums), `rows` at a time: the buffers' size
        parts = [flat.index_select(0, idx[i : i + rows]).float() for i in range(0, idx.numel(), rows)]
        return torch.cat([projected(h) for h in parts])

    def projected(h: Tensor) -> Tensor:  # (n, d) float32 -> (n, V) float32 logits
        x = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device)  # (n, V)
        if wbuf is None or pbuf is None:  # a float32 head: one product straight into x
            return torch.mm(h, w.T, out=x) if b is None else torch.addmm(b, h, w.T, out=x)
        for v0 in range(0, V, vocab_step):  # a low-precision head is converted a slice at a time
            v = min(vocab_step, V - v0)
            wv = wbuf[:v].copy_(w[v0 : v0 + v])  # (v, d) float32
            p = torch.mm(h, wv.T, out=pbuf[: h.shape[0], :v])  # (n, v)
            x[:, v0 : v0 + v] = p if b is None else p.add_(b[v0 : v0 + v])
        return x

    tasks: list[Task] = [(start, partial(project, start)) for start in range(0, flat.shape[0], rows)]
    with full_precision(hidden.device):  # also covers the projections, made lazily inside
        return statistics_from_tasks(tasks, lead, V, hidden.device, rows, mask, targets, ignore_index,
                                     transform=transform, workers=1, rows_of=rows_of)
