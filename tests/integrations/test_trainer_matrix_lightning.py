"""The trainer matrix's Lightning column (docs/supported.md): a Hugging Face model of each of the three tiny
families (``tests/helpers/trainer_matrix.py``) trained by a ``LightningModule`` whose ``training_step`` is what a
user writes for each feature, every published figure against an independent reference.

References: float64 statistics of the model's own ``outputs.logits`` of every forward with gradient (a forward
hook), scored against that forward's labels; the real ``.grad`` at ``on_before_optimizer_step`` and an untied
twin's autograd through the same loss on the same batches (tied families: the two flows); Lightning's logged
``train_loss`` through ``compare_loss=`` where it is the cross-entropy measured; validation against a fresh
float64 forward of each validation set.
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from tests.helpers.capture import reference as eval_reference
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.matrices import V, untied_twin
from tests.helpers.trainer_matrix import (
    ATOL,
    FAMILIES,
    STEPS,
    B,
    H,
    LogitsRecorder,
    Rows,
    T,
    assert_grads,
    assert_logits,
    assert_unlabelled,
    family,
    headwatch_warnings,
    is_tied,
    logits_reference,
    packed,
)  # fmt: skip

transformers = pytest.importorskip("transformers")

KEEP = 5
MIX = Rows(
    B, seed=21
).batch()  # a second batch with labels of its own (a pretraining mix)
SMOOTHING = 0.1
# the logged train_loss is the cross-entropy headwatch measures: the self-check compares them
COMPARED = {"automatic", "manual", "two_val_dataloaders", "second_fit", "gradient_accumulation", "logits_to_keep",
            "r_drop", "bf16", "neftune", "padding_free", "gradient_checkpointing", "short_last_window",
            "compile"}  # fmt: skip
# no forward returns the loss and no loss is compared: no check/* at all
UNCHECKED = {"label_smoothing", "no_labels"}


def lit_loss(model, batch: dict, feature: str, batch_idx: int) -> torch.Tensor:
    """The step's loss as a Lightning user writes it for ``feature``."""
    if feature == "neftune":
        torch.manual_seed(100 + batch_idx)  # the twin's noise is the same draw
    if feature in (
        "label_smoothing",
        "no_labels",
    ):  # the loss from the logits, outside the model
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits[:, :-1]
        targets = (
            batch["input_ids"][:, 1:]
            if feature == "no_labels"
            else batch["labels"][:, 1:]
        )
        smoothing = SMOOTHING if feature == "label_smoothing" else 0.0
        return F.cross_entropy(
            logits.reshape(-1, V),
            targets.reshape(-1),
            ignore_index=-100,
            label_smoothing=smoothing,
        )
    if (
        feature == "logits_to_keep"
    ):  # a loss on the logits of the last KEEP positions only
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            logits_to_keep=KEEP,
        ).logits
        labels = batch["labels"][:, -KEEP + 1 :]
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100
        )
    if feature == "r_drop":  # two forwards over the same batch, one loss
        return (model(**batch).loss + model(**batch).loss) / 2
    if feature == "own_labels":
        return model(**batch).loss + model(**MIX).loss
    return model(**batch).loss


class LitModel(pl.LightningModule):
    """``lit_loss`` logged as ``train_loss``; manual optimization: zero_grad, manual_backward, step."""

    def __init__(self, model, feature: str):
        super().__init__()
        self.model, self.feature = model, feature
        self.automatic_optimization = feature != "manual"

    def training_step(self, batch, batch_idx):
        loss = lit_loss(self.model, batch, self.feature, batch_idx)
        self.log("train_loss", loss, on_step=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class LitGradRecorder(pl.Callback):
    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        m = pl_module.model
        self.grads.append(
            {
                "embedding": m.get_input_embeddings().weight.grad.clone(),
                "head": m.lm_head.weight.grad.clone(),
            }
        )


class Unlabelled(torch.utils.data.Dataset):
    def __init__(self, rows: Rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {k: v for k, v in self.rows[i].items() if k != "labels"}


LIGHTNING_FEATURES = ["automatic", "manual", "two_val_dataloaders", "second_fit", "gradient_accumulation", "label_smoothing",
                      "logits_to_keep", "no_labels", "r_drop", "own_labels", "bf16", "neftune", "padding_free",
                      "gradient_checkpointing", "short_last_window"]  # fmt: skip
# the door's own mechanics (a collator, checkpointing, an accumulation window): on the tied and the untied family
DOOR_ONLY = ("padding_free", "gradient_checkpointing", "short_last_window")
CASES = [
    pytest.param(n, feature, id=f"{n}-{feature}")
    for feature in LIGHTNING_FEATURES
    for n in FAMILIES
    if not (n == "gemma_scaled" and feature in DOOR_ONLY)
]
# compiled in place before fit: the tied Llama only (a compile costs seconds; the tied split through the probe is
# what compiled code changes, and the plain loop's and the Trainer's compile rows run the three families)
CASES += [pytest.param("llama_tied", "compile", id="llama_tied-compile")]
# micro-batches per optimizer step (``accumulate_grad_batches=2``): 3 batches, so the epoch's last window holds one
WINDOWS = {"gradient_accumulation": [2] * STEPS, "short_last_window": [2, 1]}


def twin_grads(
    twin, micro: list[list[dict]], feature: str, accumulate: int
) -> list[dict[str, torch.Tensor]]:
    """Autograd on the untied twin through the same loss (under the same autocast), accumulated over each step's
    micro-batches as Lightning does (each loss over ``accumulate_grad_batches``, a shorter last window too)."""
    out = []
    for step, group in enumerate(micro):
        for batch in group:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=feature == "bf16"):
                loss = lit_loss(twin, batch, feature, step)
            (loss / accumulate).backward()
        out.append(
            {
                "embedding": twin.get_input_embeddings().weight.grad.clone(),
                "head": twin.lm_head.weight.grad.clone(),
            }
        )
        twin.zero_grad()
    return out


@pytest.mark.parametrize("name, feature", CASES)
def test_lightning(tmp_path, name, feature):
    from transformers.integrations.neftune import activate_neftune

    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    if (
        feature == "neftune"
    ):  # a Lightning user's NEFTune: Hugging Face's hook on the embedding
        activate_neftune(model, 5.0), twin is not None and activate_neftune(twin, 5.0)
    windows = WINDOWS.get(feature, [1] * STEPS)
    per_step = windows[0]  # accumulate_grad_batches
    train_rows = Rows(B * sum(windows), seed=3)
    collate = DataCollatorWithFlattening() if feature == "padding_free" else None
    val_sets = (
        [Rows(5, seed=11), Rows(6, seed=12)]
        if feature == "two_val_dataloaders"
        else [Rows(5, seed=11)]
    )
    data = list(
        torch.utils.data.DataLoader(
            train_rows, batch_size=B, shuffle=False, collate_fn=collate
        )
    )
    if feature == "no_labels":
        train_rows = Unlabelled(train_rows)
    ends = list(accumulate(windows))
    micro = [data[end - n : end] for n, end in zip(windows, ends, strict=True)]
    assert feature != "padding_free" or all(packed(b) for b in data)
    twins = twin_grads(twin, micro, feature, per_step) if twin is not None else None
    if (
        feature == "compile"
    ):  # compiled in place before fit (aot_eager: AOTAutograd without inductor's C++ build)
        model.compile(backend="aot_eager")
    if (
        feature == "gradient_checkpointing"
    ):  # transformers 5's name of gradient_checkpointing_enable
        model.activation_checkpointing_enable()
    # the first layer's attention calls: its recomputation in the backward too, under checkpointing
    layer_calls = []
    counter = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *a: layer_calls.append(1)
    )
    logger, grads = StepLogger(), LitGradRecorder()
    compare = "train_loss" if feature in COMPARED else None
    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0, compare_loss=compare),
                 GradientDensityMonitor(log_every_n_steps=1), grads]  # fmt: skip

    def fit(logger):
        trainer = pl.Trainer(
            default_root_dir=tmp_path, max_steps=STEPS, log_every_n_steps=1, logger=logger, callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, num_sanity_val_steps=0,
            accumulate_grad_batches=per_step, precision="bf16-mixed" if feature == "bf16" else "32-true",
        )  # fmt: skip
        trainer.fit(LitModel(model, feature), torch.utils.data.DataLoader(train_rows, batch_size=B, collate_fn=collate),
                    [torch.utils.data.DataLoader(r, batch_size=8) for r in val_sets])  # fmt: skip
        return trainer

    recorder = LogitsRecorder(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if (
            feature == "second_fit"
        ):  # the same callbacks in a new Trainer: the second run starts from empty state
            fit(StepLogger())
            recorder.logits.clear(), grads.grads.clear()
        trainer = fit(logger)
    recorder.remove(), counter.remove()
    said = headwatch_warnings(caught)
    if feature == "logits_to_keep":
        assert len(said) == 1 and f"last {KEEP} positions of each row" in said[0], said
    elif feature == "no_labels":
        assert len(said) == 1 and "every attended position" in said[0], said
    elif feature in (
        "r_drop",
        "own_labels",
    ):  # each forward against its own labels, pooled: said once
        assert len(said) == 1 and "more than once with gradient" in said[0], said
    else:
        assert said == [], said
    forwards = [2] * STEPS if feature in ("r_drop", "own_labels") else windows
    assert len(recorder.logits) == sum(forwards) and len(grads.grads) == STEPS
    if (
        feature == "gradient_checkpointing"
    ):  # the layer ran again in the backward; validation's forwards once
        assert len(layer_calls) - len(val_sets) == 2 * STEPS
    values = [
        {
            k: v[i]
            for k, v in logger.values.items()
            if k.startswith(f"{H}/") and "/val/" not in k
        }
        for i in range(STEPS)
    ]
    for step in range(STEPS):
        done = sum(forwards[: step + 1])
        got, logits = values[step], recorder.logits[done - forwards[step] : done]
        batches = (
            [data[step], MIX]
            if feature == "own_labels"
            else [data[step]] * 2
            if feature == "r_drop"
            else micro[step]
        )
        assert got[f"{H}/debug/capture/forwards"] == forwards[step]
        assert got[f"{H}/tokens/total"] == B * T * ends[step]
        assert_grads(
            got,
            grads.grads[step],
            twins[step] if twins else None,
            model.get_input_embeddings().padding_idx,
        )
        if (
            feature == "no_labels"
        ):  # refused: the target statistics; entropy over every attended position exact
            assert_unlabelled(got, logits[0])  # every attended position: no labels select them
        else:
            want = logits_reference(logits, batches)
            assert_logits(got, want)
            assert got[f"{H}/debug/capture/positions"] == want["positions"]
        if (
            feature in COMPARED and per_step == 1
        ):  # Lightning's logged loss (accumulating: one micro-batch's)
            assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(
                logger.values["train_loss"][step], abs=1e-6
            )
        if feature in COMPARED:
            assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(
                want["nll"], abs=ATOL
            )
            # the logged loss's positions are those its batch's forwards scored (only the kept ones, both R-Drop passes)
            assert (
                got[f"{H}/debug/check/reference_positions"]
                == got[f"{H}/debug/capture/labelled_positions"]
                == want["positions"]
            )
        if feature in UNCHECKED:
            assert f"{H}/check/nll_gap" not in got
        else:
            assert (
                abs(got[f"{H}/check/nll_gap"]) < 1e-5
                and got[f"{H}/check/mismatch"] == 0
            )
    metrics = {
        k: float(v)
        for k, v in trainer.callback_metrics.items()
        if k.startswith(f"{H}/val/")
    }
    for i, rows in enumerate(val_sets):
        with torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled=feature == "bf16"
        ):  # the logits validation scored
            want = eval_reference(model, rows.batch())
        suffix = f"/dataloader_idx_{i}" if len(val_sets) > 1 else ""
        assert metrics[f"{H}/val/logits/positions{suffix}"] == want["positions"]
        for key in (
            "entropy",
            "max_prob",
            "kl_to_uniform",
            "target_nll",
            "target_argmax_rate",
        ):
            assert metrics[f"{H}/val/logits/{key}{suffix}"] == pytest.approx(
                want[key], abs=ATOL
            ), (i, key)
