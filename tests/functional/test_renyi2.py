"""Rényi-2 (collision) entropy ``H_2 = -log sum_v p_v^2`` (Rényi 1961) against an independent float64 reference.

The statistic is one field of ``LogitStatistics``; everything after it (sums, the published
``<prefix>/logits/renyi2_entropy``, the metric reference docs/reference/metrics.md) follows from that field and its line in
``headwatch.names``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from headwatch import Headwatch, names
from headwatch.core import LogitStats
from headwatch.functional import logit_softcap, logit_statistics, logit_statistics_from_hidden
from headwatch.functional.sums import logit_stats_compute, logit_stats_update
from headwatch.model.capture import Captured
from headwatch.model.captured import captured_statistics
from tests.helpers import TinyCausalLM, TokenDataset
from tests.helpers.paths import ROOT

NINF = float("-inf")


def reference(logits: torch.Tensor) -> torch.Tensor:
    """Per-position ``H_2`` in float64 through torch's softmax, NaN for rows with no distribution."""
    x = logits.detach().double()
    p = torch.softmax(x, dim=-1)  # exact zeros for -inf logits
    h2 = -(p**2).sum(-1).log()
    undefined = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | torch.isneginf(x).all(-1)
    return torch.where(undefined, torch.full_like(h2, float("nan")), h2)


def _gen(*shape, scale=3.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _with_ninf(seed=1):
    x = _gen(6, 50, seed=seed)
    x[0, ::3] = NINF  # masked columns
    x[1, 1:] = NINF  # one finite logit: one-hot, H_2 = 0
    x[2, :] = 0.0
    x[2, 7:] = NINF  # 7 equal logits, the rest masked: H_2 = log 7
    x[3, 5] = float("nan")  # no distribution: excluded
    x[4, :] = NINF  # none either
    return x


CASES = {
    "2d": lambda: _gen(16, 100),
    "3d": lambda: _gen(3, 5, 37),
    "peaked": lambda: _gen(4, 64, scale=40.0),
    "uniform": lambda: torch.zeros(3, 10),
    "v1": lambda: _gen(3, 1),
    "large_offset": lambda: _gen(5, 300) + 1e4,
    "ninf": _with_ninf,
}


def _check(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, equal_nan=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case):
    logits = CASES[case]()
    got = logit_statistics(logits)
    _check(got.renyi2_entropy, reference(logits), atol=2e-5)
    valid = got.valid
    h2, h = got.renyi2_entropy[valid], got.entropy[valid]
    assert (h2 >= 0).all() and (h2 <= h).all()  # Rényi entropies do not increase with the order


def test_ninf_logits_are_exact():
    got = logit_statistics(_with_ninf()).renyi2_entropy
    assert got[1].item() == 0.0  # one-hot
    assert got[2].item() == pytest.approx(math.log(7), abs=1e-6)
    assert math.isnan(got[3].item()) and math.isnan(got[4].item())


def test_bf16_input_is_measured_in_float32():
    x = (_gen(64, 5000, seed=2)).bfloat16()
    _check(logit_statistics(x).renyi2_entropy, reference(x), atol=1e-5)  # reference of the same bf16 values


def test_chunking_gives_the_same_values():
    x = _gen(4, 9, 200, seed=3)
    whole = logit_statistics(x).renyi2_entropy
    one_row = logit_statistics(x, max_chunk_bytes=1).renyi2_entropy  # one row per chunk
    strided = logit_statistics(x.transpose(0, 1), max_chunk_bytes=1).renyi2_entropy  # not viewable as 2-D: copied blocks
    _check(one_row, reference(x), atol=2e-5)
    torch.testing.assert_close(one_row, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(strided, whole.transpose(0, 1), atol=1e-6, rtol=0)


def test_hidden_state_path_shares_the_row_math():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 30, 32, generator=g).bfloat16()
    weight = (torch.randn(700, 32, generator=g) * 0.5).bfloat16()
    bias = torch.randn(700, generator=g)
    logits64 = hidden.double() @ weight.double().T + bias.double()  # independent float64 projection
    got = logit_statistics_from_hidden(hidden, weight, bias, max_chunk_bytes=1 << 16)
    _check(got.renyi2_entropy, reference(logits64), atol=1e-5)
    capped = logit_statistics_from_hidden(hidden, weight, bias, max_chunk_bytes=1 << 16, transform=logit_softcap(2.0))
    _check(capped.renyi2_entropy, reference(2.0 * torch.tanh(logits64 / 2.0)), atol=1e-5)
    # the monitors' capture with a padded vocabulary: chunks of projected logits, fields concatenated
    padded = captured_statistics(Captured("hidden", hidden=hidden, weight=weight, bias=bias), vocab_size=650,
                                 max_chunk_bytes=1 << 16)
    _check(padded.statistics.renyi2_entropy, reference(logits64), atol=1e-5)


def test_mean_over_valid_positions():
    x = _with_ninf()
    mask = torch.tensor([True, True, True, True, True, False])
    means = logit_stats_compute(logit_stats_update(logit_statistics(x, mask=mask)))
    want = reference(x)[:5]
    assert means["renyi2_entropy"].item() == pytest.approx(want[~torch.isnan(want)].mean().item(), abs=1e-6)


def _float64_h2(model, input_ids):
    """Mean H_2 over the positions that have a target (all but the last), from a float64 twin."""
    twin = copy.deepcopy(model).double()
    with torch.no_grad():
        return reference(twin(input_ids)[:, :-1]).mean().item()


def test_published_through_the_plain_loop_and_validation():
    torch.manual_seed(0)
    model = TinyCausalLM(lr=0.0)
    ds = TokenDataset(n=8, pad=False)
    batch = {"input_ids": ds.input_ids, "labels": ds.labels}
    want = _float64_h2(model, batch["input_ids"])
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1)
    hw.step_start(batch, 0)
    logits = model(batch["input_ids"])
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1)).backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    values = hw.step_end()
    hw.close()
    assert values["headwatch/logits/renyi2_entropy"] == pytest.approx(want, abs=1e-6)
    assert values["headwatch/logits/renyi2_entropy"] <= values["headwatch/logits/entropy"]

    # the core monitor's validation split, as the Lightning and HF doors drive it, on the hidden-state path
    monitor = LogitStats(path="hidden")
    monitor.attach(model)
    monitor.validation_batch_start(batch)
    with torch.no_grad():
        model(batch["input_ids"])
    with pytest.warns(UserWarning, match="forced by path='hidden'"):
        monitor.validation_batch_end()
    out = monitor.validation_epoch_end()
    monitor.detach()
    assert out["headwatch/val/logits/renyi2_entropy"].item() == pytest.approx(want, abs=1e-6)


def test_declared_and_documented():
    for split in ("logits", "val/logits"):
        metric = names.declaration(f"headwatch/{split}/renyi2_entropy")
        assert metric is not None and metric.unit == "nats" and metric.source == "Rényi 1961"
        assert "sum_v p_v^2" in metric.formula
    reference = (ROOT / names.REFERENCE_PATH).read_text(encoding="utf-8")
    assert reference == names.reference_page()  # the generated metric reference is current ...
    row = next(line for line in reference.splitlines() if line.startswith("| `headwatch/<split>/renyi2_entropy` |"))
    assert "| nats | mean Rényi entropy of order 2" in row and "`H_2(p) = -log sum_v p_v^2`" in row  # ... and holds the row
