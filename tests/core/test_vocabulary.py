"""Vocabulary-sized matrices that change after attach (``resize_token_embeddings``, an untie) are resolved again and
said once, with one WARNING, on the plain loop and on Lightning; the figures after the change cover the new rows."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from headwatch.core.vocabulary import Layout, layout
from headwatch.integrations.loop import Headwatch
from tests.helpers.hf import B, Rows, T, V, tiny_llama
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.loop import Tiny, train_step

GROWN = 96


def batch(step: int, high: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(B, T, dtype=torch.long)}


def changed_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "changed after attach" in str(w.message)]


def loop_step(hw: Headwatch, model: nn.Module, step: int, high: int) -> dict[str, float]:
    b = batch(step, high)
    hw.step_start(b, step)
    model(**b).loss.backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    model.zero_grad()
    return hw.step_end()


def test_loop_resolves_a_resized_vocabulary_again_and_says_it_once():
    model = tiny_llama(tie=False)
    hw = Headwatch(model, monitors=["tokens", "logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=0, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = [loop_step(hw, model, s, V) for s in range(2)]
        model.resize_token_embeddings(GROWN)
        after = [loop_step(hw, model, s, GROWN) for s in range(2, 5)]
    (said,) = changed_warnings(caught)  # once, though three logging steps followed
    assert "head 64 rows, embedding 64 rows, untied -> head 96 rows, embedding 96 rows, untied" in said
    assert [v["headwatch/model/vocab_size"] for v in before + after] == [V, V, GROWN, GROWN, GROWN]
    last = after[-1]
    # the new head is measured (its forward hooked again): every position, over 96 columns
    assert last["headwatch/logits/positions"] == B * (T - 1)
    assert last["headwatch/logits/kl_to_uniform"] + last["headwatch/logits/entropy"] == pytest.approx(
        torch.log(torch.tensor(96.0)).item(), abs=1e-5
    )
    # ids past the old rows are counted, not out of range; the row density is over the 96 rows
    assert last["headwatch/tokens/out_of_range"] == 0
    ids = batch(4, GROWN)["input_ids"]
    assert last["headwatch/grad/embedding_row_density"] == pytest.approx(ids[:, :-1].unique().numel() / GROWN)
    hw.close()


def test_loop_says_an_untie_after_attach():
    model = Tiny()
    model.lm_head.weight = model.embed_tokens.weight  # tied at attach
    hw = Headwatch(model, monitors=["tokens", "gradients"], log_every_n_steps=1, figure_every_n_steps=0, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_step(hw, model, 0)["headwatch/grad/tied"] == 1.0
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
        values = [train_step(hw, model, s) for s in (1, 2)]
    (said,) = changed_warnings(caught)
    assert "tied -> head 16 rows, embedding 16 rows, untied" in said
    assert [v["headwatch/grad/tied"] for v in values] == [0.0, 0.0]
    hw.close()


def test_layout_reads_declarations_not_storage():
    model = Tiny()
    first = layout(model)
    assert first == Layout("lm_head", 16, "embed_tokens", 16, False)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # values change: the layout does not
    assert layout(model) == first
    assert layout(nn.Linear(3, 3)) is None  # no head and embedding to resolve: not watched


class LitLlama(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, b, batch_idx):
        return self.model(**b).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class ResizeAt(pl.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
        if batch_idx == self.step:
            pl_module.model.resize_token_embeddings(GROWN)


def test_lightning_resolves_a_resized_vocabulary_again_and_says_it_once(tmp_path):
    logger = StepLogger()
    callbacks = [ResizeAt(2), TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0),
                 GradientDensityMonitor(log_every_n_steps=1, figure_every_n_steps=0)]  # fmt: skip
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=4, log_every_n_steps=1, logger=logger, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Rows(batch(0, V), repeat=4), batch_size=B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LitLlama(tiny_llama(tie=False)), data)
    (said,) = changed_warnings(caught)
    assert "-> head 96 rows, embedding 96 rows, untied" in said
    assert logger.values["headwatch/model/vocab_size"] == [V, V, GROWN, GROWN]
    assert logger.values["headwatch/logits/positions"] == [B * (T - 1)] * 4  # the new head's forwards measured
    entropy = [h + k for h, k in zip(logger.values["headwatch/logits/entropy"], logger.values["headwatch/logits/kl_to_uniform"])]
    assert entropy == pytest.approx([torch.log(torch.tensor(float(v))).item() for v in (V, V, GROWN, GROWN)], abs=1e-5)


def test_a_vocab_size_larger_than_the_head_is_refused_with_both_sizes():
    """``LogitStats(vocab_size=...)`` beyond the head's rows would measure no padded column (a false
    ``padded_mass`` 0): the monitor is refused with one warning naming both sizes; strict raises."""
    from headwatch.core.logits import LogitStats
    from headwatch.core.orchestrator import Orchestrator
    from headwatch.errors import HeadwatchError

    model = tiny_llama(tie=False)
    run = Orchestrator([LogitStats(vocab_size=V + 1), "gradients"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.attach(model, refuse=True)
    said = [str(w.message) for w in caught if f"vocab_size={V + 1}" in str(w.message)]
    assert len(said) == 1 and f"({V} rows)" in said[0] and "lm_head" in said[0], said
    assert "LogitStats" not in [type(m).__name__ for m in run.monitors] and "GradientDensity" in [type(m).__name__ for m in run.monitors]
    with pytest.raises(HeadwatchError, match=f"`vocab_size={V + 1}` is larger than the head"):
        Orchestrator([LogitStats(vocab_size=V + 1)], strict=True).attach(model, refuse=True)
    run = Orchestrator([LogitStats(vocab_size=V)])  # the head's own size: measured
    run.attach(model, refuse=True)
    assert run.monitors and not run.refused
