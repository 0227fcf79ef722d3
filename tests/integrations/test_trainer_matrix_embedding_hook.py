"""The trainer matrix's row for a forward hook that changes the embedding's output and runs before headwatch's
(docs/supported.md, docs/matrices.md), through the Hugging Face ``Trainer``, TRL's ``SFTTrainer``, Lightning and the
plain loop:
registered on the model before the door attaches (so it runs first), adding a shift to the looked-up rows. The
shift leaves the lookup flow's Jacobian as it is: the tied split is exact, no warning. (A hook prepended after
headwatch attached runs before headwatch's too, but headwatch cannot know it: refused with the cause,
tests/model/test_matrix_contract.py.)

References: float64 statistics of the model's own ``outputs.logits``; the two ``.grad`` of an untied twin with the
same hook, by autograd on the batches the door trained on (their sum: the tied ``shared`` gradient).
"""

from __future__ import annotations

import warnings

import pytest

from tests.helpers.matrices import untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    assert_grads,
    assert_logits,
    door_run,
    family,
    headwatch_warnings,
    logits_reference,
)


def shifted(module, args, output):
    return output + 0.1


@pytest.mark.parametrize("door", ["hf_trainer", "sft_trainer", "lightning", "loop"])
def test_a_hook_that_changes_the_embedding_output_before_headwatch_attaches(
    tmp_path, door
):
    model = family("llama_tied")
    model.get_input_embeddings().register_forward_hook(shifted)
    twin = untied_twin(model)  # the same hook (deep-copied with the embedding)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run(door, model, tmp_path)
    assert headwatch_warnings(caught) == []
    assert len(values) == STEPS
    for step in range(STEPS):
        got = values[step]
        assert_logits(got, logits_reference([logits[step]], [seen[step]]))
        twin(**seen[step]).loss.backward()
        flows = {
            "embedding": twin.get_input_embeddings().weight.grad.clone(),
            "head": twin.lm_head.weight.grad.clone(),
        }
        twin.zero_grad()
        assert_grads(
            got, {"embedding": flows["embedding"] + flows["head"]}, flows, None
        )
