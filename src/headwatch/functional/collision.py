"""Rare-token synonym collision statistics (pure torch).

For a matrix ``W`` of shape ``(V, d_model)``, rare token ``r`` *collides* when
``nn_cos(r) = max_{j valid, j != r} cos(W_r, W_j) >= tau``; the collision rate is
``|{r in R : nn_cos(r) >= tau}| / |R|`` over the measured rare tokens ``R``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.neighbors import Neighbours, nearest_neighbours, pair_cosine

__all__ = [
    "collision_scalars", "collision_statistics", "panel_mask", "panel_order", "sample_mask", "sample_rows",
    "synonym_pair_rate", "top_colliding_pairs", "top_colliding_pairs_fixed",
]  # fmt: skip


def sample_rows(rows: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``rows`` when at most ``k``, else a uniform sample of ``k`` of them (``generator``), sorted ascending.

    Args:
        rows: ``(n,)`` int64 row ids.
    """
    if rows.numel() <= k:
        return rows
    pick = torch.randperm(rows.numel(), generator=generator)[:k]
    return rows[pick.to(rows.device)].sort().values


def sample_mask(mask: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Every row of ``mask`` when at most ``k``, else a uniform sample of ``k`` of them, as a fixed-size selection.

    Sync-free counterpart of :func:`sample_rows`: each row gets a uniform random key (``generator``,
    on ``mask``'s device), the rows outside ``mask`` key -1, and the ``S = min(k, V)`` largest keys
    are kept (a uniform ``k``-subset without replacement, as ``randperm(n)[:k]``, though not the same
    one for a seed). Nothing is read on the host.

    Args:
        mask: ``(V,)`` bool, the rows to sample from.
        k: the sample size (``>= 1``).
        generator: a ``torch.Generator`` on ``mask``'s device.

    Returns:
        ``(ids (S,) int64, taken (S,) bool)``: the sampled ids ascending first (``taken``), then padding
        (id 0, not ``taken``).
    """
    return panel_mask(mask, torch.rand(mask.numel(), generator=generator, device=mask.device), k)


def panel_order(V: int, seed: int) -> Tensor:
    """The priority of each of ``V`` rows in one seeded permutation: ``(V,)`` int64, distinct, in ``[1, V]``.

    Row ``order[i]`` of ``torch.randperm(V)`` (a CPU generator seeded with ``seed``: the same on every
    process and device) gets priority ``V - i``; :func:`panel_mask` keeps the highest, so a panel of ``k``
    rows is the first ``k`` rows of the permutation that fall in its mask, and a larger panel keeps
    every row of a smaller one (a prefix).
    """
    order = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    keys = torch.empty(V, dtype=torch.int64)
    keys[order] = torch.arange(V, 0, -1, dtype=torch.int64)
    return keys


def panel_mask(mask: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` rows of ``mask`` with the largest ``keys`` (all of them when fewer), as a fixed-size selection.

    With the keys of :func:`panel_order` the selection is the same rows for the same mask and seed
    (a fixed panel), and a prefix of the permutation: the panel of ``k`` rows is inside that of ``2k``.
    Nothing is read on the host.

    Args:
        mask: ``(V,)`` bool, the rows to select from.
        keys: ``(V,)`` non-negative priorities (int64 or floating), distinct within ``mask``.
        k: the panel size (``>= 1``).

    Returns:
        ``(ids (S,) int64, taken (S,) bool)``, ``S = min(k, V)``: the selected ids ascending first
        (``taken``), then padding (id 0, not ``taken``).
    """
    V = mask.numel()
    S = min(k, V)
    keyed = torch.where(mask, keys.to(mask.device), -1)
    top = torch.topk(keyed, S, sorted=False)
    taken = top.values >= 0
    ids = torch.where(taken, top.indices, V).sort().values
    taken = ids < V
    return torch.where(taken, ids, 0), taken


def top_colliding_pairs_fixed(cosine: Tensor, measured: Tensor, tau: float, k: int) -> tuple[Tensor, Tensor]:
    """:func:`top_colliding_pairs` as a fixed-size selection: ``(positions (P,), taken (P,) bool)``, ``P = min(k, S)``.

    ``positions`` index the ``(S,)`` queries, most similar first; ``taken``: a measured query whose
    cosine is ``>= tau`` (the table keeps those only).
    """
    colliding = measured & (cosine >= tau)
    cos = torch.where(colliding, cosine, float("-inf"))
    top = torch.topk(cos, min(k, cos.numel()))
    return top.indices, colliding[top.indices]


def collision_statistics(
    weight: Tensor,
    rare: Tensor,
    bucket_rows: dict[str, Tensor],
    valid: Tensor,
    tau: float,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[dict[str, Tensor], Neighbours, dict[str, Tensor]]:
    """Collision rate of the rare rows and the mean nearest-neighbour cosine of each row group.

    Args:
        weight: ``(V, d_model)`` matrix.
        rare: ``(R,)`` int64 ids of the measured rare rows.
        bucket_rows: group name -> ``(n,)`` int64 row ids (the ``rare`` group reuses ``rare``).
        valid: ``(V,)`` bool rows that may be neighbours.
        tau: collision threshold on the cosine.

    Returns:
        ``(scalars, neighbours of rare, cosines by group)``; scalars are ``rare_rate``
        (float64, NaN when ``R`` is 0) and ``<group>_nn_cosine_mean`` (mean of the finite
        ``nn_cos`` of the group's rows, NaN when none).
    """
    dev = weight.device
    nn_rare = nearest_neighbours(weight, rare.to(dev), valid.to(dev), max_chunk_bytes)
    cosines = {
        group: nn_rare.cosine if group == "rare"
        else nearest_neighbours(weight, rows.to(dev), valid.to(dev), max_chunk_bytes).cosine
        for group, rows in bucket_rows.items()
    }
    on_cpu = {group: cos.cpu() for group, cos in cosines.items()}
    return collision_scalars(nn_rare.cosine, cosines, tau), nn_rare, on_cpu


def collision_scalars(rare_cosine: Tensor, cosines: Mapping[str, Tensor], tau: float) -> dict[str, Tensor]:
    """The scalars of :func:`collision_statistics` from the nearest-neighbour cosines, however they were searched.

    Args:
        rare_cosine: ``(R,)`` ``nn_cos`` of the measured rare rows.
        cosines: group name -> ``(n,)`` ``nn_cos`` of the group's rows.
        tau: collision threshold on the cosine.

    Returns:
        ``rare_rate`` (``|{nn_cos >= tau}| / R``, float64, NaN when ``R`` is 0) and, for each group,
        ``<group>_nn_cosine_mean`` (mean of the finite ``nn_cos``, float64, NaN when none).
    """
    nan = torch.tensor(math.nan, dtype=torch.float64)
    R = rare_cosine.numel()
    scalars = {"rare_rate": (rare_cosine >= tau).sum(dtype=torch.float64) / R if R else nan}
    for group, cos in cosines.items():
        finite = cos[torch.isfinite(cos)]
        scalars[f"{group}_nn_cosine_mean"] = finite.double().mean() if finite.numel() else nan
    return scalars


def top_colliding_pairs(rare: Tensor, neighbours: Neighbours, tau: float, k: int) -> list[tuple[int, int, float]]:
    """The ``k`` most similar colliding ``(rare id, neighbour id, cosine)``, most similar first."""
    colliding = neighbours.cosine >= tau
    cos = torch.where(colliding, neighbours.cosine, torch.full_like(neighbours.cosine, -math.inf))
    k = min(k, int(colliding.sum()))
    if k == 0:
        return []
    top = torch.topk(cos, k)
    return [(int(rare[i]), int(neighbours.index[i]), float(neighbours.cosine[i])) for i in top.indices.tolist()]


def synonym_pair_rate(weight: Tensor, groups: Sequence[Sequence[int]], rare: Tensor, tau: float) -> tuple[Tensor, int]:
    """Fraction of within-group pairs ``(r, s)``, ``r`` rare, ``s != r``, with ``cos(W_r, W_s) >= tau``.

    Args:
        weight: ``(V, d_model)``; groups: lists of token ids; rare: ``(V,)`` bool.

    Returns:
        ``(rate float64 scalar (NaN when no pair), number of pairs)``.
    """
    a, b = [], []
    rare = rare.cpu()
    for group in groups:
        for r in group:
            if bool(rare[r]):
                for s in group:
                    if s != r:
                        a.append(r)
                        b.append(s)
    if not a:
        return torch.tensor(math.nan, dtype=torch.float64), 0
    cos = pair_cosine(weight, torch.tensor(a), torch.tensor(b))
    return (cos >= tau).sum(dtype=torch.float64) / len(a), len(a)
