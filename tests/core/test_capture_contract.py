"""The capture contract (docs/capture.md): headwatch measures the forward(s) the loss is computed
from, over the loss's positions, with the step's real labels, on every front door.

Every published figure is compared with a float64 recomputation from the model's own logits (one extra
forward of the same float32 model on the step's real inputs) and the step's real labels (those the
trainer's loss used: the HF Trainer's inputs before it pops them, TRL's collated batch).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

from headwatch import LogitStatsMonitor
from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.capture import GenerateThenLoss, LitLlama, assert_published, causal_ce, reference
from tests.helpers.hf import B, T, V, Rows, hf_args, one_batch, tiny_llama, word_tokenizer
from tests.helpers.lightning_runs import StepLogger

# ------------------------------------------------------------------------------------ HF Trainer
@pytest.mark.parametrize("path", ["plain", "label_smoothing", "compute_loss_func"])
def test_hf_trainer_measures_the_loss_forward_with_the_real_labels(tmp_path, path):
    """Label smoothing and ``compute_loss_func`` pop ``labels`` before the forward: the target statistics still
    come from them, over the positions that predict a label (never a row's last)."""
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)  # learning_rate 0: the model of the step
    kw = {"label_smoothing_factor": 0.1} if path == "label_smoothing" else {}
    extra = {"compute_loss_func": causal_ce} if path == "compute_loss_func" else {}
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = Trainer(model=model, args=hf_args(tmp_path, **kw), train_dataset=Rows(batch), eval_dataset=Rows(batch),
                      callbacks=[cb], **extra)  # fmt: skip
    trainer.train()
    assert_published(cb.latest, "headwatch/logits", want)
    assert want["positions"] == B * (T - 1)
    metrics = trainer.evaluate()  # the same inputs through prediction_step (labels popped there too)
    assert_published({k.removeprefix("eval_"): v for k, v in metrics.items()}, "headwatch/val/logits", want)


@pytest.mark.parametrize("after", [False, True])
def test_generation_in_evaluation_is_never_pooled(tmp_path, after):
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = type("T", (GenerateThenLoss,), {"after": after})(
        model=model, args=hf_args(tmp_path, per_device_eval_batch_size=B), eval_dataset=Rows(batch), callbacks=[cb]
    )
    cb.set_trainer(trainer)
    cb.attach_model(model, 0)  # evaluation-only: attach as on_train_begin would
    metrics = trainer.evaluate()
    assert len(calls) >= 4  # the loss forward, generate's prompt pass and decoding steps (and the metric pass)
    assert_published({k.removeprefix("eval_"): v for k, v in metrics.items()}, "headwatch/val/logits", want)


class ReferencePassFirst(Trainer):
    """A loss whose step first makes a no-grad pass on other inputs (reference log-probabilities)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            model(input_ids=inputs["input_ids"][:, :5])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_no_grad_passes_of_a_training_step_are_not_measured(tmp_path):
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)
    cb = HeadwatchCallback(monitors=["tokens", "logits"], figure_every_n_steps=0)
    ReferencePassFirst(model=model, args=hf_args(tmp_path), train_dataset=Rows(batch), callbacks=[cb]).train()
    assert_published(cb.latest, "headwatch/logits", want)
    assert cb.latest["headwatch/tokens/total"] == B * T  # the loss's batch, counted once


# ------------------------------------------------------------------------------------ TRL SFTTrainer
def _sft(tmp_path, **kw):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(3)
    rows = [(torch.randint(0, V - 2, (4,), generator=g), torch.randint(0, V - 2, (5,), generator=g)) for _ in range(B)]
    data = Dataset.from_dict({
        "prompt": [" ".join(f"w{i}" for i in p.tolist()) for p, _ in rows],
        "completion": [" " + " ".join(f"w{i}" for i in c.tolist()) for _, c in rows],
    })  # fmt: skip
    config = SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, per_device_train_batch_size=B,
                       report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=0.0,
                       max_grad_norm=0.0, bf16=False, **kw)  # fmt: skip  (float32: the exact comparison)
    model = tiny_llama(tie=True)
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=word_tokenizer(), callbacks=[cb])
    seen = []
    collate = trainer.data_collator
    trainer.data_collator = lambda examples: seen.append(collate(examples)) or seen[-1]
    if hasattr(trainer, "_train_dataloader"):
        trainer._train_dataloader = None
    return trainer, cb, seen, model


@pytest.mark.parametrize("smoothing, packing", [(0.0, False), (0.1, False), (0.0, True)])
def test_sft_trainer_completion_only_measures_the_completion_positions(tmp_path, smoothing, packing):
    """Completion-only loss (prompt tokens -100): the fused loss forward (hidden-state path), or under label
    smoothing the label-free loss forward (TRL's second, fused forward only feeds its metrics); packed rows
    (padding-free, ``position_ids``) too. Evaluation goes through the same rule."""
    kw = dict(packing=True, padding_free=True, max_length=12) if packing else {}
    trainer, cb, seen, model = _sft(tmp_path, label_smoothing_factor=smoothing, completion_only_loss=True, **kw)
    trainer.train()
    batch = seen[0]
    assert (batch["labels"] == -100).sum() >= 4 * B  # the prompts are masked
    want = reference(model, batch)
    assert_published(cb.latest, "headwatch/logits", want)
    if smoothing == 0.0:  # the trainer's own figures: its loss (token mean) and TRL's token accuracy
        trl = next(r for r in trainer.state.log_history if "mean_token_accuracy" in r)
        assert cb.latest["headwatch/logits/target_argmax_rate"] == pytest.approx(trl["mean_token_accuracy"], abs=1e-6)
        assert cb.latest["headwatch/logits/target_nll"] == pytest.approx(trl["loss"], abs=2e-6)
    if not packing:
        seen.clear()
        metrics = trainer.evaluate(trainer.train_dataset)
        assert_published({k.removeprefix("eval_"): v for k, v in metrics.items()}, "headwatch/val/logits", reference(model, seen[0]))


# ------------------------------------------------------------------------------------ Lightning


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_measures_the_loss_forward_only(tmp_path, manual):
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)
    logger = StepLogger()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=1, log_every_n_steps=1, logger=logger, enable_progress_bar=False,
        callbacks=[LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0)], enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Rows(batch), batch_size=B)
    trainer.fit(LitLlama(model, manual), data, data)
    logged = {k: v[0] for k, v in logger.values.items()}
    assert_published(logged, "headwatch/logits", want)
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/val/")}
    assert_published(val, "headwatch/val/logits", want)


# ------------------------------------------------------------------------------------ plain loop
def test_plain_loop_measures_the_loss_forward_only():
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    hw.step_start(batch, 0)
    with torch.no_grad():
        model(input_ids=batch["input_ids"][:, :5])  # a reference pass: feeds no gradient
    model(**batch).loss.backward()
    values = hw.step_end()
    hw.close()
    assert_published(values, "headwatch/logits", want)


def test_logits_to_keep_counts_the_kept_positions_only():
    """A loss on the logits of the last k positions: those positions are measured, not every one."""
    model, batch = tiny_llama(tie=True), one_batch()
    k = 4
    want = reference(model, batch, kept=k)
    assert want["positions"] == B * (k - 1)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    hw.step_start(batch, 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=k).logits
    assert logits.shape == (B, k, V)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, -k + 1 :].reshape(-1)).backward()
    with pytest.warns(UserWarning, match="last 4 positions of each row"):
        values = hw.step_end()
    hw.close()
    assert_published(values, "headwatch/logits", want)


def test_logits_to_keep_with_labels_masked_outside_the_kept_positions_is_exact():
    """Labels masked everywhere but the kept tail (a completion-only loss on the last k logits): the kept positions'
    own labels are scored, not the masked ones of the whole row (0.3 counted 0 positions and published NaN)."""
    model, batch = tiny_llama(tie=True), one_batch()
    k = 4
    labels = batch["labels"].clone()
    labels[:, :-k] = -100
    batch = {**batch, "labels": labels}
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    hw.step_start(batch, 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=k).logits
    kept = labels[:, -k + 1 :]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, V).double(), kept.reshape(-1), ignore_index=-100)
    nll.backward()
    with pytest.warns(UserWarning, match="last 4 positions of each row"):
        values = hw.step_end()
    hw.close()
    assert values["headwatch/logits/positions"] == (kept != -100).sum().item() == B * (k - 1)
    assert values["headwatch/logits/target_nll"] == pytest.approx(nll.item(), rel=1e-6)


def test_no_labels_is_published_as_such():
    """Without labels the target statistics are NaN and the warning names what the entropy then covers."""
    model, batch = tiny_llama(tie=True), one_batch()
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    hw.step_start(unlabelled, 0)
    with pytest.warns(UserWarning, match="no `labels` in a training dict batch: target_nll.*every attended position"):
        logits = model(**unlabelled).logits  # measured inside the forward
    F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1)).backward()
    values = hw.step_end()
    hw.close()
    assert math.isnan(values["headwatch/logits/target_nll"]) and math.isnan(values["headwatch/logits/ece"])
    assert values["headwatch/logits/positions"] == B * T  # every attended position: not the loss's, and said so


def test_two_forwards_with_gradient_both_feed_the_loss_and_are_both_measured():
    """R-Drop style: two forwards with gradient, one loss from both; each is measured against the batch's labels."""
    model, batch = tiny_llama(tie=True), one_batch()
    want = reference(model, batch)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    hw.step_start(batch, 0)
    with pytest.warns(UserWarning, match="more than once with gradient"):
        loss = model(**batch).loss + model(**batch).loss
    loss.backward()
    values = hw.step_end()
    hw.close()
    assert_published(values, "headwatch/logits", {**want, "positions": 2 * want["positions"]})


def test_a_split_mixing_labelled_and_unlabelled_batches_says_so():
    model, batch = tiny_llama(tie=True), one_batch()
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=0)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.warns(UserWarning, match="pooled batches with labels and batches without"):
        for b in (batch, unlabelled):
            hw.step_start(b, 0)  # two micro-batches of one logging step
            model(**b).logits.sum().backward()
    hw.step_end()
    hw.close()
