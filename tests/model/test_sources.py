"""Which tensor is measured (docs/sources.md), against the models' own outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from headwatch.errors import HeadwatchError  # noqa: E402
from headwatch.model.capture import LogitsCapture  # noqa: E402
from headwatch.model.captured import captured_statistics  # noqa: E402
from headwatch.model.sources import final_logit_transform, resolve_logits_source  # noqa: E402
from tests.helpers import positions  # noqa: E402
from tests.helpers.sources import run_captured, tiny_gemma2, tiny_t5  # noqa: E402


def reference(logits: torch.Tensor, targets: torch.Tensor | None, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 entropy and nll per valid position, straight from softmax."""
    x = logits.double()[valid]  # (N, V)
    logp = torch.log_softmax(x, dim=-1)
    out = {"entropy": -(logp.exp() * logp).sum(-1)}
    if targets is not None:
        out["nll"] = -logp.gather(-1, targets[valid].unsqueeze(-1)).squeeze(-1)
    return out


# ---------------------------------------------------------------------------------------------- Gemma 2


def test_gemma2_softcapped_logits_are_measured():
    model, batch = tiny_gemma2()
    source = resolve_logits_source(model)
    assert source.kind == "model_logits" and source.owner is model and source.alignment == "causal"
    assert "logits" in source.describe() and "after any post-head transform" in source.describe()
    with torch.no_grad():
        results, report, out = run_captured(model, source, batch, lambda: model(**batch))
        raw = model.lm_head(model.model(input_ids=batch["input_ids"]).last_hidden_state)
    assert raw.abs().max() == pytest.approx(110.0, rel=1e-4)
    assert report.measured == 1 and report.path == "logits" and report.problem is None
    stats = results[0][1].statistics
    _, targets = positions(batch, "causal")
    valid = targets != -100
    assert stats.valid.sum() == 13  # 2 x 7 shifted targets, one of them -100
    ref = reference(out.logits, targets, valid)
    assert torch.allclose(stats.entropy[valid].double(), ref["entropy"], atol=1e-5)
    assert stats.nll[valid].double().mean().item() == pytest.approx(out.loss.item(), abs=1e-5)
    assert ref["nll"].mean().item() == pytest.approx(out.loss.item(), abs=1e-5)  # the model's loss is of these logits
    # the raw head output is another distribution: measuring it would be wrong by far
    raw_entropy = reference(raw, None, valid)["entropy"].mean().item()
    assert ref["entropy"].mean().item() > 5 * raw_entropy


def test_gemma2_hidden_path_applies_the_softcap():
    model, batch = tiny_gemma2()
    source = resolve_logits_source(model)
    assert source.transform is not None and "final_logit_softcapping" in source.transform.description
    with torch.no_grad():
        logit_results, _, _ = run_captured(model, source, batch, lambda: model(**batch))
        hidden_results, report, _ = run_captured(model, source, batch, lambda: model(**batch), path="hidden")
    assert report.path == "hidden" and report.problem is None and "forced" in report.note
    a, b = logit_results[0][1].statistics, hidden_results[0][1].statistics
    assert torch.equal(a.valid, b.valid)
    assert torch.allclose(a.entropy[a.valid], b.entropy[b.valid], atol=1e-5)
    assert torch.allclose(a.nll[a.valid], b.nll[b.valid], atol=1e-5)


def test_final_logit_transform_keys():
    assert final_logit_transform(None) is None
    assert final_logit_transform(transformers.LlamaConfig()) is None
    t = final_logit_transform(transformers.Gemma2Config(final_logit_softcapping=30.0))
    x = torch.tensor([110.0, -3.0])
    assert torch.allclose(t(x), 30.0 * torch.tanh(x / 30.0))
    cohere = final_logit_transform(transformers.CohereConfig(logit_scale=0.0625))
    assert torch.allclose(cohere(x), x * 0.0625)
    granite = final_logit_transform(transformers.GraniteConfig(logits_scaling=8.0))
    assert torch.allclose(granite(x), x / 8.0)


# ---------------------------------------------------------------------------------------------- T5


@pytest.mark.parametrize("encoder_length", [8, 12])
def test_t5_labels_aligned_and_encoder_mask_ignored(encoder_length):
    model = tiny_t5()
    assert model.lm_head.weight is model.shared.weight
    g = torch.Generator().manual_seed(encoder_length)
    ids = torch.randint(1, 64, (2, encoder_length), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0  # the encoder's padding
    labels = torch.randint(1, 64, (2, 8), generator=g)
    labels[0, -1] = labels[1, -2] = -100
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    source = resolve_logits_source(model)
    assert source.alignment == "seq2seq" and "decoder_attention_mask" in source.describe()
    with torch.no_grad():
        results, report, out = run_captured(model, source, batch, lambda: model(**batch))
    assert report.measured == 1 and report.problem is None
    stats = results[0][1].statistics
    valid = labels != -100
    assert int(stats.valid.sum()) == 14
    assert torch.equal(stats.valid, valid)
    ref = reference(out.logits, labels, valid)
    assert torch.allclose(stats.entropy[valid].double(), ref["entropy"], atol=1e-5)
    assert stats.nll[valid].double().mean().item() == pytest.approx(out.loss.item(), abs=1e-5)


def test_positions_by_alignment():
    labels = torch.tensor([[1, 2, 3, -100]])
    enc = torch.tensor([[1, 1, 1, 1, 0, 0]])
    dec = torch.tensor([[1, 1, 0, 0]])
    mask, targets = positions({"labels": labels, "attention_mask": enc}, "seq2seq")
    assert mask is None and torch.equal(targets, labels)
    mask, _ = positions({"labels": labels, "attention_mask": enc, "decoder_attention_mask": dec}, "seq2seq")
    assert torch.equal(mask, dec.bool())
    mask, targets = positions({"labels": labels, "attention_mask": dec}, "causal")
    assert torch.equal(targets, torch.tensor([[2, 3, -100, -100]])) and torch.equal(mask, dec.bool())
    _, targets = positions({"labels": labels}, "aligned")
    assert torch.equal(targets, labels)
    assert positions((labels, labels), "causal") == (None, None)
    with pytest.raises(HeadwatchError, match="`alignment` must be None or one of"):
        resolve_logits_source(tiny_t5(), alignment="shifted")
