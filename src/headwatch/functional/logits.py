"""Statistics of next-token distributions computed from logits, in bounded memory.

Definitions (natural logarithms throughout, so every value is in nats), for one
position with logits ``x`` of length ``V`` and ``p = softmax(x)``:

- entropy ``H(p) = -sum_v p_v log p_v``, in ``[0, log V]`` (Shannon, 1948);
- ``kl_to_uniform = KL(p || U) = sum_v p_v log(p_v V) = log V - H(p)``, the
  "sharpness": 0 for the uniform distribution, ``log V`` for a one-hot one;
- ``kl_from_uniform = KL(U || p) = -log V - (1/V) sum_v log p_v``: very sensitive to
  near-zero probabilities, ``+inf`` when some ``p_v = 0`` (a ``-inf`` logit);
- ``max_prob = max_v p_v``;
- with a target ``y``: ``nll = -log p_y`` and ``target_is_argmax = x_y == max_v x_v``
  (ties count as the argmax).

All of them follow from one pass over each row: with ``m = max_v x_v``,
``s = x - m``, ``Z = sum_v exp(s_v)``,
``H = log Z - sum_v exp(s_v) s_v / Z``, ``max_prob = 1 / Z``,
``KL(U || p) = log Z - mean_v(s_v) - log V`` and ``nll = log Z - s_y``.
``-inf`` logits contribute exactly ``0 * log 0 = 0`` to the entropy. Rows containing
NaN or ``+inf`` (or made only of ``-inf``) have no defined distribution: they are
reported as non-finite and excluded, never propagated into means.

Memory is bounded: rows are processed in chunks whose float32 working buffers stay
under ``max_chunk_bytes``; no ``(..., V)`` log-softmax, probability or uniform tensor
is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch._errors import HeadwatchError

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
"""Default budget for the working buffers of one chunk of rows: 64 MiB."""

# On the CPU a chunk that stays in cache is faster than a big one (the passes over a
# chunk then hit L2/L3 instead of DRAM); on accelerators big chunks amortise launches.
_CPU_CHUNK_BYTES = 4 * 2**20  # measured: 0.5 MiB 120 ms, 2 MiB 72 ms, 4 MiB 64 ms, 16 MiB 84 ms (bench/README.md)



def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for everything else (bf16, fp16, float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LogitStatistics(NamedTuple):
    """Per-position statistics; every tensor has the leading shape ``(...)`` of the logits.

    Positions that are not ``valid`` hold NaN in the float fields and False in
    ``target_is_argmax``.
    """

    entropy: Tensor
    """H(p) in nats; float32 (float64 for float64 logits), like every float field."""
    kl_to_uniform: Tensor
    """KL(p || U) = log V - H(p) in nats, float32."""
    kl_from_uniform: Tensor
    """KL(U || p) in nats, float32 (``+inf`` where some logit is ``-inf``)."""
    max_prob: Tensor
    """max_v p_v, float32."""
    nll: Tensor | None
    """-log p_target in nats, float32; None when no targets were given."""
    target_is_argmax: Tensor | None
    """bool, the target has the largest logit; None when no targets were given."""
    valid: Tensor
    """bool, the position was measured: selected by the mask, a finite row, a valid target."""
    nonfinite: Tensor
    """bool, the position was selected but its logits hold NaN or +inf (or only -inf)."""
    invalid_target: Tensor
    """bool, the position was selected but its target is outside ``[0, V)`` and not ``ignore_index``."""


def _check_inputs(
    logits: Tensor, mask: Tensor | None, targets: Tensor | None, max_chunk_bytes: int
) -> None:
    if not isinstance(logits, Tensor):
        raise HeadwatchError(f"expected `logits` to be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise HeadwatchError(
            f"expected logits of shape [..., vocab_size] with vocab_size >= 1, got {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise HeadwatchError(f"expected floating-point logits, got dtype {logits.dtype}")
    lead = logits.shape[:-1]
    if mask is not None:
        if mask.shape != lead:
            raise HeadwatchError(
                f"expected mask of shape {tuple(lead)} (the logits' shape without the vocabulary "
                f"dimension), got {tuple(mask.shape)}; logits have shape {tuple(logits.shape)}"
            )
        if mask.dtype != torch.bool:
            raise HeadwatchError(f"expected a boolean mask, got dtype {mask.dtype}")
    if targets is not None:
        if targets.shape != lead:
            raise HeadwatchError(
                f"expected targets of shape {tuple(lead)} (the logits' shape without the "
                f"vocabulary dimension), got {tuple(targets.shape)}; logits have shape {tuple(logits.shape)}"
            )
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise HeadwatchError(f"expected integer targets, got dtype {targets.dtype}")
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes <= 0:
        raise HeadwatchError(f"expected `max_chunk_bytes` to be a positive int, got {max_chunk_bytes!r}")


def rows_per_chunk(vocab_size: int, dtype: torch.dtype, device: torch.device, max_chunk_bytes: int) -> int:
    """Rows of a ``(rows, vocab_size)`` chunk whose working buffers fit in ``max_chunk_bytes``.

    The working set of a chunk is two buffers ``(rows, V)`` in the compute dtype (float32,
    or float64 for float64 input) plus, for inputs of another dtype, a converted copy of the
    chunk. At least one row is always used.
    """
    cdtype = compute_dtype(dtype)
    per_row = vocab_size * (8 if cdtype == torch.float64 else 4) * (2 if dtype == cdtype else 3)
    budget = max_chunk_bytes if device.type != "cpu" else min(max_chunk_bytes, _CPU_CHUNK_BYTES)
    return max(1, budget // per_row)


def _row_blocks(logits: Tensor, rows: int) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(offset, block)`` with ``block`` a ``(n <= rows, V)`` view (or a copy of that block only)."""
    V = logits.shape[-1]
    try:
        flat = logits.view(-1, V)
    except RuntimeError:  # not viewable as 2-D: walk the leading dimension, copy one block at a time
        lead = logits.shape[:-1]
        per_item = math.prod(lead[1:])
        offset = 0
        if per_item <= rows:
            step = max(1, rows // max(per_item, 1))
            for i in range(0, lead[0], step):
                block = logits[i : i + step].reshape(-1, V)
                yield offset, block
                offset += block.shape[0]
        else:
            for i in range(lead[0]):
                for sub_offset, block in _row_blocks(logits[i], rows):
                    yield offset + sub_offset, block
                offset += per_item
        return
    for start in range(0, flat.shape[0], rows):
        yield start, flat[start : start + rows]


@torch.no_grad()
def logit_statistics(
    logits: Tensor,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> LogitStatistics:
    """Entropy, sharpness and target statistics of ``softmax(logits)`` at every position.

    Args:
        logits: ``(..., V)`` float32, bfloat16 or float16 (any floating dtype); math is
            done in float32 whatever the input dtype (float64 for float64 input). Not
            modified, not copied whole.
        mask: optional ``(...)`` bool, True where the position is a prediction to measure.
        targets: optional ``(...)`` integer ids aligned with ``logits`` (already shifted:
            ``logits[..., t, :]`` is scored against ``targets[..., t]``). Positions whose
            target equals ``ignore_index`` are excluded.
        ignore_index: target value marking positions that are not predictions (-100,
            as in ``torch.nn.functional.cross_entropy``).
        max_chunk_bytes: upper bound on the extra working memory of one chunk of rows
            (default 64 MiB); on the CPU chunks are kept cache-sized (4 MiB) below it.

    Returns:
        :class:`LogitStatistics`, each field of shape ``(...)``.

    Raises:
        HeadwatchError: logits are not a floating tensor of shape ``(..., V)``, or the
            mask/targets do not have the logits' leading shape or the right dtype.

    Definitions: see the module docstring; entropy after Shannon (1948), KL divergence
    after Kullback and Leibler (1951).
    """
    _check_inputs(logits, mask, targets, max_chunk_bytes)
    V = logits.shape[-1]
    rows = rows_per_chunk(V, logits.dtype, logits.device, max_chunk_bytes)
    return _statistics_from_blocks(
        _row_blocks(logits, rows), logits.shape[:-1], V, logits.device, rows, mask, targets, ignore_index,
        compute_dtype(logits.dtype),
    )


@torch.no_grad()
def logit_statistics_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> LogitStatistics:
    """:func:`logit_statistics` of ``hidden @ weight.T + bias`` without materialising the logits.

    For models trained with a fused linear cross-entropy (Liger Kernel, Cut
    Cross-Entropy) that never hold logits: each chunk of rows is projected by the head
    in float32, measured, and dropped, so memory stays under ``max_chunk_bytes``.

    Args:
        hidden: ``(..., d_model)`` final hidden states (any floating dtype).
        weight: ``(V, d_model)`` head weight, as stored by ``nn.Linear(d_model, V)``.
        bias: optional ``(V,)`` head bias.
        mask, targets, ignore_index, max_chunk_bytes: as in :func:`logit_statistics`.

    Returns:
        :class:`LogitStatistics`, each field of shape ``(...)``.

    Raises:
        HeadwatchError: shapes do not agree (``hidden``'s last dimension is not
            ``weight``'s second, ``bias`` is not ``(V,)``), or as :func:`logit_statistics`.
    """
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor):
        raise HeadwatchError("expected `hidden` and `weight` to be torch.Tensors")
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise HeadwatchError(
            f"expected hidden of shape [..., d_model] and weight of shape [vocab_size, d_model], got "
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    V = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (V,):
        raise HeadwatchError(f"expected bias of shape ({V},), got {tuple(bias.shape)}")
    lead = hidden.shape[:-1]
    _check_inputs(hidden.new_empty(()).expand(*lead, V), mask, targets, max_chunk_bytes)
    # one more float32 (rows, V) buffer than logit_statistics: the projected block
    rows = rows_per_chunk(V, torch.bfloat16, hidden.device, max_chunk_bytes)
    w = weight.detach()
    b = bias.detach().float() if bias is not None else None
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    d = w.shape[1]
    # a low-precision head is converted to float32 a slice of rows at a time, never whole
    vocab_step = V if w.dtype == torch.float32 else max(1, min(V, max_chunk_bytes // (4 * 4 * d)))

    def project(h: Tensor, v0: int, v1: int) -> Tensor:
        wv = w[v0:v1].float()  # (v, d): a copy only for a low-precision head
        return h @ wv.T if b is None else torch.addmm(b[v0:v1], h, wv.T)

    def blocks() -> Iterator[tuple[int, Tensor]]:
        for start in range(0, flat.shape[0], rows):
            h = flat[start : start + rows].float()  # (n, d)
            if vocab_step == V:
                yield start, project(h, 0, V)  # (n, V)
                continue
            x = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device)  # (n, V)
            for v0 in range(0, V, vocab_step):
                x[:, v0 : v0 + vocab_step] = project(h, v0, v0 + vocab_step)
            yield start, x

    return _statistics_from_blocks(blocks(), lead, V, hidden.device, rows, mask, targets, ignore_index)


def _statistics_from_blocks(
    blocks: Iterator[tuple[int, Tensor]],
    lead: torch.Size,
    V: int,
    device: torch.device,
    rows: int,
    mask: Tensor | None,
    targets: Tensor | None,
    ignore_index: int,
    dtype: torch.dtype = torch.float32,
) -> LogitStatistics:
    """The one-pass row math, over ``(offset, (n, V) logits)`` blocks covering ``prod(lead)`` rows."""
    N = math.prod(lead)
    log_v = math.log(V)
    lowest = torch.finfo(dtype).min

    entropy = torch.empty(N, dtype=dtype, device=device)
    max_prob = torch.empty_like(entropy)
    mean_s = torch.empty_like(entropy)  # mean_v(s_v), for KL(U || p)
    log_z = torch.empty_like(entropy)
    row_finite = torch.empty(N, dtype=torch.bool, device=device)
    s_target = torch.empty_like(entropy) if targets is not None else None

    flat_targets = None
    target_ok = None
    if targets is not None:
        flat_targets = targets.reshape(N).long()
        in_range = (flat_targets >= 0) & (flat_targets < V)
        target_ok = in_range
        # Out-of-range ids are gathered at 0 and excluded below: an out-of-bounds gather
        # would be a device-side assert on a GPU and kill the run.
        flat_targets = torch.where(in_range, flat_targets, torch.zeros_like(flat_targets))

    s_buf = torch.empty(min(rows, max(N, 1)), V, dtype=dtype, device=device)
    e_buf = torch.empty_like(s_buf)
    for start, block in blocks:
        n = block.shape[0]
        x = block if block.dtype == dtype else block.to(dtype)  # (n, V), float32 (float64 for float64 input)
        m = x.amax(dim=-1, keepdim=True)  # (n, 1)
        finite = torch.isfinite(m)  # False for NaN, +inf, or an all -inf row
        s = torch.sub(x, torch.where(finite, m, torch.zeros_like(m)), out=s_buf[:n])  # (n, V), <= 0
        mean_s[start : start + n] = s.sum(dim=-1) / V  # -inf when a logit is -inf: KL(U || p) = +inf
        if s_target is not None:  # before the clamp: a -inf target logit gives nll = +inf
            idx = flat_targets[start : start + n].unsqueeze(-1)  # (n, 1)
            s_target[start : start + n] = s.gather(-1, idx).squeeze(-1)
        s.clamp_(min=lowest)  # -inf -> lowest float: exp() gives exactly 0 and 0 * s = 0
        e = torch.exp(s, out=e_buf[:n])  # (n, V)
        z = e.sum(dim=-1)  # (n,)
        lz = torch.log(z)
        log_z[start : start + n] = lz
        entropy[start : start + n] = lz - torch.linalg.vecdot(e, s) / z
        max_prob[start : start + n] = z.reciprocal()
        row_finite[start : start + n] = finite.squeeze(-1)

    # Entropy of an (almost) one-hot row can round to a tiny negative: clamp into [0, log V].
    entropy.clamp_(min=0.0, max=log_v)
    selected = mask.reshape(N) if mask is not None else torch.ones(N, dtype=torch.bool, device=device)
    nonfinite = selected & ~row_finite
    valid = selected & row_finite
    invalid_target = torch.zeros_like(valid)
    nll = None
    is_argmax = None
    if targets is not None:
        assert flat_targets is not None and target_ok is not None and s_target is not None
        not_ignored = targets.reshape(N) != ignore_index
        invalid_target = valid & not_ignored & ~target_ok
        valid = valid & not_ignored & target_ok
        nll = log_z - s_target
        is_argmax = (s_target == 0) & valid
    nan = torch.tensor(float("nan"), device=device)

    def _out(t: Tensor) -> Tensor:
        return torch.where(valid, t, nan).reshape(lead)

    return LogitStatistics(
        entropy=_out(entropy),
        kl_to_uniform=_out(log_v - entropy),
        kl_from_uniform=_out(torch.clamp(log_z - mean_s - log_v, min=0.0)),
        max_prob=_out(max_prob),
        nll=_out(nll) if nll is not None else None,
        target_is_argmax=is_argmax.reshape(lead) if is_argmax is not None else None,
        valid=valid.reshape(lead),
        nonfinite=nonfinite.reshape(lead),
        invalid_target=invalid_target.reshape(lead),
    )


def entropy(logits: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """Entropy ``H(softmax(logits))`` in nats at every position.

    Args:
        logits: ``(..., V)`` floating tensor.
        max_chunk_bytes: working-memory bound, see :func:`logit_statistics`.

    Returns:
        ``(...)`` float32; NaN where the row holds NaN or ``+inf``.
    """
    return logit_statistics(logits, max_chunk_bytes=max_chunk_bytes).entropy


def kl_to_uniform(logits: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """Sharpness ``KL(p || U) = log V - H(p)`` in nats at every position, ``(..., V) -> (...)``."""
    return logit_statistics(logits, max_chunk_bytes=max_chunk_bytes).kl_to_uniform


def kl_from_uniform(logits: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """``KL(U || p) = -log V - (1/V) sum_v log p_v`` in nats at every position, ``(..., V) -> (...)``."""
    return logit_statistics(logits, max_chunk_bytes=max_chunk_bytes).kl_from_uniform


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


def _logit_stats_update(stats: LogitStatistics) -> LogitStatSums:
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


def _logit_stats_compute(sums: LogitStatSums) -> dict[str, Tensor]:
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
