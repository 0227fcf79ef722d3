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

from typing import NamedTuple

import torch
from torch import Tensor

from headwatch._errors import HeadwatchError
from headwatch.functional._precision import full_precision
from headwatch.functional.quantiles import quantiles, sorted_quantiles


def _check_matrix(matrix: Tensor, name: str = "matrix") -> None:
    if not isinstance(matrix, Tensor) or matrix.ndim != 2:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise HeadwatchError(f"expected {name} of shape [vocab_size, d_model], got {shape}")


def dense_rows(matrix: Tensor) -> Tensor:
    """A dense view of a ``(V, d_model)`` gradient: sparse (``nn.Embedding(sparse=True)``) ones are densified."""
    _check_matrix(matrix)
    return matrix.to_dense() if matrix.is_sparse else matrix


_ROW_CHUNK_BYTES = 8 * 2**20
"""Bound on the float64 copy of one block of rows made by :func:`row_norms` and :func:`row_cosine`."""


def _row_steps(matrix: Tensor) -> range:
    """Starts of blocks of rows whose float64 copy stays under 8 MiB (at least one row)."""
    step = max(1, _ROW_CHUNK_BYTES // (8 * max(1, matrix.shape[1])))
    return range(0, matrix.shape[0], step)


def row_norms(matrix: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """L2 norm of every row, ``(V, d_model) -> (V,)`` float32 (float64 inputs stay float64).

    Accumulated in float64, a block of rows at a time (at most 8 MiB of float64 copy),
    with autocast disabled: no overflow for any finite entries (squares of float32 values
    up to 3.4e38 fit float64) and no underflow of tiny ones. A norm above float32's
    largest value (3.4e38: rows with entries near it) is ``inf`` in the float32 result;
    ``dtype=torch.float64`` returns it exactly. Sparse COO inputs are accepted (duplicate
    indices are summed first). No host sync.
    """
    m = dense_rows(matrix)
    out_dtype = dtype or (torch.float64 if m.dtype == torch.float64 else torch.float32)
    out = torch.empty(m.shape[0], dtype=out_dtype, device=m.device)
    with full_precision(m.device):
        steps = _row_steps(m)
        for i in steps:
            block = m[i : i + steps.step]
            out[i : i + block.shape[0]] = torch.linalg.vector_norm(block, dim=1, dtype=torch.float64)
    return out


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
    """:func:`row_nonzero` reusing row norms already computed: exact, and cheaper when few rows are zero.

    A non-zero (or NaN) norm means a non-zero row. A zero float32 norm may hide entries
    below about 1e-19 (their squares underflow), so those rows alone are re-checked
    exactly; when they are more than a quarter of the matrix, the whole matrix is (two
    reductions). Syncs (logging steps only).
    """
    m = dense_rows(matrix)
    zero = norms == 0
    n_zero = int(zero.sum())
    if n_zero == 0:
        return ~zero
    if n_zero > m.shape[0] // 4:
        return row_nonzero(m)
    idx = zero.nonzero().flatten()
    sub = m.index_select(0, idx)
    exact = ~zero
    exact[idx] = (sub.amax(dim=1) != 0) | (sub.amin(dim=1) != 0)
    return exact


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

    Defined where both row norms are positive. Computed in float64 blocks of rows (at most
    8 MiB each), autocast disabled: no overflow for any finite entries. ``norms_a``/``norms_b``
    reuse norms already computed (:func:`row_norms`).

    Returns:
        ``(cosine (V,) float32, both_nonzero (V,) bool)``; cosine is 0 where undefined.
    """
    _check_matrix(a, "a")
    _check_matrix(b, "b")
    if a.shape != b.shape:
        raise HeadwatchError(f"expected two matrices of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    both = torch.empty(a.shape[0], dtype=torch.bool, device=a.device)
    cos = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    with full_precision(a.device):
        steps = _row_steps(a)
        for i in steps:
            j = i + steps.step
            ab, bb = a[i:j].double(), b[i:j].double()  # (n, d) float64: no overflow in the dot product
            na = norms_a[i:j].double() if norms_a is not None else torch.linalg.vector_norm(ab, dim=1)
            nb = norms_b[i:j].double() if norms_b is not None else torch.linalg.vector_norm(bb, dim=1)
            both[i:j] = (na > 0) & (nb > 0)
            # a batched (1 x d) @ (d x 1) product streams both blocks once (vecdot is slower on the CPU)
            dot = torch.bmm(ab.unsqueeze(1), bb.unsqueeze(2)).reshape(-1)
            cos[i:j] = (dot / (na * nb).clamp(min=torch.finfo(torch.float64).tiny)).clamp(-1.0, 1.0)
    return torch.where(both, cos, torch.zeros_like(cos)), both


class Summary(NamedTuple):
    """Mean, max, median and 95th percentile of selected values (NaN when none is selected)."""

    mean: Tensor
    max: Tensor
    p50: Tensor
    p95: Tensor
    count: Tensor


def summarize(values: Tensor, select: Tensor | None = None) -> Summary:
    """Summary statistics of ``values[select]`` as float64 scalars (syncs: call on logging steps)."""
    v = values if select is None else values[select]
    v = v.double()
    n = torch.tensor(float(v.numel()), dtype=torch.float64, device=values.device)
    if v.numel() == 0:
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=values.device)
        return Summary(nan, nan, nan, nan, n)
    p50, p95 = quantiles(v, (0.5, 0.95))
    return Summary(v.mean(), v.max(), p50, p95, n)


def summarize_groups(values: Tensor, groups: dict[str, Tensor]) -> dict[str, Summary]:
    """:func:`summarize` of ``values[mask]`` for several masks, sorting ``values`` once.

    Args:
        values: ``(V,)``; groups: name -> ``(V,)`` bool mask.
    """
    ordered, order = torch.sort(values.double())
    out = {}
    for name, mask in groups.items():
        v = ordered[mask.to(order.device)[order]]  # still ascending
        n = torch.tensor(float(v.numel()), dtype=torch.float64, device=values.device)
        if v.numel() == 0:
            nan = torch.tensor(float("nan"), dtype=torch.float64, device=values.device)
            out[name] = Summary(nan, nan, nan, nan, n)
            continue
        p50, p95 = sorted_quantiles(v, (0.5, 0.95))
        out[name] = Summary(v.mean(), v[-1], p50, p95, n)
    return out


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


def spearman(x: Tensor, y: Tensor) -> Tensor:
    """Spearman's rank correlation of two 1-D tensors, float64 scalar (NaN if undefined).

    Undefined (NaN) when there are fewer than 2 values, either input is constant, or holds NaN.
    """
    if x.shape != y.shape or x.ndim != 1:
        raise HeadwatchError(f"expected two 1-D tensors of the same length, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.numel() < 2 or bool(torch.isnan(x).any() | torch.isnan(y).any()):
        return torch.tensor(float("nan"), dtype=torch.float64, device=x.device)  # as SciPy: NaN in, NaN out
    rx = rankdata(x)
    ry = rankdata(y)
    rx = rx - rx.mean()
    ry = ry - ry.mean()
    denom = torch.sqrt((rx * rx).sum() * (ry * ry).sum())
    return torch.where(denom > 0, (rx * ry).sum() / denom, torch.nan)
