"""Gradients recorded by a Lightning callback, for comparing the gradient statistics with the gradients themselves."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from headwatch import GradientDensityMonitor


class Recording(GradientDensityMonitor):
    """Keeps the (V, d) flow matrices the monitor measured, to compare with a twin model."""

    recorded: list[dict[str, torch.Tensor]]

    def _flows(self, loss_scale):
        flows = super()._flows(loss_scale)
        self.recorded = getattr(self, "recorded", [])
        self.recorded.append({k: v.detach().clone() for k, v in flows.items() if v is not None})
        return flows


class GradRecorder(Callback):
    """Records .grad of the embedding and head at each optimizer step (after unscaling)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(
            {
                "embedding": pl_module.embed_tokens.weight.grad.detach().clone().to_dense(),
                "head": pl_module.lm_head.weight.grad.detach().clone(),
            }
        )
