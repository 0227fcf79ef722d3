"""Logits near float32's largest value (+-1e38, 3e38): finite rows whose float32 sums overflow. Every statistic matches
the float64 reference (``torch.log_softmax`` of the logits in float64) rounded to float32, on every path: a
contiguous tensor, a non-viewable one, a transform, and the fused path from hidden states."""

from __future__ import annotations

import math

import pytest
import torch

from headwatch.functional.hidden import logit_scale, logit_statistics_from_hidden
from headwatch.functional.logits import logit_statistics

V = 128


def _rows() -> torch.Tensor:
    """(6, V) float32 rows, each finite: where the sum of ``x - max`` overflows float32, where ``x - max`` itself does,
    and ordinary rows around them (that recomputing a row leaves the others alone)."""
    g = torch.Generator().manual_seed(0)
    half = torch.tensor([1e38, -1e38]).repeat(V // 2)  # sum of x - max: -2e38 * 64, overflows; KL(U || p) 1e38
    one_high = torch.full((V,), -3e38)
    one_high[5] = 3e38  # x - max = -6e38 overflows: KL(U || p) 6e38 (127 / 128) is beyond float32 too (inf)
    ordinary = torch.randn(V, generator=g) * 3
    wide = torch.linspace(-3e36, 3e36, V)  # the sum of x - max, -3e36 * 128, overflows; x - max does not: KL 3e36
    masked = torch.randn(V, generator=g)
    masked[3] = -math.inf  # a -inf logit: KL(U || p) is +inf exactly, not a row to recompute
    return torch.stack([half, ordinary, one_high, wide, masked, ordinary.flip(0)])


def _reference(x: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 statistics of ``softmax(x)`` from ``torch.log_softmax`` (an independent recomputation), per row."""
    lp = torch.log_softmax(x.double(), dim=-1)
    p = lp.exp()
    entropy = -torch.where(p > 0, p * lp, 0.0).sum(-1)
    return {
        "entropy": entropy,
        "kl_to_uniform": math.log(V) - entropy,
        "kl_from_uniform": -math.log(V) - lp.mean(-1),
        "max_prob": p.amax(-1),
        "renyi2_entropy": -torch.log((p * p).sum(-1)),
        "nll": -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
    }


def _check(stats, x: torch.Tensor, targets: torch.Tensor) -> None:
    want = _reference(x, targets)
    for name, ref in want.items():
        got = getattr(stats, name).reshape(-1)
        torch.testing.assert_close(got.double(), ref.float().double(), rtol=2e-6, atol=2e-6, msg=name)


@pytest.fixture(scope="module")
def case():
    x = _rows()
    targets = torch.tensor([1, 0, 7, 127, 3, 9])
    return x, targets


def test_kl_from_uniform_of_finite_rows_whose_float32_sums_overflow_is_the_float64_value(case):
    x, targets = case
    stats = logit_statistics(x, targets=targets)
    _check(stats, x, targets)
    kl = stats.kl_from_uniform
    assert kl[0] == pytest.approx(1e38, rel=1e-6) and kl[3] == pytest.approx(3e36, rel=1e-5)
    assert math.isinf(kl[2]) and math.isinf(kl[4])  # 6e38 is beyond float32; a -inf logit: p_v = 0
    assert torch.isfinite(stats.entropy).all() and stats.valid.all()


def test_two_logits_three_e38_apart_by_six_e38_give_a_finite_kl():
    """``x - max`` overflows to -inf (exp 0: right to float32 precision, p = e^-6e38), yet KL(U || p) =
    (6e38 - log 2) / 2 is within float32's range."""
    x = torch.tensor([[3e38, -3e38], [-3e38, 3e38]])
    stats = logit_statistics(x, targets=torch.tensor([0, 0]))
    want = _reference(x, torch.tensor([0, 0]))
    assert stats.kl_from_uniform.tolist() == pytest.approx([3e38, 3e38], rel=1e-6)
    torch.testing.assert_close(stats.kl_from_uniform.double(), want["kl_from_uniform"].float().double())
    assert stats.nll.tolist() == [0.0, float("inf")] and stats.entropy.tolist() == [0.0, 0.0]
    assert want["nll"][1] == pytest.approx(6e38) and stats.max_prob.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("path", ["non-viewable", "transform", "hidden", "bfloat16"])
def test_every_path_recomputes_the_overflowed_rows(case, path):
    x, targets = case
    if path == "non-viewable":  # seen through a transpose: blocks are copied, rows found by their position
        logits, t = x.view(2, 3, V).transpose(0, 1), targets.view(2, 3).T  # (3, 2, V), not viewable as (6, V)
        stats = logit_statistics(logits, targets=t, max_chunk_bytes=3 * V * 4)
        _check(stats, logits.reshape(-1, V), t.reshape(-1))
    elif path == "transform":  # the statistics are those of the transformed logits, recomputed rows too
        stats = logit_statistics(x / 4, targets=targets, transform=logit_scale(4.0))
        _check(stats, x / 4 * 4.0, targets)
    elif path == "hidden":  # x = hidden @ W.T, W holding the rows' logits / 1e19
        finite = x.clone()
        finite[4, 3] = 0.0  # a product has no -inf logit
        weight = (finite / 1e19).T.contiguous()  # (V, 6): column i is row i's logits / 1e19
        hidden = torch.eye(6) * 1e19  # (6, 6): row i picks column i
        stats = logit_statistics_from_hidden(hidden, weight, targets=targets)
        _check(stats, hidden @ weight.T, targets)
    else:  # bfloat16 holds +-1e38 and 3e38 (its range is float32's)
        b = x.to(torch.bfloat16)
        _check(logit_statistics(b, targets=targets), b.float(), targets)


def test_beyond_the_rows_read_again_the_smallest_maxima_keep_inf(monkeypatch):
    """Two overflowed rows and one read again: the one with the largest ``|max|`` gets its value, the other keeps the
    float32 sum's ``+inf``, as before (a diverged run); the -inf row, the ordinary one, unchanged."""
    from headwatch.functional import logits

    monkeypatch.setattr(logits, "OVERFLOW_ROWS", 1)
    x = _rows()[[0, 3, 4, 1]]  # +-1e38 (|max| 1e38), +-3e36 (3e36), a -inf logit, ordinary
    got = logits.logit_statistics(x).kl_from_uniform
    want = _reference(x, torch.zeros(4, dtype=torch.long))["kl_from_uniform"].float()
    assert got[0] == pytest.approx(float(want[0]), rel=1e-6) and math.isinf(got[1]) and math.isfinite(want[1])
    assert math.isinf(got[2]) and got[3] == pytest.approx(float(want[3]), rel=1e-5)


def test_the_recomputation_makes_no_host_sync(case):
    """The overflowed rows are found and read again with fixed-size ops: nothing waits for the device."""
    from tests.helpers.syncs import SyncCounter

    x, targets = case
    with SyncCounter() as counter:
        logit_statistics(x, targets=targets)
    assert counter.events == [], counter.events
