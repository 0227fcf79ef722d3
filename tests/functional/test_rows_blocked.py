"""The per-row reductions read each matrix once, block by block (functional.rows.row_norms_and_nonzero): the same
values, bit for bit, as whole-matrix passes, and an update made in place while it is measured."""

from __future__ import annotations

import pytest
import torch

from headwatch.functional import rows


def _matrix(V: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(V + d)
    m = torch.randn(V, d, generator=g, dtype=torch.float64) * 1e-3
    m[torch.rand(V, generator=g) < 0.6] = 0  # mostly zero rows, as an embedding's gradient
    m[1] = 3e20  # overflows float32 squares
    m[2, 0] = -1e-30  # underflows them: non-zero with a zero float32 norm
    m[3, 1] = float("nan")
    m[V - 1] = torch.linspace(-2, 2, d, dtype=torch.float64)
    return m.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN included)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _whole(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The three whole-matrix passes the blocks replace, with the same float64 recomputation."""
    acc = torch.float64 if m.dtype == torch.float64 else torch.float32
    norms = torch.linalg.vector_norm(m, dim=1, dtype=acc)
    nonzero = (norms != 0) | (m.amax(dim=1) != 0) | (m.amin(dim=1) != 0)
    if acc == torch.float64:
        return norms, nonzero
    suspect = torch.isinf(norms) | (nonzero & (norms < rows._LOW))
    return rows._fix_rows_float64(norms, suspect, lambda idx: rows._float64_norms(m, idx)), nonzero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_give_the_whole_matrix_values_bitwise(dtype, threads, monkeypatch):
    monkeypatch.setattr(rows, "ROW_BLOCK_BYTES", 7 * 64 * 4)  # blocks of a few rows, the last one short
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = _matrix(101, 64, dtype)
        norms, nonzero = rows.row_norms_and_nonzero(m)
    finally:
        torch.set_num_threads(previous)
    want_norms, want_nonzero = _whole(m)
    assert _same_bits(norms, want_norms) and torch.equal(nonzero, want_nonzero)
    assert nonzero[2] and nonzero[3]  # the sub-1e-23 row and the NaN row count as non-zero
    reference = torch.linalg.vector_norm(m.double(), dim=1)
    finite = reference.isfinite()
    assert torch.allclose(norms.double()[finite], reference[finite], rtol=1e-6 if dtype != torch.float64 else 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_update_is_made_and_measured_in_one_pass(dtype, monkeypatch):
    monkeypatch.setattr(rows, "ROW_BLOCK_BYTES", 5 * 32 * 4)
    before = _matrix(64, 32, dtype)
    after = before.clone()
    after[10:20] += 1e-3  # rows that moved; the others did not (their difference is exactly 0)
    after = torch.nn.Parameter(after)  # a weight: the in-place subtraction records no graph
    buffer = before.clone()
    norms, nonzero = rows.row_norms_and_nonzero(buffer, subtract=after)
    delta = before - after.detach()
    assert _same_bits(buffer, delta) and not buffer.requires_grad
    want_norms, want_nonzero = _whole(delta)
    assert _same_bits(norms, want_norms) and torch.equal(nonzero, want_nonzero)
    assert nonzero[10:20].all() and not nonzero[20:-1].any()


def test_subtract_must_match_the_matrix():
    with pytest.raises(rows.HeadwatchError, match="expected a dense matrix and `subtract` of its shape"):
        rows.row_norms_and_nonzero(torch.zeros(4, 3), subtract=torch.zeros(4, 2))


def test_a_gradient_that_requires_grad_is_measured():
    """``create_graph=True`` backward leaves ``.grad`` tensors that require grad: measured as any other."""
    g = _matrix(30, 16, torch.float32).requires_grad_()
    norms, nonzero = rows.row_norms_and_nonzero(g)
    want_norms, want_nonzero = _whole(g.detach())
    assert _same_bits(norms, want_norms) and torch.equal(nonzero, want_nonzero) and not norms.requires_grad
