"""Argument checks, and the base of Lightning callbacks that are not monitors (the alert).

Monitors are ``core`` classes fed by :class:`headwatch.integrations.lightning.MonitorCallback`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from headwatch import tensorboard as tb
from headwatch.errors import HeadwatchError, check_bool, check_every, check_module_or_name, check_positive_int, check_prefix
from headwatch.core.schedule import Schedule
from headwatch.integrations.lightning.door import publish, published_steps, tensorboard_writers, to_floats

__all__ = ["HeadwatchCallback", "check_bool", "check_every", "check_module_or_name", "check_positive_int",
           "check_prefix", "published_steps", "to_floats"]  # fmt: skip


class HeadwatchCallback(Callback):
    """Base of headwatch's monitors.

    - measures on the steps Lightning logs (``(step + 1) % every == 0``, ``step`` being
      ``trainer.global_step`` before the step);
    - a failure to measure warns once and is counted, unless ``strict`` (then it raises
      :class:`HeadwatchError`);
    - scalars go to every logger at once (one host sync) and into
      ``trainer.callback_metrics``; histograms go to TensorBoard loggers, rank zero only.
    """

    def __init__(self, log_every_n_steps: int | None, prefix: str, strict: bool) -> None:
        check_every("log_every_n_steps", log_every_n_steps)
        check_prefix(prefix)
        check_bool("strict", strict)
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.strict = strict
        self._every = 0
        self._warned: set[str] = set()
        self._failures = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            tb.write_layout(tensorboard_writers(trainer), self.prefix)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "writing the TensorBoard dashboard layout")

    def _resolve_every(self, trainer: pl.Trainer) -> None:
        self._every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        if self._every == 0:
            rank_zero_warn(f"{type(self).__name__}: log_every_n_steps is 0, training steps are not measured.")

    def _is_logging_step(self, step: int) -> bool:
        return Schedule(self._every).is_logging_step(step)

    def _info_once(self, message: str) -> None:
        """A set-up message, printed once per callback (``setup`` runs for every stage)."""
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_info(message)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _fail(self, err: Exception, where: str) -> None:
        name = type(self).__name__
        if self.strict:
            raise HeadwatchError(f"{name} failed while {where}: {type(err).__name__}: {err}") from err
        self._failures += 1
        self._warn_once(
            f"fail:{where}",
            f"{name} failed while {where} ({type(err).__name__}: {err}); training goes on and "
            "this measurement is skipped. Pass strict=True to raise instead. (warned once)",
        )

    def _publish(self, trainer: pl.Trainer, scalars: dict[str, Tensor | float], step: int) -> dict[str, float]:
        """Write scalars to every logger at ``step`` and to ``trainer.callback_metrics``; returns them as floats."""
        return publish(trainer, scalars, step)

    @staticmethod
    def _write_histogram(trainer: pl.Trainer, tag: str, values: Tensor, step: int) -> None:
        writers = tensorboard_writers(trainer)
        tb.write_histogram(writers, tag, values, step)
        tb.flush(writers)

    @staticmethod
    def _write_text(trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        writers = tensorboard_writers(trainer)
        tb.write_text(writers, tag, text, step)
        tb.flush(writers)
