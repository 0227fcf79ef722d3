"""The capture contract's tests: float64 references of what the loss scored, a model that generates before its loss, a Lightning Llama."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

KEYS = ("entropy", "max_prob", "kl_to_uniform", "target_nll", "target_argmax_rate")


def reference(model, batch: dict, kept: int | None = None) -> dict[str, float]:
    """float64 statistics of ``model``'s own logits on ``batch`` over the positions its causal loss uses: logits
    at t scored against ``labels[t + 1]``, ``labels != -100`` and attended; ``kept``: the last ``kept`` positions."""
    was = model.training
    model.eval()
    with torch.no_grad():
        fields = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}  # packed: positions
        logits = model(**fields).logits.double()
    model.train(was)
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # (B, T)
    valid = targets != -100
    if batch.get("attention_mask") is not None:
        valid &= batch["attention_mask"].bool()
    if kept is not None:
        valid[:, : labels.shape[1] - kept] = False
    logp = logits.log_softmax(-1)[valid]  # (N, V)
    p = logp.exp()
    H = -(p * logp).sum(-1)
    y = targets[valid]
    return {
        "entropy": H.mean().item(),
        "max_prob": p.amax(-1).mean().item(),
        "kl_to_uniform": (math.log(logits.shape[-1]) - H).mean().item(),
        "target_nll": -logp.gather(-1, y[:, None]).mean().item(),
        "target_argmax_rate": (logp.argmax(-1) == y).double().mean().item(),
        "positions": int(valid.sum()),
    }


def assert_published(values: dict[str, float], group: str, want: dict[str, float], atol: float = 2e-5) -> None:
    assert values[f"{group}/positions"] == want["positions"]
    for key in KEYS:
        assert values[f"{group}/{key}"] == pytest.approx(want[key], abs=atol), key
    assert math.isfinite(values[f"{group}/ece"])  # calibration has the labels too


def causal_ce(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func``: the causal cross-entropy, from the logits and the unshifted labels."""
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


class GenerateThenLoss(Trainer):
    """``predict_with_generate``-style evaluation: ``generate()`` (prompt pass + decoding steps), then the loss
    forward; ``after=True``: the loss forward first, then ``generate()`` and a second pass for a metric."""

    after = False

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        prompt = {"input_ids": inputs["input_ids"][:, :6], "attention_mask": inputs["attention_mask"][:, :6]}
        if not self.after:
            model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if self.after:
            model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                model(input_ids=inputs["input_ids"][:, :6])  # a metric's second pass
        return out


class LitLlama(pl.LightningModule):
    """Automatic or manual optimization; each training step also makes a no-grad pass (a metric), each
    validation step a ``generate()`` call and a second pass."""

    def __init__(self, model, manual: bool = False):
        super().__init__()
        self.model = model
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.model(input_ids=batch["input_ids"][:, :5])
        loss = self.model(**batch).loss
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        self.model.generate(input_ids=batch["input_ids"][:, :6], max_new_tokens=3, do_sample=False, pad_token_id=0)
        self.model(**batch)
        self.model(input_ids=batch["input_ids"][:, :5])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)
