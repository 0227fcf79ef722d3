"""Collision rates, per-bucket neighbour cosines and synonym partner ranks on drift-corrected rows.

The correction and the drift statistics are in :mod:`headwatch.functional.drift` (definitions,
sources). This module turns them into the numbers a monitor logs:

- headline: rare rows whose nearest other pairable row has *corrected* cosine ``>= tau``;
- drift: the same rate on raw rows (the older definition: it measures common drift, not
  collision), the mean cosine of the rare rows to their mean direction, and the variance
  share of the removed directions;
- the mean corrected nearest-neighbour cosine of the rows of each frequency bucket;
- supervised synonyms: the pair rate under the corrected cosine, and the rank of each
  synonym's partner among its nearest rows (threshold-free: 1 means nearest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.drift import (
    DEFAULT_TAU,
    DriftCorrection,
    apply_correction,
    check_rows,
    mean_resultant_length,
    principal_directions_masked,
    remove_top_directions,
    unit_row_sum_masked,
)
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.precision import full_precision
from headwatch.functional.neighbors import (
    Neighbours, nearest_neighbours, nearest_neighbours_masked, nearest_neighbours_masked_sets, pair_cosine, similarity_chunks,
    unit_rows,
)  # fmt: skip


class CorrectedCollision(NamedTuple):
    """Collision of the query rows (normally the rare tokens) before and after the drift correction."""

    rate: Tensor
    """float64 scalar, headline: measured queries whose corrected ``nn_cos >= tau`` / measured queries
    (NaN when none was measured)."""
    raw_rate: Tensor
    """float64 scalar, the same on raw rows: a drift statistic, not a collision rate."""
    drift_mean_cos: Tensor
    """float64 scalar, mean cosine of the measured query rows to their mean direction (raw rows)."""
    removed_variance: Tensor
    """float64 scalar, share of the basis rows' variance held by the removed directions."""
    queries: Tensor
    """``(Q,)`` int64 measured queries (the pairable ones among those given)."""
    cosine: Tensor
    """``(Q,)`` float32 corrected nearest-neighbour cosine."""
    neighbour: Tensor
    """``(Q,)`` int64 corrected nearest neighbour (-1 if none)."""
    raw_cosine: Tensor
    """``(Q,)`` float32 raw nearest-neighbour cosine."""
    raw_neighbour: Tensor
    """``(Q,)`` int64 raw nearest neighbour."""
    skipped_queries: Tensor
    """int64 scalar, queries given that were not pairable (not measured)."""


def rate_above(cos: Tensor, tau: float) -> Tensor:
    if cos.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=cos.device)
    return (cos >= tau).double().mean()


def check_queries(queries: Tensor, tau: float, V: int, device: torch.device) -> Tensor:
    """``(Q,)`` int64 ``queries`` on ``device``, checked: 1-D integer ids in ``[0, V)``, ``tau`` in ``[-1, 1]``.

    Raises:
        HeadwatchError: ``tau`` is not a cosine, or ``queries`` not 1-D integer ids in ``[0, V)``.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not -1.0 <= tau <= 1.0:
        raise HeadwatchError(f"`tau` must be a cosine in [-1, 1], got {tau!r}")
    if not isinstance(queries, Tensor) or queries.ndim != 1 or queries.is_floating_point():
        raise HeadwatchError("expected `queries` to be a 1-D integer tensor of row ids")
    queries = queries.to(device).long()
    if queries.numel() and (int(queries.min()) < 0 or int(queries.max()) >= V):
        raise HeadwatchError(f"query row ids must be in [0, {V}), got values from {int(queries.min())} to {int(queries.max())}")
    return queries


@torch.no_grad()
def corrected_collision(
    rows: Tensor,
    queries: Tensor,
    pairable: Tensor,
    tau: float = DEFAULT_TAU,
    k: int | None = None,
    basis: Tensor | None = None,
    correction: DriftCorrection | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[CorrectedCollision, DriftCorrection]:
    """Collision of ``queries`` after removing the mean and the top-``k`` principal directions.

    Args:
        rows: ``(V, d)`` floating (head or embedding rows); not modified.
        queries: ``(Q,)`` integer row ids to measure (e.g. the rare tokens, or a sample).
            Queries that are not ``pairable`` are skipped and counted.
        pairable: ``(V,)`` bool, rows allowed on either side of a pair
            (:func:`headwatch.functional.drift.pairable_rows`).
        tau: collision threshold on the cosine, in ``[-1, 1]`` (default 0.9).
        k: directions removed; default ``max(1, round(d_model / 100))``.
        basis: ``(V,)`` bool, rows defining the mean and directions (default: ``pairable``).
        correction: a :class:`DriftCorrection` already computed for these rows (reused).
        max_chunk_bytes: working-memory bound of each chunk.

    Returns:
        ``(CorrectedCollision, DriftCorrection)``; the correction's ``(V, d)`` rows can be reused
        for :func:`nn_cosine_by_bucket` and :func:`partner_ranks`.

    Raises:
        HeadwatchError: bad shapes or dtypes, ``tau`` outside ``[-1, 1]``, or as
        :func:`headwatch.functional.drift.remove_top_directions`.
    """
    pairable = check_rows(rows, pairable)
    queries = check_queries(queries, tau, rows.shape[0], rows.device)
    if correction is None:
        correction = remove_top_directions(rows, pairable if basis is None else basis, k, max_chunk_bytes=max_chunk_bytes)
    keep = pairable[queries]
    measured = queries[keep]
    fixed = nearest_neighbours(correction.rows, measured, pairable, max_chunk_bytes)
    raw = nearest_neighbours(rows, measured, pairable, max_chunk_bytes)
    drift_mean_cos = mean_resultant_length(rows, measured, max_chunk_bytes)
    return collision_from_neighbours(fixed, raw, tau, keep, measured, drift_mean_cos, correction.removed_variance), correction


class FixedCollision(NamedTuple):
    """:class:`CorrectedCollision` of a fixed-size query set with a validity mask (nothing selected by value)."""

    rate: Tensor
    """float64 scalar, measured queries whose corrected ``nn_cos >= tau`` / measured queries (NaN when none)."""
    raw_rate: Tensor
    """float64 scalar, the same on raw rows (a drift statistic)."""
    drift_mean_cos: Tensor
    """float64 scalar, mean resultant length of the measured query rows (raw rows; NaN when none)."""
    removed_variance: Tensor
    """float64 scalar, share of the basis rows' variance held by the removed directions."""
    measured: Tensor
    """``(S,)`` bool, the queries measured: given and pairable."""
    cosine: Tensor
    """``(S,)`` float32 corrected nearest-neighbour cosine (meaningful where ``measured``)."""
    neighbour: Tensor
    """``(S,)`` int64 corrected nearest neighbour (-1 if none)."""
    raw_cosine: Tensor
    """``(S,)`` float32 raw nearest-neighbour cosine."""
    basis_rows: Tensor
    """float64 scalar, rows that defined the mean and the directions (at least 2 are needed)."""


def rate_above_masked(cos: Tensor, keep: Tensor, tau: float) -> Tensor:
    """``|{i : keep_i, cos_i >= tau}| / |{i : keep_i}|`` float64 (NaN when none is kept), on the device."""
    n = keep.sum(dtype=torch.float64)
    return torch.where(n > 0, ((cos >= tau) & keep).sum(dtype=torch.float64) / n, float("nan"))


@torch.no_grad()
def corrected_collision_masked(
    rows: Tensor,
    queries: Tensor,
    given: Tensor,
    pairable: Tensor,
    tau: float = DEFAULT_TAU,
    k: int = 1,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[FixedCollision, Tensor]:
    """:func:`corrected_collision` of a fixed-size query set, without reading a value on the host.

    The basis is ``pairable``; the measured queries are those ``given`` and pairable (a mask, not a
    selection); the mean and directions come from :func:`~headwatch.functional.drift.principal_directions_masked`,
    the neighbours from :func:`~headwatch.functional.neighbors.nearest_neighbours_masked`. Same
    definitions and values as :func:`corrected_collision` on ``queries[given]``.

    Args:
        rows: ``(V, d)`` floating; queries: ``(S,)`` row ids in ``[0, V)`` (not checked);
        given: ``(S,)`` bool, the real queries among ``queries`` (the rest is padding);
        pairable: ``(V,)`` bool; tau: cosine threshold; k: directions removed, in ``[1, d]``.

    Returns:
        ``(FixedCollision, corrected (V, d) float32 rows)``. Fewer than 2 pairable rows do not raise:
        ``basis_rows`` says so, for the caller to check on the host.
    """
    fixed, corrected, _ = corrected_collision_groups(rows, queries, given, pairable, tau, k, max_chunk_bytes)
    return fixed, corrected


@torch.no_grad()
def corrected_collision_groups(
    rows: Tensor,
    queries: Tensor,
    given: Tensor,
    pairable: Tensor,
    tau: float = DEFAULT_TAU,
    k: int = 1,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    groups: Sequence[Tensor] = (),
) -> tuple[FixedCollision, Tensor, list[Neighbours]]:
    """:func:`corrected_collision_masked`, and the nearest neighbours among the corrected pairable rows of each of
    ``groups`` (``(G_i,)`` row ids in ``[0, V)``, not checked) found in the same pass over the corrected rows
    (:func:`~headwatch.functional.neighbors.nearest_neighbours_masked_sets`: the values of one search per set).

    Returns:
        ``(FixedCollision, corrected (V, d) float32 rows, one Neighbours per group)``.
    """
    device = rows.device
    queries, given, pairable = queries.to(device).long(), given.to(device), pairable.to(device)
    mean, directions, variances, trace, n = principal_directions_masked(rows, pairable, k, max_chunk_bytes=max_chunk_bytes)
    corrected = apply_correction(rows, mean, directions, max_chunk_bytes)
    measured = given & pairable[queries]
    fixed, *found = nearest_neighbours_masked_sets(corrected, [queries, *groups], pairable, max_chunk_bytes)
    raw = nearest_neighbours_masked(rows, queries, pairable, max_chunk_bytes)
    m = measured.sum(dtype=torch.float64)
    unit = torch.linalg.vector_norm(unit_row_sum_masked(rows, queries, measured, max_chunk_bytes))
    result = FixedCollision(
        rate=rate_above_masked(fixed.cosine, measured, tau),
        raw_rate=rate_above_masked(raw.cosine, measured, tau),
        drift_mean_cos=torch.where(m > 0, unit / m, float("nan")),
        removed_variance=variances.sum() / trace,
        measured=measured,
        cosine=fixed.cosine,
        neighbour=fixed.index,
        raw_cosine=raw.cosine,
        basis_rows=n,
    )
    return result, corrected, found


def collision_from_neighbours(
    fixed: Neighbours, raw: Neighbours, tau: float, keep: Tensor, measured: Tensor, drift_mean_cos: Tensor,
    removed_variance: Tensor,
) -> CorrectedCollision:
    """:class:`CorrectedCollision` from the neighbours of the ``measured`` queries on corrected and raw rows.

    Args:
        fixed: :class:`~headwatch.functional.neighbors.Neighbours` of ``measured`` among the
            corrected pairable rows, ``(Q,)``.
        raw: the same among the raw pairable rows, ``(Q,)``.
        keep: ``(Q_given,)`` bool, which of the queries given were pairable (``measured`` are those).
        drift_mean_cos: float64 scalar, as the field of the same name.
        removed_variance: float64 scalar, as the field of the same name.

    One process or row-sharded (:func:`headwatch.distributed.sharded_drift.corrected_collision_rows`):
    the rates and fields are defined here once.
    """
    return CorrectedCollision(
        rate=rate_above(fixed.cosine, tau),
        raw_rate=rate_above(raw.cosine, tau),
        drift_mean_cos=drift_mean_cos,
        removed_variance=removed_variance,
        queries=measured,
        cosine=fixed.cosine,
        neighbour=fixed.index,
        raw_cosine=raw.cosine,
        raw_neighbour=raw.index,
        skipped_queries=(~keep).sum(),
    )


@torch.no_grad()
def nn_cosine_by_bucket(
    rows: Tensor,
    queries: Tensor,
    bucket: Tensor,
    pairable: Tensor,
    num_buckets: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[Tensor, Tensor]:
    """Sums and counts of the nearest-neighbour cosine of ``queries``, by the bucket of each query.

    Pass the corrected rows (``DriftCorrection.rows``) for the corrected statistic. Queries that
    are not pairable, or whose bucket is outside ``[0, num_buckets)``, are not counted.

    Args:
        rows: ``(V, d)``.
        queries: ``(Q,)`` row ids (e.g. a sample of each bucket).
        bucket: ``(V,)`` integer bucket of each row (as ``TokenFrequency``; -1 for none).
        pairable: ``(V,)`` bool.
        num_buckets: number of buckets.

    Returns:
        ``(sums (num_buckets,), counts (num_buckets,))`` float64; mean = sums / counts.
    """
    pairable = check_rows(rows, pairable)
    V = rows.shape[0]
    if bucket.shape != (V,) or bucket.is_floating_point():
        raise HeadwatchError(f"expected an integer `bucket` of shape ({V},), got {tuple(bucket.shape)} {bucket.dtype}")
    queries = queries.to(rows.device).long()
    b = bucket.to(rows.device).long()[queries]
    keep = pairable[queries] & (b >= 0) & (b < num_buckets)
    cos = nearest_neighbours(rows, queries, pairable, max_chunk_bytes).cosine.double()
    keep = keep & torch.isfinite(cos)
    sums = torch.zeros(num_buckets, dtype=torch.float64, device=rows.device)
    counts = torch.zeros_like(sums)
    slot = torch.where(keep, b, torch.zeros_like(b))
    sums.index_add_(0, slot, torch.where(keep, cos, torch.zeros_like(cos)))
    counts.index_add_(0, slot, keep.double())
    return sums, counts


def ordered_pairs(groups: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Every ordered pair ``(a, b)``, ``a != b``, of the members of each synonym group: ``(P,), (P,)`` int64."""
    a: list[int] = []
    b: list[int] = []
    for group in groups:
        ids = sorted({int(i) for i in group})
        for i in ids:
            for j in ids:
                if i != j:
                    a.append(i)
                    b.append(j)
    return torch.tensor(a, dtype=torch.long), torch.tensor(b, dtype=torch.long)


@torch.no_grad()
def partner_ranks(
    rows: Tensor,
    a: Tensor,
    b: Tensor,
    valid: Tensor,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Tensor:
    """Rank of ``b[i]`` among the nearest rows of ``a[i]`` by cosine: 1 means nearest.

    ``rank_i = 1 + |{j valid, j != a_i, j != b_i : cos(W_{a_i}, W_j) > cos(W_{a_i}, W_{b_i}) + t}|``
    (ties in ``b``'s favour). Threshold-free: on a planted run it falls as a synonym pair is
    learned. By chunked float32 products of scale-safe unit rows (any finite scale); memory one
    ``(P, keys)`` chunk. ``t = 8 sqrt(d) 2^-24`` (3e-6 at d_model 1024) is float32 rounding: two cosines
    computed by different products may differ by a few ulps where they are equal (an exact copy of
    ``b``), and such a competitor counts as a tie.

    Args:
        rows: ``(V, d)`` (the corrected rows for the corrected rank).
        a: ``(P,)`` integer row ids, the first of each pair (e.g. from :func:`ordered_pairs`).
        b: ``(P,)`` integer row ids, the second of each pair.
        valid: ``(V,)`` bool, rows that count as competitors.

    Returns:
        ``(P,)`` int64 ranks; NaN-free (a non-finite row's competitors are not counted).

    Raises:
        HeadwatchError: ``a`` and ``b`` are not 1-D of one length, or bad shapes.
    """
    valid = check_rows(rows, valid)
    if a.ndim != 1 or a.shape != b.shape:
        raise HeadwatchError(f"expected `a` and `b` as 1-D id tensors of one length, got {tuple(a.shape)} and {tuple(b.shape)}")
    dev = rows.device
    a, b = a.to(dev).long(), b.to(dev).long()
    if a.numel() == 0:  # no pair: no chunk to size
        return torch.zeros(0, dtype=torch.long, device=dev)
    target = pair_cosine(rows, a, b).unsqueeze(1)  # (P, 1), scale-safe
    # float32 rounding: a competitor's cosine and the partner's, computed by different products, may differ by a
    # few ulps where they are equal (an exact copy of the partner); up to this much above counts as a tie
    tie = 8 * math.sqrt(rows.shape[1]) * 2.0**-24
    V = rows.shape[0]  # every row a key, those not valid masked: nothing selected by value (no host sync)
    qc, kc = similarity_chunks(a.numel(), V, rows.shape[1], max_chunk_bytes, dev)
    above = torch.zeros(a.numel(), dtype=torch.long, device=dev)
    with full_precision(dev):
        for q0 in range(0, a.numel(), qc):  # the pairs usually fit one chunk: every key chunk normalised once
            qa, qb = a[q0 : q0 + qc], b[q0 : q0 + qc]
            q = unit_rows(rows.index_select(0, qa))  # (q, d), scale-safe (a plain norm overflows at 1e20, underflows at 1e-20)
            for k0 in range(0, V, kc):
                w = unit_rows(rows[k0 : k0 + kc])  # (k, d)
                ids = torch.arange(k0, k0 + w.shape[0], device=dev)
                sims = q @ w.T  # (q, k)
                mine = (ids.unsqueeze(0) == qa.unsqueeze(1)) | (ids.unsqueeze(0) == qb.unsqueeze(1))
                sims.masked_fill_(mine | ~valid[k0 : k0 + w.shape[0]].unsqueeze(0), float("-inf"))
                above[q0 : q0 + qc] += (sims > target[q0 : q0 + qc] + tie).sum(dim=1)
    return above + 1


def synonym_statistics(
    rows: Tensor, groups: Sequence[Sequence[int]], pairable: Tensor, tau: float = DEFAULT_TAU,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> dict[str, Tensor]:
    """Pair rate and median partner rank of synonym groups on ``rows`` (pass the corrected rows).

    Pairs with a member that is not pairable (never seen, padded, zero) are skipped and counted.

    Returns:
        ``pair_rate`` (ordered pairs with ``cos >= tau`` / measured pairs), ``median_rank``
        (lower median of :func:`partner_ranks`), ``pairs`` (measured), ``skipped_pairs``;
        float64 scalars (NaN rate and rank when no pair was measured).
    """
    pairable = check_rows(rows, pairable)
    a, b = ordered_pairs(groups)
    a, b = a.to(rows.device), b.to(rows.device)
    V = rows.shape[0]
    if a.numel() and (int(torch.minimum(a, b).min()) < 0 or int(torch.maximum(a, b).max()) >= V):
        raise HeadwatchError(f"synonym group ids must be in [0, {V})")
    return synonym_statistics_masked(rows, a, b, pairable, tau, max_chunk_bytes)


@torch.no_grad()
def synonym_statistics_masked(
    rows: Tensor, a: Tensor, b: Tensor, pairable: Tensor, tau: float = DEFAULT_TAU,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> dict[str, Tensor]:  # fmt: skip
    """:func:`synonym_statistics` of the ordered pairs ``(a, b)`` (:func:`ordered_pairs`, on ``rows``' device,
    ids in ``[0, V)``: not checked), without reading a value on the host: the pairs with a member that
    is not pairable are masked, not removed. Same values as :func:`synonym_statistics`."""
    device = rows.device
    pairable = pairable.to(device)
    keep = pairable[a] & pairable[b]
    m = keep.sum(dtype=torch.float64)
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
    skipped = (~keep).sum().double()
    if a.numel() == 0:  # no pair at all (a static shape)
        return {"pair_rate": nan, "median_rank": nan, "pairs": m, "skipped_pairs": skipped}
    ranks = partner_ranks(rows, a, b, pairable, max_chunk_bytes).double()
    ordered = torch.where(keep, ranks, float("inf")).sort().values  # the kept ranks first, ascending
    lower = ((m - 1) // 2).clamp(min=0).long().reshape(1)  # torch.median's lower median
    collides = ((pair_cosine(rows, a, b) >= tau) & keep).sum(dtype=torch.float64)
    return {
        "pair_rate": torch.where(m > 0, collides / m, nan),
        "median_rank": torch.where(m > 0, ordered.gather(0, lower).squeeze(0), nan),
        "pairs": m,
        "skipped_pairs": skipped,
    }
