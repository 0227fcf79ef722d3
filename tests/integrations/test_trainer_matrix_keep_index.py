"""The trainer matrix's row for ``logits_to_keep`` given as an index tensor (docs/supported.md, docs/capture.md):
the kept positions cannot be told apart from the logits' shape, so every door refuses the logits statistics with
one warning naming the cause and the fix, and measures the gradients, exact against an untied twin's autograd
through the same loss on the batches the door trained on. Under Lightning with ``compare_loss=`` the self-check
has a reference but nothing measured to compare it with (``logits/positions`` 0, the refusal said once): no
``check/mismatch``, no second warning.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.matrices import V, untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    H,
    assert_grads,
    door_run,
    family,
    headwatch_warnings,
)

KEEP = torch.tensor(
    [2, 4, 6]
)  # positions whose logits the loss scores (against the next token)


def kept_loss(model, batch: dict) -> torch.Tensor:
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=KEEP,
    ).logits
    return F.cross_entropy(
        logits.reshape(-1, V),
        batch["labels"][:, KEEP + 1].reshape(-1),
        ignore_index=-100,
    )


@pytest.mark.parametrize("door", ["hf_trainer", "sft_trainer", "lightning", "loop"])
def test_logits_to_keep_as_indices_is_refused_with_the_cause_gradients_exact(
    tmp_path, door
):
    model = family("llama_tied")
    twin = untied_twin(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, _ = door_run(door, model, tmp_path, loss=kept_loss)
    # the overhead budget's note depends on the machine's load: not what this row is about
    said = [m for m in headwatch_warnings(caught) if "overhead_budget" not in m]
    assert (
        "logits_to_keep given as indices" in said[0] and "hidden_module=" in said[0]
    ), said
    assert len(said) == 1, said  # under Lightning's compare_loss= too: no self-check alarm on a refused step
    if door == "lightning":  # compare_loss= gives a reference; the capture measured 0 positions: nothing compared
        assert all(values[s][f"{H}/check/mismatch"] == 0 for s in range(STEPS))
        assert all(math.isfinite(values[s][f"{H}/debug/check/reference_nll"]) for s in range(STEPS))
    assert len(values) == STEPS
    for step in range(STEPS):
        got = values[step]
        assert got[f"{H}/logits/positions"] == 0 and math.isnan(
            got[f"{H}/logits/entropy"]
        )
        kept_loss(twin, seen[step]).backward()
        flows = {
            "embedding": twin.get_input_embeddings().weight.grad.clone(),
            "head": twin.lm_head.weight.grad.clone(),
        }
        twin.zero_grad()
        assert_grads(
            got, {"embedding": flows["embedding"] + flows["head"]}, flows, None
        )
