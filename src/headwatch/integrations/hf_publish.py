"""How the Hugging Face front door (:mod:`headwatch.integrations.transformers`) publishes: through ``Trainer.log``
(every ``report_to`` integration), media and alert markers to the Trainer's TensorBoard writer, the console's
printers showing the headline values only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback

from headwatch import tensorboard as tb
from headwatch.core.monitor import Media
from headwatch.errors import HeadwatchError

TB_PREFIX = "train/"
"""What the Trainer's ``TensorBoardCallback`` puts before every logged key (``rewrite_logs``)."""


class TrainerSink:
    """The values through ``Trainer.log`` (every ``report_to`` integration, ``log_history``, the console's
    headline keys), media to the Trainer's TensorBoard writer under ``train/``. Media that cannot be written do
    not keep the values from the step (their error is raised last). An empty publication writes nothing."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        cb, trainer = self.callback, self.callback.trainer
        if not numbers and not media:
            return
        writers = cb.writers()
        media_error: Exception | None = None
        for m in media:  # before Trainer.log, whose TensorBoardCallback flushes the writer: one flush
            try:
                tb.write_media(writers, tb.prefixed(m, TB_PREFIX), step)
            except Exception as err:  # noqa: BLE001 - the values and the alert go on; raised below
                media_error = media_error or err
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
        if media_error is not None:  # the orchestrator warns once (raises when strict): only the media were lost
            raise media_error


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
