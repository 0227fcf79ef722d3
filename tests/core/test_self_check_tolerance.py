"""The self-check's strict rules: the tolerance follows the dtype the loss scored (checked against ``torch.finfo`` and
against the real rounding gap of bf16 and fp16 logits, in float64), position counts match exactly."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from headwatch.core.self_check import (
    TOLERANCES,
    CaptureTally,
    SelfCheck,
    Tolerance,
    dtype_tolerance,
)
from headwatch.integrations.loop import Headwatch
from tests.helpers.loop import Tiny, V

P = "headwatch"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [64, 128256])
def test_tolerance_is_the_documented_multiple_of_the_dtypes_eps(dtype, vocab):
    eps = torch.finfo(dtype).eps  # the reference, not headwatch's table
    nll, entropy = dtype_tolerance("nll", dtype, vocab), dtype_tolerance("entropy", dtype, vocab)
    assert nll == Tolerance(max(eps * math.log(vocab) / 8, 1e-5), max(1.28 * eps, 1e-4))
    assert entropy == Tolerance(max(eps * math.log(vocab) / 8, 5e-4), max(1.28 * eps, 1e-4))
    assert dtype_tolerance("accuracy", dtype, vocab) == TOLERANCES["accuracy"]
    assert dtype_tolerance("nll", None, vocab) == TOLERANCES["nll"]  # unknown: the fixed default


def test_bf16_keeps_the_calibrated_one_percent_and_orders_the_dtypes():
    assert dtype_tolerance("nll", torch.bfloat16, 64).rtol == pytest.approx(1e-2)
    order = [dtype_tolerance("nll", d, 32000) for d in (torch.float32, torch.float16, torch.bfloat16)]
    assert order[0].atol < order[1].atol < order[2].atol and order[0].rtol < order[1].rtol < order[2].rtol


def mean_figures(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """Mean NLL and mean entropy, in float64."""
    logp = torch.log_softmax(logits, -1)
    return F.nll_loss(logp, targets).item(), -(logp.exp() * logp).sum(-1).mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_rounding_of_low_precision_logits_stays_within_its_tolerance(dtype):
    """Mean NLL and entropy of logits rounded to ``dtype`` against the float64 values of the unrounded logits: the
    gap a loss in that dtype can have from headwatch's float32 recomputation of the same model."""
    g = torch.Generator().manual_seed(0)
    for vocab, scale in ((64, 1.0), (4096, 4.0), (32000, 8.0)):
        x = torch.randn(256, vocab, generator=g, dtype=torch.float64) * scale
        t = torch.randint(0, vocab, (256,), generator=g)
        rounded = x.to(dtype).double()

        (nll, ent), (nll_r, ent_r) = mean_figures(x, t), mean_figures(rounded, t)
        for key, ref, got in (("nll", nll, nll_r), ("entropy", ent, ent_r)):
            tol = dtype_tolerance(key, dtype, vocab)
            assert abs(got - ref) <= tol.atol + tol.rtol * abs(ref), (key, vocab, got - ref)


def extended(labelled: int, reference_positions: int, own: float, reference: float) -> dict:
    """The self-check of one step: headwatch measured ``labelled`` positions with mean NLL ``own``; the loss counted
    ``reference_positions`` with mean ``reference`` (float32 logits over 64 columns)."""
    check = SelfCheck(P)
    tally = CaptureTally()
    targets = torch.zeros(labelled, dtype=torch.long)
    tally.add(targets, -100, torch.float32, 64)
    check.begin(True)
    check.add_nll_sum(torch.tensor(reference * reference_positions, dtype=torch.float64), torch.tensor(reference_positions))
    scalars = {f"{P}/logits/target_nll": torch.tensor(own, dtype=torch.float64), f"{P}/logits/positions": torch.tensor(float(labelled))}
    return check.extend(scalars, [SimpleNamespace(capture_tally=tally)])


def test_position_counts_must_match_exactly():
    assert extended(100, 100, 2.5, 2.5)[f"{P}/check/mismatch"] == 0.0
    one_off = extended(100, 101, 2.5, 2.5)  # the same mean over one position more: a capture of other positions
    assert one_off[f"{P}/check/nll_gap"] == 0.0 and one_off[f"{P}/check/mismatch"] == 1.0


def step_loss_checked(model: torch.nn.Module, offset: float) -> dict[str, float]:
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0, summary=False)
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(3))
    hw.step_start({"input_ids": ids, "labels": ids}, 0)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    out = hw.step_end(loss=loss.detach() + offset)
    hw.close()
    return out


def test_the_tolerance_follows_the_logits_dtype_of_the_run():
    torch.manual_seed(0)
    model = Tiny()
    offset = 5e-3  # beyond float32's tolerance (about 3e-4 here), within bf16's (about 3e-2)
    assert step_loss_checked(model, 0.0)[f"{P}/check/mismatch"] == 0.0
    fp32 = step_loss_checked(model, offset)
    assert fp32[f"{P}/check/mismatch"] == 1.0 and f"{P}/logits/entropy" not in fp32  # withheld
    bf16 = step_loss_checked(model.to(torch.bfloat16), offset)
    assert bf16[f"{P}/check/mismatch"] == 0.0 and f"{P}/logits/entropy" in bf16
