"""The plain-loop door for the tests: a tiny model, one watched training step (also run by gloo workers), and a door
trained a few steps."""

from __future__ import annotations

import warnings

import torch
from torch import nn

V, D = 16, 8


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.lm_head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)

    def forward(self, ids):
        return self.lm_head(self.embed_tokens(ids))  # (B, T, V)


def train_step(hw, model, step):
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(step))
    hw.step_start({"input_ids": ids, "labels": ids}, step)
    model(ids).logsumexp(-1).mean().backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    model.zero_grad()
    return hw.step_end()


def trained_loop(steps: int = 6, every: int = 2, **kwargs):
    """``(door, model)``: a :class:`Tiny` (seed 0) watched by the plain-loop door logging every ``every`` steps, with no
    figures and no summary (``kwargs`` override), after ``steps`` training steps, its warnings silenced."""
    import headwatch

    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, **{"log_every_n_steps": every, "figure_every_n_steps": None, "summary": False, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            train_step(hw, model, s)
    return hw, model
