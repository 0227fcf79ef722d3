"""LogitStatsMonitor on Hugging Face families: target_nll is the model's own loss (docs/sources.md)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from headwatch import LogitStatsMonitor
from tests.helpers.lightning_runs import StepLogger, make_trainer
from tests.helpers.sources import tiny_gemma2, tiny_t5

transformers = pytest.importorskip("transformers")


class HFModule(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def batches(seed: int, encoder_length: int | None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(4):
        labels = torch.randint(1, 64, (2, 8), generator=g)
        labels[0, -1] = labels[1, 0] = -100
        ids = torch.randint(1, 64, (2, encoder_length or 8), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0 if encoder_length else 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return DataLoader(out, batch_size=None)


@pytest.mark.parametrize("family", ["gemma2", "t5"])
def test_target_nll_is_the_models_loss(tmp_path, family):
    model = tiny_gemma2()[0] if family == "gemma2" else tiny_t5()
    logger = StepLogger()
    monitor = LogitStatsMonitor(validation=False, figure_every_n_steps=None, log_histogram=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=4, log_every_n_steps=1, logger=logger)
    trainer.fit(HFModule(model.train()), batches(0, 12 if family == "t5" else None))
    nll, loss = logger.values["headwatch/logits/target_nll"], logger.values["train_loss"]
    assert len(nll) == len(loss) == 4
    assert nll == pytest.approx(loss, abs=1e-5)
    want = 14 if family == "t5" else 2 * 7 - 1  # T5: labels as given; causal: shifted, one -100 among them
    assert logger.values["headwatch/logits/positions"] == [want] * 4


def test_compiled_before_fit_hf_model_is_measured_anyway(tmp_path):
    from tests.helpers.sources import llama_batch, tiny_llama

    lm = tiny_llama().train()
    batch = llama_batch()
    lm.compile(backend="aot_eager")  # AOTAutograd as inductor does, without its C++ build (40 s on 2 CPU cores)
    lm(**batch).loss.backward()  # compiled and run once before the Trainer registers headwatch's hooks
    lm.zero_grad()
    logger = StepLogger()
    monitor = LogitStatsMonitor(validation=False, figure_every_n_steps=None, log_histogram=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=2, log_every_n_steps=1, logger=logger)
    try:
        trainer.fit(HFModule(lm), DataLoader([batch, batch], batch_size=None))
    finally:
        torch._dynamo.reset()
    # the owner's hook still runs around compiled code: the same numbers as the model's own loss
    assert logger.values["headwatch/logits/target_nll"] == pytest.approx(logger.values["train_loss"], abs=1e-5)


def test_compiled_before_fit_plain_model_names_the_cause(tmp_path):
    from tests.helpers import TinyCausalLM, loader

    model = TinyCausalLM()
    model.compile()
    first = next(iter(loader(n=16)))
    model(first["input_ids"]).sum().backward()  # compiled and run before fit: same shapes, grad on
    model.zero_grad()
    monitor = LogitStatsMonitor(validation=False, figure_every_n_steps=None, log_histogram=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=2, log_every_n_steps=1)
    try:
        with pytest.warns(UserWarning, match=r"compiled \(torch.compile\) and was called before headwatch") as record:
            trainer.fit(model, loader(n=16))
    finally:
        torch._dynamo.reset()
    assert not any("every position masked" in str(w.message) for w in record)


def test_setup_message_describes_the_softcapped_logits(tmp_path, monkeypatch):
    """Gemma 2 soft-caps the head's output: the message names the owner's logits, not `model.lm_head`'s output."""
    import headwatch.integrations.lightning.callback as integration
    from headwatch.model.sources import resolve_logits_source

    said: list[str] = []
    monkeypatch.setattr(integration, "rank_zero_info", said.append)
    model = tiny_gemma2()[0]
    monitor = LogitStatsMonitor(validation=False, figure_every_n_steps=None, log_histogram=False, log_every_n_steps=2)
    trainer = make_trainer(tmp_path, [monitor], max_steps=1, log_every_n_steps=2)
    trainer.fit(HFModule(model.train()), batches(0, None))
    lines = [m for m in said if m.startswith("headwatch: measuring")]
    want = resolve_logits_source(HFModule(model)).describe()
    assert lines == [f"headwatch: measuring the logits every 2 steps: {want}"]
    assert "the `logits` returned by `model` (Gemma2ForCausalLM" in lines[0]
    assert "after any post-head transform" in lines[0] and "the output of the head" not in lines[0]
