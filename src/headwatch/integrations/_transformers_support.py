"""Pieces of the Hugging Face front door (:mod:`headwatch.integrations.transformers`) that need no callback state."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from headwatch import tensorboard as tb
from headwatch.core.monitor import Media

if TYPE_CHECKING:
    from headwatch.integrations.transformers import HeadwatchCallback

TB_PREFIX = "train/"
"""What the Trainer's ``TensorBoardCallback`` puts before every logged key (``rewrite_logs``)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / accelerate / ``torch.compile`` wrappers."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def find_trainer(callback: TrainerCallback) -> Trainer | None:
    """The ``Trainer`` whose callback handler holds ``callback``, found up the call stack.

    Callbacks are not handed the trainer; its methods (``_inner_training_loop``,
    ``evaluate``) are on the stack whenever it calls a callback.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(cb is callback for cb in owner.callback_handler.callbacks):
                return owner
            frame = frame.f_back
    finally:
        del frame
    return None


def loss_scale(trainer: Trainer | None, args: Any) -> Tensor | None:
    """The fp16 ``GradScaler`` scale the backward ran with (gradients unscaled in place first), or None.

    The Trainer unscales gradients in place when it clips (``max_grad_norm > 0``); without
    clipping they are unscaled here, as clipping would (``GradScaler.step`` then skips it).
    """
    accelerator = getattr(trainer, "accelerator", None)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if not args.max_grad_norm or args.max_grad_norm <= 0:
        accelerator.unscale_gradients()
    return scaler.get_scale()


def is_rules(alert: Any) -> bool:
    from headwatch.alerts import CollapseRules

    return isinstance(alert, CollapseRules)


class WritersSink:
    """The alert's markers and messages in the Trainer's TensorBoard writer, beside its ``train/`` scalars."""

    def __init__(self, callback: HeadwatchCallback) -> None:
        self.callback = callback

    def scalar(self, tag: str, value: float, step: int) -> None:
        writers = self.callback.writers()
        tb.write_scalars(writers, {TB_PREFIX + tag: value}, step)
        tb.flush(writers)

    def text(self, tag: str, text: str, step: int) -> None:
        writers = self.callback.writers()
        tb.write_text(writers, TB_PREFIX + tag, text, step)
        tb.flush(writers)


def prefixed(media: Media, prefix: str) -> Media:
    """``media`` with every tag under ``prefix`` (next to the Trainer's ``train/`` scalars)."""
    return Media(
        {prefix + k: v for k, v in media.histograms.items()},
        {prefix + k: v for k, v in media.texts.items()},
        {prefix + k: v for k, v in media.figures.items()},
    )
