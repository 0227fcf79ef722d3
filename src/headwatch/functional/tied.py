"""Statistics of the two gradient flows of a tied embedding/head matrix, and per-row gradient groups.

A tied matrix ``W`` (``lm_head.weight is embed_tokens.weight``) receives
``G = E + H``: ``E_i = sum_{n : x_n = i} dL/d(embedding output)_n`` through the lookup
(:func:`headwatch.functional.rows.lookup_gradient`) and ``H = G - E`` through the scoring.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwatch.functional.rows import row_cosine, row_density, row_nonzero_given_norms, row_norms, summarize_groups
from headwatch.names import STATS

__all__ = ["row_group_statistics", "tied_flow_statistics"]


def tied_flow_statistics(
    lookup: Tensor, scoring: Tensor, valid: Tensor, lookup_norms: Tensor | None = None, scoring_norms: Tensor | None = None
) -> dict[str, Tensor]:
    """How the lookup and scoring flows of a tied matrix agree, row by row.

    Args:
        lookup: ``(V, d_model)`` lookup part ``E``.
        scoring: ``(V, d_model)`` scoring part ``H``.
        valid: ``(V,)`` bool rows that can occur.
        lookup_norms: ``(V,)`` row norms of ``lookup`` when already computed.
        scoring_norms: ``(V,)`` row norms of ``scoring`` when already computed.

    Returns:
        float64 scalars: ``tied_flow_rows`` (valid rows where both flows are non-zero),
        ``tied_flow_cosine_mean`` (mean ``cos(E_i, H_i)`` over them) and
        ``tied_flow_conflict_fraction`` (fraction with ``cos < 0``); NaN when no row has both.
    """
    a = row_norms(lookup) if lookup_norms is None else lookup_norms
    b = row_norms(scoring) if scoring_norms is None else scoring_norms
    cosine, both = row_cosine(lookup, scoring, a, b)
    rows = both & valid.to(cosine.device)
    n = rows.sum(dtype=torch.float64)
    return {
        "tied_flow_rows": n,
        "tied_flow_cosine_mean": torch.where(n > 0, (cosine * rows).sum(dtype=torch.float64) / n.clamp(min=1), torch.nan),
        "tied_flow_conflict_fraction": torch.where(
            n > 0, ((cosine < 0) & rows).sum(dtype=torch.float64) / n.clamp(min=1), torch.nan
        ),
    }


def row_group_statistics(matrix: Tensor, groups: dict[str, Tensor], norms: Tensor | None = None) -> dict[str, Tensor]:
    """Row density and row-norm statistics of a ``(V, d_model)`` matrix for each row group.

    Args:
        matrix: ``(V, d_model)`` gradient or update.
        groups: name -> ``(V,)`` bool rows of the group.
        norms: ``(V,)`` row L2 norms when already computed.

    Returns:
        ``{f"{name}_row_density": |{i in group : M_i != 0}| / |group|,
        f"{name}_row_norm_{stat}": statistic of ||M_i||_2 over the group}`` for ``stat`` in
        mean, max, p50, p95; float64 scalars, NaN for an empty group.
    """
    norms = row_norms(matrix) if norms is None else norms
    nonzero = row_nonzero_given_norms(matrix, norms)
    out: dict[str, Tensor] = {}
    for key, summary in summarize_groups(norms, groups).items():
        out[f"{key}_row_density"] = row_density(nonzero, groups[key])
        out.update({f"{key}_row_norm_{stat}": getattr(summary, stat) for stat in STATS})
    return out
