"""PEFT adapters for the tests: a tiny Llama and its adapted copy."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, D = 64, 16


def tiny_llama(tie: bool = True):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def adapted(**lora):
    """A tied tiny Llama under PEFT; ``init_lora_weights=False`` makes B non-zero (a trained adapter)."""
    lora.setdefault("init_lora_weights", False)
    return peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, **lora))
