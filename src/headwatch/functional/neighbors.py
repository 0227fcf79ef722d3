"""Exact nearest neighbours of vocabulary rows by cosine similarity, in bounded memory.

For a matrix ``W`` of shape ``(V, d_model)`` (head or embedding rows) and a set of valid
rows, the nearest-neighbour cosine of row ``r`` is

    ``nn_cos(r) = max_{j valid, j != r} cos(W_r, W_j)``,  ``cos(a, b) = <a, b> / (||a|| ||b||)``

(a zero row has cosine 0 with every row). Row ``r`` *collides* when ``nn_cos(r) >= tau``:
the model can barely tell token ``r`` from token ``nn(r)`` (as an input, or when
predicting). Computed exactly by chunked float32 matrix products with a running max, on
the device; the largest temporary is one ``(queries, keys)`` similarity chunk within
``max_chunk_bytes``, never a ``V x V`` matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.precision import cpu_workers, full_precision, map_rows_single_threaded
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES


class Neighbours(NamedTuple):
    """Nearest valid neighbour of each query row."""

    cosine: Tensor
    """``(Q,)`` float32, ``nn_cos`` of each query (-inf if it has no other valid row, NaN if the
    query row holds NaN/inf; such rows are never anyone's neighbour)."""
    index: Tensor
    """``(Q,)`` int64, row id of the nearest neighbour (-1 if none)."""


_CPU_BLOCK_BYTES = 16 * 2**20
"""On the CPU, the similarity block ``(q, k)`` is kept within 16 MiB (2048 x 2048), so its pass for the max stays in
cache: measured (bench/README.md, ``collision.py``) at d_model 256, 8192 queries x 32000 keys on 2 cores, 2048 x 2048
blocks 1.70-1.82 s against 2.62 s for the budget's 1489 x 8192. On accelerators big blocks amortise the launches."""


def chunk_sizes(
    num_queries: int, num_keys: int, d: int, max_chunk_bytes: int, block_bytes: int | None = None
) -> tuple[int, int]:
    """Query and key rows per chunk.

    Working set, float32: similarities ``(q, k)``, normalised keys ``(k, d)`` (counted twice:
    the product may pack a copy) and queries ``(q, d)``. Matrix products need both sides large to run at full speed (measured on
    the CPU: ``q = 1024, k = 8192`` at d_model 512 runs at the speed of one big product),
    so keys start at 8192 and halve until at least ``min(Q, 1024)`` queries fit.

    ``block_bytes`` (optional) caps the similarity block ``4 q k`` as well (a cache-sized block on the
    CPU, see :func:`similarity_chunks`): keys then take at most ``max(sqrt(block_bytes / 4), block_bytes /
    (4 Q))`` rows and queries what is left of the cap (at least 1).
    """

    def queries_that_fit(k: int) -> int:
        # keys counted twice: the matrix product may pack a copy of them
        return (max_chunk_bytes - 8 * k * d) // (4 * (k + d))

    k = max(1, min(num_keys, 8192))
    while k > 1 and queries_that_fit(k) < min(num_queries, 1024):
        k //= 2
    q = min(num_queries, max(1, queries_that_fit(k)))
    if block_bytes is not None:
        cells = max(1, block_bytes // 4)
        k = max(1, min(k, max(math.isqrt(cells), cells // max(1, num_queries))))
        q = max(1, min(q, cells // k))
    return q, k


def similarity_chunks(num_queries: int, num_keys: int, d: int, max_chunk_bytes: int, device: torch.device) -> tuple[int, int]:
    """:func:`chunk_sizes` for a search on ``device``: a cache-sized similarity block on the CPU (16 MiB)."""
    return chunk_sizes(num_queries, num_keys, d, max_chunk_bytes, _CPU_BLOCK_BYTES if device.type == "cpu" else None)


_GROUP = 64


def row_max(sims: Tensor) -> tuple[Tensor, Tensor]:
    """``sims.max(dim=1)`` of a ``(q, k)`` block: each row's largest value and the lowest index holding it.

    On the CPU, torch's max with indices reads a row element by element (measured 5.2 ms on a 2048 x 2048
    float32 block) while ``amax`` is vectorised (0.5 ms): the block is read once by ``amax`` over groups of
    64 columns, the winning group of each row found among the ``(q, k / 64)`` group maxima, and the index
    inside it among its 64 values (1.7 ms in all). The same values and indices (the first group holding the
    maximum, its first column holding it; NaN wins as in ``max``); columns beyond a multiple of 64 are
    compared separately. On other devices, ``max`` itself.
    """
    q, k = sims.shape
    main = k - k % _GROUP
    if sims.device.type != "cpu" or main == 0 or not sims.is_contiguous():
        return sims.max(dim=1)
    grouped = sims[:, :main].view(q, main // _GROUP, _GROUP) if main == k else sims[:, :main].reshape(q, main // _GROUP, _GROUP)
    value, group = grouped.amax(dim=2).max(dim=1)  # (q,): the row's maximum and the first group holding it
    inside = grouped[torch.arange(q, device=sims.device), group].max(dim=1).indices  # (q,) within that group
    index = group * _GROUP + inside
    if main < k:
        tail_value, tail_index = sims[:, main:].max(dim=1)
        later = (tail_value > value) | (torch.isnan(tail_value) & ~torch.isnan(value))
        value, index = torch.where(later, tail_value, value), torch.where(later, tail_index + main, index)
    return value, index


def _normalise_rows_(rows: Tensor) -> Tensor:
    """Divide each row of a float32 copy by its L2 norm in place; returns ``(n,)`` bool, the row was finite.

    Each row is first divided by its largest absolute entry, so the squares cannot
    overflow (or underflow) whatever the scale of finite entries. Zero rows stay zero;
    rows holding NaN/inf are reported non-finite (their content is then meaningless).
    """
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.maximum(rows.amax(dim=1, keepdim=True), -rows.amin(dim=1, keepdim=True))  # (n, 1) max |entry|
    rows.div_(scale.clamp(min=tiny))  # NaN propagates: NaN rows stay NaN, inf rows become NaN
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)  # (n, 1), in [0, sqrt(d)]
    rows.div_(norms.clamp(min=tiny))
    return torch.isfinite(norms.squeeze(1)) & torch.isfinite(scale.squeeze(1))


def unit_rows(rows: Tensor) -> Tensor:
    """A float32 copy of ``(n, d_model)`` ``rows``, each divided by its L2 norm, scale-safe: entries from 1e-38 to
    3e38 keep their direction (each row is first divided by its largest absolute entry, so the squares neither
    overflow nor underflow). Zero rows stay zero; rows holding NaN or inf become NaN."""
    out = rows.detach().to(torch.float32, copy=True)
    _normalise_rows_(out)
    return out


@torch.no_grad()
def nearest_neighbours(
    matrix: Tensor,
    queries: Tensor,
    valid: Tensor | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Neighbours:
    """Nearest neighbour by cosine, among the other valid rows, of each query row.

    Args:
        matrix: ``(V, d_model)`` rows (any floating dtype; math in float32).
        queries: ``(Q,)`` int64 row ids to find neighbours for.
        valid: ``(V,)`` bool, rows that may be neighbours (default: all). Queries need not
            be valid themselves; a query is never its own neighbour.
        max_chunk_bytes: bound on the working memory (default 64 MiB).

    Returns:
        :class:`Neighbours` with ``(Q,)`` tensors.

    Raises:
        HeadwatchError: ``matrix`` is not 2-D floating, ``queries``/``valid`` have the
            wrong shape or dtype, or a query id is outside ``[0, V)``.
    """
    if not isinstance(matrix, Tensor) or matrix.ndim != 2 or not matrix.is_floating_point():
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise HeadwatchError(f"expected a floating matrix of shape [vocab_size, d_model], got {shape}")
    V, d = matrix.shape
    if not isinstance(queries, Tensor) or queries.ndim != 1 or queries.is_floating_point():
        raise HeadwatchError("expected `queries` to be a 1-D integer tensor of row ids")
    if valid is None:
        valid = torch.ones(V, dtype=torch.bool, device=matrix.device)
    if valid.shape != (V,) or valid.dtype != torch.bool:
        raise HeadwatchError(f"expected `valid` of shape ({V},) and dtype bool, got {tuple(valid.shape)} {valid.dtype}")
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1:
        raise HeadwatchError(f"`max_chunk_bytes` must be a positive int, got {max_chunk_bytes!r}")
    device = matrix.device
    queries = queries.to(device).long()
    if queries.numel() and (int(queries.min()) < 0 or int(queries.max()) >= V):
        raise HeadwatchError(f"query row ids must be in [0, {V}), got values from {int(queries.min())} to {int(queries.max())}")
    Q = queries.numel()
    best = torch.full((Q,), float("-inf"), dtype=torch.float32, device=device)
    best_idx = torch.full((Q,), -1, dtype=torch.long, device=device)
    key_ids = valid.to(device).nonzero().flatten()  # (K,) sorted ascending
    K = key_ids.numel()
    if Q == 0 or K == 0:
        return Neighbours(best, best_idx)

    w = matrix.detach()
    qc, kc = similarity_chunks(Q, K, d, max_chunk_bytes, device)
    # position of each query among the keys (for excluding itself), -1 when not a key
    pos = torch.searchsorted(key_ids, queries)
    is_key = (pos < K) & (key_ids[pos.clamp(max=K - 1)] == queries)
    self_pos = torch.where(is_key, pos, torch.full_like(pos, -1))
    neg_inf = torch.tensor(float("-inf"), device=device)
    bad_queries = torch.zeros(Q, dtype=torch.bool, device=device)
    with full_precision(device):  # float32 products whatever autocast / TF32 settings say
        for k0 in range(0, K, kc):
            ids = key_ids[k0 : k0 + kc]
            keys = w.index_select(0, ids).float()  # (k, d), a copy
            bad_keys = ~_normalise_rows_(keys)  # a NaN/inf row is nobody's neighbour
            has_bad = bool(bad_keys.any())
            if has_bad:
                keys[bad_keys] = 0.0
            for q0 in range(0, Q, qc):
                q_rows = w.index_select(0, queries[q0 : q0 + qc]).float()  # (q, d), a copy
                finite_q = _normalise_rows_(q_rows)
                if k0 == 0:
                    bad_queries[q0 : q0 + qc] = ~finite_q
                sims = q_rows @ keys.T  # (q, k)
                if has_bad:
                    sims[:, bad_keys] = float("-inf")
                local = self_pos[q0 : q0 + qc] - k0  # the query itself, if it is in this key chunk
                inside = (local >= 0) & (local < ids.numel())
                rows = torch.arange(sims.shape[0], device=device)
                sims[rows, local.clamp(0, ids.numel() - 1)] = torch.where(
                    inside, neg_inf, sims[rows, local.clamp(0, ids.numel() - 1)]
                )
                value, arg = row_max(sims)
                better = value > best[q0 : q0 + qc]
                best[q0 : q0 + qc] = torch.where(better, value, best[q0 : q0 + qc])
                best_idx[q0 : q0 + qc] = torch.where(better, ids[arg], best_idx[q0 : q0 + qc])
    best = torch.where(bad_queries, torch.tensor(float("nan"), device=device), best)
    best_idx = torch.where(bad_queries, torch.full_like(best_idx, -1), best_idx)
    return Neighbours(best.clamp(max=1.0), best_idx)


@torch.no_grad()
def nearest_neighbours_masked(
    matrix: Tensor,
    queries: Tensor,
    valid: Tensor,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Neighbours:
    """:func:`nearest_neighbours` without reading a value on the host: every row is a key, the rows
    that are not ``valid`` masked out (``-inf``), no argument check.

    Same result as :func:`nearest_neighbours` (ties between exactly equal cosines aside: the lowest
    key id wins in both); the work is ``Q x V`` instead of ``Q x K`` products. For callers whose
    ids are in range by construction (a fixed-size sample, :func:`headwatch.functional.collision.sample_mask`).

    Args:
        matrix: ``(V, d_model)`` floating rows (math in float32).
        queries: ``(Q,)`` integer row ids in ``[0, V)`` (not checked).
        valid: ``(V,)`` bool, rows that may be neighbours.
        max_chunk_bytes: bound on the working memory.

    Returns:
        :class:`Neighbours` with ``(Q,)`` tensors, as :func:`nearest_neighbours`.
    """
    return nearest_neighbours_masked_sets(matrix, [queries], valid, max_chunk_bytes)[0]


def merge_maxima(values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """The largest of ``W`` running maxima of each query and its key id: ``(W, Q)`` values and ids (-1: none) ->
    ``(Q,)`` each. Among equal maxima the lowest id wins (that of one pass over the keys in order); an id of -1
    never wins (its value is ``-inf``)."""
    value, index = values[0], indices[0]
    for v, i in zip(values[1:], indices[1:]):
        take = (v > value) | ((v == value) & (i >= 0) & ((index < 0) | (i < index)))
        value, index = torch.where(take, v, value), torch.where(take, i, index)
    return value, index


@torch.no_grad()
def nearest_neighbours_masked_sets(
    matrix: Tensor,
    query_sets: Sequence[Tensor],
    valid: Tensor,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> list[Neighbours]:
    """:func:`nearest_neighbours_masked` of several query sets of one matrix, in one pass over its rows.

    Each key row is read and normalised once for all the sets (not once per set) and each query row once
    (not once per chunk of keys, when the unit queries fit a quarter of ``max_chunk_bytes``). On the CPU the
    chunks of keys are shared among torch's threads, each running single-threaded ops with its own running
    maximum, merged at the end (the lowest key id wins a tie, as in one pass): on a busy machine every
    multi-threaded op waits for a time slice (:func:`~headwatch.functional.precision.map_rows_single_threaded`),
    and a search is hundreds of ops. Every query's value is that of :func:`nearest_neighbours_masked` alone.

    Args:
        matrix: ``(V, d_model)`` floating rows (math in float32).
        query_sets: ``(Q_i,)`` integer row ids in ``[0, V)`` each (not checked).
        valid: ``(V,)`` bool, rows that may be neighbours.
        max_chunk_bytes: bound on the working memory (shared by the threads).

    Returns:
        one :class:`Neighbours` of ``(Q_i,)`` tensors per set, in order.
    """
    V, d = matrix.shape
    device = matrix.device
    sizes = [q.numel() for q in query_sets]
    queries = torch.cat([q.to(device).long().reshape(-1) for q in query_sets]) if query_sets else torch.zeros(0, dtype=torch.long, device=device)
    valid = valid.to(device)
    Q = queries.numel()
    if Q == 0 or V == 0:
        best = torch.full((Q,), float("-inf"), dtype=torch.float32, device=device)
        return [Neighbours(c, i) for c, i in zip(best.split(sizes), torch.full((Q,), -1, device=device).split(sizes))]
    w = matrix.detach()
    threads = cpu_workers(device, V)
    budget = max(1, max_chunk_bytes // threads)
    qc, kc = similarity_chunks(Q, V, d, budget, device)
    key_starts = list(range(0, V, kc))
    workers = cpu_workers(device, len(key_starts))
    best = torch.full((workers, Q), float("-inf"), dtype=torch.float32, device=device)  # each worker's running max
    best_idx = torch.full((workers, Q), -1, dtype=torch.long, device=device)
    finite = torch.empty(Q, dtype=torch.bool, device=device)
    query_starts = list(range(0, Q, qc))
    unit: dict[int, Tensor] = {}

    def unit_queries(q0: int, first: bool = True) -> Tensor:
        rows = w.index_select(0, queries[q0 : q0 + qc]).float()  # (q, d), a copy
        ok = _normalise_rows_(rows)
        if first:  # one writer: the first chunk of keys, when the unit queries are not kept
            finite[q0 : q0 + qc] = ok
        return rows

    def search(k0: int, worker: int) -> None:
        keys = w[k0 : k0 + kc].to(torch.float32, copy=True)  # (k, d), a copy (normalised in place)
        n = keys.shape[0]
        usable = _normalise_rows_(keys) & valid[k0 : k0 + n]  # a NaN/inf row is nobody's neighbour
        keys.masked_fill_(~usable.unsqueeze(1), 0.0)
        bias = torch.where(usable, 0.0, float("-inf")).unsqueeze(0)  # (1, k): -inf for the unusable keys
        for q0 in query_starts:
            qs = queries[q0 : q0 + qc]
            q_rows = unit[q0] if q0 in unit else unit_queries(q0, k0 == 0)
            sims = torch.addmm(bias, q_rows, keys.T)  # (q, k); the mask added in the product (no extra pass)
            local = qs - k0  # the query itself, if it is in this key chunk
            inside = (local >= 0) & (local < n)
            rows = torch.arange(sims.shape[0], device=device)
            at = local.clamp(0, n - 1)
            sims[rows, at] = torch.where(inside, float("-inf"), sims[rows, at])
            value, arg = row_max(sims)
            mine, mine_idx = best[worker, q0 : q0 + qc], best_idx[worker, q0 : q0 + qc]
            better = value > mine  # strictly: this worker's earlier (lower) keys win a tie
            mine.copy_(torch.where(better, value, mine))
            mine_idx.copy_(torch.where(better, arg + k0, mine_idx))

    with full_precision(device):  # float32 products whatever autocast / TF32 settings say
        if Q * d * 4 <= max_chunk_bytes // 4:  # the unit queries, once
            for q0 in query_starts:
                unit[q0] = unit_queries(q0)
        map_rows_single_threaded(search, key_starts, workers)
    value, index = merge_maxima(best, best_idx)
    value = torch.where(finite, value, float("nan")).clamp(max=1.0)
    index = torch.where(finite, index, -1)
    return [Neighbours(c, i) for c, i in zip(value.split(sizes), index.split(sizes))]


def pair_cosine(matrix: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``cos(W_a[i], W_b[i])`` for id pairs, ``(P,), (P,) -> (P,)`` float32 (0 for a zero row)."""
    if a.shape != b.shape or a.ndim != 1:
        raise HeadwatchError(f"expected two 1-D id tensors of the same length, got {tuple(a.shape)} and {tuple(b.shape)}")
    with full_precision(matrix.device):
        wa = unit_rows(matrix.index_select(0, a.to(matrix.device).long()))  # (P, d)
        wb = unit_rows(matrix.index_select(0, b.to(matrix.device).long()))
        return torch.linalg.vecdot(wa, wb).clamp(-1.0, 1.0)


def synonym_table(groups: list[list[int]], vocab_size: int) -> Tensor:
    """``(V, G)`` int64 table: row ``t`` lists the other members of ``t``'s synonym group(s), padded with -1.

    Raises:
        HeadwatchError: an id outside ``[0, vocab_size)``.
    """
    members: dict[int, set[int]] = {}
    for group in groups:
        ids = [int(i) for i in group]
        for i in ids:
            if not 0 <= i < vocab_size:
                raise HeadwatchError(f"synonym group {group} has id {i} outside [0, {vocab_size})")
        for i in ids:
            members.setdefault(i, set()).update(j for j in ids if j != i)
    width = max((len(v) for v in members.values()), default=0)
    table = torch.full((vocab_size, max(width, 1)), -1, dtype=torch.long)
    for i, others in members.items():
        if others:
            table[i, : len(others)] = torch.tensor(sorted(others))
    return table


def synonym_confusion(logits: Tensor, targets: Tensor, table: Tensor, eligible: Tensor) -> tuple[Tensor, Tensor]:
    """How often a synonym of the target scores at least as high as the target.

    At positions whose target ``t`` is ``eligible`` (e.g. rare and in a synonym group),
    the position is *confused* when ``max_{s in syn(t)} logits[s] >= logits[t]``.

    Args:
        logits: ``(..., V)``.
        targets: ``(...)`` integer ids aligned with ``logits``; ids outside ``[0, V)``
            (``ignore_index``) are not eligible.
        table: ``(V, G)`` from :func:`synonym_table`.
        eligible: ``(V,)`` bool.

    Returns:
        ``(eligible positions, confused positions)`` as float64 scalars (no host sync).
    """
    V = logits.shape[-1]
    if table.shape[0] != V or eligible.shape != (V,):
        raise HeadwatchError(f"expected a synonym table with {V} rows and eligible of shape ({V},)")
    flat = logits.detach().reshape(-1, V)
    t = targets.reshape(-1).long().to(flat.device)
    in_range = (t >= 0) & (t < V)
    tc = t.clamp(0, V - 1)
    syn = table.to(flat.device).index_select(0, tc)  # (N, G)
    has_syn = syn >= 0
    ok = in_range & eligible.to(flat.device).index_select(0, tc) & has_syn.any(dim=1)
    target_logit = flat.gather(1, tc.unsqueeze(1)).float()  # (N, 1)
    syn_logits = flat.gather(1, syn.clamp(min=0)).float()  # (N, G)
    syn_logits = torch.where(has_syn, syn_logits, float("-inf"))
    confused = ok & (syn_logits.amax(dim=1) >= target_logit.squeeze(1))
    return ok.sum(dtype=torch.float64), confused.sum(dtype=torch.float64)
