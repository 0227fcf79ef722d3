"""Per-row statistics of vocabulary-sized matrices ``(V, d_model)``: gradients, updates, weights.

Definitions, for a matrix ``G`` of shape ``(V, d_model)`` (row ``i`` belongs to token ``i``)
and a boolean ``valid`` of shape ``(V,)`` (rows that can occur; padded vocabulary and
``padding_idx`` rows are not valid):

- row L2 norm ``||G_i||_2 = sqrt(sum_j G_ij^2)``, in the matrix's units (gradient
  units for gradients, weight units for updates ``W_after - W_before``);
- row density ``|{i valid : G_i != 0}| / |{i valid}|``: the fraction of valid rows with
  any non-zero entry (exact zero test, no tolerance);
- lookup (embedding-path) gradient of an embedding read at ids ``x`` with output
  gradient ``g`` of shape ``(N, d_model)``: ``E_i = sum_{n : x_n = i} g_n``
  (the backward of ``nn.Embedding``; rows at ``padding_idx`` get no gradient);
- per-row cosine ``cos_i = <A_i, B_i> / (||A_i|| ||B_i||)`` on rows where both are non-zero;
- Spearman's rank correlation ``rho`` (Spearman, 1904): Pearson's correlation of the
  tie-averaged ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.precision import full_precision
from headwatch.functional.quantiles import sort_key


def _check_matrix(matrix: Tensor, name: str = "matrix") -> None:
    if not isinstance(matrix, Tensor) or matrix.ndim != 2:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise HeadwatchError(f"expected {name} of shape [vocab_size, d_model], got {shape}")


def dense_rows(matrix: Tensor) -> Tensor:
    """A dense view of a ``(V, d_model)`` gradient: sparse (``nn.Embedding(sparse=True)``) ones are densified."""
    _check_matrix(matrix)
    return matrix.to_dense() if matrix.is_sparse else matrix


# Float32 sums of squares overflow above 3.4e38 (norms above 1.8e19) and lose precision below
# 1.2e-38 (norms below about 1.1e-19): rows outside [_LOW, _HIGH] are recomputed in float64.
_LOW, _HIGH = 2.0**-62, 2.0**62


FIX_ROWS = 1024
"""Suspect rows (float32 overflow or underflow) recomputed in float64 per call, without a host sync."""


def _fix_rows_float64(values: Tensor, suspect: Tensor, exact: Callable[[Tensor], Tensor]) -> Tensor:
    """``values`` with the ``suspect`` rows replaced by ``exact(row_ids)`` (float64), with no host sync.

    The first :data:`FIX_ROWS` suspect rows (a fixed-size ``topk`` of the flags) are recomputed; any
    suspect row beyond them (more than 1024 rows whose float32 norm overflowed or underflowed: a
    diverged run) becomes NaN, "not measured", never a wrong finite value.
    """
    k = min(FIX_ROWS, suspect.numel())
    if k == 0:
        return values
    idx = torch.topk(suspect.to(torch.float32), k, sorted=False).indices  # every suspect row first, if <= k
    picked = suspect.index_select(0, idx)
    fixed = torch.where(picked, exact(idx).to(values.dtype), values.index_select(0, idx))
    done = torch.zeros_like(suspect).index_fill_(0, idx, True)
    values = torch.where(suspect & ~done, torch.full_like(values, math.nan), values)
    return values.index_copy(0, idx, fixed)


def _float64_norms(matrix: Tensor, idx: Tensor) -> Tensor:
    """``(k,)`` float64 L2 norms of the rows ``idx`` of ``matrix`` (the exact recomputation of suspect rows)."""
    return torch.linalg.vector_norm(matrix.index_select(0, idx).double(), dim=1)


def row_norms(matrix: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """L2 norm of every row, ``(V, d_model) -> (V,)`` float32 (float64 inputs stay float64).

    One float32 pass (autocast disabled); rows whose float32 norm overflowed (``inf`` from
    finite entries: norms above 1.8e19, e.g. a loss scaled by 1e22) or may have lost
    precision to underflow (non-zero norms below 2**-62) are recomputed in float64, so any
    finite row gets its norm. Rows whose entries are all below about 1e-23 still get 0 (use
    :func:`row_nonzero` to tell them from zero rows). A norm above float32's largest value
    (3.4e38) is ``inf`` in float32: ``dtype=torch.float64`` returns it exactly. Sparse COO
    inputs are accepted (duplicate indices are summed first). One host sync (a bool).
    """
    m = dense_rows(matrix)
    out_dtype = dtype or (torch.float64 if m.dtype == torch.float64 else torch.float32)
    with full_precision(m.device):
        acc = torch.float64 if m.dtype == torch.float64 else torch.float32
        norms = torch.linalg.vector_norm(m, dim=1, dtype=acc).to(out_dtype)
        if acc == torch.float64:
            return norms
        suspect = torch.isinf(norms) | ((norms > 0) & (norms < _LOW))
        return _fix_rows_float64(norms, suspect, partial(_float64_norms, m))


def finite_histogram_values(values: Tensor) -> tuple[Tensor, int]:
    """The finite entries of ``values`` (flattened) and how many were skipped (NaN or +-inf).

    For histogram writers (TensorBoard's refuses non-finite values and drops the whole
    histogram): write ``values``, and warn when ``n_skipped > 0``. Syncs once.
    """
    flat = values.detach().reshape(-1)
    finite = torch.isfinite(flat)
    kept = flat[finite]
    return kept, int(flat.numel() - kept.numel())


def row_nonzero(matrix: Tensor) -> Tensor:
    """Whether each row has any non-zero entry, ``(V, d_model) -> (V,)`` bool (exact; NaN counts as non-zero).

    Computed as ``max_j G_ij != 0 or min_j G_ij != 0``: two reductions, no ``(V, d_model)``
    temporary (a ``G != 0`` mask would be one).
    """
    m = dense_rows(matrix)
    return (m.amax(dim=1) != 0) | (m.amin(dim=1) != 0)


def row_nonzero_given_norms(matrix: Tensor, norms: Tensor) -> Tensor:
    """:func:`row_nonzero` of a matrix whose row norms are known: exact, with no host sync.

    A non-zero (or NaN) norm means a non-zero row; a zero float32 norm may hide entries below
    about 1e-19 (their squares underflow), so rows are also checked by their largest and smallest
    entries (two reductions; deciding which rows to re-check would cost a host sync).
    """
    return (norms != 0) | row_nonzero(matrix)


def row_norms_given_nonzero(matrix: Tensor, norms: Tensor, nonzero: Tensor) -> Tensor:
    """``norms`` (:func:`row_norms`) with the rows that are non-zero but got a zero float32 norm (every entry below
    about 1e-23: their squares underflow) recomputed in float64, so that a norm is 0 only for a zero row. Fixed-size
    operations only (the first :data:`FIX_ROWS` such rows; beyond, NaN), no host sync.

    Args:
        matrix: ``(V, d_model)``; norms: ``(V,)``; nonzero: ``(V,)`` bool (:func:`row_nonzero_given_norms`).
    """
    m = dense_rows(matrix)
    suspect = nonzero & (norms == 0)
    with full_precision(m.device):
        return _fix_rows_float64(norms, suspect, partial(_float64_norms, m))


def _row_passes(m: Tensor, acc: torch.dtype, subtract: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(V,)`` norms (``acc``) and non-zero flags of ``m`` (``m -= subtract`` first, in place).

    Whole-matrix reductions, each one multi-threaded op: on 2 CPU cores at (32000, 256) float32 they take 3.7 ms for a
    gradient and 5.9 ms for an update, against 7.1 and 8.8 ms for the same reductions over cache-sized blocks shared
    among threads (whose many small ops and thread hand-offs cost more than the second read of the matrix saves).
    """
    if subtract is not None:
        m.sub_(subtract)
    norms = torch.linalg.vector_norm(m, dim=1, dtype=acc)
    return norms, (norms != 0) | (m.amax(dim=1) != 0) | (m.amin(dim=1) != 0)


def row_norms_and_nonzero(matrix: Tensor, subtract: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`row_norms` and :func:`row_nonzero` of one matrix, ``(V, d_model) -> ((V,), (V,) bool)``, no host sync.

    The same values as :func:`row_norms` followed by :func:`row_nonzero_given_norms` and
    :func:`row_norms_given_nonzero` (a norm is 0 only for a zero row; any finite row gets its norm), with one
    fixed-size float64 recomputation of the suspect rows instead of two.

    Args:
        matrix: ``(V, d_model)``.
        subtract: optional ``(V, d_model)`` of the same dtype, subtracted from ``matrix`` in place first (an update
            ``W_before - W_after`` made in the buffer that held ``W_before``; ``matrix`` then holds it).

    Raises:
        HeadwatchError: ``matrix`` is not 2-D, or ``subtract`` is given for a sparse matrix or with another shape.
    """
    m = dense_rows(matrix).detach()  # the same storage (an update is made in it); the `out=` reductions take no graph
    if subtract is not None and (matrix.is_sparse or subtract.shape != m.shape):
        raise HeadwatchError(f"expected a dense matrix and `subtract` of its shape {tuple(m.shape)}, got {tuple(subtract.shape)}")
    with full_precision(m.device):
        acc = torch.float64 if m.dtype == torch.float64 else torch.float32
        norms, nonzero = _row_passes(m, acc, subtract.detach() if subtract is not None else None)
        if acc == torch.float64:
            return norms, nonzero
        # float32 overflow (inf from finite entries), or a non-zero row whose norm lost precision or underflowed to 0
        suspect = torch.isinf(norms) | (nonzero & (norms < _LOW))
        exact = _fix_rows_float64(norms, suspect, partial(_float64_norms, m))
        return exact, nonzero


def row_density(nonzero: Tensor, valid: Tensor | None = None) -> Tensor:
    """Fraction of valid rows that are non-zero: ``sum(nonzero & valid) / sum(valid)``, float64 scalar.

    NaN when there is no valid row.
    """
    if valid is None:
        valid = torch.ones_like(nonzero)
    if nonzero.shape != valid.shape:
        raise HeadwatchError(f"expected nonzero and valid of the same shape (V,), got {tuple(nonzero.shape)} and {tuple(valid.shape)}")
    n = valid.sum(dtype=torch.float64)
    return torch.where(n > 0, (nonzero & valid).sum(dtype=torch.float64) / n.clamp(min=1), torch.nan)


def lookup_gradient(
    ids: Tensor, grad_output: Tensor, num_rows: int, padding_idx: int | None = None, out: Tensor | None = None
) -> Tensor:
    """The embedding-path gradient ``E_i = sum_{n : ids_n = i} grad_output_n``.

    Args:
        ids: ``(...)`` integer token ids that were looked up.
        grad_output: ``(..., d_model)`` gradient of the loss at the embedding's output.
        num_rows: ``V``, rows of the embedding.
        padding_idx: row that gets no gradient (as ``nn.Embedding(padding_idx=...)``).
        out: optional ``(V, d_model)`` float32 accumulator to add into (for micro-batches).

    Returns:
        ``(V, d_model)`` float32.

    Raises:
        HeadwatchError: shapes disagree or an id is outside ``[0, V)``.
    """
    if grad_output.shape[:-1] != ids.shape:
        raise HeadwatchError(
            f"expected grad_output of shape {tuple(ids.shape)} + (d_model,), got {tuple(grad_output.shape)}"
        )
    d = grad_output.shape[-1]
    flat_ids = ids.reshape(-1).long()
    g = grad_output.reshape(-1, d).float()
    if padding_idx is not None:
        g = g * (flat_ids != padding_idx).unsqueeze(-1)
    if out is None:
        out = torch.zeros(num_rows, d, dtype=torch.float32, device=grad_output.device)
    if out.shape != (num_rows, d):
        raise HeadwatchError(f"expected out of shape ({num_rows}, {d}), got {tuple(out.shape)}")
    return out.index_add_(0, flat_ids, g)


def row_cosine(
    a: Tensor, b: Tensor, norms_a: Tensor | None = None, norms_b: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-row cosine of two ``(V, d_model)`` matrices, and where it is defined.

    Defined where both row norms are positive. float32 with autocast disabled; rows whose
    norms are above 2**62 or below 2**-62 (where the float32 dot product could overflow or
    underflow) are recomputed in float64 (one host sync). ``norms_a``/``norms_b`` reuse
    norms already computed (:func:`row_norms`).

    Returns:
        ``(cosine (V,) float32, both_nonzero (V,) bool)``; cosine is 0 where undefined.
    """
    _check_matrix(a, "a")
    _check_matrix(b, "b")
    if a.shape != b.shape:
        raise HeadwatchError(f"expected two matrices of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    with full_precision(a.device):
        af, bf = a.float(), b.float()
        na = norms_a.float() if norms_a is not None else row_norms(af)
        nb = norms_b.float() if norms_b is not None else row_norms(bf)
        both = (na > 0) & (nb > 0)
        # a batched (1 x d) @ (d x 1) product: over matrices that do not fit in cache it streams
        # both once, where vecdot / (a * b).sum() run at about half the speed on the CPU
        dot = torch.bmm(af.unsqueeze(1), bf.unsqueeze(2)).reshape(-1)
        cos = dot / (na * nb).clamp(min=torch.finfo(torch.float32).tiny)
        # where the float32 dot product or norm product may overflow or underflow: float64
        suspect = both & ((na > _HIGH) | (nb > _HIGH) | (na < _LOW) | (nb < _LOW))

        def exact(idx: Tensor) -> Tensor:
            ra, rb = af.index_select(0, idx).double(), bf.index_select(0, idx).double()
            return torch.linalg.vecdot(ra, rb) / (torch.linalg.vector_norm(ra, dim=1) * torch.linalg.vector_norm(rb, dim=1))

        cos = _fix_rows_float64(cos, suspect, exact)
    return torch.where(both, cos.clamp(-1.0, 1.0), torch.zeros_like(cos)), both


class Summary(NamedTuple):
    """Mean, max, median and 95th percentile of selected values (NaN when none is selected, or one is NaN), and
    their count."""

    mean: Tensor
    max: Tensor
    p50: Tensor
    p95: Tensor
    count: Tensor


def summarize(values: Tensor, select: Tensor | None = None) -> Summary:
    """Summary statistics of ``values[select]`` (``values`` 1-D) as float64 scalars, no host sync."""
    return summarize_groups(values, {"": select if select is not None else torch.ones_like(values, dtype=torch.bool)})[""]


def _sorted_summaries(ordered: Tensor, selected: list[Tensor], order: Tensor) -> Summary:
    """:class:`Summary` of the entries of the ascending ``ordered = values[order]`` (float64 ``(V,)``, ``V > 0``)
    selected by each of ``selected`` (``G`` bool ``(V,)`` masks of ``values``): fields of shape ``(G,)``, fixed-size
    operations only, no host sync.

    The ``k``-th selected value (0-based) is at the first index where the running count of selected
    entries reaches ``k + 1`` (a ``searchsorted`` in that count, exact in integers); the quantiles interpolate as
    :func:`~headwatch.functional.quantiles.sorted_quantiles` between the selected values at
    ``floor`` and ``ceil`` of ``q (n - 1)``. Every group in one call, the ops over the ``(G, V)`` masks at once where
    that is faster on the CPU (the cumulative counts and the sums; a gather along dim 1 is slower than one per row).
    """
    masks = torch.stack([mask.index_select(0, order) for mask in selected])  # (G, V), in the order of ``ordered``
    running = masks.cumsum(1, dtype=torch.int64)  # (G, V), exact counts
    n = running[:, -1].double()  # (G,)
    p50, p95 = 0.5 * (n - 1), 0.95 * (n - 1)
    ranks = torch.stack([p50.floor(), p50.ceil(), p95.floor(), p95.ceil(), n - 1], dim=1).clamp(min=0.0)  # (G, 5)
    index = torch.searchsorted(running, ranks.long() + 1).clamp(max=ordered.numel() - 1)
    at = ordered.index_select(0, index.reshape(-1)).view(index.shape)  # (G, 5)
    # between two equal neighbours the quantile is their value: two infinite norms give inf, not inf - inf = NaN
    q50 = torch.where(at[:, 1] == at[:, 0], at[:, 0], at[:, 0] + (at[:, 1] - at[:, 0]) * (p50 - ranks[:, 0]))
    q95 = torch.where(at[:, 3] == at[:, 2], at[:, 2], at[:, 2] + (at[:, 3] - at[:, 2]) * (p95 - ranks[:, 2]))
    # one sum per group over the whole (V,) row, every row reduced alike: a group's mean has the same bits alone or
    # with others
    mean = torch.where(masks, ordered, 0.0).sum(dim=1) / n
    # NaN sorts last: a group holding a NaN has it as its largest value, and every field NaN (as numpy's mean, max
    # and percentile), not quantiles of its other values
    some = (n > 0) & ~torch.isnan(at[:, 4])
    return Summary(*(torch.where(some, x, float("nan")) for x in (mean, at[:, 4], q50, q95)), n)


def summarize_groups(values: Tensor, groups: dict[str, Tensor]) -> dict[str, Summary]:
    """:func:`summarize` of ``values[mask]`` for several masks, sorting ``values`` once (no host sync).

    Args:
        values: ``(V,)``; groups: name -> ``(V,)`` bool mask.
    """
    if values.numel() == 0 or not groups:
        nan = torch.full((), float("nan"), dtype=torch.float64, device=values.device)
        none = torch.zeros((), dtype=torch.float64, device=values.device)
        return {name: Summary(nan, nan, nan, nan, none) for name in groups}
    order = torch.sort(sort_key(values)).indices  # integer keys sort faster than floats, NaN last as torch.sort
    ordered = values.double().index_select(0, order)
    both = _sorted_summaries(ordered, [mask.to(order.device) for mask in groups.values()], order)
    return {name: Summary(*(field[i] for field in both)) for i, name in enumerate(groups)}


def rankdata(values: Tensor) -> Tensor:
    """Ranks ``1..n`` of a 1-D tensor with ties given their average rank (``scipy.stats.rankdata``)."""
    if values.ndim != 1:
        raise HeadwatchError(f"expected a 1-D tensor, got shape {tuple(values.shape)}")
    n = values.numel()
    if n == 0:
        return values.double()
    sorted_vals, order = torch.sort(values)
    _, inverse, counts = torch.unique_consecutive(sorted_vals, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # 1-based rank of each tie group's last member
    average = ends - (counts.double() - 1) / 2
    # index_select + scatter_: advanced indexing is far slower on the CPU for the same work
    return torch.empty(n, dtype=torch.float64, device=values.device).scatter_(0, order, average.index_select(0, inverse))


def tie_groups(ordered: Tensor) -> tuple[Tensor, Tensor]:
    """The first and last position of each entry's tie group (a run of equal entries) in a sorted 1-D tensor,
    ``(n,) -> ((n,), (n,))`` int64: fixed-size operations, no host sync (the first position is a running maximum of
    the group starts, the last a running minimum, from the end, of the group ends)."""
    n = ordered.numel()
    device = ordered.device
    change = ordered[1:] != ordered[:-1]
    start = torch.ones(n, dtype=torch.bool, device=device)
    start[1:] = change
    end = torch.ones(n, dtype=torch.bool, device=device)
    end[:-1] = change
    position = torch.arange(n, device=device)
    first = torch.where(start, position, 0).cummax(0).values
    last = torch.where(end, position, n).flip(0).cummin(0).values.flip(0)
    return first, last


def selected_ranks(values: Tensor, selected: Tensor) -> Tensor:
    """:func:`rankdata` of ``values[selected]``, in place (0 at the entries not selected): fixed-size
    operations only, no host sync. ``(n,), (n,) bool -> (n,)`` float64.

    For :func:`spearman_of_ranks`, when one variable is correlated with several others (its ranks
    computed once). Any strictly increasing transform of ``values`` has the same ranks.

    The selected values are sorted first, ascending (one sort, the entries not selected keyed as NaN, last); a tie
    group is a run of one key, and each entry gets its group's average ``(first + last) / 2 + 1`` of 0-based
    positions (``rankdata``'s ``end - (count - 1) / 2``): the first position is a running maximum of the group starts,
    the last a running minimum, from the end, of the group ends.
    """
    n = values.numel()
    device = values.device
    # one sort of integer keys (sort_key: the values' order, faster than floats): the entries not selected get the
    # largest key, so the selected values come first in ascending order (selected NaN values get it too: their ranks
    # are unspecified, and spearman's NaN); ties in any order (the average rank of a tie group does not depend on it)
    key = sort_key(values)
    largest = torch.iinfo(key.dtype).max
    by_value, order = torch.sort(torch.where(selected, key, largest))
    first, last = tie_groups(by_value)
    average = (first + last).double() / 2 + 1
    ranks = torch.empty(n, dtype=torch.float64, device=device).scatter_(0, order, average)
    # selected values keyed as the largest (an int64 2**63 - 1) sort among the entries not selected, in any order:
    # they are the largest selected ones, ranked count - (c - 1) / 2 with c of them
    top = selected & (key == largest)
    tie = selected.sum(dtype=torch.float64) - (top.sum(dtype=torch.float64) - 1) / 2
    return torch.where(top, tie, torch.where(selected, ranks, 0.0))


def spearman(x: Tensor, y: Tensor, select: Tensor | None = None) -> Tensor:
    """Spearman's rank correlation of two 1-D tensors, float64 scalar (NaN if undefined).

    ``select``: ``(n,)`` bool, the pairs to correlate (default all): the correlation of
    ``x[select]`` and ``y[select]`` without a host sync (no boolean selection).
    Undefined (NaN) when there are fewer than 2 values, either input is constant, or holds NaN.
    """
    if x.shape != y.shape or x.ndim != 1:
        raise HeadwatchError(f"expected two 1-D tensors of the same length, got {tuple(x.shape)} and {tuple(y.shape)}")
    if select is not None and select.shape != x.shape:
        raise HeadwatchError(f"expected select of shape {tuple(x.shape)}, got {tuple(select.shape)}")
    if x.numel() < 2:
        return torch.full((), float("nan"), dtype=torch.float64, device=x.device)
    chosen = select.to(x.device) if select is not None else torch.ones_like(x, dtype=torch.bool)
    x_nan = (torch.isnan(x) & chosen).any()
    return spearman_of_ranks(selected_ranks(x, chosen), y, chosen, x_nan)


def spearman_of_ranks(x_ranks: Tensor, y: Tensor, select: Tensor, x_nan: Tensor | bool = False) -> Tensor:
    """:func:`spearman` of ``x`` and ``y`` given ``x_ranks = selected_ranks(x, select)``, float64 scalar.

    Args:
        x_ranks: ``(n,)`` float64 ranks of the selected ``x`` (:func:`selected_ranks`).
        y: ``(n,)`` the other variable; select: ``(n,)`` bool, the pairs correlated.
        x_nan: whether a selected ``x`` is NaN (then the result is NaN, as SciPy's).
    """
    if x_ranks.shape != y.shape or y.ndim != 1 or select.shape != y.shape:
        raise HeadwatchError(
            f"expected x_ranks, y and select of one shape (n,), got {tuple(x_ranks.shape)}, {tuple(y.shape)}, {tuple(select.shape)}"
        )
    if y.numel() < 2:
        return torch.full((), float("nan"), dtype=torch.float64, device=y.device)
    chosen = select.to(y.device)
    n = chosen.sum(dtype=torch.float64)
    ry = selected_ranks(y, chosen)
    rx = torch.where(chosen, x_ranks - x_ranks.sum() / n, 0.0)
    ry = torch.where(chosen, ry - ry.sum() / n, 0.0)
    denom = torch.sqrt((rx * rx).sum() * (ry * ry).sum())
    undefined = (n < 2) | (torch.isnan(y) & chosen).any() | x_nan | ~(denom > 0)  # as SciPy: NaN in, NaN out
    return torch.where(undefined, float("nan"), (rx * ry).sum() / denom)


def norm_ratio(rare: Tensor, frequent: Tensor) -> Tensor:
    """``rare / frequent`` (the rare-to-frequent row-norm ratio), NaN where ``frequent == 0``.

    A frequent (``top1``) bucket with no gradient on the step (no lookup of its tokens) has
    mean row norm 0: the ratio is then undefined and reported as NaN, not ``+inf``. Computed
    on the device with ``torch.where`` (no host sync).
    """
    return torch.where(frequent == 0, torch.full_like(rare, float("nan")), rare / frequent)
