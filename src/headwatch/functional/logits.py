"""Statistics of next-token distributions computed from logits, in bounded memory.

Definitions (natural logarithms throughout, so every value is in nats), for one
position with logits ``x`` of length ``V`` and ``p = softmax(x)``:

- entropy ``H(p) = -sum_v p_v log p_v``, in ``[0, log V]`` (Shannon, 1948);
- ``kl_to_uniform = KL(p || U) = sum_v p_v log(p_v V) = log V - H(p)``, the
  "sharpness": 0 for the uniform distribution, ``log V`` for a one-hot one;
- ``kl_from_uniform = KL(U || p) = -log V - (1/V) sum_v log p_v``: very sensitive to
  near-zero probabilities, ``+inf`` when some ``p_v = 0`` (a ``-inf`` logit);
- ``max_prob = max_v p_v``;
- ``renyi2_entropy = H_2(p) = -log sum_v p_v^2``, the Rényi entropy of order 2 (Rényi, 1961),
  or collision entropy: minus the log-probability that two independent draws from ``p`` agree;
  in ``[0, H(p)]``, it weighs the large probabilities and barely sees the long tail;
- with a target ``y``: ``nll = -log p_y`` and ``target_is_argmax = x_y == max_v x_v``
  (ties count as the argmax).

All of them follow from one pass over each row: with ``m = max_v x_v``,
``s = x - m``, ``Z = sum_v exp(s_v)``,
``H = log Z - sum_v exp(s_v) s_v / Z``, ``max_prob = 1 / Z``,
``KL(U || p) = log Z - mean_v(s_v) - log V``, ``nll = log Z - s_y`` and
``H_2 = 2 log Z - log sum_v exp(2 s_v)`` (``sum_v exp(s_v)^2``, a norm of the same buffer);
``exp(s_v)`` is computed as ``exp2(s_v log2(e))`` (twice as fast on the CPU, the same accuracy: worst
entropy error against float64 1.0e-6 nats at V 32000, logit scales 0.01 to 100).
Finite logits near float32's largest value (``+-1e38``) overflow float32 sums: ``sum_v s_v`` when
``|sum_v s_v| > 3.4e38``, and ``s_v`` itself when ``m - x_v > 3.4e38``. Such a row's ``sum_v s_v`` reads ``-inf``, as a
row holding a ``-inf`` logit does rightly; the first :data:`OVERFLOW_ROWS` of these rows (by largest ``|m|``) are read
again and their ``mean_v s_v`` summed as ``sum_v (x_v / V - m / V)``, terms that cannot overflow (fixed-size ops, no
host sync), so that ``KL(U || p)`` is the float64 value to float32 precision (``+inf`` only beyond float32's range or
for a ``-inf`` logit; ``tests/functional/test_logits_overflow.py``). The other statistics need no such care: an
overflowed ``s_v = -inf`` gives ``exp(s_v) = 0`` where the true probability is below ``e^-3.4e38``, zero to float32
precision, and it contributes 0 to ``H``, ``Z`` and ``sum_v p_v^2`` (``nll`` of such a target is ``+inf``, its float64
value being beyond float32's range).
``-inf`` logits contribute exactly ``0 * log 0 = 0`` to the entropy and 0 to ``sum_v p_v^2``. Rows containing
NaN or ``+inf`` (or made only of ``-inf``) have no defined distribution: they are
reported as non-finite and excluded, never propagated into means.

Memory is bounded: rows are processed in chunks whose float32 working buffers stay
under ``max_chunk_bytes``; no ``(..., V)`` log-softmax, probability or uniform tensor
is allocated.

Precision: the math runs in float32 (float64 for float64 logits) with autocast disabled,
so a call inside ``torch.autocast`` (Lightning's ``precision="bf16-mixed"``) gives the
same values as outside (``tests/functional/test_precision.py``). Speed on the CPU: chunks are cache-sized
and shared among torch's threads, each running single-threaded ops (see
``headwatch.functional.precision``), so a busy machine does not stall every op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.precision import cpu_workers, full_precision, map_rows_single_threaded, single_threaded

__all__ = [  # check_inputs, check_transform, statistics_from_tasks: building blocks of functional.hidden
    "DEFAULT_MAX_CHUNK_BYTES", "LogitStatistics", "compute_dtype", "entropy", "kl_from_uniform", "kl_to_uniform",
    "logit_statistics", "rows_per_chunk",
]  # fmt: skip

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
"""Default budget for the working buffers of one chunk of rows: 64 MiB."""

# On the CPU a chunk that stays in cache is faster than a big one (the passes over a
# chunk then hit L2/L3 instead of DRAM); on accelerators big chunks amortise launches.
_LOG2_E, _LN_2 = 1.0 / math.log(2.0), math.log(2.0)
_CPU_CHUNK_BYTES = 4 * 2**20  # measured: 0.5 MiB 120 ms, 2 MiB 72 ms, 4 MiB 64 ms, 16 MiB 84 ms (bench/README.md)
OVERFLOW_ROWS = 4
"""Rows read again per call to recompute ``KL(U || p)`` where the float32 sum of ``x - max`` read ``-inf`` (a fixed
number, with no host sync: ``4 * V`` logits read from memory, most of the cost, then three passes over them, 0.4 ms
in a 42 ms call on (1024, 32000) on a busy CPU; beyond 4 such rows, those with the smallest ``|max|`` keep
``+inf``)."""


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
    renyi2_entropy: Tensor
    """H_2(p) = -log sum_v p_v^2 in nats, in ``[0, H(p)]``, float32 (Rényi, 1961)."""
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


def check_inputs(
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


LogitTransform = Callable[[Tensor], Tensor]
"""A final transform of the logits, applied to each ``(n, V)`` float32 chunk (see ``transform=``)."""


def rows_per_chunk(
    vocab_size: int, dtype: torch.dtype, device: torch.device, max_chunk_bytes: int, extra_buffers: int = 0
) -> int:
    """Rows of a ``(rows, vocab_size)`` chunk whose working buffers fit in ``max_chunk_bytes``.

    The working set of a chunk is two buffers ``(rows, V)`` in the compute dtype (float32,
    or float64 for float64 input) plus, for inputs of another dtype, a converted copy of the
    chunk, plus ``extra_buffers`` more (a transformed copy). On the CPU the budget is capped
    at a cache-sized 4 MiB per chunk and per thread. At least one row is always used.
    """
    cdtype = compute_dtype(dtype)
    buffers = (2 if dtype == cdtype else 3) + extra_buffers
    per_row = vocab_size * (8 if cdtype == torch.float64 else 4) * buffers
    budget = max_chunk_bytes if device.type != "cpu" else min(max_chunk_bytes, _CPU_CHUNK_BYTES)
    return max(1, budget // per_row)


Task = tuple[int, Callable[[], Tensor]]
"""``(offset of the first row, a function returning the (n, V) block)``: blocks are made lazily."""


def _row_tasks(logits: Tensor, rows: int) -> list[Task]:
    """Blocks of at most ``rows`` rows: views where ``logits`` is viewable as 2-D, else one copied block at a time."""
    V = logits.shape[-1]
    try:
        flat = logits.view(-1, V)
    except RuntimeError:  # not viewable as 2-D: walk the leading dimension, copy one block at a time
        lead = logits.shape[:-1]
        per_item = math.prod(lead[1:])
        if per_item <= rows:
            step = max(1, rows // max(per_item, 1))
            return [(i * per_item, partial(_copied_block, logits, i, step)) for i in range(0, lead[0], step)]
        return [(i * per_item + off, make) for i in range(lead[0]) for off, make in _row_tasks(logits[i], rows)]
    return [(start, partial(_view_block, flat, start, rows)) for start in range(0, flat.shape[0], rows)]


def _view_block(flat: Tensor, start: int, rows: int) -> Tensor:
    return flat[start : start + rows]


def _copied_block(logits: Tensor, i: int, step: int) -> Tensor:
    return logits[i : i + step].reshape(-1, logits.shape[-1])


@torch.no_grad()
def logit_statistics(
    logits: Tensor,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    *,
    transform: LogitTransform | None = None,
) -> LogitStatistics:
    """Entropy, sharpness and target statistics of ``softmax(logits)`` at every position.

    Args:
        logits: ``(..., V)`` float32, bfloat16 or float16 (any floating dtype); math is
            done in float32 whatever the input dtype (float64 for float64 input) and
            whatever an enclosing ``torch.autocast`` region says. Not modified, not copied whole.
        mask: optional ``(...)`` bool, True where the position is a prediction to measure.
        targets: optional ``(...)`` integer ids aligned with ``logits`` (already shifted:
            ``logits[..., t, :]`` is scored against ``targets[..., t]``). Positions whose
            target equals ``ignore_index`` are excluded.
        ignore_index: target value marking positions that are not predictions (-100,
            as in ``torch.nn.functional.cross_entropy``).
        max_chunk_bytes: upper bound on the extra working memory of the chunks in flight
            (default 64 MiB); on the CPU the chunks are shared among torch's threads (one
            chunk in flight per thread, each within ``max_chunk_bytes / threads`` and kept
            cache-sized, 4 MiB, below that).
        transform: optional final transform of the logits (softcapping
            :func:`logit_softcap`, a scale :func:`logit_scale`, or any callable), applied to
            each ``(n, V)`` chunk after conversion to float32: a fresh copy that it may
            modify in place; it must return an ``(n, V)`` tensor. The statistics are those
            of ``softmax(transform(logits))``.

    Returns:
        :class:`LogitStatistics`, each field of shape ``(...)``.

    Raises:
        HeadwatchError: logits are not a floating tensor of shape ``(..., V)``, the
            mask/targets do not have the logits' leading shape or the right dtype, or
            ``transform`` is not callable or changes a chunk's shape.

    Definitions: see the module docstring; entropy after Shannon (1948), KL divergence
    after Kullback and Leibler (1951), Rényi entropy after Rényi (1961).
    """
    check_inputs(logits, mask, targets, max_chunk_bytes)
    check_transform(transform)
    V = logits.shape[-1]
    extra = 1 if transform is not None and compute_dtype(logits.dtype) == logits.dtype else 0
    # the budget is shared by the CPU threads, each with its own chunk buffers
    workers = cpu_workers(logits.device, math.prod(logits.shape[:-1]))
    budget = max(1, max_chunk_bytes // workers)
    rows = rows_per_chunk(V, logits.dtype, logits.device, budget, extra_buffers=extra)
    tasks = _row_tasks(logits, rows)
    return statistics_from_tasks(
        tasks, logits.shape[:-1], V, logits.device, rows, mask, targets, ignore_index,
        compute_dtype(logits.dtype), transform, workers=min(workers, max(1, len(tasks))),
        rows_of=partial(_logit_rows, logits),
    )


def _logit_rows(logits: Tensor, idx: Tensor) -> Tensor:
    """The ``(k, V)`` rows ``idx`` of ``logits`` flattened to ``(N, V)``, gathered (a copy) without flattening it."""
    try:
        flat: Tensor | None = logits.view(-1, logits.shape[-1])
    except RuntimeError:  # not viewable as 2-D: each row's position in the leading dimensions
        flat = None
    if flat is not None:
        return flat.index_select(0, idx)  # several times faster than indexing by positions
    index: list[Tensor] = []
    for size in reversed(logits.shape[:-1]):  # row-major
        index.insert(0, idx % size)
        idx = idx // size
    return logits[tuple(index)]


def check_transform(transform: object) -> None:
    if transform is not None and not callable(transform):
        raise HeadwatchError(
            f"expected `transform` to be None or a callable taking and returning an (n, V) tensor, "
            f"got {type(transform).__name__}"
        )


class _Rows(NamedTuple):
    """Per-row reductions of the chunk loop, written chunk by chunk (disjoint slices) and finished over every row at
    once (:func:`_finish`); every field but the last two is an ``(N,)`` float buffer in the compute dtype."""

    max: Tensor  # m = max_v x_v
    sum_s: Tensor  # sum_v s_v, for KL(U || p)
    z: Tensor  # Z = sum_v exp(s_v)
    norm_e: Tensor  # (sum_v exp(s_v)^2)^(1/2) = Z (sum_v p_v^2)^(1/2), for H_2
    sum_es2: Tensor  # sum_v exp(s_v) s_v log2(e), for H
    s_target: Tensor | None
    targets: Tensor | None  # (N,) int64, out-of-range ids replaced by 0


def _measure_block(
    out: _Rows, start: int, block: Tensor, bufs: tuple[Tensor, Tensor], transform: LogitTransform | None
) -> None:
    """The one-pass row math on one ``(n, V)`` block, written to ``out[start : start + n]``."""
    n = block.shape[0]
    s_buf, e_buf = bufs
    dtype = s_buf.dtype
    x = block if block.dtype == dtype else block.to(dtype)  # (n, V), float32 (float64 for float64 input)
    if transform is not None:
        x = transform(x.clone() if x is block else x)
        if not isinstance(x, Tensor) or x.shape != block.shape:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise HeadwatchError(f"expected `transform` to return a tensor of shape {tuple(block.shape)}, got {got}")
        x = x.to(dtype)
    rows = slice(start, start + n)  # this block's entries of every (N,) output, written in place (out=)
    # only the passes over the block here: the per-row arithmetic runs once over every row in _finish (a block's
    # dozen small ops cost, on the CPU, about as much as its passes; a row that is not finite gives NaN, dropped there)
    m = torch.amax(x, dim=-1, keepdim=True, out=out.max[rows].unsqueeze(-1))  # (n, 1)
    s = torch.sub(x, m, out=s_buf[:n])  # (n, V), <= 0
    torch.sum(s, dim=-1, out=out.sum_s[rows])  # -inf when a logit is -inf: KL(U || p) = +inf
    if out.s_target is not None and out.targets is not None:  # a -inf target logit: nll +inf
        torch.gather(s, -1, out.targets[rows].unsqueeze(-1), out=out.s_target[rows].unsqueeze(-1))  # (n, 1)
    # e = exp(s) as exp2(s log2(e)): torch's CPU exp2 runs at twice exp's speed (AVX2; exp is ~60% of a chunk's
    # time); the scaled s2 = s log2(e) rounds to a relative 6e-8, an error of |s| 6e-8 in each exponent
    s2 = s.mul_(_LOG2_E)
    e = torch.exp2(s2, out=e_buf[:n])  # (n, V); exactly 0 at -inf
    torch.sum(e, dim=-1, out=out.z[rows])
    # sum_v e_v^2 as a squared norm: one reduction, no (n, V) temporary (about 1/7 of exp's time on the CPU)
    torch.linalg.vector_norm(e, dim=-1, out=out.norm_e[rows])
    # sum_v e_v s2_v in place into e (no (n, V) temporary; faster than vecdot or bmm on the CPU); nansum: at a -inf
    # logit e_v s2_v = 0 * -inf is NaN where the term is 0 (a finite row has no other NaN)
    torch.nansum(e.mul_(s2), dim=-1, out=out.sum_es2[rows])


def statistics_from_tasks(
    tasks: list[Task],
    lead: torch.Size,
    V: int,
    device: torch.device,
    rows: int,
    mask: Tensor | None,
    targets: Tensor | None,
    ignore_index: int,
    dtype: torch.dtype = torch.float32,
    transform: LogitTransform | None = None,
    workers: int = 1,
    rows_of: Callable[[Tensor], Tensor] | None = None,
) -> LogitStatistics:
    """The row math over lazily made ``(offset, (n, V) logits)`` blocks covering ``prod(lead)`` rows.

    Runs with autocast disabled; with ``workers > 1`` (CPU) the blocks are shared among
    that many single-threaded threads, each with its own pair of ``(rows, V)`` buffers.
    ``rows_of(idx)``: the ``(k, V)`` logits of the flat rows ``idx`` (before ``transform``), read again for the rows
    whose float32 sums overflowed (see the module docstring); None: those rows keep ``KL(U || p) = +inf``.
    """
    N = math.prod(lead)
    flat_targets = target_ok = None
    if targets is not None:
        flat_targets = targets.reshape(N).long()
        target_ok = (flat_targets >= 0) & (flat_targets < V)
        # Out-of-range ids are gathered at 0 and excluded below: an out-of-bounds gather
        # would be a device-side assert on a GPU and kill the run.
        flat_targets = torch.where(target_ok, flat_targets, torch.zeros_like(flat_targets))
    new = partial(torch.empty, N, dtype=dtype, device=device)
    rows_out = {name: new() for name in _Rows._fields if name not in ("s_target", "targets")}
    out = _Rows(**rows_out, s_target=new() if targets is not None else None, targets=flat_targets)
    buf_rows = min(rows, max(N, 1))
    bufs = [
        (torch.empty(buf_rows, V, dtype=dtype, device=device), torch.empty(buf_rows, V, dtype=dtype, device=device))
        for _ in range(max(1, workers))
    ]

    def run(task: Task, worker: int) -> None:
        start, make = task
        _measure_block(out, start, make(), bufs[worker], transform)

    with full_precision(device):
        map_rows_single_threaded(run, tasks, workers)
        bufs.clear()  # before rows are read again (_exact_overflowed): the memory budget holds either, never both
        exact = partial(_exact_overflowed, rows_of, transform)
        return _finish(out, lead, V, mask, targets, ignore_index, target_ok, exact)


def _finish(
    out: _Rows, lead: torch.Size, V: int, mask: Tensor | None, targets: Tensor | None, ignore_index: int,
    target_ok: Tensor | None, exact: Callable[[Tensor, _Rows, Tensor, Tensor, int], Tensor],
) -> LogitStatistics:
    """The per-row arithmetic of the block sums (:class:`_Rows`), validity masks, NaN outside them, and the derived
    fields."""
    N = math.prod(lead)
    device = out.z.device
    log_v = math.log(V)
    finite = torch.isfinite(out.max)  # False for NaN, +inf, or an all -inf row
    z = out.z
    log_z = torch.log(z)
    # H = log Z - sum_v e_v s_v / Z, with s_v = ln(2) s2_v; an (almost) one-hot row can round to a tiny negative
    entropy = torch.sub(log_z, out.sum_es2.mul_(_LN_2).div_(z)).clamp_(min=0.0, max=log_v)
    # H_2 = 2 log Z - log sum_v exp(2 s_v); rounding can put it a hair outside [0, H]
    renyi2 = torch.minimum((2 * log_z - torch.log(out.norm_e.square_())).clamp_(min=0.0), entropy)
    mean_s = out.sum_s.div_(V)
    selected = mask.reshape(N) if mask is not None else torch.ones(N, dtype=torch.bool, device=device)
    nonfinite = selected & ~finite
    valid = selected & finite
    invalid_target = torch.zeros_like(valid)
    nll = is_argmax = None
    if targets is not None and target_ok is not None and out.s_target is not None:
        not_ignored = targets.reshape(N).long() != ignore_index  # int64: -100 would wrap to 156 in a uint8 compare
        invalid_target = valid & not_ignored & ~target_ok
        valid = valid & not_ignored & target_ok
        nll = log_z - out.s_target
        is_argmax = (out.s_target == 0) & valid
    def _out(t: Tensor) -> Tensor:
        return torch.where(valid, t, float("nan")).reshape(lead)  # a Python NaN: no copy to the device

    return LogitStatistics(
        entropy=_out(entropy),
        kl_to_uniform=_out(log_v - entropy),
        kl_from_uniform=_out(exact(torch.clamp(log_z - mean_s - log_v, min=0.0), out, finite, log_z, V)),
        max_prob=_out(torch.reciprocal(z)),
        renyi2_entropy=_out(renyi2),
        nll=_out(nll) if nll is not None else None,
        target_is_argmax=is_argmax.reshape(lead) if is_argmax is not None else None,
        valid=valid.reshape(lead),
        nonfinite=nonfinite.reshape(lead),
        invalid_target=invalid_target.reshape(lead),
    )


def _exact_overflowed(
    rows_of: Callable[[Tensor], Tensor] | None, transform: LogitTransform | None, kl: Tensor, out: _Rows,
    finite: Tensor, log_z: Tensor, V: int,
) -> Tensor:
    """``kl`` (``KL(U || p)`` of every row, ``(N,)``) with the rows whose float32 ``sum_v s_v`` read ``-inf`` recomputed
    from their logits read again (``rows_of``, then ``transform`` as in the chunk loop), without overflow: the first
    :data:`OVERFLOW_ROWS` of them by largest ``|m|`` (a fixed-size ``topk``, no host sync); a row holding a ``-inf``
    logit comes out ``+inf`` again."""
    k = min(OVERFLOW_ROWS, kl.numel())
    if rows_of is None or k == 0 or kl.dtype == torch.float64:  # float64 sums do not overflow at finite logits
        return kl
    suspect = finite & torch.isinf(out.sum_s)
    idx = torch.topk(torch.where(suspect, out.max.abs(), -1.0), k, sorted=False).indices  # every suspect, if <= k
    with single_threaded(kl.device, 0):  # small ops: on a busy CPU each parallel region would wait for every thread
        x = rows_of(idx).to(kl.dtype)  # (k, V) float32, a copy: the transform may work in place
        x = transform(x).to(kl.dtype) if transform is not None else x
        # mean_v s_v as sum_v (x_v / V - m / V): terms of one sign (<= 0), so no partial sum exceeds the total, which
        # exceeds float32's range only where KL(U || p) does; in place, no float64 copy
        mean_s = x.div_(V).sub_(out.max.index_select(0, idx).div(V).unsqueeze(-1)).sum(dim=-1)  # (k,)
    fixed = (log_z.index_select(0, idx) - mean_s - math.log(V)).clamp_(min=0.0)
    return kl.index_copy(0, idx, torch.where(suspect.index_select(0, idx), fixed, kl.index_select(0, idx)))


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
