"""Math on the matrix that really trains: low-rank adapter deltas, the effective head's row
gradient, and rows that were never trained.

Definitions, for a head or embedding stored as rows ``W`` of shape ``(V, d_model)``:

- LoRA (Hu et al., 2021, *LoRA: Low-Rank Adaptation of Large Language Models*) adds a
  low-rank update: ``W_eff = W + s * L @ R`` with ``L`` of shape ``(V, r)``, ``R`` of shape
  ``(r, d_model)`` and the scaling ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
  For ``nn.Linear`` heads ``L = lora_B.weight`` and ``R = lora_A.weight``; for embeddings
  ``L = lora_embedding_A.T`` and ``R = lora_embedding_B.T`` (PEFT's layouts).
- The gradient the effective head ``logits = h @ W_eff.T`` receives, from its input ``h``
  ``(N, d_model)`` and the gradient at its output ``g = dL/dlogits`` ``(N, V)``:
  ``dL/dW_eff = g.T @ h`` ``(V, d_model)`` (the chain rule through one matrix product). It
  exists whether or not ``W_eff`` is a Parameter, so it is the row gradient of a LoRA head.
- A row is *never trained* (zero row) when its L2 norm is ``<= rtol * median row norm``;
  ``rtol = 0`` is the exact all-zero test (reserved tokens initialised to zero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES


def _rows_per_chunk(row_bytes: int, max_chunk_bytes: int) -> int:
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1:
        raise HeadwatchError(f"`max_chunk_bytes` must be a positive int, got {max_chunk_bytes!r}")
    return max(1, max_chunk_bytes // max(1, row_bytes))


@torch.no_grad()
def add_low_rank_(
    out: Tensor, left: Tensor, right: Tensor, scaling: float, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
) -> Tensor:
    """``out += scaling * left @ right`` in place, row chunk by row chunk, math in float32.

    Args:
        out: ``(V, d_model)`` floating accumulator (usually float32).
        left: ``(V, r)``.
        right: ``(r, d_model)``.
        scaling: the adapter's scale ``s``.
        max_chunk_bytes: bound on the float32 temporary ``(rows, d_model)``.

    Returns:
        ``out``.

    Raises:
        HeadwatchError: the shapes do not chain.
    """
    chained = out.ndim == left.ndim == right.ndim == 2 and left.shape[1] == right.shape[0]
    if not chained or (left.shape[0], right.shape[1]) != tuple(out.shape):
        raise HeadwatchError(
            f"expected out [V, d_model], left [V, r], right [r, d_model], got {tuple(out.shape)}, "
            f"{tuple(left.shape)}, {tuple(right.shape)}"
        )
    V, d = out.shape
    step = _rows_per_chunk(4 * (d + left.shape[1]), max_chunk_bytes)
    r32 = right.detach().to(device=out.device, dtype=torch.float32)
    for r0 in range(0, V, step):
        part = left.detach()[r0 : r0 + step].to(device=out.device, dtype=torch.float32) @ r32  # (rows, d)
        out[r0 : r0 + step].add_(part, alpha=float(scaling))
    return out


@torch.no_grad()
def head_weight_gradient(
    hidden: Tensor, grad_logits: Tensor, out: Tensor | None = None, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
) -> Tensor:
    """The gradient of the loss with respect to the effective head matrix, ``g.T @ h``.

    For a head computing ``logits = h @ W_eff.T`` (any bias aside), ``dL/dW_eff = sum_n g_n h_n^T``
    with ``g_n = dL/dlogits_n``. Feed it the head's captured input and the gradient at its output
    (a tensor hook), chunk by chunk: micro-batches add into ``out``.

    Args:
        hidden: ``(..., d_model)`` the head's input ``h``.
        grad_logits: ``(..., V)`` the gradient at the head's output, same leading shape.
        out: optional ``(V, d_model)`` float32 accumulator.
        max_chunk_bytes: bound on the float32 copies of a chunk of positions.

    Returns:
        ``(V, d_model)`` float32, in gradient units of the head's weight.

    Raises:
        HeadwatchError: leading shapes differ, or ``out`` has the wrong shape.
    """
    if hidden.shape[:-1] != grad_logits.shape[:-1]:
        raise HeadwatchError(
            f"expected hidden [..., d_model] and grad_logits [..., vocab_size] with the same leading shape, "
            f"got {tuple(hidden.shape)} and {tuple(grad_logits.shape)}"
        )
    d, V = hidden.shape[-1], grad_logits.shape[-1]
    if out is None:
        out = torch.zeros(V, d, dtype=torch.float32, device=grad_logits.device)
    if out.shape != (V, d):
        raise HeadwatchError(f"expected out of shape ({V}, {d}), got {tuple(out.shape)}")
    h = hidden.detach().reshape(-1, d)
    g = grad_logits.detach().reshape(-1, V)
    step = _rows_per_chunk(4 * (V + d), max_chunk_bytes)
    for n0 in range(0, g.shape[0], step):
        gc = g[n0 : n0 + step].to(device=out.device, dtype=torch.float32)  # (n, V)
        hc = h[n0 : n0 + step].to(device=out.device, dtype=torch.float32)  # (n, d)
        out.addmm_(gc.T, hc)
    return out


@torch.no_grad()
def zero_rows(matrix: Tensor, rtol: float = 0.0) -> Tensor:
    """Rows that were never trained: ``||W_i||_2 <= rtol * median_j ||W_j||_2``, ``(V, d) -> (V,)`` bool.

    With ``rtol = 0`` (default) exactly the all-zero rows (no float32 underflow: tested with
    ``amax``/``amin``). A zero row has cosine 0 with every row, so it is nobody's near-duplicate;
    count these rows on their own and leave them out of the valid rows of any collision search.

    Raises:
        HeadwatchError: ``matrix`` is not 2-D or ``rtol`` is negative.
    """
    if not isinstance(matrix, Tensor) or matrix.ndim != 2:
        raise HeadwatchError(f"expected a matrix of shape [vocab_size, d_model], got {getattr(matrix, 'shape', matrix)!r}")
    if not isinstance(rtol, (int, float)) or rtol < 0:
        raise HeadwatchError(f"`rtol` must be a float >= 0, got {rtol!r}")
    m = matrix.detach()
    exact = (m.amax(dim=1) == 0) & (m.amin(dim=1) == 0)
    if rtol == 0:
        return exact
    norms = torch.linalg.vector_norm(m, dim=1, dtype=torch.float32)
    return exact | (norms <= rtol * norms.median())
