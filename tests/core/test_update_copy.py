"""The update statistics are those of ``W_before - W_after`` from a copy taken before the optimizer step, bit for
bit: the monitor's copy, made into the update in place, against an independent clone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headwatch

V, D = 40, 8


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.lm_head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V, bias=False)

    def forward(self, ids):
        return self.lm_head(self.embed_tokens(ids))  # (B, T, V)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_update_statistics_match_an_independent_copy(optimizer):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=1e-3)
    hw = headwatch.Headwatch(model, monitors=["gradients", "tokens"], log_every_n_steps=1, figure_every_n_steps=0, summary=False)
    ids = torch.randint(0, V // 2, (2, 6), generator=torch.Generator().manual_seed(1))  # rows V/2.. never looked up
    hw.step_start({"input_ids": ids, "labels": ids}, 0)
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    hw.before_optimizer_step()
    weights = {"embedding": model.embed_tokens.weight, "head": model.lm_head.weight}
    before = {name: w.detach().clone() for name, w in weights.items()}
    opt.step()
    hw.after_optimizer_step()
    opt.zero_grad()
    values = hw.step_end()
    hw.close()
    for name, w in weights.items():
        delta = before[name] - w.detach()  # (V, D)
        norms = torch.linalg.vector_norm(delta, dim=1)
        nonzero = (delta != 0).any(dim=1)
        key = f"headwatch/update/{name}"
        assert values[f"{key}_row_density"] == nonzero.sum().item() / V
        assert values[f"{key}_row_norm_max"] == norms.max().item()
        assert values[f"{key}_row_norm_mean"] == pytest.approx(norms.double().mean().item(), rel=1e-12)
    if optimizer == "sgd":  # rows never looked up keep their weights: the density tells them apart
        assert values["headwatch/update/embedding_row_density"] <= 0.5 < values["headwatch/update/head_row_density"]
