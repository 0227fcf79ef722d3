"""The trainer matrix's row for an encoder-decoder trained with generation in its evaluation (docs/supported.md,
"Seq2Seq with generation"): a tiny T5 (its head tied to the shared embedding) through the Hugging Face ``Seq2SeqTrainer`` with
``predict_with_generate=True``, a ``LightningModule`` whose validation step calls ``generate()`` before its loss
forward, and the plain loop; every published figure against an independent reference.

References: float64 statistics of the model's own ``outputs.logits`` (the decoder's head) of each loss forward,
scored against the labels as given (the decoder's position ``t`` predicts ``labels[t]``: no shift), ``-100`` out;
evaluations: a fresh forward of the evaluation rows; the gradients: the real ``.grad`` (untied) or an untied twin's
two ``.grad`` by autograd on the batches the door trained on (tied: the lookup flow of the encoder and decoder
embeddings, the scoring flow of the head); the trainers' own losses.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.matrices import D, V, twin_grads, untied_twin
from tests.helpers.references import reference as float64_stats
from tests.helpers.trainer_matrix import (
    ATOL,
    STEPS,
    B,
    GradRecorder,
    H,
    LitLoss,
    LogitsRecorder,
    Rows,
    SeenCollator,
    assert_grads,
    door_run,
    headwatch_warnings,
    hf_args,
)  # fmt: skip

transformers = pytest.importorskip("transformers")

EVAL_ROWS = 4


def t5() -> torch.nn.Module:
    """A tiny T5, no dropout (the twin's forwards are the model's): its head is the shared embedding (transformers 5
    ties it whatever the config says), the decoder's output scaled by ``d_model ** -0.5`` before it."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=V, d_model=D, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def seq2seq_reference(
    logits: list[torch.Tensor], batches: list[dict]
) -> dict[str, float]:
    """float64 statistics pooled over one step's forwards: the logits ``(B, L, V)`` at ``t`` scored against
    ``labels[t]``, ``-100`` out."""
    cols: dict[str, list[np.ndarray]] = {
        k: []
        for k in ("entropy", "kl_to_uniform", "max_prob", "nll", "target_is_argmax")
    }
    for x, batch in zip(logits, batches, strict=True):
        ref = float64_stats(x, None, batch["labels"])
        for k, col in cols.items():
            col.append(np.asarray(ref[k])[ref["valid"]])
    out = {k: float(np.concatenate(v).astype(float).mean()) for k, v in cols.items()}
    out["positions"] = sum(len(v) for v in cols["nll"])
    return out


def assert_published(values: dict, want: dict, group: str) -> None:
    assert values[f"{group}/positions"] == want["positions"]
    pairs = {"entropy": "entropy", "kl_to_uniform": "kl_to_uniform", "max_prob": "max_prob", "target_nll": "nll",
             "target_argmax_rate": "target_is_argmax"}  # fmt: skip
    for key, col in pairs.items():
        assert values[f"{group}/{key}"] == pytest.approx(want[col], abs=ATOL), key
    assert math.isfinite(values[f"{group}/ece"])


def evaluation_reference(model) -> dict[str, float]:
    """A fresh forward of the evaluation rows (one batch), the model in evaluation mode."""
    batch = Rows(EVAL_ROWS, seed=5).batch()
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    model.train(was)
    return seq2seq_reference([logits], [batch])


def counted_generate(model) -> list[int]:
    """Count ``model.generate`` calls (the premise: the evaluation generated)."""
    calls, generate = [], model.generate

    def wrapped(*args, **kwargs):
        calls.append(1)
        return generate(*args, **kwargs)

    model.generate = wrapped
    return calls


class LitSeq2Seq(LitLoss):
    """Training: ``model(**batch).loss``; validation: ``generate()`` from the encoder input, then the loss forward."""

    def validation_step(self, batch, batch_idx):
        self.model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=3,
            do_sample=False,
        )
        self.log("val_loss", self.model(**batch).loss)


def generated_length(prediction) -> dict[str, float]:
    """A metric over the generated tokens: without one, ``evaluate()`` computes the loss alone and never generates."""
    return {"generated_length": float(prediction.predictions.shape[-1])}


def hf_run(
    model, out
) -> tuple[list[dict], list[dict], list[torch.Tensor], list, dict, list[int]]:
    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    args = hf_args(
        out,
        transformers.Seq2SeqTrainingArguments,
        predict_with_generate=True,
        generation_max_length=6,
    )
    grads = GradRecorder()
    trainer = transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=Rows(B * STEPS, seed=3),
                                          eval_dataset=Rows(EVAL_ROWS, seed=5), callbacks=[cb, grads],
                                          compute_metrics=generated_length)  # fmt: skip
    seen = SeenCollator(trainer.data_collator)
    trainer.data_collator = seen
    calls = counted_generate(model)
    recorder = LogitsRecorder(model)
    trainer.train()
    metrics = trainer.evaluate()
    recorder.remove()
    logged = [r for r in trainer.state.log_history if f"{H}/logits/entropy" in r]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert all(
        v == pytest.approx(r[f"{H}/logits/target_nll"], abs=1e-5)
        for v, r in zip(losses, logged, strict=True)
    )
    metrics = {k.removeprefix("eval_"): v for k, v in metrics.items()}
    metrics[f"{H}/val/loss"] = metrics["loss"]
    return logged, seen.seen[:STEPS], recorder.logits, grads.grads, metrics, calls


def lightning_run(
    model, out
) -> tuple[list[dict], list[dict], list[torch.Tensor], list, dict, list[int]]:
    logger = StepLogger()
    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0, compare_loss="train_loss"),
                 GradientDensityMonitor(log_every_n_steps=1)]  # fmt: skip
    trainer = pl.Trainer(default_root_dir=out, max_steps=STEPS, log_every_n_steps=1, logger=logger, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                         devices=1, num_sanity_val_steps=0, val_check_interval=STEPS)  # fmt: skip
    train = torch.utils.data.DataLoader(Rows(B * STEPS, seed=3), batch_size=B)
    val = torch.utils.data.DataLoader(Rows(EVAL_ROWS, seed=5), batch_size=EVAL_ROWS)
    calls = counted_generate(model)
    recorder = LogitsRecorder(model)
    trainer.fit(LitSeq2Seq(model), train, val)
    recorder.remove()
    values = [
        {
            k: v[i]
            for k, v in logger.values.items()
            if k.startswith(f"{H}/") and "/val/" not in k
        }
        for i in range(STEPS)
    ]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics[f"{H}/val/loss"] = metrics["val_loss"]
    return values, list(train), recorder.logits, None, metrics, calls


@pytest.mark.parametrize("door", ["hf_trainer", "lightning", "loop"])
def test_an_encoder_decoder_with_generation_in_evaluation(tmp_path, door):
    """Training: each step's decoder logits against its labels, gradients exact; evaluation (HF, Lightning): the loss
    forward alone, ``generate()``'s forwards never pooled (the premise: ``generate`` ran)."""
    model = t5()
    twin = untied_twin(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if door == "loop":
            values, seen, logits = door_run("loop", model, tmp_path)
            grads, metrics, calls = None, None, []
        else:
            values, seen, logits, grads, metrics, calls = (
                hf_run if door == "hf_trainer" else lightning_run
            )(model, tmp_path)
    assert headwatch_warnings(caught) == []
    assert len(values) == STEPS and len(logits) == STEPS
    expected = twin_grads(twin, seen)
    for step in range(STEPS):
        got = values[step]
        want = seq2seq_reference([logits[step]], [seen[step]])
        assert_published(got, want, f"{H}/logits")
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        # the real .grad at the HF Trainer's optimizer step; elsewhere the sum of the twin's two flows
        real = (
            grads[step]
            if grads
            else {"embedding": expected[step]["embedding"] + expected[step]["head"]}
        )
        assert_grads(got, real, expected[step], None)
    if metrics is not None:
        assert len(calls) >= 1  # the evaluation generated
        want = evaluation_reference(model)
        assert_published(metrics, want, f"{H}/val/logits")
        assert metrics[f"{H}/val/logits/target_nll"] == pytest.approx(
            metrics[f"{H}/val/loss"], abs=1e-5
        )
        assert metrics[f"{H}/val/debug/capture/forwards"] == 1  # the loss forward alone
