"""The self-check runs in evaluation as in training: the model's own ``outputs.loss`` of the eval-mode forwards
against ``val/logits/*``; a failed evaluation withholds its ``val/logits/*`` figures, counted in ``val/check/withheld``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from transformers import Trainer

from headwatch import LogitStatsMonitor
from headwatch.core import LogitStats
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import B, Rows, T, V, hf_args, one_batch, tiny_llama
from tests.helpers.lightning_runs import StepLogger

P = "eval_headwatch/val"


def evaluate(tmp_path, monitors, alter: bool = False) -> dict[str, float]:
    model = tiny_llama(tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: other labels have another NLL
    cb = HeadwatchCallback(monitors=monitors, figure_every_n_steps=0, summary=False)
    trainer = Trainer(model=model, args=hf_args(tmp_path, per_device_eval_batch_size=B), eval_dataset=Rows(one_batch(), 2), callbacks=[cb])
    if alter:  # after headwatch's pre-hook: the model's loss scores other labels than the batch headwatch read
        model.register_forward_pre_hook(
            lambda module, a, kw: (a, {**kw, "labels": torch.where(kw["labels"] == -100, -100, (kw["labels"] + 1) % V)}),
            with_kwargs=True,
        )
    return trainer.evaluate()


def test_an_evaluation_is_checked_against_the_models_own_loss(tmp_path):
    metrics = evaluate(tmp_path, ["logits"])
    assert metrics[f"{P}/check/mismatch"] == 0.0 and metrics[f"{P}/check/withheld"] == 0.0
    assert metrics[f"{P}/debug/check/reference_nll"] == pytest.approx(metrics["eval_loss"], abs=1e-5)
    assert abs(metrics[f"{P}/check/nll_gap"]) < 1e-5
    positions = 2 * B * (T - 1)  # two batches
    assert metrics[f"{P}/debug/capture/labelled_positions"] == metrics[f"{P}/debug/check/reference_positions"] == positions
    assert metrics[f"{P}/debug/check/reference_forwards"] == 2.0
    assert metrics[f"{P}/logits/target_nll"] == pytest.approx(metrics["eval_loss"], abs=1e-5)


def test_a_failed_evaluation_withholds_its_logit_figures_with_one_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"self-check FAILED.*same positions, different values.*withheld") as caught:
        metrics = evaluate(tmp_path, [LogitStats(path="hidden")], alter=True)  # hidden path: no loss call read
    assert sum("self-check FAILED" in str(w.message) for w in caught) == 1
    assert metrics[f"{P}/check/mismatch"] == 1.0 and abs(metrics[f"{P}/check/nll_gap"]) > 0.05
    assert not [k for k in metrics if k.startswith(f"{P}/logits/")]
    assert metrics[f"{P}/check/withheld"] > 10


class LitLlama(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_validation_is_checked_and_the_sanity_check_left_out(tmp_path):
    logger = StepLogger()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=2, log_every_n_steps=1, logger=logger, val_check_interval=2, num_sanity_val_steps=1,
        callbacks=[LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Rows(one_batch(), 2), batch_size=B)
    trainer.fit(LitLlama(tiny_llama(tie=False)), data, torch.utils.data.DataLoader(Rows(one_batch(), 2), batch_size=B))
    val = {k: v for k, v in logger.values.items() if k.startswith("headwatch/val/")}
    assert val["headwatch/val/check/mismatch"] == [0.0] and val["headwatch/val/check/withheld"] == [0.0]
    # two batches, not the sanity check's one more
    assert val["headwatch/val/debug/check/reference_positions"] == val["headwatch/val/debug/capture/labelled_positions"] == [2 * B * (T - 1)]
    assert val["headwatch/val/debug/check/reference_nll"][0] == pytest.approx(val["headwatch/val/logits/target_nll"][0], abs=1e-5)
