"""Pieces of the Hugging Face front door (:mod:`headwatch.integrations.transformers`) that need no callback state."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback

from headwatch import tensorboard as tb
from headwatch.errors import HeadwatchError
from headwatch.core.monitor import Media


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


STATE_NAME = "headwatch_state.pt"
"""The monitors' state in each Trainer checkpoint folder (``<output_dir>/checkpoint-<step>/``)."""


def resume_dir(callback: TrainerCallback, args: Any, state: Any) -> str | None:
    """The checkpoint folder a resumed ``train`` started from, or None for a fresh run.

    ``Trainer.train(resume_from_checkpoint=...)`` is read on the call stack (the callback is not
    handed it; ``True`` is already the resolved folder there), else ``args.resume_from_checkpoint``;
    a run whose state starts past step 0 without either resumed from
    ``<output_dir>/checkpoint-<global_step>``.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner, path = frame.f_locals.get("self"), frame.f_locals.get("resume_from_checkpoint")
            if isinstance(owner, Trainer) and isinstance(path, str) and any(cb is callback for cb in owner.callback_handler.callbacks):
                return path
            frame = frame.f_back
    finally:
        del frame
    if isinstance(getattr(args, "resume_from_checkpoint", None), str):
        return args.resume_from_checkpoint
    if state.global_step > 0:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    return None


def restore_state(callback: Any, args: Any, state: Any) -> None:
    """On a resumed run, load into ``callback`` the state its ``on_save`` wrote in the checkpoint folder
    the run resumes from; warn once when that folder holds none."""
    import torch

    folder = resume_dir(callback, args, state)
    if folder is None:
        return
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        callback.monitors[0].warn_once(
            "no_state",
            f"HeadwatchCallback: the run resumes from {folder!r}, which holds no {STATE_NAME}; the monitors' "
            "counts start afresh. (warned once)",
        )
        return
    try:
        callback.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as err:  # noqa: BLE001
        callback.monitors[0].fail(err, f"restoring the monitors' state from {path}")


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

    def __init__(self, callback: Any) -> None:
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


CONSOLE_PRINTERS = (ProgressCallback, PrinterCallback)
"""The Trainer's callbacks that print every logged record on the console (tqdm bar / ``disable_tqdm``)."""


def console_filter(console_keys: Sequence[str] | str | None, prefix: str) -> frozenset[str] | None:
    """The full names shown on the console: ``None`` -> :data:`headwatch.names.CONSOLE_KEYS`, ``"all"`` -> None
    (no filter); otherwise each name with or without ``<prefix>/``.

    Raises:
        HeadwatchError: ``console_keys`` is not None, ``"all"`` or a sequence of str.
    """
    from headwatch.names import CONSOLE_KEYS

    if console_keys == "all":
        return None
    keys = CONSOLE_KEYS if console_keys is None else console_keys
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
        raise HeadwatchError(f"`console_keys` must be None, 'all' or a sequence of metric names, got {console_keys!r}")
    return frozenset(k if k.startswith(prefix + "/") else f"{prefix}/{k}" for k in keys)


class _ConsoleView(TrainerCallback):
    """A printing callback that sees only the shown keys of one record (nothing when none is shown)."""

    def __init__(self, printer: TrainerCallback, shown: frozenset[str]) -> None:
        self.printer, self.shown = printer, shown

    def __getattr__(self, name: str) -> Any:
        return getattr(self.printer, name)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> Any:
        kept = {k: v for k, v in (logs or {}).items() if k in self.shown}
        if kept:
            extra = {k: logs[k] for k in ("epoch",) if logs and k in logs}
            return self.printer.on_log(args, state, control, logs={**kept, **extra}, **kwargs)
        return None


@contextmanager
def console_shows(trainer: Trainer, shown: frozenset[str] | None) -> Iterator[None]:
    """While inside, the Trainer's console printers print only ``shown`` keys; every other callback (the
    reporting integrations: TensorBoard, W&B ...) receives the whole record. ``shown=None``: no change."""
    callbacks = trainer.callback_handler.callbacks
    swapped = [] if shown is None else [(i, cb) for i, cb in enumerate(callbacks) if isinstance(cb, CONSOLE_PRINTERS)]
    try:
        for i, cb in swapped:
            callbacks[i] = _ConsoleView(cb, shown)
        yield
    finally:
        for i, cb in swapped:
            callbacks[i] = cb
