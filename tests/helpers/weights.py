"""The matrices that really train, for the tests: a tied T5 (one weight in four modules), its batch, untied twins."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

V, D = 48, 16
T5_MEMBERS = {"shared", "encoder.embed_tokens", "decoder.embed_tokens"}


def tiny_t5(tie: bool = True) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=V, d_model=D, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=tie,
    )
    return transformers.T5ForConditionalGeneration(config)


def t5_batch(encoder_length: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(1, V, (2, 8), generator=g)
    labels[:, 2] = -100  # two ignored positions, not at the end (every decoder input is still read by a scored position)
    return {"input_ids": torch.randint(1, V, (2, encoder_length), generator=g), "labels": labels}


def untied_twin(model: nn.Module) -> nn.Module:
    """The same function with a separate Parameter in each module that held the shared one."""
    twin = copy.deepcopy(model)
    for name in (*T5_MEMBERS, "lm_head"):
        module = twin.get_submodule(name)
        module.weight = nn.Parameter(module.weight.detach().clone())
    return twin
