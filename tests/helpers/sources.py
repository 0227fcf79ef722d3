"""Which tensor is measured, for the tests: one captured forward, tiny Gemma 2, T5 and Llama models built from a config."""

from __future__ import annotations

import pytest
import torch

from headwatch.model.capture import LogitsCapture
from headwatch.model.captured import captured_statistics
from tests.helpers.lm import positions

transformers = pytest.importorskip("transformers")


def run_captured(model, source, batch, call, path="auto", vocab_size=None):
    """Arm a capture for one forward ``call()``; return (per-forward statistics, report, call's output)."""
    mask, targets = positions(batch, source.alignment)
    shape = (targets if targets is not None else mask).shape if (targets is not None or mask is not None) else None
    results = []
    capture = LogitsCapture(
        source,
        lambda c: results.append((c, captured_statistics(c, mask, targets, vocab_size=vocab_size))),
        path=path,
        model=model,
    )
    capture.attach()
    capture.begin(shape)
    out = call()
    report = capture.end()
    capture.detach()
    return results, report, out


def tiny_gemma2():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0, attn_implementation="eager",
        tie_word_embeddings=False,  # scaling the head leaves the rest of the model as it is
    )
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        raw = model.lm_head(model.model(input_ids=ids).last_hidden_state)
        model.lm_head.weight.mul_(110.0 / raw.abs().max())  # raw head output reaches |x| = 110
    labels = ids.clone()
    labels[0, 5] = -100
    return model, {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def tiny_t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg).eval()


def tiny_llama(tie: bool = False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def llama_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    labels = ids.clone()
    labels[1, :2] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
