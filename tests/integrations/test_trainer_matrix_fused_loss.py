"""The trainer matrix's fused-loss row (docs/supported.md): Cut Cross-Entropy through its transformers patch (its
``torch_compile`` implementation, CPU) on the matrix's tied Llama, trained by the Hugging Face ``Trainer`` and by a
``LightningModule``; the loss never holds the logits, so headwatch reads its call (the hidden states and the head
weight it scored).

References: the target NLL against the loss's own per-token values (``reduction="none"``, the same call on the
hidden states the forward computed), 1e-6 relative; the other logit statistics against a float64 recomputation of
those hidden states times the head; the gradients against an untied twin under the same patched loss, by autograd.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.fused import cce_token_nll, cut_cross_entropy_patch
from tests.helpers.matrices import twin_grads, untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    H,
    assert_logits,
    door_run,
    family,
    grad_reference,
    headwatch_warnings,
    logits_reference,
)  # fmt: skip


@pytest.fixture
def cce_patch(monkeypatch):
    """``cce_patch(model)``: the model's forward replaced as Cut Cross-Entropy's transformers patch replaces it."""
    yield from cut_cross_entropy_patch(monkeypatch)


class FinalHidden:
    """The final hidden states (``model.model``'s output) of each training forward with gradient."""

    def __init__(self, model: torch.nn.Module):
        self.hidden: list[torch.Tensor] = []
        self.handle = model.model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.hidden.append(output.last_hidden_state.detach().clone())


@pytest.mark.parametrize("door", ["hf_trainer", "lightning"])
def test_cut_cross_entropy_through_its_transformers_patch_at_each_door(
    tmp_path, cce_patch, door
):
    model = family("llama_tied")
    twin = untied_twin(model)
    cce_patch(model), cce_patch(twin)
    hidden = FinalHidden(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run(door, model, tmp_path)
    hidden.handle.remove()
    said = headwatch_warnings(caught)
    assert said == [], said
    assert (
        logits == [] and len(hidden.hidden) == STEPS
    )  # the loss forwards returned no logits
    expected = twin_grads(twin, seen[:STEPS])
    weight = model.lm_head.weight.detach()
    for step in range(STEPS):
        got, h, batch = values[step], hidden.hidden[step], seen[step]
        want, positions = cce_token_nll(h, weight, batch["labels"])
        assert got[f"{H}/logits/positions"] == positions
        assert abs(got[f"{H}/logits/target_nll"] - want.item()) <= 1e-6 * want.item()
        assert_logits(got, logits_reference([h.double() @ weight.double().T], [batch]))
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        flows = {
            **expected[step],
            "shared": expected[step]["embedding"] + expected[step]["head"],
        }
        assert got[f"{H}/grad/tied"] == 1.0
        for key, value in grad_reference(flows, None).items():
            assert got[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-4, abs=1e-7), (
                key
            )
