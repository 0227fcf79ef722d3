"""Drift-corrected collision (:mod:`headwatch.functional.drift_pairs`) of a row-sharded ``(V, d_model)`` matrix.

Under FSDP2 (DTensor ``Shard(0)``) each process holds rows ``[offset, offset + n)``. The
correction ``x' = (x - mu) - U U^T (x - mu)`` needs the mean ``mu`` and the top-``k`` principal
directions ``U`` of every pairable row; they are sums over rows, so each process sums its own
rows and the sums are all-reduced (:func:`headwatch.functional.drift.principal_directions_of`):

- pairable rows: each process flags its rows (valid, seen, finite, not zero); the flags are
  gathered into one ``(V,)`` mask (``16 V`` bytes received) and the excluded counts all-reduced;
- mean and directions: the ``(d,)`` row sum and the ``(d, d)`` float64 covariance (exact path),
  or the ``(d, k + 10)`` products and the trace of each subspace iteration (randomized path, the
  same seeded start on every process), all-reduced; rank 0's result is then shared so every
  process corrects its rows with bitwise the same ``mu`` and ``U``;
- mean resultant length of the rare rows: the ``(d,)`` sum of unit rows, all-reduced;
- corrected rows: a float32 copy of the LOCAL rows only (``n x d``);
- nearest neighbours (rare sample, corrected and raw; bucket samples):
  :func:`headwatch.distributed.sharded.nearest_neighbours_sharded` (queries gathered, local search,
  maxima combined);
- synonym pairs: their few rows gathered (``U x d``); partner ranks count each process's closer
  rows, and the counts are all-reduced.

No process holds a ``(V, d_model)`` tensor. A plain tensor takes the one-process functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.distributed.reduce import Reducer
from headwatch.distributed.sharded import Rows, gather_by_rows, gather_rows, local_rows, nearest_neighbours_sharded
from headwatch.functional.drift import (
    Pairable,
    apply_correction,
    pairable_rows,
    principal_directions_of,
    resultant_length,
    unit_row_sum,
)
from headwatch.functional.drift_pairs import (
    CorrectedCollision,
    check_queries,
    collision_from_neighbours,
    corrected_collision,
    ordered_pairs,
    partner_ranks,
    synonym_statistics,
)
from headwatch.functional.neighbors import nearest_neighbours, pair_cosine

__all__ = [
    "corrected_collision_rows",
    "nn_cosines_rows",
    "pair_cosine_rows",
    "pairable_rows_sharded",
    "principal_directions_sharded",
    "synonym_statistics_rows",
]


def pairable_rows_sharded(
    rows: Rows, valid: Tensor, seen: Tensor, include_unseen: bool, max_chunk_bytes: int, reducer: Reducer
) -> Pairable:
    """:func:`headwatch.functional.drift.pairable_rows` of a plain or row-sharded matrix.

    Args:
        rows: this process's rows (:func:`headwatch.distributed.sharded.local_rows`).
        valid, seen: ``(V,)`` bool, the same on every process.

    Returns:
        :class:`~headwatch.functional.drift.Pairable` of the whole matrix: ``(V,)`` mask (one
        ``(V, 2)`` float64 gather) and counts (one all-reduce of 4 int64).
    """
    local = pairable_rows(rows.local, rows.select(valid), rows.select(seen), include_unseen, max_chunk_bytes)
    if not rows.sharded:
        return local
    flags = local.mask.double()
    mask = gather_by_rows(torch.stack([flags, flags], dim=1), rows, reducer)[:, 0] != 0
    counts = reducer.sum(torch.stack([local.padded, local.unseen, local.zero, local.nonfinite]))
    return Pairable(mask, *counts.unbind())


def principal_directions_sharded(
    rows: Rows, basis: Tensor, k: int, max_chunk_bytes: int, reducer: Reducer,
    method: str = "auto", niter: int = 2, seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Mean and top-``k`` principal directions of the ``basis`` rows of a row-sharded matrix.

    The row sums go through ``reducer.sum`` (a collective); ``method`` ``"auto"`` decides on the
    global row count, so every process takes the same path. Rank 0's result is then shared
    (one all-reduce of ``d (k + 1) + k + 1`` float64), so every process holds bitwise the same.

    Args:
        rows: this process's rows; basis: ``(V,)`` bool rows defining mean and directions.

    Returns:
        As :func:`headwatch.functional.drift.top_principal_directions`: ``mean (d,)`` float32,
        ``directions (d, k)`` float32, ``variances (k,)`` float64, ``total_variance ()`` float64.

    Raises:
        HeadwatchError: fewer than 2 basis rows over every process.
    """
    ids = rows.select(basis.to(rows.local.device)).nonzero().flatten()
    mean, directions, variances, trace = principal_directions_of(
        rows.local, ids, k, method, niter, seed, max_chunk_bytes, total=reducer.sum
    )
    d = directions.shape[0]
    packed = torch.cat([mean.double(), directions.double().flatten(), variances, trace.reshape(1)])
    packed = reducer.sum(packed if reducer.rank == 0 else torch.zeros_like(packed))  # rank 0's values everywhere
    mean, directions = packed[:d].float(), packed[d : d + d * k].reshape(d, k).float()
    return mean, directions, packed[d + d * k : -1], packed[-1]


def corrected_collision_rows(
    matrix: Tensor | Rows, queries: Tensor, pairable: Tensor, tau: float, k: int, max_chunk_bytes: int, reducer: Reducer
) -> tuple[CorrectedCollision, Tensor | Rows]:
    """:func:`headwatch.functional.drift_pairs.corrected_collision` of a plain or row-sharded matrix.

    Args:
        matrix: ``(V, d)`` tensor, DTensor (``Shard(0)``) or :class:`~headwatch.distributed.sharded.Rows`.
        queries: ``(Q,)`` row ids; pairable: ``(V,)`` bool (:func:`pairable_rows_sharded`),
            also the basis of the mean and the directions; the same on every process.
        tau, k, max_chunk_bytes: as ``corrected_collision``.

    Returns:
        ``(CorrectedCollision, corrected rows)``: the corrected rows are the ``(V, d)`` float32
        tensor on the one-process path and a :class:`Rows` of the ``(n, d)`` local rows when
        sharded. Memory when sharded: ``n d`` float32 corrected rows plus the neighbour search's
        work copy (:func:`~headwatch.distributed.sharded.nearest_neighbours_sharded`).

    Raises:
        HeadwatchError: as ``corrected_collision``.
    """
    rows = local_rows(matrix)
    if not rows.sharded:
        res, corr = corrected_collision(rows.local, queries, pairable, tau, k, max_chunk_bytes=max_chunk_bytes)
        return res, corr.rows
    device = rows.local.device
    queries, pairable = check_queries(queries, tau, rows.num_rows, device), pairable.to(device)
    mean, directions, variances, trace = principal_directions_sharded(rows, pairable, k, max_chunk_bytes, reducer)
    fixed_rows = rows.with_local(apply_correction(rows.local, mean, directions, max_chunk_bytes))
    keep = pairable[queries]
    measured = queries[keep]
    fixed = nearest_neighbours_sharded(fixed_rows, measured, pairable, max_chunk_bytes, reducer)
    raw = nearest_neighbours_sharded(rows, measured, pairable, max_chunk_bytes, reducer)
    mine = measured[(measured >= rows.offset) & (measured < rows.offset + rows.local.shape[0])] - rows.offset
    units = reducer.sum(unit_row_sum(rows.local, mine, max_chunk_bytes))  # (d,) float64
    drift_mean_cos = resultant_length(units, measured.numel())
    return collision_from_neighbours(fixed, raw, tau, keep, measured, drift_mean_cos, variances.sum() / trace), fixed_rows


def nn_cosines_rows(
    matrix: Tensor | Rows, groups: dict[str, Tensor], pairable: Tensor, max_chunk_bytes: int, reducer: Reducer
) -> dict[str, Tensor]:
    """Nearest-neighbour cosine ``(Q_g,)`` float32 of each group's pairable rows among the pairable rows.

    Args:
        matrix: ``(V, d)`` plain or row-sharded (e.g. the corrected rows of :func:`corrected_collision_rows`).
        groups: name -> ``(Q_g,)`` row ids (e.g. a sample of each frequency bucket).
        pairable: ``(V,)`` bool, the same on every process.

    Returns:
        name -> the cosines of the group's rows that are pairable, in order (on the CPU). One
        process: one search per group; sharded: one search for every group together.
    """
    rows = local_rows(matrix)
    pairable = pairable.to(rows.local.device)
    kept = {name: ids.to(pairable.device)[pairable[ids.to(pairable.device)]] for name, ids in groups.items()}
    if not rows.sharded:
        return {name: nearest_neighbours(rows.local, ids, pairable, max_chunk_bytes).cosine.cpu() for name, ids in kept.items()}
    found = nearest_neighbours_sharded(rows, torch.cat([torch.zeros(0, dtype=torch.long, device=pairable.device), *kept.values()]),
                                       pairable, max_chunk_bytes, reducer)
    return dict(zip(kept, (c.cpu() for c in found.cosine.split([ids.numel() for ids in kept.values()]))))


def pair_cosine_rows(matrix: Tensor | Rows, a: Tensor, b: Tensor, reducer: Reducer) -> Tensor:
    """:func:`headwatch.functional.neighbors.pair_cosine` ``(P,)`` float32 of a plain or row-sharded matrix.

    Sharded: only the rows of ``a`` and ``b`` are gathered (``U x d``, ``U`` distinct ids).
    """
    rows = local_rows(matrix)
    if not rows.sharded:
        return pair_cosine(rows.local, a, b)
    a, b = a.to(rows.local.device).long(), b.to(rows.local.device).long()
    members = torch.unique(torch.cat([a, b]))  # sorted
    small = gather_rows(rows, members, reducer)  # (U, d)
    return pair_cosine(small, torch.searchsorted(members, a), torch.searchsorted(members, b))


def synonym_statistics_rows(
    matrix: Tensor | Rows, groups: Sequence[Sequence[int]], pairable: Tensor, tau: float,
    max_chunk_bytes: int, reducer: Reducer,
) -> dict[str, Tensor]:  # fmt: skip
    """:func:`headwatch.functional.drift_pairs.synonym_statistics` of a plain or row-sharded matrix.

    Sharded: the synonyms' rows are gathered (``U x d`` float32, ``U`` distinct members); each
    process counts its own rows closer to ``a`` than ``b`` is (:func:`partner_ranks` on its rows
    plus the gathered ones, which are not competitors), and the ``(P,)`` counts are all-reduced.
    """
    rows = local_rows(matrix)
    if not rows.sharded:
        return synonym_statistics(rows.local, groups, pairable, tau, max_chunk_bytes)
    device, n, offset = rows.local.device, rows.local.shape[0], rows.offset
    pairable = pairable.to(device)
    a, b = ordered_pairs(groups)
    a, b = a.to(device), b.to(device)
    if a.numel() and (int(torch.minimum(a, b).min()) < 0 or int(torch.maximum(a, b).max()) >= rows.num_rows):
        raise HeadwatchError(f"synonym group ids must be in [0, {rows.num_rows})")
    keep = pairable[a] & pairable[b]
    a, b = a[keep], b[keep]
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=device)
    if a.numel() == 0:
        return {"pair_rate": nan, "median_rank": nan, "pairs": nan.new_tensor(0.0), "skipped_pairs": (~keep).sum().double()}
    members = torch.unique(torch.cat([a, b]))  # sorted
    small = gather_rows(rows, members, reducer).float()  # (U, d)
    work = torch.cat([rows.local.float(), small])  # this process's rows, then the members (not competitors)

    def at(ids: Tensor) -> Tensor:  # position in `work`: the local row when held here (excluded as itself)
        held = (ids >= offset) & (ids < offset + n)
        return torch.where(held, ids - offset, n + torch.searchsorted(members, ids))

    keys = torch.cat([rows.select(pairable), torch.zeros(members.numel(), dtype=torch.bool, device=device)])
    above = reducer.sum(partner_ranks(work, at(a), at(b), keys, max_chunk_bytes) - 1)  # (P,) closer rows
    ia, ib = torch.searchsorted(members, a), torch.searchsorted(members, b)
    return {
        "pair_rate": (pair_cosine(small, ia, ib) >= tau).double().mean(),
        "median_rank": (above + 1).double().median(),
        "pairs": torch.tensor(float(a.numel()), dtype=torch.float64, device=device),
        "skipped_pairs": (~keep).sum().double(),
    }
