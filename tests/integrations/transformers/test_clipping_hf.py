"""The Hugging Face Trainer clips the gradients before ``on_pre_optimizer_step`` (its default ``max_grad_norm`` is
1.0): the tied split sets the lookup flow headwatch captured in the backward against the clipped ``.grad``, so the
captured flow must carry the same clip coefficient, or ``H = G - E`` mixes two scales.

Reference: an untied twin's two gradients by autograd on the same batch (unclipped), each times the coefficient the
clipping applied (the clipped tied ``.grad``'s norm over the norm of the twin's sum, a scalar): float64 row norms
of the scaled lookup flow, and the per-row cosines of the two flows (scale-free: the twin's own).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama
from tests.helpers.matrices import untied_twin

H = "headwatch"


class GradAtOptimizerStep(TrainerCallback):
    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(model.get_input_embeddings().weight.grad.detach().clone())


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.02])
def test_the_tied_split_under_the_trainers_clipping_equals_an_untied_twins_flows(tmp_path, max_grad_norm):
    model, batch = tiny_llama(tie=True), one_batch()
    twin = untied_twin(model)
    twin(**batch).loss.backward()
    lookup, scoring = twin.get_input_embeddings().weight.grad.double(), twin.lm_head.weight.grad.double()
    cb, grads = HeadwatchCallback(monitors=["tokens", "gradients"]), GradAtOptimizerStep()
    args = hf_args(tmp_path, max_grad_norm=max_grad_norm)
    Trainer(model=model, args=args, train_dataset=Rows(batch), callbacks=[cb, grads]).train()
    clipped = grads.grads[0].double()
    scale = float(clipped.norm() / (lookup + scoring).norm())
    assert (scale < 0.5) == (max_grad_norm > 0)  # the premise: clipping really scaled the gradient
    torch.testing.assert_close(clipped, scale * (lookup + scoring), rtol=1e-5, atol=1e-9)
    got = cb.latest
    assert got[f"{H}/grad/embedding_row_norm_max"] == pytest.approx(float(scale * lookup.norm(dim=1).max()), rel=1e-4)
    assert got[f"{H}/grad/head_row_norm_max"] == pytest.approx(float(scale * scoring.norm(dim=1).max()), rel=1e-4)
    both = (lookup.norm(dim=1) > 0) & (scoring.norm(dim=1) > 0)
    cosine = torch.nn.functional.cosine_similarity(lookup[both], scoring[both], dim=1)
    assert got[f"{H}/grad/tied_flow_cosine_mean"] == pytest.approx(float(cosine.mean()), abs=1e-4)
    assert got[f"{H}/grad/tied_flow_conflict_fraction"] == pytest.approx(float((cosine < 0).double().mean()), abs=1e-9)
