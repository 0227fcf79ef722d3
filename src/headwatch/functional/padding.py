"""Probability mass on vocabulary columns beyond the tokenizer's vocabulary.

Embedding tables and heads are often padded beyond the tokenizer's ``vocab_size`` (to a
multiple of 64 or 128, for faster matmuls): the logits then have ``V > vocab_size``
columns, and columns ``vocab_size .. V-1`` are ids no tokenizer produces. The loss
(``cross_entropy`` over all ``V`` columns) and sampling still use the full softmax, so
headwatch's entropy is that of the full softmax over ``V`` columns, the distribution the
model is trained and sampled with; how much of it sits on padding is reported beside it:

``padded_mass = sum_{v >= vocab_size} p_v``, with ``p = softmax(x)`` over all ``V`` columns,
a probability in ``[0, 1]``; ``0`` exactly when ``V == vocab_size``. Computed as the ratio
``sum_{v >= vocab_size} exp(x_v - m) / sum_v exp(x_v - m)`` with ``m`` the row max, in float32
(float64 for float64 input), chunk of rows by chunk of rows, so the extra memory stays under
``max_chunk_bytes``; its absolute error is a few float32 eps, whatever the logits' scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES, compute_dtype, rows_per_chunk


@torch.no_grad()
def padded_mass(logits: Tensor, vocab_size: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """Probability ``softmax(logits)`` puts on the padded columns ``[vocab_size, V)``, per position.

    Args:
        logits: ``(..., V)`` floating tensor (any dtype; the math is float32, float64 for
            float64 input), the logits the loss uses.
        vocab_size: the tokenizer's vocabulary size, ``1 <= vocab_size <= V``; columns at
            and beyond it are padding.
        max_chunk_bytes: bound on the working memory of one chunk of rows (default 64 MiB).

    Returns:
        ``(...)`` probabilities in ``[0, 1]`` (unit: probability, not nats): 0 where
        ``V == vocab_size`` or the padded logits are all ``-inf``; NaN for rows with NaN
        or ``+inf`` logits, or made only of ``-inf`` (no distribution is defined).

    Raises:
        HeadwatchError: ``logits`` is not a floating tensor with a last dimension, or
            ``vocab_size`` is not an int in ``[1, V]``.

    Definition: the module docstring; ``softmax`` over all ``V`` columns, as in
    ``torch.nn.functional.cross_entropy``.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 1:
        raise HeadwatchError(
            "expected logits of shape [..., vocab_size] as a floating tensor, got "
            + (f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits).__name__)
        )
    V = logits.shape[-1]
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= V:
        raise HeadwatchError(
            f"`vocab_size` must be an int in [1, {V}] (the logits have {V} columns), got {vocab_size!r}"
        )
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1:
        raise HeadwatchError(f"`max_chunk_bytes` must be an int >= 1, got {max_chunk_bytes!r}")
    dtype = compute_dtype(logits.dtype)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, V)  # a view for contiguous logits
    out = torch.zeros(flat.shape[0], dtype=dtype, device=logits.device)
    rows = rows_per_chunk(V, logits.dtype, logits.device, max_chunk_bytes)
    for start in range(0, flat.shape[0], rows):
        x = flat[start : start + rows].to(dtype)  # (n, V)
        m = x.amax(dim=-1, keepdim=True)  # (n, 1)
        finite = torch.isfinite(m).squeeze(-1)  # NaN, +inf or an all -inf row: no distribution
        if vocab_size < V:
            # a ratio of sums shifted by the row max, not exp(lse_pad - lse_all): two logsumexps
            # of size ~|m| each round to ulp(|m|), an absolute error of ~1e-6 on the mass at
            # logits ~30 in float32; the shifted ratio keeps it to a few eps of the mass
            e = (x - torch.where(torch.isfinite(m), m, torch.zeros_like(m))).exp_()  # (n, V), one buffer
            pad = e[:, vocab_size:].sum(dim=-1)  # (n,); 0 when all padded logits are -inf
            mass = (pad / (e[:, :vocab_size].sum(dim=-1) + pad)).clamp_(max=1.0)
        else:
            mass = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
        out[start : start + x.shape[0]] = torch.where(finite, mass, torch.full_like(mass, float("nan")))
    return out.reshape(lead)
