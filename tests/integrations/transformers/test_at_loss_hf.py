"""Measured at the loss, through the Hugging Face door: the model's ``loss_function`` and forwards with their own labels.

References, independent of headwatch: the tensor and the labels the model's ``loss_function`` received (recorded by
a wrapper of the test's own, put in place before headwatch attaches), scored in float64 and by
``F.cross_entropy(..., reduction="none")`` as the loss scores them; the positions the loss counts.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

from headwatch.core.logits import LogitStats
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

P = "headwatch"
STEPS = 3


class LossRecorder:
    """The logits and labels each training call of ``model.loss_function`` received (no-grad calls left out)."""

    def __init__(self, model):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = model.loss_function

        def loss_function(logits, labels, vocab_size, **kw):
            if torch.is_grad_enabled():
                self.calls.append((logits.detach().clone(), labels.detach().clone()))
            return original(logits=logits, labels=labels, vocab_size=vocab_size, **kw)

        model.loss_function = loss_function

    def reference(self, calls) -> dict[str, float]:
        """float64 token means over the loss's positions of ``calls``, and the loss's own per-token values (float32)."""
        nll, own, ent, n = 0.0, 0.0, 0.0, 0
        for logits, labels in calls:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)  # as ForCausalLMLoss shifts them
            keep = targets != -100
            x = logits.reshape(-1, logits.shape[-1])
            logp = x.double().log_softmax(-1)[keep]
            nll -= logp.gather(-1, targets[keep, None]).sum().item()
            own += F.cross_entropy(x.float(), targets, ignore_index=-100, reduction="none")[keep].double().sum().item()
            ent -= (logp.exp() * logp).sum().item()
            n += int(keep.sum())
        return {"nll": nll / n, "own": own / n, "entropy": ent / n, "positions": n}


@pytest.mark.parametrize("bf16", [True, False])
def test_the_target_nll_is_the_loss_functions_own_at_every_step(tmp_path, bf16):
    """A Hugging Face model's ``loss_function`` is read inside the call: the target NLL equals the loss's per-token
    values on the tensor it received (bf16 under the CPU autocast, float32 without) to 1e-6 relative at each step."""
    model = tiny_llama(tie=True)
    rec = LossRecorder(model)
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    args = hf_args(tmp_path, max_steps=STEPS, logging_first_step=False, learning_rate=1e-2, bf16=bf16)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(one_batch(), STEPS), callbacks=[cb])
    trainer.train()
    history = {r["step"]: r for r in trainer.state.log_history if f"{P}/logits/target_nll" in r}
    assert sorted(history) == list(range(1, STEPS + 1)) and len(rec.calls) == STEPS
    assert {logits.dtype for logits, _ in rec.calls} == {torch.bfloat16 if bf16 else torch.float32}
    for step, call in zip(sorted(history), rec.calls):
        want, got = rec.reference([call]), history[step]
        assert got[f"{P}/logits/positions"] == want["positions"]
        assert abs(got[f"{P}/logits/target_nll"] - want["nll"]) <= 1e-6 * want["nll"]
        assert abs(got[f"{P}/logits/target_nll"] - want["own"]) <= 1e-6 * want["own"]
        assert abs(got[f"{P}/logits/entropy"] - want["entropy"]) <= 1e-6 * want["entropy"]
        assert got[f"{P}/debug/capture/forwards"] == 1 and got[f"{P}/check/mismatch"] == 0


def _batch(kept: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """4 rows of 12 tokens whose labels predict ``kept[r]`` next tokens in row ``r`` (the rest ``-100``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (4, 12), generator=g)
    labels = ids.clone()
    for row, k in enumerate(kept):
        labels[row, : 12 - k] = -100  # labels[:, 1:] keeps k per row
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


MAIN, MIX = _batch((11, 9, 9, 8), seed=5), _batch((11, 11, 10, 10), seed=6)  # 37 and 42 labelled positions


class WithMix(Trainer):
    """A pretraining mix: each step's loss adds a second forward over a batch with labels of its own."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=False)
        return loss + model(**MIX).loss


@pytest.mark.parametrize("path", ["auto", "hidden"])
def test_a_second_forward_with_its_own_labels_is_measured_against_them(tmp_path, path):
    """37 labelled positions in the batch, 42 in the mix: both forwards measured against their own labels on every
    step, the first included (at the loss's call, or forced onto the forward hooks: the later forward's own inputs),
    and the self-check agrees with the model's two losses."""
    model = tiny_llama(tie=True)
    rec = LossRecorder(model)
    cb = HeadwatchCallback(monitors=[LogitStats(path=path)], figure_every_n_steps=0)
    args = hf_args(tmp_path, max_steps=STEPS, logging_first_step=False, learning_rate=1e-2)
    trainer = WithMix(model=model, args=args, train_dataset=Rows(MAIN, STEPS), callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in record if "self-check FAILED" in str(w.message)]
    history = {r["step"]: r for r in trainer.state.log_history if f"{P}/logits/target_nll" in r}
    assert sorted(history) == list(range(1, STEPS + 1)) and len(rec.calls) == 2 * STEPS
    for i, step in enumerate(sorted(history)):
        main, mix = rec.calls[2 * i : 2 * i + 2]
        assert [rec.reference([c])["positions"] for c in (main, mix)] == [37, 42]
        want, got = rec.reference([main, mix]), history[step]
        assert got[f"{P}/debug/capture/labelled_positions"] == got[f"{P}/logits/positions"] == 79
        assert got[f"{P}/logits/target_nll"] == pytest.approx(want["nll"], rel=1e-6 if path == "auto" else 1e-5)
        assert got[f"{P}/debug/capture/forwards"] == 2 and got[f"{P}/check/mismatch"] == 0


class RDrop(Trainer):
    """R-Drop style: two forwards over the same batch, one loss from both."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return (model(**inputs).loss + model(**inputs).loss) / 2


def test_r_drop_passes_over_one_batch_stay_pooled(tmp_path):
    model = tiny_llama(tie=True)
    rec = LossRecorder(model)
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = RDrop(model=model, args=hf_args(tmp_path, logging_first_step=False), train_dataset=Rows(MAIN), callbacks=[cb])
    with pytest.warns(UserWarning, match="more than once with gradient"):
        trainer.train()
    want, got = rec.reference(rec.calls), cb.latest
    assert len(rec.calls) == 2 and want["positions"] == 2 * 37
    assert got[f"{P}/debug/capture/forwards"] == 2 and got[f"{P}/logits/positions"] == 2 * 37
    assert got[f"{P}/logits/target_nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert math.isfinite(got[f"{P}/logits/ece"]) and got[f"{P}/check/mismatch"] == 0
