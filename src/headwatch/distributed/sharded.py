"""Row-sharded ``(V, d_model)`` matrices (FSDP2 ``fully_shard``, DTensor ``Shard(0)``): local rows, exact combination.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``, Lightning's ``ModelParallelStrategy``) a
weight and, between backward and optimizer step, its ``.grad`` are DTensors whose rows are split
over the processes (``Shard(0)``: rank ``r`` holds rows ``[offset_r, offset_r + n_r)``). Every
per-row statistic is computed on each process's own rows and combined exactly:

- per-row values that a quantile needs (row norms, non-zero flags: ``4 + 4`` bytes per row)
  are gathered into ``(V,)`` vectors; sums and counts are all-reduced;
- nearest neighbours: the (small) query rows are gathered, each process searches its own rows,
  and the per-process maxima are combined (largest cosine; on a tie, the lowest row id, as the
  one-process search keeps the first maximum);
- the lookup flow of a tied matrix: each process compacts its ``dL/d(embedding output)`` onto
  the token ids of its batch (``(U, d_model)``, ``U <= tokens``), the compact rows are gathered,
  and each process keeps the ones in its row range.

No process ever holds the full ``(V, d_model)`` matrix here. A plain (not sharded) tensor, a
replicated DTensor, or one process, take the one-process path unchanged. Layouts other than
``Shard(0)`` / ``Replicate`` (tensor parallelism's ``Shard(1)``, ``Partial``) raise
:class:`~headwatch.errors.HeadwatchError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from headwatch.distributed.reduce import Reducer, stacked
from headwatch.errors import HeadwatchError
from headwatch.functional import collision as fcollision
from headwatch.functional.adapters import zero_rows
from headwatch.functional.neighbors import Neighbours, nearest_neighbours
from headwatch.functional.rows import (
    dense_rows,
    row_cosine,
    row_density,
    row_norms,
    row_norms_and_nonzero,
    summarize_groups,
)
from headwatch.functional.tied import tied_flow_statistics as _tied_flow_statistics
from headwatch.names import STATS

__all__ = [
    "Rows",
    "ShardedLookup",
    "collision_statistics",
    "gather_rows",
    "is_sharded",
    "local_rows",
    "nearest_neighbours_sharded",
    "row_norms_full",
    "row_statistics",
    "synonym_pair_rate",
    "tied_flow_statistics",
    "tied_flow_sums",
    "tied_flow_values",
    "zero_rows_full",
]


class Rows(NamedTuple):
    """This process's rows of a ``(V, d_model)`` matrix."""

    local: Tensor
    """``(n, d_model)`` plain tensor: global rows ``[offset, offset + n)``."""
    offset: int
    num_rows: int
    """``V``, rows of the whole matrix."""
    sharded: bool
    """True when the rows are split over processes (combine through the reducer)."""

    def with_local(self, local: Tensor) -> Rows:
        """The same rows, other values (e.g. the update ``W_before - W_after`` of these rows)."""
        return Rows(local, self.offset, self.num_rows, self.sharded)

    def select(self, values: Tensor) -> Tensor:
        """This process's part ``values[offset : offset + n]`` of a ``(V, ...)`` tensor."""
        return values[self.offset : self.offset + self.local.shape[0]]


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def fully_sharded(model: Any) -> bool:
    """Whether ``model`` or a module inside it is managed by FSDP2 (``fully_shard``).

    Such a module's Parameters are unsharded (plain tensors) only during its forward and backward;
    ``reshard_after_forward`` frees their memory after the forward, so a tensor read from
    ``module.weight`` during the forward must be copied to be used after it.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    modules = getattr(model, "modules", None)
    return callable(modules) and any(isinstance(m, FSDPModule) for m in modules())


def is_sharded(matrix: Tensor | Rows) -> bool:
    """Whether ``matrix`` is a DTensor whose rows are split over processes."""
    if isinstance(matrix, Rows):
        return matrix.sharded
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(matrix, dtensor) and any(p.is_shard() for p in matrix.placements)


def local_rows(matrix: Tensor | Rows) -> Rows:
    """This process's rows of ``matrix`` (a plain tensor: all of it, ``offset`` 0; no copy).

    Replicated mesh dimensions (HSDP) hold copies: only the copy at coordinate 0 contributes
    rows, the others an empty ``(0, d_model)`` block, so every row is counted once.

    Raises:
        HeadwatchError: a DTensor split other than by rows (``Shard(1)``, ``Partial``).
    """
    if isinstance(matrix, Rows):
        return matrix
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(matrix, dtensor):
        return Rows(matrix.detach(), 0, int(matrix.shape[0]), False)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements, mesh = matrix.placements, matrix.device_mesh
    bad = [p for p in placements if not (p.is_replicate() or (p.is_shard() and p.dim == 0))]  # type: ignore[attr-defined]
    if bad:
        raise HeadwatchError(
            f"a (vocab_size, d_model) matrix sharded as {tuple(placements)} cannot be measured row by row: "
            "expected Shard(0) (FSDP2 fully_shard) or Replicate placements"
        )
    local = matrix.detach().to_local()
    if not any(p.is_shard() for p in placements):
        return Rows(local, 0, int(matrix.shape[0]), False)
    _, offset = compute_local_shape_and_global_offset(matrix.shape, mesh, placements)
    if any(p.is_replicate() and mesh.get_local_rank(i) != 0 for i, p in enumerate(placements)):
        local = local[:0]
    return Rows(local, int(offset[0]), int(matrix.shape[0]), True)


def gather_by_rows(values: Tensor, rows: Rows, reducer: Reducer) -> Tensor:
    """``(n, k)`` float64 values of this process's rows -> ``(V, k)`` on every process (one gather).

    Raises:
        HeadwatchError: the processes' rows do not cover the ``V`` rows exactly once.
    """
    header = torch.tensor([[rows.offset, values.shape[0]] + [0] * (values.shape[1] - 2)], dtype=torch.float64)
    parts = reducer.gather(torch.cat([header.to(values.device), values.double()]))
    out = torch.zeros(rows.num_rows, values.shape[1], dtype=torch.float64, device=values.device)
    covered = 0
    for part in parts:
        offset, n = int(part[0, 0]), int(part[0, 1])
        out[offset : offset + n] = part[1 : 1 + n].to(out.device)
        covered += n
    if covered != rows.num_rows:
        raise HeadwatchError(
            f"the processes hold {covered} rows of a matrix of {rows.num_rows} rows: its rows are not split "
            "once over the reducer's processes (a mesh smaller than the process group?)"
        )
    return out


def _norms_and_nonzero(rows: Rows, reducer: Reducer, subtract: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(V,)`` row norms (float32) and non-zero flags (bool) of every row, gathered when sharded."""
    norms, nonzero = row_norms_and_nonzero(rows.local, subtract)  # rows of entries below ~1e-23: not 0
    if not rows.sharded:
        return norms, nonzero
    both = gather_by_rows(torch.stack([norms.double(), nonzero.double()], dim=1), rows, reducer)
    return both[:, 0].to(norms.dtype), both[:, 1] != 0


def row_norms_full(matrix: Tensor | Rows, reducer: Reducer) -> Tensor:
    """``(V,)`` L2 row norms of a plain or row-sharded matrix (:func:`headwatch.functional.rows.row_norms`)."""
    rows = local_rows(matrix)
    norms = row_norms(dense_rows(rows.local))
    if not rows.sharded:
        return norms
    return gather_by_rows(torch.stack([norms.double(), norms.double()], dim=1), rows, reducer)[:, 0].to(norms.dtype)


def zero_rows_full(matrix: Tensor | Rows, reducer: Reducer) -> Tensor:
    """``(V,)`` bool all-zero rows (:func:`headwatch.functional.adapters.zero_rows`) of a plain or row-sharded matrix."""
    rows = local_rows(matrix)
    zero = zero_rows(rows.local)
    if not rows.sharded:
        return zero
    return gather_by_rows(torch.stack([zero.double(), zero.double()], dim=1), rows, reducer)[:, 0] != 0


def row_statistics(
    matrix: Tensor | Rows, groups: dict[str, Tensor], reducer: Reducer, subtract: Tensor | None = None
) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`headwatch.functional.tied.row_group_statistics` of a plain or row-sharded matrix.

    Args:
        matrix: ``(V, d_model)`` tensor, DTensor (``Shard(0)``) or :class:`Rows`.
        groups: name -> ``(V,)`` bool rows of the group (the same on every process).
        reducer: combines the processes' rows (a collective when the matrix is sharded).
        subtract: optional plain tensor of this process's rows' shape, subtracted from them in place first
            (:func:`headwatch.functional.rows.row_norms_and_nonzero`: an update made and measured in one pass).

    Returns:
        ``(statistics, (V,) row norms)``; the statistics are those of the whole matrix.
    """
    norms, nonzero = _norms_and_nonzero(local_rows(matrix), reducer, subtract)
    out: dict[str, Tensor] = {}
    for key, summary in summarize_groups(norms, groups).items():
        out[f"{key}_row_density"] = row_density(nonzero, groups[key].to(nonzero.device))
        out.update({f"{key}_row_norm_{stat}": getattr(summary, stat) for stat in STATS})
    return out, norms


def tied_flow_statistics(
    lookup: Tensor | Rows, scoring: Tensor | Rows, valid: Tensor, reducer: Reducer, lookup_norms: Tensor, scoring_norms: Tensor
) -> dict[str, Tensor]:
    """:func:`headwatch.functional.tied.tied_flow_statistics` on row-sharded flows (sums all-reduced).

    ``lookup_norms`` / ``scoring_norms``: ``(V,)`` norms of every row (:func:`row_statistics`).
    """
    a, b = local_rows(lookup), local_rows(scoring)
    if not a.sharded:
        return _tied_flow_statistics(a.local, b.local, valid, lookup_norms, scoring_norms)
    return tied_flow_values(reducer.sum(tied_flow_sums(a, b, valid, lookup_norms, scoring_norms)))


def tied_flow_sums(lookup: Tensor | Rows, scoring: Tensor | Rows, valid: Tensor, lookup_norms: Tensor, scoring_norms: Tensor) -> Tensor:
    """This process's rows' part of :func:`tied_flow_statistics`: float64 ``(3,)`` (rows where both flows are
    non-zero, their cosines' sum, the rows with a negative cosine), to be summed over processes (no collective)."""
    a, b = local_rows(lookup), local_rows(scoring)
    cosine, both = row_cosine(a.local, b.local, a.select(lookup_norms), b.select(scoring_norms))
    rows = both & a.select(valid.to(cosine.device))
    return torch.stack([rows.sum(dtype=torch.float64), (cosine * rows).sum(dtype=torch.float64), ((cosine < 0) & rows).sum(dtype=torch.float64)])


def tied_flow_values(sums: Tensor) -> dict[str, Tensor]:
    """``tied_flow_rows``, ``tied_flow_cosine_mean``, ``tied_flow_conflict_fraction`` from :func:`tied_flow_sums`
    summed over processes (NaN without rows)."""
    n = sums[0]
    return {
        "tied_flow_rows": n,
        "tied_flow_cosine_mean": torch.where(n > 0, sums[1] / n.clamp(min=1), torch.nan),
        "tied_flow_conflict_fraction": torch.where(n > 0, sums[2] / n.clamp(min=1), torch.nan),
    }


class ShardedLookup:
    """The lookup flow ``E_i = sum_{n : ids_n = i} g_n`` of a row-sharded tied matrix, kept compact.

    :meth:`add` (every micro-batch's backward) keeps ``(unique ids (U,), summed rows (U, d_model))``
    float32; :meth:`rows` gathers them from every process and keeps this process's rows.
    """

    def __init__(self) -> None:
        self.ids: list[Tensor] = []
        self.sums: list[Tensor] = []

    def add(self, ids: Tensor, grad_output: Tensor, padding_idx: int | None = None) -> None:
        """Add one micro-batch: ``ids (...)``, ``grad_output (..., d_model)`` (as ``lookup_gradient``)."""
        if grad_output.shape[:-1] != ids.shape:
            raise HeadwatchError(f"expected grad_output of shape {tuple(ids.shape)} + (d_model,), got {tuple(grad_output.shape)}")
        flat = ids.reshape(-1).long().to(grad_output.device)
        g = grad_output.reshape(flat.numel(), -1).float()
        if padding_idx is not None:
            g = g * (flat != padding_idx).unsqueeze(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        self.ids.append(unique)
        self.sums.append(torch.zeros(unique.numel(), g.shape[1], dtype=torch.float32, device=g.device).index_add_(0, inverse, g))

    def rows(self, like: Rows, reducer: Reducer) -> Rows:
        """This process's rows of the lookup flow, averaged over processes (as FSDP averages ``.grad``).

        One round per process ``k``: every process sends its compact rows in ``k``'s row range
        (received: ``W x U_k x d_model`` float32, ``U_k`` distinct ids in that range), so no
        process ever holds every process's rows at once.
        """
        device, d = like.local.device, like.local.shape[1]
        ids = torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.long, device=device)
        sums = torch.cat(self.sums) if self.sums else torch.zeros(0, d, dtype=torch.float32, device=device)
        ids, inverse = torch.unique(ids, return_inverse=True)  # sorted: a row range is a slice
        sums = torch.zeros(ids.numel(), d, dtype=torch.float32, device=device).index_add_(0, inverse, sums)
        n, offset = like.local.shape[0], like.offset
        local = torch.zeros(n, d, dtype=torch.float32, device=device)
        ranges = [tuple(int(v) for v in r) for r in stacked(reducer, torch.tensor([offset, n], device=device)).tolist()]
        for start, count in ranges:  # the same order on every process
            lo, hi = torch.searchsorted(ids, torch.tensor([start, start + count], device=device)).tolist()
            got_ids, got_sums = reducer.gather(ids[lo:hi]), reducer.gather(sums[lo:hi])
            if (start, count) == (offset, n) and n:
                for part_ids, part_sums in zip(got_ids, got_sums):
                    local.index_add_(0, part_ids.to(device) - offset, part_sums.to(device))
        return like.with_local(local.div_(reducer.world_size))


def gather_rows(matrix: Tensor | Rows, ids: Tensor, reducer: Reducer) -> Tensor:
    """``(len(ids), d_model)`` rows ``ids`` of a row-sharded matrix on every process, in its dtype."""
    rows = local_rows(matrix)
    ids = ids.to(rows.local.device).long()
    if not rows.sharded:
        return rows.local.index_select(0, ids)
    n = rows.local.shape[0]
    mine = ((ids >= rows.offset) & (ids < rows.offset + n)).nonzero().flatten()
    held = rows.local.index_select(0, ids[mine] - rows.offset).float()  # gloo has no bf16
    out = torch.zeros(ids.numel(), rows.local.shape[1], dtype=torch.float32, device=rows.local.device)
    # one gather: each held row after its position in `ids` (float32 values and positions are exact in float64)
    for part in reducer.gather(torch.cat([mine.double().unsqueeze(1), held.double()], dim=1)):
        part = part.to(out.device)
        out[part[:, 0].long()] = part[:, 1:].float()
    return out.to(rows.local.dtype)


def nearest_neighbours_sharded(
    matrix: Tensor | Rows, queries: Tensor, valid: Tensor, max_chunk_bytes: int, reducer: Reducer
) -> Neighbours:
    """:func:`headwatch.functional.neighbors.nearest_neighbours` of a row-sharded matrix, exact.

    The query rows are gathered (``Q x d_model``); each process searches its own valid rows
    (a work copy of them plus the queries it does not hold) and the maxima are combined.
    """
    rows = local_rows(matrix)
    if not rows.sharded:
        return nearest_neighbours(rows.local, queries, valid, max_chunk_bytes)
    device, n, offset = rows.local.device, rows.local.shape[0], rows.offset
    queries = queries.to(device).long()
    query_rows = gather_rows(rows, queries, reducer)
    mine = (queries >= offset) & (queries < offset + n)
    foreign = (~mine).nonzero().flatten()
    work = torch.cat([rows.local, query_rows.index_select(0, foreign)])  # queries held elsewhere are not keys
    position = torch.full_like(queries, -1)
    position[foreign] = n + torch.arange(foreign.numel(), device=device)
    index = torch.where(mine, queries - offset, position)
    keys = torch.cat([rows.select(valid.to(device)), torch.zeros(foreign.numel(), dtype=torch.bool, device=device)])
    found = nearest_neighbours(work, index, keys, max_chunk_bytes)
    found_ids = torch.where(found.index >= 0, found.index + offset, found.index)
    # one gather: the float32 cosines and the row ids are exact in float64
    both = stacked(reducer, torch.stack([found.cosine.double(), found_ids.double()]))  # (W, 2, Q)
    cosines, ids = both[:, 0].to(found.cosine.dtype), both[:, 1].long()  # (W, Q)
    best = cosines.amax(dim=0)  # NaN (a non-finite query) stays NaN
    none = rows.num_rows
    pick = torch.where((cosines == best) & (ids >= 0), ids, torch.full_like(ids, none)).amin(dim=0)
    return Neighbours(best, torch.where(pick == none, torch.full_like(pick, -1), pick))


def collision_statistics(
    weight: Tensor, rare: Tensor, bucket_rows: dict[str, Tensor], valid: Tensor, tau: float, max_chunk_bytes: int,
    reducer: Reducer,
) -> tuple[dict[str, Tensor], Neighbours, dict[str, Tensor]]:
    """:func:`headwatch.functional.collision.collision_statistics` of a plain or row-sharded matrix.

    Sharded: one search for the rare rows and every group's rows together.
    """
    if not is_sharded(weight):
        return fcollision.collision_statistics(weight, rare, bucket_rows, valid, tau, max_chunk_bytes)
    names = ["rare"] + [g for g in bucket_rows if g != "rare"]
    parts = [rare if g == "rare" else bucket_rows[g] for g in names]
    found = nearest_neighbours_sharded(weight, torch.cat([p.reshape(-1).long().cpu() for p in parts]), valid, max_chunk_bytes, reducer)
    split = dict(zip(names, zip(found.cosine.split([p.numel() for p in parts]), found.index.split([p.numel() for p in parts]))))
    nn_rare = Neighbours(*split["rare"])
    cosines = {group: split[group][0] for group in bucket_rows}
    on_cpu = {group: cos.cpu() for group, cos in cosines.items()}
    return fcollision.collision_scalars(nn_rare.cosine, cosines, tau), nn_rare, on_cpu


def synonym_pair_rate(
    weight: Tensor, groups: Sequence[Sequence[int]], rare: Tensor, tau: float, reducer: Reducer
) -> tuple[Tensor, int]:
    """:func:`headwatch.functional.collision.synonym_pair_rate` of a plain or row-sharded matrix (group rows gathered)."""
    if not is_sharded(weight):
        return fcollision.synonym_pair_rate(weight, groups, rare, tau)
    members = sorted({int(i) for g in groups for i in g})
    position = {token: j for j, token in enumerate(members)}
    small = gather_rows(weight, torch.tensor(members, dtype=torch.long), reducer)  # (U, d_model)
    remapped = [[position[int(i)] for i in g] for g in groups]
    return fcollision.synonym_pair_rate(small, remapped, rare.cpu()[torch.tensor(members, dtype=torch.long)], tau)
