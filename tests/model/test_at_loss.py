"""Measured at the loss (``headwatch.model.at_loss``): the fused losses through their transformers patches, the
wrappers put in place and taken away, TRL's fused output read, the families' transform table.

References, independent of headwatch: the loss's own per-token values (Cut Cross-Entropy's ``reduction="none"`` on
the same hidden states, under the same autocast), float64 recomputations.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import transformers

from headwatch.integrations.loop import Headwatch
from headwatch.model.at_loss import (
    LossCalls,
    fused_head_values,
    liger_call,
    watch_loss_function,
)
from headwatch.model.sources import final_logit_transform
from tests.helpers.fused import cce_token_nll, cut_cross_entropy_patch
from tests.helpers.hf import one_batch, tiny_llama

P = "headwatch"


@pytest.fixture
def cce_patch(monkeypatch):
    """``cce_patch(model)``: the model's forward replaced as Cut Cross-Entropy's transformers patch replaces it."""
    yield from cut_cross_entropy_patch(monkeypatch)


@pytest.mark.parametrize("bf16", [True, False])
def test_cut_cross_entropy_through_its_transformers_patch(cce_patch, bf16):
    """The loss never holds the logits; headwatch reads its call (the hidden states and weight it scored, at its
    precision): the target NLL equals the loss's own per-token values to 1e-6 relative, under bf16 autocast too."""
    model, batch = tiny_llama(tie=True), one_batch()
    cce_patch(model)
    hw = Headwatch(
        model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0
    )
    hidden = []
    model.model.register_forward_hook(
        lambda m, a, out: hidden.append(out.last_hidden_state.detach())
    )
    hw.step_start(batch, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(**batch).loss.backward()
        want, positions = cce_token_nll(
            hidden[0], model.lm_head.weight, batch["labels"]
        )  # the loss's own values
    values = hw.step_end()
    hw.close()
    want = want.item()
    assert values[f"{P}/logits/positions"] == positions
    assert abs(values[f"{P}/logits/target_nll"] - want) <= 1e-6 * want
    assert values[f"{P}/check/mismatch"] == 0 and math.isfinite(
        values[f"{P}/logits/ece"]
    )


def test_the_loss_function_wrapper_is_put_back_at_detach():
    model = tiny_llama(tie=True)
    before = model.loss_function
    hw = Headwatch(
        model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0
    )
    assert (
        getattr(model.loss_function, "__headwatch_loss__", False)
        and model.loss_function.__wrapped__ is before
    )
    hw.close()
    assert "_loss_function" not in model.__dict__ and model.loss_function is before
    own = lambda **kw: before(**kw)
    model.loss_function = own
    undo = watch_loss_function(model, lambda call: None, lambda: False)
    assert model.loss_function is not own
    undo()
    assert model.loss_function is own


def test_fused_loss_wrappers_are_restored_when_the_last_capture_leaves(
    cce_patch, monkeypatch
):
    # the process-wide registry, as if this capture were the process's only one (an earlier test's model may live on)
    monkeypatch.setattr(LossCalls, "_listeners", [])
    monkeypatch.setattr(LossCalls, "_replaced", {})
    module = sys.modules["cut_cross_entropy.transformers.llama"]
    original = module.linear_cross_entropy
    model = tiny_llama(tie=True)
    cce_patch(model)
    hw = Headwatch(
        model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0
    )
    assert (
        module.linear_cross_entropy is not original
        and module.linear_cross_entropy.__wrapped__ is original
    )
    hw.close()
    assert module.linear_cross_entropy is original


def test_trls_fused_output_is_read_with_its_positions_and_labels():
    labels = torch.tensor([[-100, 5, 6, -100]])
    out = types.SimpleNamespace(log_probs=torch.tensor([[-1.0, -2.0, 0.0]]), label_mask=torch.tensor([[True, True, False]]),
                                entropy=torch.tensor([[0.5, 0.7, 0.0]]), is_top1=None)  # fmt: skip
    values, targets, shifted = fused_head_values(out, {"labels": labels})
    assert shifted and targets.tolist() == [[5, 6, -100]]
    assert values.nll.tolist() == [[1.0, 2.0, -0.0]] and values.valid.tolist() == [
        [True, True, False]
    ]
    assert values.entropy is not None and values.is_top1 is None
    assert (
        fused_head_values(
            types.SimpleNamespace(logits=torch.zeros(1, 4, 3)), {"labels": labels}
        )
        is None
    )


def test_a_liger_call_is_read_with_the_loss_shift():
    def LigerForCausalLMLoss(hidden_states, lm_head_weight, labels, hidden_size, num_items_in_batch=None,
                             ignore_index=-100, shift_labels=None, final_logit_softcapping=None, **kwargs):  # fmt: skip
        """The signature of Liger Kernel's ``transformers.model.loss_utils.LigerForCausalLMLoss``."""

    h, w, labels = (
        torch.randn(2, 4, 8),
        torch.randn(16, 8),
        torch.tensor([[1, 2, 3, 4], [5, 6, -100, -100]]),
    )
    call = liger_call(
        LigerForCausalLMLoss, (h, w, labels, 8), {"final_logit_softcapping": 30.0}
    )
    assert call.targets.tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]
    assert (
        call.precision == (torch.float32, torch.float32)
        and "30.0 * tanh" in call.transform.description
    )
    x = torch.tensor([100.0])
    assert torch.allclose(call.transform(x), 30.0 * torch.tanh(x / 30.0))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="not run: CUDA only (Liger Kernel's Triton kernels)",
)
def test_liger_through_its_transformers_patch():
    """Liger's fused linear cross-entropy through ``apply_liger_kernel_to_llama``: the target NLL equals the loss's
    own value (its mean over the loss's positions) to 1e-6 relative, in bf16."""
    liger = pytest.importorskip("liger_kernel.transformers")
    liger.apply_liger_kernel_to_llama(
        fused_linear_cross_entropy=True, cross_entropy=False
    )
    model, batch = (
        tiny_llama(tie=True).cuda(),
        {k: v.cuda() for k, v in one_batch().items()},
    )
    hw = Headwatch(
        model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0
    )
    hw.step_start(batch, 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    values = hw.step_end()
    hw.close()
    assert values[f"{P}/debug/capture/forwards"] == 1
    assert abs(values[f"{P}/logits/target_nll"] - loss.item()) <= 1e-6 * loss.item()


@pytest.mark.parametrize(
    "config, x, want",
    [
        (
            transformers.HyperCLOVAXConfig(logits_scaling=4.0),
            2.0,
            8.0,
        ),  # multiplies by logits_scaling
        (transformers.GraniteConfig(logits_scaling=4.0), 2.0, 0.5),  # divides by it
        (transformers.FalconH1Config(lm_head_multiplier=3.0), 2.0, 6.0),
        (
            transformers.CohereConfig(logit_scale=0.5, logits_scaling=9.0),
            2.0,
            1.0,
        ),  # the first scale found only
    ],
)
def test_the_families_transform_table(config, x, want):
    """The scale each family's forward applies to its head's output (TRL's fused head uses the same table)."""
    assert final_logit_transform(config)(torch.tensor([x])).item() == pytest.approx(
        want
    )


def test_a_copied_model_gets_the_loss_function_not_the_wrapper():
    """A reference model deep-copied from the policy holds the loss it had, never a reader of the policy's capture
    (whose loss calls would otherwise be heard as the policy's)."""
    import copy

    model = tiny_llama(tie=True)
    before = model.loss_function
    hw = Headwatch(
        model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0
    )
    assert copy.deepcopy(model).loss_function is before
    hw.close()
