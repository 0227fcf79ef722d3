"""Tiny models and untied twins whose autograd gradients are the reference of the gradient statistics, whatever wraps them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

V, D = 128, 32


def tiny(family: str, tied: bool = True) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=tied)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    # Gemma 2: the embedding multiplies its rows by sqrt(d_model) in its forward, and the logits are soft-capped
    config = transformers.Gemma2Config(num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0, **common)
    return transformers.Gemma2ForCausalLM(config).float()


GRANITE_SCALING = 4.0  # Granite divides its head's output by ``logits_scaling``


def granite() -> nn.Module:
    """A tiny untied Granite (``logits_scaling`` 4, ``embedding_multiplier`` 2), its head scaled up so that the
    logits are far from uniform: the scaling then moves every statistic."""
    torch.manual_seed(0)
    config = transformers.GraniteConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        tie_word_embeddings=False, logits_scaling=GRANITE_SCALING, embedding_multiplier=2.0,
    )  # fmt: skip
    model = transformers.GraniteForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def untied_twin(model: nn.Module) -> nn.Module:
    """The same values, the head a Parameter of its own: its two ``.grad`` are the tied matrix's two flows."""
    twin = copy.deepcopy(model)
    twin.lm_head.weight = nn.Parameter(twin.lm_head.weight.detach().clone())
    assert twin.lm_head.weight is not twin.get_input_embeddings().weight
    return twin


def twin_grads(twin: nn.Module, data, seed_each_forward: bool = False) -> list[dict[str, torch.Tensor]]:
    out = []
    for step, batch in enumerate(data):
        if seed_each_forward:
            torch.manual_seed(100 + step)  # NEFTune's noise: the same draw as the monitored model's
        twin(**batch).loss.backward()
        out.append({"embedding": twin.get_input_embeddings().weight.grad.clone(), "head": twin.lm_head.weight.grad.clone()})
        twin.zero_grad()
    return out
