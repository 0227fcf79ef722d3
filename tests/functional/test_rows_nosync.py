"""Row norms and non-zero flags without a host sync (functional.rows), exact against float64 references."""

from __future__ import annotations

import math

import torch

import headwatch.functional.rows as rows


def test_overflowing_and_underflowing_rows_are_recomputed_exactly():
    m = torch.randn(50, 8)
    m[3] = 3e20  # float32 squares overflow
    m[7] = 1e-21  # float32 squares are subnormal: the float32 norm loses precision
    got = rows.row_norms(m)
    ref = torch.linalg.vector_norm(m.double(), dim=1)
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=0)
    assert math.isfinite(float(got[3])) and float(got[3]) == float(ref[3].float())  # the float32 rounding of the exact norm

def test_more_suspect_rows_than_the_bound_are_nan_not_wrong(monkeypatch):
    monkeypatch.setattr(rows, "FIX_ROWS", 2)
    m = torch.ones(6, 4)
    m[[1, 2, 4]] = 3e20  # three rows overflow float32; two are recomputed
    got = rows.row_norms(m)
    ref = torch.linalg.vector_norm(m.double(), dim=1).float()
    big = [1, 2, 4]
    fixed = [i for i in big if math.isfinite(float(got[i]))]
    assert len(fixed) == 2 and all(float(got[i]) == float(ref[i]) for i in fixed)
    assert sum(math.isnan(float(got[i])) for i in big) == 1  # never inf, never a wrong finite value
    assert torch.equal(got[[0, 3, 5]], ref[[0, 3, 5]])  # the other rows untouched


def test_nonzero_flags_see_entries_whose_squares_underflow():
    m = torch.zeros(5, 4)
    m[1, 2] = 1e-30  # its square underflows to 0: the float32 norm is 0
    m[3, 0] = float("nan")
    m[4, 1] = -2.0
    norms = torch.linalg.vector_norm(m, dim=1)
    assert float(norms[1]) == 0.0
    assert rows.row_nonzero_given_norms(m, norms).tolist() == [False, True, False, True, True]
    assert torch.equal(rows.row_nonzero_given_norms(m, norms), (m.double() != 0).any(dim=1) | m.isnan().any(dim=1))
