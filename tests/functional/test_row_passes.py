"""The per-row reductions of a gradient or an update (functional.rows.row_norms_and_nonzero) against independent
references: float64 norms, an exact non-zero test, and an update made in place while it is measured."""

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


def _reference(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 norms and the exact non-zero test (NaN counts as non-zero)."""
    return torch.linalg.vector_norm(m.double(), dim=1), ((m != 0) | m.isnan()).any(dim=1)


def _check(m: torch.Tensor, norms: torch.Tensor, nonzero: torch.Tensor) -> None:
    want_norms, want_nonzero = _reference(m)
    assert torch.equal(nonzero, want_nonzero)
    assert norms.dtype == (torch.float64 if m.dtype == torch.float64 else torch.float32)
    finite = want_norms.isfinite()
    rtol = 1e-6 if m.dtype != torch.float64 else 1e-12
    assert torch.allclose(norms.double()[finite], want_norms[finite], rtol=rtol, atol=0)
    assert torch.equal(norms[~finite].isnan(), want_norms[~finite].isnan())
    assert ((norms == 0) == ~want_nonzero).all()  # a norm is 0 only for a zero row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_norms_and_nonzero_match_float64_references(dtype, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = _matrix(101, 64, dtype)
        norms, nonzero = rows.row_norms_and_nonzero(m)
    finally:
        torch.set_num_threads(previous)
    _check(m, norms, nonzero)
    assert nonzero[2] and nonzero[3]  # the sub-1e-23 row and the NaN row count as non-zero
    assert norms[1] > 1e21 and norms[2] > 0  # overflowing and underflowing float32 squares: recomputed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_update_is_made_in_place_and_measured(dtype):
    before = _matrix(64, 32, dtype)
    after = before.clone()
    after[10:20] += 1e-3  # rows that moved; the others did not (their difference is exactly 0)
    after = torch.nn.Parameter(after)  # a weight: the in-place subtraction records no graph
    buffer = before.clone()
    norms, nonzero = rows.row_norms_and_nonzero(buffer, subtract=after)
    delta = before - after.detach()
    assert _same_bits(buffer, delta) and not buffer.requires_grad
    _check(delta, norms, nonzero)
    assert nonzero[10:20].all() and not nonzero[20:-1].any()


def test_subtract_must_match_the_matrix():
    with pytest.raises(rows.HeadwatchError, match="expected a dense matrix and `subtract` of its shape"):
        rows.row_norms_and_nonzero(torch.zeros(4, 3), subtract=torch.zeros(4, 2))


def test_a_gradient_that_requires_grad_is_measured():
    """``create_graph=True`` backward leaves ``.grad`` tensors that require grad: measured as any other."""
    g = _matrix(30, 16, torch.float32).requires_grad_()
    norms, nonzero = rows.row_norms_and_nonzero(g)
    _check(g.detach(), norms, nonzero)
    assert not norms.requires_grad and not nonzero.requires_grad
