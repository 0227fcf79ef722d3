"""Plumbing shared by headwatch's callbacks: argument checks, schedule, failure policy, publishing."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor

from headwatch._errors import HeadwatchError
from headwatch.dashboard import flush_tensorboard


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HeadwatchError(f"`{name}` must be a bool, got {value!r}")


def check_every(name: str, value: Any) -> None:
    if value is not None:
        check_positive_int(name, value)


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HeadwatchError(f"`{name}` must be an int >= 1, got {value!r}")


def check_module_or_name(name: str, value: Any) -> None:
    from torch import nn

    if value is not None and not isinstance(value, (str, nn.Module)):
        raise HeadwatchError(f"`{name}` must be None, an nn.Module or its dotted name, got {type(value).__name__}")


def check_prefix(value: Any) -> None:
    if not isinstance(value, str) or not value or value.endswith("/"):
        raise HeadwatchError(f"`prefix` must be a non-empty string not ending in '/', got {value!r}")


def to_floats(scalars: dict[str, Tensor | float]) -> dict[str, float]:
    """Scalars (tensors on any device, or numbers) as Python floats with one host sync."""
    if not scalars:
        return {}
    devices = [v.device for v in scalars.values() if isinstance(v, Tensor) and v.device.type != "cpu"]
    device = devices[0] if devices else torch.device("cpu")
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in scalars.values()])
    return dict(zip(scalars, stacked.tolist()))  # the one host sync of a logging step


_PUBLISHED: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()


def published_steps(trainer: Any) -> dict[str, int]:
    """Metric name -> the step it was last published at by a headwatch callback, for this trainer.

    Lets a reader (the collapse alert) tell a fresh value from one it has already seen,
    whatever the order of the callbacks.
    """
    steps = _PUBLISHED.get(trainer)
    if steps is None:
        steps = _PUBLISHED[trainer] = {}
    return steps


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
        from headwatch.dashboard import write_layout

        try:
            write_layout(trainer, self.prefix)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "writing the TensorBoard dashboard layout")

    def _resolve_every(self, trainer: pl.Trainer) -> None:
        self._every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        if self._every == 0:
            rank_zero_warn(f"{type(self).__name__}: log_every_n_steps is 0, training steps are not measured.")

    def _is_logging_step(self, step: int) -> bool:
        return self._every > 0 and (step + 1) % self._every == 0

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
        numbers = to_floats(scalars)
        if not numbers:
            return {}
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in numbers.items()})
        published_steps(trainer).update(dict.fromkeys(numbers, step))
        flush_tensorboard(trainer)  # live charts: TensorBoardLogger alone flushes every 120 s
        return numbers

    @staticmethod
    @rank_zero_only
    def _write_histogram(trainer: pl.Trainer, tag: str, values: Tensor, step: int) -> None:
        values = values.detach().float().cpu()
        values = values[torch.isfinite(values)]  # TensorBoard refuses NaN/inf; they are counted elsewhere
        if values.numel() == 0:
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram(tag, values, global_step=step)
                logger.experiment.flush()

    @staticmethod
    @rank_zero_only
    def _write_text(trainer: pl.Trainer, tag: str, text: str, step: int) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(tag, text, global_step=step)
                logger.experiment.flush()
