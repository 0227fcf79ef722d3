"""The trainer matrix's row for a family that scales its logits (docs/supported.md): Granite divides the head's
output by ``logits_scaling`` (and multiplies the looked-up rows by ``embedding_multiplier``), through the Hugging
Face ``Trainer``, Lightning and the plain loop; every published figure against an independent reference.

References: float64 statistics of the model's own ``outputs.logits`` (the scaled ones the loss uses) of each loss
forward, scored against the batch's labels; the self-check against the model's own loss; the gradients of an
identical copy by autograd on the batches the door trained on.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.helpers.matrices import GRANITE_SCALING as SCALING
from tests.helpers.matrices import granite, twin_grads
from tests.helpers.trainer_matrix import (
    STEPS,
    H,
    assert_grads,
    assert_logits,
    door_run,
    headwatch_warnings,
    logits_reference,
)

transformers = pytest.importorskip("transformers")





@pytest.mark.parametrize("door", ["hf_trainer", "lightning", "loop"])
def test_a_family_that_scales_its_logits_through_each_door(tmp_path, door):
    model = granite()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run(door, model, tmp_path)
    assert headwatch_warnings(caught) == []
    expected = twin_grads(twin, seen[:STEPS])
    assert len(values) == STEPS and len(logits) == STEPS
    for step in range(STEPS):
        got = values[step]
        want = logits_reference([logits[step]], [seen[step]])
        assert_logits(got, want)
        unscaled = logits_reference(
            [SCALING * logits[step]], [seen[step]]
        )  # what the head itself returned
        assert (
            abs(unscaled["entropy"] - got[f"{H}/logits/entropy"]) > 1e-2
        )  # the scaling matters here
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        assert_grads(
            got, expected[step], None, model.get_input_embeddings().padding_idx
        )
    ids = seen[0]["input_ids"][:1]
    with (
        torch.no_grad()
    ):  # the premise: the logits are the head's output over logits_scaling
        out = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(
            out.logits, model.lm_head(out.hidden_states[-1]) / SCALING
        )
