"""The README's path: untie in ``LightningModule.configure_model`` a Hugging Face model wrapped in a
LightningModule, then warm the head up with the monitors on. Everything must see the final model."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import GradientDensityMonitor, LogitStatsMonitor
from headwatch.remedies import HeadWarmup, untie_output_head
from tests.helpers import loader
from tests.helpers.lightning_runs import make_trainer

transformers = pytest.importorskip("transformers")

V, D, LR, HEAD_LR = 64, 16, 0.1, 1e-2


def _llama(initializer_range: float = 0.02) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True, initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class LitLlama(pl.LightningModule):
    """The README's module: a tied Llama, untied with a fresh N(0, 0.02^2) head in configure_model."""

    def __init__(self, init_kw: dict | None = None):
        super().__init__()
        self.model = _llama()
        self.init_kw = {"init": "normal", "std": 0.02} if init_kw is None else init_kw

    def configure_model(self):
        if self.model.lm_head.weight is self.model.get_input_embeddings().weight:
            untie_output_head(self, **self.init_kw)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Steps(Callback):
    """Per optimizer step: which parameters changed, the head's gradient and change, what required grad."""

    def __init__(self):
        self.moved, self.trainable, self.head_grad, self.head_delta = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.trainable.append({n for n, p in pl_module.named_parameters() if p.requires_grad})
        self.head_grad.append(pl_module.model.lm_head.weight.grad.detach().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = dict(pl_module.named_parameters())
        self.moved.append({n for n, p in params.items() if not torch.equal(p.detach(), self._before[n])})
        self.head_delta.append(params["model.lm_head.weight"].detach() - self._before["model.lm_head.weight"])


def _fit(tmp_path, steps: Steps, max_steps: int = 5) -> LitLlama:
    module = LitLlama()
    callbacks = [HeadWarmup(3, head_lr=HEAD_LR), LogitStatsMonitor(figure_every_n_steps=0),
                 GradientDensityMonitor(figure_every_n_steps=0), steps]  # fmt: skip
    make_trainer(tmp_path, callbacks, max_steps=max_steps, log_every_n_steps=1).fit(module, loader(n=40))
    return module


def test_warmup_after_untie_in_configure_model_moves_only_the_head(tmp_path, recwarn):
    steps = Steps()
    module = _fit(tmp_path, steps)
    names = {n for n, _ in module.named_parameters()}
    assert "model.lm_head.weight" in names and len(names) == 12  # untied: the head is a parameter of its own
    assert not [w for w in recwarn if "untie first" in str(w.message)]  # the user did untie
    # warm-up: only the untied head requires grad and changes; the embedding stays bit for bit
    assert steps.trainable[:3] == [{"model.lm_head.weight"}] * 3
    assert steps.moved[:3] == [{"model.lm_head.weight"}] * 3
    assert steps.moved[3:] == [names] * 2 and steps.trainable[3:] == [names] * 2
    # SGD step of the head: -head_lr * grad during the warm-up, -lr * grad after it
    for step, lr in ((0, HEAD_LR), (2, HEAD_LR), (3, LR), (4, LR)):
        torch.testing.assert_close(steps.head_delta[step], -lr * steps.head_grad[step], rtol=1e-5, atol=1e-7)


def _setup_lines(records) -> list[str]:
    return [r.getMessage() for r in records if "head `model.lm_head` and embedding" in r.getMessage()]


def test_tying_is_said_once_for_the_final_model(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, Steps(), max_steps=1)
    lines = _setup_lines(caplog.records)
    assert len(lines) == 1, lines
    assert "separate Parameters: untied." in lines[0] and "one effective matrix" not in lines[0]
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("headwatch/grad/tying/text_summary")]
    assert len(texts) == 1 and "separate Parameters: untied." in texts[0], texts


def test_validate_says_the_final_model_too(tmp_path, caplog):
    module = LitLlama()
    trainer = make_trainer(tmp_path, [GradientDensityMonitor(figure_every_n_steps=0)], limit_val_batches=1)
    module.validation_step = lambda batch, batch_idx: None
    with caplog.at_level(logging.INFO):
        trainer.validate(module, loader(n=8))
    lines = _setup_lines(caplog.records)
    assert len(lines) == 1 and "separate Parameters: untied." in lines[0], lines


def test_normal_init_reads_initializer_range_of_the_wrapped_hf_model():
    module = LitLlama()
    module.model = _llama(initializer_range=0.05)  # 0.05: not the default 0.02 a fallback could give
    assert getattr(module, "config", None) is None
    report = untie_output_head(module, init="normal")
    assert report.std == 0.05
    w = module.model.lm_head.weight.detach().double()
    # sample std of V * D = 1024 draws of N(0, 0.05^2): standard error 0.05 / sqrt(2 * 1024) = 0.0011
    assert w.std().item() == pytest.approx(0.05, abs=5 * 0.05 / (2 * V * D) ** 0.5)
    assert w.mean().abs().item() < 5 * 0.05 / (V * D) ** 0.5
