"""The trainer matrix's Hugging Face ``Trainer`` cell for a batch without labels (docs/supported.md): rows of
``input_ids`` and ``attention_mask`` only, the loss computed in ``compute_loss`` from the logits against the next
token. The target statistics are refused (NaN, one warning naming what the entropy then covers); entropy and
max-probability over every attended position exact; the gradients exact.

References: float64 statistics of the model's own ``outputs.logits`` over every position; the two ``.grad`` of an
untied twin through the same loss on the batches the Trainer trained on.
"""

from __future__ import annotations

import warnings

import torch.nn.functional as F

from tests.helpers.matrices import V, untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    B,
    H,
    Rows,
    assert_grads,
    assert_unlabelled,
    door_run,
    family,
    headwatch_warnings,
)


class Unlabelled(Rows):
    def __getitem__(self, i):
        return {k: v for k, v in super().__getitem__(i).items() if k != "labels"}


def next_token_loss(model, batch):
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, V), batch["input_ids"][:, 1:].reshape(-1))


def test_hf_trainer_without_labels_refuses_the_target_statistics(tmp_path):
    model = family("llama_tied")
    twin = untied_twin(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen, logits = door_run(
            "hf_trainer",
            model,
            tmp_path,
            loss=next_token_loss,
            rows=Unlabelled(B * STEPS, seed=3),
        )
    said = headwatch_warnings(caught)
    assert len(said) == 1 and "every attended position" in said[0], said
    assert len(values) == STEPS and all("labels" not in b for b in seen)
    for step in range(STEPS):
        got = values[step]
        assert_unlabelled(got, logits[step])  # every attended position: no labels select them
        assert f"{H}/check/nll_gap" not in got
        next_token_loss(twin, seen[step]).backward()
        flows = {
            "embedding": twin.get_input_embeddings().weight.grad.clone(),
            "head": twin.lm_head.weight.grad.clone(),
        }
        twin.zero_grad()
        assert_grads(
            got, {"embedding": flows["embedding"] + flows["head"]}, flows, None
        )
