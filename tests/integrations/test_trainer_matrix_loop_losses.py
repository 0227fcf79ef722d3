"""The trainer matrix's plain-loop cells for losses written outside the model (docs/supported.md): label smoothing
(the loss from the logits, ``F.cross_entropy(label_smoothing=0.1)``; the model gets no labels) and a second forward
with labels of its own in one step (a pretraining mix), on the tied Llama.

References: float64 statistics of the model's own ``outputs.logits`` of each forward with gradient, scored against
that forward's labels (the step's batch; the mix's own); the two ``.grad`` of an untied twin through the same loss
(their sum: the tied ``shared`` gradient); the self-check against the model's own losses where forwards return one.
"""

from __future__ import annotations

import warnings

import pytest
import torch.nn.functional as F

from tests.helpers.matrices import V, untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    B,
    H,
    Rows,
    assert_grads,
    assert_logits,
    door_run,
    family,
    headwatch_warnings,
    logits_reference,
)

MIX = Rows(B, seed=21).batch()  # labels of its own


def smoothed(model, batch):
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits[:, :-1]
    return F.cross_entropy(
        logits.reshape(-1, V),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        label_smoothing=0.1,
    )


def with_mix(model, batch):
    return model(**batch).loss + model(**MIX).loss


@pytest.mark.parametrize("feature", ["label_smoothing", "own_labels"])
def test_plain_loop_loss_outside_the_model(tmp_path, feature):
    loss = smoothed if feature == "label_smoothing" else with_mix
    model = family("llama_tied")
    twin = untied_twin(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run("loop", model, tmp_path, loss=loss)
    said = headwatch_warnings(caught)
    forwards = 2 if feature == "own_labels" else 1
    if (
        feature == "own_labels"
    ):  # each forward against its own labels, pooled: said once
        assert len(said) == 1 and "more than once with gradient" in said[0], said
    else:
        assert said == [], said
    assert len(values) == STEPS and len(logits) == STEPS * forwards
    for step in range(STEPS):
        got = values[step]
        scored = [seen[step], MIX][:forwards]
        want = logits_reference(logits[step * forwards : (step + 1) * forwards], scored)
        assert_logits(got, want)
        assert got[f"{H}/debug/capture/forwards"] == forwards
        if (
            feature == "label_smoothing"
        ):  # no forward returns the loss: nothing compared
            assert f"{H}/check/nll_gap" not in got
        else:  # the self-check against the model's two losses
            assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(
                want["nll"], abs=2e-5
            )
            assert (
                abs(got[f"{H}/check/nll_gap"]) < 1e-5
                and got[f"{H}/check/mismatch"] == 0
            )
        loss(twin, seen[step]).backward()
        flows = {
            "embedding": twin.get_input_embeddings().weight.grad.clone(),
            "head": twin.lm_head.weight.grad.clone(),
        }
        twin.zero_grad()
        assert_grads(
            got, {"embedding": flows["embedding"] + flows["head"]}, flows, None
        )
