"""Pieces of the Hugging Face front door (:mod:`headwatch.integrations.transformers`) that need no callback state."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback

from headwatch import tensorboard as tb
from headwatch.alerts import wiring as alerts
from headwatch.alerts.actions import JSONL_NAME
from headwatch.alerts.wiring import is_rules  # noqa: F401 - its home is headwatch.alerts.wiring
from headwatch.core.checkpoint import STATE_NAME, load_state_file, save_state_file
from headwatch.core.monitor import Media
from headwatch.core.trl import (  # noqa: F401 - TRL's trainers, known in headwatch.core.trl
    RL_TRAINERS,
    TRL_METRICS,
    UNDERSTOOD_TRL,
    refuse_unknown_trainer,
    sampling_temperature,
    trl_marks,
    trl_step_values,
    trl_trainer,
)
from headwatch.errors import HeadwatchError
from headwatch.model.capture import called_from


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


def evaluation_prefix(metrics: dict | None) -> str:
    """The ``metric_key_prefix`` of an ``evaluate()`` call, from its metrics (every evaluation has
    ``<prefix>_runtime``, ``speed_metrics``); ``"eval"`` when it cannot be read."""
    for key in metrics or {}:
        if key.endswith("_runtime"):
            return key[: -len("_runtime")]
    return "eval"


def hand_loss_inputs(trainer: Trainer, run: Any) -> None:
    """Wrap ``trainer.compute_loss`` (once per trainer and run) so that ``run`` sees the inputs the loss is
    computed with, ``labels`` included, for the duration of the call (:meth:`Orchestrator.loss_inputs`).

    ``Trainer.compute_loss`` pops ``labels`` from the inputs before the forward under label smoothing or a
    ``compute_loss_func`` (TRL's ``SFTTrainer`` makes a label-free forward there); the forward pre-hook
    then sees no labels. Which forward is measured stays the orchestrator's decision.
    """
    current = getattr(trainer, "compute_loss", None)
    if current is None or getattr(current, "__headwatch_run__", None) is run:
        return
    original = current

    def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with run.loss_inputs(inputs):
            return original(model, inputs, *args, **kwargs)

    compute_loss.__headwatch_run__ = run  # type: ignore[attr-defined]
    compute_loss.__wrapped__ = original  # type: ignore[attr-defined]
    trainer.compute_loss = compute_loss  # type: ignore[method-assign]


def in_evaluation() -> bool:
    """True when the caller runs inside a ``Trainer.prediction_step`` (``evaluate()``, ``predict()``, any subclass's
    override): an evaluation forward. A forward of the model outside it (the user's own call after ``train()``)
    is no evaluation batch."""
    return called_from("prediction_step", Trainer)


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
    the run resumes from (:func:`headwatch.core.checkpoint.load_state_file`: warn once when it holds none)."""
    folder = resume_dir(callback, args, state)
    if folder is not None:
        load_state_file(callback.run, callback.load_state_dict, folder)


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


def wire_alert(callback: Any, args: Any) -> None:
    """Build the ``AlertEngine`` of a callback's ``CollapseRules`` (standard actions: console, a marker in the
    Trainer's TensorBoard, ``<output_dir>/headwatch_alerts.jsonl``); decisions through its reducer, rank zero
    runs the main-process actions (:func:`headwatch.alerts.wiring.wire_alert`)."""
    callback.alert = alerts.wire_alert(
        callback.alert, lambda fired: not callback.reducer.all(not fired), callback.reducer.rank == 0, "HeadwatchCallback alert",
        sink=WritersSink(callback), prefix=callback.prefix, jsonl_path=Path(args.output_dir) / JSONL_NAME,
        save_checkpoint=callback.save_checkpoint if callback.checkpoint_on_critical else None,
        stop=callback.stop_training if callback.stop_on_critical else None,
    )  # fmt: skip


def save_state(callback: Any, args: Any, state: Any) -> None:
    """Write the callback's state to ``<output_dir>/checkpoint-<step>/headwatch_state.pt``: every rank takes the
    (collective) state, the process that saves the Trainer's state (``args.should_save``) writes."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    save_state_file(callback.run, callback.state_dict, folder, bool(args.should_save))


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


class TrainerSink:
    """The values through ``Trainer.log`` (every ``report_to`` integration, ``log_history``, the console's
    headline keys), media to the Trainer's TensorBoard writer under ``train/``, then the alert."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        cb, trainer = self.callback, self.callback.trainer
        writers = cb.writers()
        for m in media:  # before Trainer.log, whose TensorBoardCallback flushes the writer: one flush
            tb.write_media(writers, tb.prefixed(m, TB_PREFIX), step)
        if trainer is not None:
            should_log = trainer.control.should_log
            # the base method: a subclass's log (TRL's) would flush its own averaged metrics into this record
            with console_shows(trainer, cb.console_keys):  # the console: headline values; report_to: all
                Trainer.log(trainer, dict(numbers))  # its on_log event clears control.should_log ...
            trainer.control.should_log = should_log  # ... which must still log the loss of this step
            cb.write_layout()  # a writer created by that log (callbacks in any order, evaluate() only)
        else:
            tb.flush(writers)
            cb.run.warn_once(
                "no_trainer",
                "HeadwatchCallback could not find its Trainer; values are only kept in `.latest`. Attach it with "
                "headwatch.integrations.transformers.attach(trainer, callback). (warned once)",
            )
        alerts.observe(cb.alert, step, numbers, val, cb._eval_metrics)



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
