"""Collision beyond common drift: nearest neighbours after removing the shared directions of the rows.

Why. Rare and never-seen tokens' head rows all receive nearly the same "push-down" gradient
(``sum_n p_{n,i} h_n``), so they drift together along one common direction ("representation
degeneration", Gao et al., ICLR 2019). Raw cosine then calls almost every rare row a
near-duplicate of another (on headwatch's example 99.6% of rare rows reach cosine 0.9, tied or
untied). That is drift, not two specific rows merging.

Correction ("all-but-the-top", Mu & Viswanath, ICLR 2018). With ``mu`` the mean of the valid rows
and ``U`` (``(d, k)``, orthonormal columns) their top-``k`` principal directions (eigenvectors of
the covariance ``C = sum_i (x_i - mu)(x_i - mu)^T`` with the ``k`` largest eigenvalues), each row
becomes

    ``x' = (x - mu) - U U^T (x - mu)``,

default ``k = max(1, round(d_model / 100))`` (the paper's rule of thumb). A rare row *collides*
when its nearest other pairable row has corrected cosine ``>= tau`` (default 0.9).

Drift itself is reported, not hidden: the variance share of the removed directions
``sum_{j<=k} lambda_j / trace(C)``, the mean cosine of rare rows to their mean direction (the
mean resultant length ``||mean_i x_i / ||x_i||||`` of directional statistics, Mardia & Jupp
2000), and the raw-cosine rate (the older definition, which measures drift).

Memory: the principal directions come from a ``(d, d)`` float64 covariance accumulated over
chunks of rows when that is cheap, else from randomized subspace iteration on the covariance
operator (Halko, Martinsson & Tropp, SIAM Review 2011, Alg. 4.4): each pass reads the rows a
chunk at a time, so the extra memory is one chunk, a few ``(d, k + 10)`` matrices, and the one
``(V, d)`` float32 matrix of corrected rows that the neighbour search reads. Never ``(V, V)``.
A row-sharded matrix (FSDP2) is corrected process by process, its row sums all-reduced
(:func:`principal_directions_of`, :mod:`headwatch.distributed.sharded_drift`): ``n x d`` local rows each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.neighbors import nearest_neighbours
from headwatch.functional.precision import single_threaded

DEFAULT_TAU = 0.9
_OVERSAMPLE = 10  # extra columns of the randomized subspace (Halko et al. recommend 5-10)
_EXACT_MACS = 2**33  # covariance cheaper than this many multiply-adds: exact float64 path


def default_k(d_model: int) -> int:
    """``max(1, round(d_model / 100))``: directions removed by default (Mu & Viswanath 2018)."""
    return max(1, round(d_model / 100))


class DriftCorrection(NamedTuple):
    """Rows with the mean and the top principal directions removed, and what was removed."""

    rows: Tensor
    """``(V, d)`` float32 corrected rows (every row is corrected; only valid rows defined ``mu``, ``U``)."""
    mean: Tensor
    """``(d,)`` float32, mean of the valid rows."""
    directions: Tensor
    """``(d, k)`` float32, orthonormal principal directions, largest variance first."""
    variances: Tensor
    """``(k,)`` float64, variance (sum of squares of centred valid rows) along each direction."""
    total_variance: Tensor
    """float64 scalar, ``trace(C)``: sum of squared norms of the centred valid rows."""

    @property
    def removed_variance(self) -> Tensor:
        """Share of ``trace(C)`` held by the removed directions, in ``[0, 1]`` (NaN for no variance)."""
        return self.variances.sum() / self.total_variance


def check_rows(rows: Tensor, valid: Tensor | None) -> Tensor:
    if not isinstance(rows, Tensor) or rows.ndim != 2 or not rows.is_floating_point():
        got = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
        raise HeadwatchError(f"expected a floating `rows` matrix of shape [vocab_size, d_model], got {got}")
    V = rows.shape[0]
    if valid is None:
        return torch.ones(V, dtype=torch.bool, device=rows.device)
    if not isinstance(valid, Tensor) or valid.shape != (V,) or valid.dtype != torch.bool:
        got = (tuple(valid.shape), valid.dtype) if isinstance(valid, Tensor) else type(valid).__name__
        raise HeadwatchError(f"expected `valid` of shape ({V},) and dtype bool, got {got}")
    return valid.to(rows.device)


def _chunk_rows(d: int, columns: int, max_chunk_bytes: int) -> int:
    """Rows per chunk: a float32 chunk, its float64 copy and a ``(rows, columns)`` product fit the budget."""
    return max(1, max_chunk_bytes // (4 * d + 8 * d + 8 * columns))


def _chunks(rows: Tensor, ids: Tensor, step: int) -> Iterator[Tensor]:
    """The rows ``ids`` a chunk at a time: ``(c, d)`` slices when ``ids`` is every row, else copies.

    ``ids`` may also be a ``(V,)`` bool mask: every row in order, those outside the mask zero (new
    tensors; nothing selected by value)."""
    if ids.dtype == torch.bool:
        for s in range(0, rows.shape[0], step):
            yield torch.where(ids[s : s + step].unsqueeze(1), rows[s : s + step], 0.0)
        return
    every = ids.numel() == rows.shape[0]  # ids are sorted and unique: every row, in order
    for s in range(0, ids.numel(), step):
        yield rows[s : s + step] if every else rows.index_select(0, ids[s : s + step])


def _centred_chunks(rows: Tensor, ids: Tensor, mean: Tensor, step: int, dtype: torch.dtype = torch.float32) -> Iterator[Tensor]:
    """``(c, d)`` rows ``ids`` minus ``mean`` in ``dtype`` (new tensors), a chunk at a time (a bool mask
    ``ids``: every row, those outside the mask zero after centring)."""
    if ids.dtype == torch.bool:
        for s in range(0, rows.shape[0], step):
            chunk = rows[s : s + step]
            xc = torch.sub(chunk, mean, out=torch.empty(chunk.shape, dtype=dtype, device=chunk.device))
            yield torch.where(ids[s : s + step].unsqueeze(1), xc, 0.0)
        return
    for chunk in _chunks(rows, ids, step):
        yield torch.sub(chunk, mean, out=torch.empty(chunk.shape, dtype=dtype, device=chunk.device))


def _covariance_times(rows: Tensor, ids: Tensor, mean: Tensor, basis: Tensor, step: int) -> Tensor:
    """``C @ basis`` (float64 ``(d, q)``) with ``C`` the covariance of the rows ``ids``, by chunks."""
    out = torch.zeros_like(basis)
    b32 = basis.float()
    for xc in _centred_chunks(rows, ids, mean, step):
        out += (xc.T @ (xc @ b32)).double()  # float32 products, float64 accumulation over chunks
    return out


@torch.no_grad()
def top_principal_directions(
    rows: Tensor,
    valid: Tensor | None = None,
    k: int | None = None,
    method: str = "auto",
    niter: int = 2,
    seed: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mean, top-``k`` principal directions, their variances and the total variance of the valid rows.

    Args:
        rows: ``(V, d)`` floating (any dtype; read a chunk at a time, never copied whole).
        valid: ``(V,)`` bool, rows that define the mean and the directions (default: all).
        k: directions; default :func:`default_k`. Must be in ``[1, d]``.
        method: ``"exact"`` (float64 ``(d, d)`` covariance accumulated by chunks, then
            ``torch.linalg.eigh``), ``"randomized"`` (subspace iteration with ``k + 10``
            columns, ``niter`` passes), or ``"auto"`` (exact when ``n d^2 <= 2^33``).
        niter: power iterations of the randomized method (2: Halko et al.'s advice for a
            slowly decaying spectrum; the drift directions stand far above the rest).
        seed: seed of the randomized method's starting subspace.
        max_chunk_bytes: bound on one chunk's working memory.

    Returns:
        ``(mean (d,) float32, directions (d, k) float32, variances (k,) float64,
        total_variance () float64)``; variances are eigenvalues of ``C`` (unnormalised sums of
        squares), largest first.

    Raises:
        HeadwatchError: bad shapes or dtypes, ``k`` outside ``[1, d]``, an unknown ``method``,
            or fewer than 2 valid rows.
    """
    valid = check_rows(rows, valid)
    d = rows.shape[1]
    k = default_k(d) if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d:
        raise HeadwatchError(f"`k` must be an int in [1, d_model={d}], got {k!r}")
    if method not in ("auto", "exact", "randomized"):
        raise HeadwatchError(f"`method` must be 'auto', 'exact' or 'randomized', got {method!r}")
    return principal_directions_of(rows, valid.nonzero().flatten(), k, method, niter, seed, max_chunk_bytes)


def _same(total: Tensor) -> Tensor:
    return total


def principal_directions_of(
    rows: Tensor,
    ids: Tensor,
    k: int,
    method: str = "auto",
    niter: int = 2,
    seed: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    total: Callable[[Tensor], Tensor] = _same,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`top_principal_directions` of the rows ``ids`` (sorted, unique), arguments already checked.

    Every row-sum (the count, the mean's ``(d,)`` sum, the ``(d, d)`` covariance or the
    randomized path's ``(d, k + 10)`` products and trace) goes through ``total``: the identity on
    one process, an all-reduce sum over processes that each pass their own rows (row-sharded
    matrices, :mod:`headwatch.distributed.sharded_drift`). The randomized start is seeded, so every
    process computes the same directions from the same sums.

    ``ids`` may also be a ``(V,)`` bool mask of the rows (:func:`principal_directions_masked`): then no
    value is read on the host (the row count stays on the device, ``"auto"`` decides on ``V``, the
    randomized start is drawn on the rows' device) and fewer than 2 rows do not raise.

    Raises:
        HeadwatchError: fewer than 2 rows in all (``ids`` not a mask).
    """
    d = rows.shape[1]
    masked = ids.dtype == torch.bool
    if masked:  # no data-dependent selection and no host read: the count stays on the device
        ids = ids.to(rows.device)
        n: Any = total(ids.sum(dtype=torch.float64))
        decided_on = rows.shape[0]
    else:
        n = ids.numel() if total is _same else int(total(torch.tensor(float(ids.numel()), dtype=torch.float64, device=rows.device)))
        if n < 2:
            raise HeadwatchError(f"principal directions need at least 2 valid rows, got {n}")
        decided_on = n
    q = min(d, k + _OVERSAMPLE)
    step = _chunk_rows(d, max(d, q), max_chunk_bytes)
    sums = torch.zeros(d, dtype=torch.float64, device=rows.device)
    for chunk in _chunks(rows, ids, step):
        sums += chunk.sum(0, dtype=torch.float64)
    mean64 = total(sums) / n
    mean = mean64.float()
    if method == "exact" or (method == "auto" and decided_on * d * d <= _EXACT_MACS):
        directions, variances, trace = _exact_directions(rows, ids, mean64, k, step, total)
    else:
        directions, variances, trace = _randomized_directions(rows, ids, mean, k, q, niter, seed, step, total, masked)
    return mean, directions, variances, trace


def _exact_directions(
    rows: Tensor, ids: Tensor, mean64: Tensor, k: int, step: int, total: Callable[[Tensor], Tensor] = _same
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``k`` eigenpairs of the float64 covariance accumulated over chunks (summed by ``total``), and its trace."""
    d = rows.shape[1]
    cov = torch.zeros(d, d, dtype=torch.float64, device=rows.device)
    for xc in _centred_chunks(rows, ids, mean64, step, torch.float64):
        cov.addmm_(xc.T, xc)
    cov = total(cov)
    with single_threaded(cov.device, d):
        values, vectors = torch.linalg.eigh(cov)  # ascending
    return vectors.flip(1)[:, :k].float(), values.flip(0)[:k].clamp(min=0.0), cov.diagonal().sum()


def _randomized_directions(
    rows: Tensor, ids: Tensor, mean: Tensor, k: int, q: int, niter: int, seed: int, step: int,
    total: Callable[[Tensor], Tensor] = _same, start_on_device: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Subspace iteration on the covariance operator (Halko et al. 2011, Alg. 4.4), then Rayleigh-Ritz.

    ``start_on_device``: the seeded start drawn by a generator on the rows' device (no host-to-device
    copy; on a GPU another draw of the same distribution), else on the CPU and copied."""
    d = rows.shape[1]
    if start_on_device:
        gen = torch.Generator(device=rows.device).manual_seed(seed)
        start = torch.randn(d, q, generator=gen, dtype=torch.float64, device=rows.device)
    else:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        start = torch.randn(d, q, generator=gen, dtype=torch.float64).to(rows.device)
    basis = torch.linalg.qr(start).Q
    for _ in range(niter):
        basis = torch.linalg.qr(total(_covariance_times(rows, ids, mean, basis, step))).Q
    trace = torch.zeros((), dtype=torch.float64, device=rows.device)
    projected = torch.zeros_like(basis)
    b32 = basis.float()
    for xc in _centred_chunks(rows, ids, mean, step):
        trace += xc.double().square().sum()
        projected += (xc.T @ (xc @ b32)).double()
    both = total(torch.cat([projected, trace.reshape(1, 1).expand(1, projected.shape[1])]))  # one collective
    projected, trace = both[:-1], both[-1, 0]
    with single_threaded(basis.device, q):
        values, vectors = torch.linalg.eigh(basis.T @ projected)  # (q, q), ascending
    directions = torch.linalg.qr(basis @ vectors.flip(1)[:, :k]).Q
    return directions.float(), values.flip(0)[:k].clamp(min=0.0), trace


@torch.no_grad()
def principal_directions_masked(rows: Tensor, mask: Tensor, k: int, **options: Any) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`principal_directions_of` of the rows in ``mask``, without reading a value on the host.

    Every row is read a chunk at a time and the rows outside ``mask`` contribute zero (no
    data-dependent selection); the row count stays on the device. ``method`` ``"auto"`` decides
    on the matrix's row count ``V`` (``V d^2 <= 2^33``: exact), known without a sync, where
    :func:`principal_directions_of` decides on the selected rows; the randomized start is drawn
    on the rows' device.

    Args:
        rows: ``(V, d)`` floating; mask: ``(V,)`` bool; k: directions, in ``[1, d]`` (not checked).
        options: ``method``, ``niter``, ``seed``, ``max_chunk_bytes`` as in :func:`principal_directions_of`.

    Returns:
        ``(mean (d,) float32, directions (d, k) float32, variances (k,) float64, total_variance ()
        float64, n () float64)``: as :func:`top_principal_directions`, and the number of rows in
        ``mask``. Fewer than 2 rows do not raise here (the caller checks ``n`` on the host, after
        its one transfer): the mean is then NaN or the covariance zero.
    """
    mask = mask.to(device=rows.device, dtype=torch.bool)
    return (*principal_directions_of(rows, mask, k, **options), mask.sum(dtype=torch.float64))


def unit_row_sum_masked(rows: Tensor, ids: Tensor, keep: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """:func:`unit_row_sum` of the rows ``ids[keep]``, without a data-dependent selection: ``(d,)`` float64."""
    d = rows.shape[1]
    total = torch.zeros(d, dtype=torch.float64, device=rows.device)
    tiny = torch.finfo(torch.float32).tiny
    ids, keep = ids.to(rows.device).long(), keep.to(rows.device)
    step = _chunk_rows(d, 0, max_chunk_bytes)
    for s in range(0, ids.numel(), step):
        x = rows.index_select(0, ids[s : s + step]).float()
        unit = (x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp(min=tiny)).double()
        total += torch.where(keep[s : s + step].unsqueeze(1), unit, 0.0).sum(0)
    return total


@torch.no_grad()
def remove_top_directions(rows: Tensor, valid: Tensor | None = None, k: int | None = None, **options: Any) -> DriftCorrection:
    """Subtract the valid rows' mean and project out their top-``k`` principal directions.

    ``x' = (x - mu) - U U^T (x - mu)`` for every row (Mu & Viswanath 2018, "all-but-the-top"),
    in float32 on the rows' device; ``mu`` and ``U`` from the valid rows only
    (:func:`top_principal_directions`).

    Args:
        rows: ``(V, d)`` floating, e.g. ``lm_head.weight``; not modified.
        valid: ``(V,)`` bool (default: all rows).
        k: as in :func:`top_principal_directions`.
        **options: ``method``, ``niter``, ``seed``, ``max_chunk_bytes``, keyword only, as in
            :func:`top_principal_directions` (``max_chunk_bytes`` also bounds the correction's chunks).

    Returns:
        :class:`DriftCorrection`; its ``rows`` is the one new ``(V, d)`` float32 matrix.

    Raises:
        HeadwatchError: as :func:`top_principal_directions`.
    """
    mean, directions, variances, total = top_principal_directions(rows, valid, k, **options)
    corrected = apply_correction(rows, mean, directions, options.get("max_chunk_bytes", DEFAULT_MAX_CHUNK_BYTES))
    return DriftCorrection(corrected, mean, directions, variances, total)


def apply_correction(rows: Tensor, mean: Tensor, directions: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """``x' = (x - mean) - U U^T (x - mean)`` of every row: ``(n, d)`` rows, ``(d,)`` mean, ``(d, k)`` ``U``.

    Returns one new ``(n, d)`` float32 tensor (on a row-sharded matrix: the local rows only),
    computed a chunk of rows at a time.
    """
    n, d = rows.shape
    out = torch.empty(n, d, dtype=torch.float32, device=rows.device)
    step = _chunk_rows(d, directions.shape[1], max_chunk_bytes)
    w = rows.detach()
    for s in range(0, n, step):
        block = out[s : s + step]
        torch.sub(w[s : s + step], mean, out=block)  # (c, d) float32
        block.addmm_(block @ directions, directions.T, alpha=-1.0)
    return out


class Pairable(NamedTuple):
    """Rows that may be either side of a pair, and the counts of each excluded kind (int64 scalars)."""

    mask: Tensor
    """``(V,)`` bool: valid, seen (unless unseen rows are included), finite and not all zero."""
    padded: Tensor
    """rows that are not valid (padded vocabulary, ``padding_idx``)."""
    unseen: Tensor
    """valid rows never seen in the data (excluded unless ``include_unseen``)."""
    zero: Tensor
    """valid rows that are all zero."""
    nonfinite: Tensor
    """valid rows holding NaN or inf."""


@torch.no_grad()
def pairable_rows(
    rows: Tensor,
    valid: Tensor | None = None,
    seen: Tensor | None = None,
    include_unseen: bool = False,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Pairable:
    """Rows allowed on either side of a nearest-neighbour pair, by default.

    Never-seen tokens, padded rows and all-zero rows say nothing about two tokens merging:
    they are excluded from both sides of a pair and counted on their own.

    Args:
        rows: ``(V, d)`` floating.
        valid: ``(V,)`` bool, rows that can occur (default: all).
        seen: ``(V,)`` bool, tokens seen in the data (default: all).
        include_unseen: keep never-seen valid rows.

    Raises:
        HeadwatchError: bad shapes or dtypes.
    """
    valid = check_rows(rows, valid)
    seen = check_rows(rows, seen)
    norms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    step = _chunk_rows(rows.shape[1], 0, max_chunk_bytes)
    for s in range(0, rows.shape[0], step):
        norms[s : s + step] = torch.linalg.vector_norm(rows[s : s + step].float(), dim=1)
    finite = torch.isfinite(norms)
    zero = finite & (norms == 0)
    unseen = valid & ~seen
    mask = valid & finite & ~zero & (seen | include_unseen)
    return Pairable(
        mask, (~valid).sum(), unseen.sum(), (valid & zero).sum(), (valid & ~finite).sum()
    )


def mean_resultant_length(rows: Tensor, ids: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """Mean cosine of the rows ``ids`` to their mean direction, float64 scalar (NaN for none).

    With unit vectors ``u_i = x_i / ||x_i||`` and mean direction ``m = sum u_i / ||sum u_i||``,
    ``mean_i cos(x_i, m) = ||mean_i u_i||`` (the mean resultant length, Mardia & Jupp 2000):
    1 when all rows point one way, about ``1/sqrt(n)`` for random directions. Zero rows
    count as zero vectors.
    """
    return resultant_length(unit_row_sum(rows, ids, max_chunk_bytes), ids.numel())


def resultant_length(unit_sum: Tensor, n: int) -> Tensor:
    """``||unit_sum|| / n``: the mean resultant length of ``n`` rows from the ``(d,)`` float64 sum of their
    unit vectors (:func:`unit_row_sum`, all-reduced when the rows are sharded); NaN when ``n`` is 0."""
    return torch.linalg.vector_norm(unit_sum) / n if n else unit_sum.new_tensor(float("nan"))


def unit_row_sum(rows: Tensor, ids: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Tensor:
    """``sum_i x_i / ||x_i||`` over the rows ``ids`` of ``(n, d)`` ``rows``: ``(d,)`` float64 (a zero row adds 0)."""
    d = rows.shape[1]
    total = torch.zeros(d, dtype=torch.float64, device=rows.device)
    tiny = torch.finfo(torch.float32).tiny
    ids = ids.to(rows.device).long()
    step = _chunk_rows(d, 0, max_chunk_bytes)
    for s in range(0, ids.numel(), step):
        x = rows.index_select(0, ids[s : s + step]).float()
        total += (x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp(min=tiny)).double().sum(0)
    return total
