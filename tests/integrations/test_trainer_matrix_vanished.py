"""The trainer matrix's row for a loss whose backward returns a zero head gradient (docs/supported.md,
docs/self_check.md), through the Hugging Face ``Trainer``, TRL's ``SFTTrainer`` and Lightning: a hook on the
untied head's Parameter zeroes its gradient, as a broken fused loss would. Flagged on every step
(``check/vanished_gradient = 1``, one warning), the head's row densities withheld, its norms as the gradient
holds them (0); the embedding's gradient and the logits exact.

References: float64 statistics of the model's own ``outputs.logits``; the embedding's ``.grad`` of an identical copy
(the same hook) by autograd on the batches the door trained on.
"""

from __future__ import annotations

import copy
import warnings

import pytest

from tests.helpers.trainer_matrix import (
    STEPS,
    H,
    assert_logits,
    door_run,
    family,
    grad_reference,
    headwatch_warnings,
    logits_reference,
)


def zeroed(grad):
    return grad * 0


@pytest.mark.parametrize("door", ["hf_trainer", "sft_trainer", "lightning"])
def test_a_zeroed_head_gradient_is_flagged_through_each_door(tmp_path, door):
    model = family("gemma2_softcap")  # untied: the head has a gradient of its own
    model.lm_head.weight.register_hook(zeroed)
    twin = copy.deepcopy(model)
    twin.lm_head.weight.register_hook(zeroed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run(door, model, tmp_path)
    said = [m for m in headwatch_warnings(caught) if "overhead_budget" not in m]  # that note follows the load
    assert len(said) == 1 and "output head's gradient VANISHED" in said[0], said
    assert len(values) == STEPS
    for step in range(STEPS):
        got = values[step]
        assert_logits(got, logits_reference([logits[step]], [seen[step]]))
        assert (
            got[f"{H}/check/vanished_gradient"] == 1 and got[f"{H}/check/withheld"] >= 1
        )
        assert (
            f"{H}/grad/head_row_density" not in got
            and got[f"{H}/grad/head_row_norm_max"] == 0.0
        )
        twin(**seen[step]).loss.backward()
        embedding = twin.get_input_embeddings().weight.grad.clone()
        twin.zero_grad()
        pad = model.get_input_embeddings().padding_idx
        for key, want in grad_reference({"embedding": embedding}, pad).items():
            assert got[f"{H}/grad/{key}"] == pytest.approx(want, rel=1e-5, abs=1e-7), (
                key
            )
