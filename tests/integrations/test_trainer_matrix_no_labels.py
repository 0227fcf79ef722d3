"""The trainer matrix's Hugging Face ``Trainer`` cell for a batch without labels (docs/supported.md): rows of
``input_ids`` and ``attention_mask`` only, the loss computed in ``compute_loss`` from the logits against the next
token. The target statistics are refused (NaN, one warning naming what the entropy then covers); entropy and
max-probability over every attended position exact; the gradients exact.

References: float64 statistics of the model's own ``outputs.logits`` over every position; the two ``.grad`` of an
untied twin through the same loss on the batches the Trainer trained on.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch.nn.functional as F

from tests.helpers.matrices import V, untied_twin
from tests.helpers.references import reference as float64_stats
from tests.helpers.trainer_matrix import (
    ATOL,
    STEPS,
    B,
    H,
    Rows,
    T,
    assert_grads,
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
        ref = float64_stats(
            logits[step], None, None
        )  # every attended position: no labels to select them
        assert (
            got[f"{H}/logits/positions"] == B * T
            and got[f"{H}/debug/capture/labelled_positions"] == 0
        )
        assert got[f"{H}/logits/entropy"] == pytest.approx(
            ref["entropy"].mean(), abs=ATOL
        )
        assert got[f"{H}/logits/max_prob"] == pytest.approx(
            ref["max_prob"].mean(), abs=ATOL
        )
        assert math.isnan(got[f"{H}/logits/target_nll"]) and math.isnan(
            got[f"{H}/logits/ece"]
        )
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
