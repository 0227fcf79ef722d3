"""The trainer matrix's vocabulary rows (docs/supported.md): a model whose rows go past the tokenizer's (Qwen-style
padding, ``resize_token_embeddings(pad_to_multiple_of=)``) and a frozen embedding (the LoRA recipe's), through
each front door, on the untied Gemma 2 family of ``tests/integrations/test_trainer_matrix.py`` (each matrix's own
``.grad`` is the reference).

References: float64 row norms of the real ``.grad`` of each matrix at each step (recorded as it accumulates),
over the tokenizer's rows only; float64 statistics of the logits the loss used against the step's labels
(:func:`tests.helpers.trainer_matrix.logits_reference`), and the softmax mass past the tokenizer's rows of those
same logits for ``logits/padded_mass``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.trainer_matrix import (
    ATOL,
    STEPS,
    H,
    assert_logits,
    door_run,
    family,
    grad_reference,
    headwatch_warnings,
    logits_reference,
)  # fmt: skip

pytest.importorskip("transformers")

REAL = 100  # the tokenizer's words; the family's 128 rows are padded beyond them


class GradRows:
    """The ``.grad`` of a Parameter each time a backward has accumulated into it (one micro-batch per step)."""

    def __init__(self, weight: torch.nn.Parameter):
        self.grads: list[torch.Tensor] = []
        self.handle = weight.register_post_accumulate_grad_hook(
            lambda p: self.grads.append(p.grad.detach().clone())
        )


def padded_mass(logits: torch.Tensor, batch: dict) -> float:
    """float64 softmax mass on the columns ``>= REAL`` of ``(B, T, V)`` logits, mean over the labelled positions."""
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    mass = torch.softmax(logits.double(), -1)[..., REAL:].sum(-1)
    return float(mass[targets != -100].mean())


@pytest.mark.parametrize("door", ["sft_trainer", "lightning", "loop"])
def test_padded_rows_are_left_out_and_their_mass_published(tmp_path, door):
    """The tokenizer's size (TRL: its ``processing_class``; Lightning and the loop: ``vocab_size=``): the row
    figures over its 100 rows, not the model's 128; ``logits/padded_mass`` the softmax mass on the 28 others; the
    logits statistics over all 128 columns (the distribution the loss uses)."""
    model = family("gemma2_softcap")
    emb, head = (
        GradRows(model.get_input_embeddings().weight),
        GradRows(model.lm_head.weight),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, batches, logits = door_run(door, model, tmp_path, vocab=REAL)
    assert headwatch_warnings(caught) == []
    assert len(logits) == len(emb.grads) == len(head.grads) == STEPS
    for step, got in enumerate(values):
        assert (
            int(batches[step]["input_ids"].max()) < REAL
        )  # the data uses the tokenizer's rows only
        assert_logits(
            got, logits_reference(logits[step : step + 1], batches[step : step + 1])
        )
        mass = padded_mass(logits[step], batches[step])
        assert 0 < mass < 1 and got[f"{H}/logits/padded_mass"] == pytest.approx(
            mass, abs=ATOL
        )
        flows = {"embedding": emb.grads[step], "head": head.grads[step]}
        want = grad_reference(
            flows, model.get_input_embeddings().padding_idx, real=REAL
        )
        for key, value in want.items():
            assert got[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                key
            )
        # the premise: over all 128 rows the embedding's density would differ (its padded rows never occur)
        every_row = grad_reference(flows, model.get_input_embeddings().padding_idx)
        assert every_row["embedding_row_density"] != want["embedding_row_density"]


@pytest.mark.parametrize("door", ["hf_trainer", "sft_trainer", "lightning", "loop"])
def test_a_frozen_embedding_is_named_once_and_the_head_measured(tmp_path, door):
    """The embedding frozen (``requires_grad=False``) before the door attaches, the head training: nothing is
    published for the embedding (no zeros), one warning names it; the head's gradient and the logits exact."""
    model = family("gemma2_softcap")
    model.get_input_embeddings().weight.requires_grad_(False)
    head = GradRows(model.lm_head.weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, batches, logits = door_run(door, model, tmp_path)
    said = headwatch_warnings(caught)
    assert len(said) == 1 and "embed_tokens` is FROZEN" in said[0], said
    assert len(logits) == len(head.grads) == STEPS
    for step, got in enumerate(values):
        assert_logits(
            got, logits_reference(logits[step : step + 1], batches[step : step + 1])
        )
        assert not [
            k
            for k in got
            if k.startswith((f"{H}/grad/", f"{H}/update/")) and "embedding" in k
        ]
        assert (
            f"{H}/grad/shared_row_density" not in got and got[f"{H}/grad/tied"] == 0.0
        )
        want = grad_reference(
            {"head": head.grads[step]}, model.get_input_embeddings().padding_idx
        )
        for key, value in want.items():
            assert got[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                key
            )
