"""The Hugging Face door reads the run's vocabulary from the Trainer's tokenizer (``processing_class``, a processor's
``.tokenizer``; ``vocab_size=`` wins): the model's padded rows are left out of the row figures and their softmax mass
is published, each checked against a float64 recomputation over the real rows only."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from headwatch.integrations.hf_support import tokenizer_size
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, V, hf_args, one_batch, tiny_llama

REAL = 48  # the tokenizer's words; the model's 64 rows are padded beyond them


def small_tokenizer(words: int = REAL):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words - 1)} | {"<pad>": words - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def real_batch() -> dict[str, torch.Tensor]:
    """:func:`one_batch` with its ids inside the tokenizer's words."""
    batch = one_batch()
    ids = batch["input_ids"] % REAL
    return {**batch, "input_ids": ids, "labels": torch.where(batch["labels"] == -100, -100, ids)}


class Processor:
    """A multimodal processor's shape: no length of its own, its text tokenizer under ``.tokenizer``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def run(tmp_path, processing_class=None, **kw) -> tuple[dict[str, float], torch.nn.Module]:
    model = tiny_llama(tie=False)
    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0, **kw)
    trainer = Trainer(model=model, args=hf_args(tmp_path), train_dataset=Rows(real_batch()), callbacks=[cb],
                      processing_class=processing_class)  # fmt: skip
    trainer.train()
    return dict(cb.latest), model


def float64_reference(model: torch.nn.Module, real: int) -> dict[str, float]:
    """Row densities over the first ``real`` rows and the softmax mass past them, by autograd in float64."""
    twin = tiny_llama(tie=False)
    twin.load_state_dict(model.state_dict())
    twin = twin.double()
    out = twin(**real_batch())
    out.loss.backward()
    emb, head = twin.model.embed_tokens.weight.grad[:real], twin.lm_head.weight.grad[:real]
    logp = torch.log_softmax(out.logits.detach()[:, :-1], dim=-1)  # (B, T-1, V): the positions with a target
    mass = logp[..., real:].exp().sum(-1)
    return {
        "grad/embedding_row_density": (emb.abs().sum(1) > 0).double().mean().item(),
        "grad/head_row_density": (head.abs().sum(1) > 0).double().mean().item(),
        "logits/padded_mass": mass.mean().item(),
    }


@pytest.mark.parametrize("how", ["tokenizer", "processor", "explicit"])
def test_row_figures_cover_the_tokenizers_rows_only(tmp_path, how):
    tok = small_tokenizer()
    kw = {"tokenizer": {"processing_class": tok}, "processor": {"processing_class": Processor(tok)},
          "explicit": {"processing_class": small_tokenizer(60), "vocab_size": REAL}}[how]  # fmt: skip
    got, model = run(tmp_path, **kw)
    want = float64_reference(model, REAL)
    assert real_batch()["input_ids"].max() < REAL  # the data uses real rows only
    for key, value in want.items():
        assert got[f"headwatch/{key}"] == pytest.approx(value, abs=1e-6), key
    assert 0 < got["headwatch/logits/padded_mass"] < 1
    # the same model without a tokenizer: every one of the 64 rows counts, no padded mass
    plain, _ = run(tmp_path / "plain")
    assert "headwatch/logits/padded_mass" not in plain
    distinct = real_batch()["input_ids"][:, :-1].unique().numel()
    assert plain["headwatch/grad/embedding_row_density"] == pytest.approx(distinct / V)
    assert got["headwatch/grad/embedding_row_density"] == pytest.approx(distinct / REAL)


def test_a_tokenizer_larger_than_the_model_is_not_used_and_said(tmp_path):
    with pytest.warns(UserWarning, match="tokenizer has 80 tokens but the model's input embedding 64 rows"):
        got, _ = run(tmp_path, processing_class=small_tokenizer(80))
    assert "headwatch/logits/padded_mass" not in got
    assert "headwatch/grad/embedding_row_density" in got


def test_tokenizer_size_reads_tokenizers_and_processors():
    tok = small_tokenizer()
    trainer = type("T", (), {"processing_class": tok})()
    assert tokenizer_size(trainer) == REAL == len(tok)
    trainer.processing_class = Processor(tok)
    assert tokenizer_size(trainer) == REAL
    trainer.processing_class = object()  # an image processor: no length
    assert tokenizer_size(trainer) is None
    assert tokenizer_size(None) is None
    with pytest.raises(Exception, match="vocab_size"):
        HeadwatchCallback(vocab_size=0)


class GrowAt(TrainerCallback):
    """Adds words to the tokenizer and resizes the model to a multiple of 32 rows before step ``step``."""

    def __init__(self, tok, step: int):
        self.tok, self.step = tok, step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.tok.add_tokens([f"new{i}" for i in range(20)])
            model.resize_token_embeddings(len(self.tok), pad_to_multiple_of=32)


def test_a_vocabulary_resized_during_training_is_read_again_from_the_tokenizer(tmp_path):
    tok = small_tokenizer()
    model = tiny_llama(tie=False)
    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0, summary=False)
    args = hf_args(tmp_path, max_steps=4, optim="sgd")
    trainer = Trainer(model=model, args=args, train_dataset=Rows(real_batch()), callbacks=[GrowAt(tok, 2), cb], processing_class=tok)
    with pytest.warns(UserWarning, match="head 64 rows, embedding 64 rows, untied -> head 96 rows, embedding 96 rows") as caught:
        trainer.train()
    assert sum("changed after attach" in str(w.message) for w in caught) == 1
    logged = [r for r in trainer.state.log_history if "headwatch/model/vocab_size" in r]
    assert [r["headwatch/model/vocab_size"] for r in logged] == [V, V, 96, 96]
    distinct = real_batch()["input_ids"][:, :-1].unique().numel()
    # the tokenizer's 68 words after the resize (96 rows): the 28 padded rows left out
    assert [r["headwatch/grad/embedding_row_density"] for r in logged] == pytest.approx(
        [distinct / REAL] * 2 + [distinct / (REAL + 20)] * 2
    )
    assert all(0 < r["headwatch/logits/padded_mass"] < 1 for r in logged)
