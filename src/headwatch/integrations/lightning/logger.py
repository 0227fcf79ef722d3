"""A Lightning ``TensorBoardLogger`` that never stops the run for its storage, at start or later.

Lightning's ``TensorBoardLogger`` makes its ``SummaryWriter`` (``logger.experiment``) in ``Trainer.fit`` before
the first callback hook (``_call_setup_hook``): it makes the save directory, then torch's
``SummaryWriter(...)`` opens its event file, and either raises ``OSError`` when the directory cannot be
written (read-only, full, not permitted), with or without headwatch. Its ``save()``, called after every
``log_metrics``, writes ``hparams.yaml`` there and raises the same way.

:class:`TensorBoardLogger` is Lightning's, with three changes:

- ``experiment`` is :class:`headwatch.tensorboard.SummaryWriter` (guarded from its first open: it starts
  without an event file, keeps the events in memory, and writes them once the fault clears, with
  ``headwatch/storage/delayed_events``); a failing ``makedirs`` of the root directory is tolerated (the
  writer makes its directory itself once it can);
- ``save()`` catches a failure to write ``hparams.yaml`` (one warning, unless the writer has already
  warned about the same directory), removes a partial file, and writes it again at a later ``save()``
  once the fault clears;
- without TensorBoard installed (``tensorboardX`` writer), ``experiment`` is Lightning's own.

Checkpoints are not written by the logger: ``ModelCheckpoint`` saving into an unwritable directory
still stops the run (Lightning's, not a logger).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LightningTensorBoardLogger):
    """``lightning.pytorch.loggers.TensorBoardLogger`` that never raises for its storage (module docstring).

    Use it where Lightning's is used: ``Trainer(logger=TensorBoardLogger(save_dir="runs"), callbacks=[...])``.
    The run trains every step when ``save_dir`` is read-only, full or cannot be made, at start or later;
    the values still reach the other loggers and ``trainer.callback_metrics``; one warning says what is not
    written and why; the events (and ``hparams.yaml``) are written once the fault clears.

    It raises nothing for its storage; HeadwatchError for ``max_pending_bytes`` or ``retry_seconds`` out of range;
    errors for its other arguments are Lightning's and torch's.

    Args:
        *args: those of ``lightning.pytorch.loggers.TensorBoardLogger`` (``save_dir``, ``name``, ``version``...).
        **kwargs: those of ``lightning.pytorch.loggers.TensorBoardLogger`` (``log_graph``, ``default_hp_metric``,
            ``prefix``, ``sub_dir``, and the ``SummaryWriter``'s ``max_queue``, ``flush_secs``,
            ``filename_suffix``...).
        max_pending_bytes: serialized events kept in memory while the log directory cannot be written
            (default 64 MiB); beyond it the oldest are dropped and counted in
            ``headwatch/storage/lost_events``.
        retry_seconds: shortest time in seconds between two attempts to open an event file (default 30 s;
            the logger flushes at every ``save()``, i.e. after every ``log_metrics``).
    """

    def __init__(self, *args: Any, max_pending_bytes: int | None = None, retry_seconds: float | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        from headwatch.tensorboard.guard import check_guard_options

        check_guard_options(max_pending_bytes, retry_seconds)  # now: a SummaryWriter is made at the first log only
        super().__init__(*args, **kwargs)
        self.headwatch_guard_kwargs = {"max_pending_bytes": max_pending_bytes, "retry_seconds": retry_seconds}
        self.hparams_error: BaseException | None = None  # the last failure to write hparams.yaml, None once written
        self.hparams_warned = False

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The run's ``headwatch.tensorboard.SummaryWriter`` (made on first use; never raises for the storage)."""
        if self._experiment is not None:
            return self._experiment
        assert rank_zero_only.rank == 0, "tried to init log dirs in non global_rank=0"
        try:
            from headwatch.tensorboard.summary_writer import SummaryWriter
        except ImportError:  # pragma: no cover - no tensorboard: Lightning's (tensorboardX) writer
            return super().experiment
        if self.root_dir:
            try:
                self._fs.makedirs(self.root_dir, exist_ok=True)
            except OSError:  # the writer warns, and makes its directory itself once it can
                pass
        self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs, **self.headwatch_guard_kwargs)
        return self._experiment

    @rank_zero_only
    def save(self) -> None:
        """Flush the writer (never raises), then write ``hparams.yaml`` if missing; a failure to write it is
        warned once and tried again at the next ``save()``."""
        hparams_file = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        existed = self._exists(hparams_file)
        try:
            super().save()
        except OSError as err:
            if not existed and self._exists(hparams_file):  # a partial file would never be written again
                try:
                    self._fs.rm(hparams_file)
                except OSError:
                    pass
            self._hparams_failed(err, hparams_file)
        else:
            self.hparams_error = None

    def _exists(self, path: str) -> bool:
        try:
            return bool(self._fs.isfile(path))
        except OSError:
            return False

    def _hparams_failed(self, err: BaseException, path: str) -> None:
        self.hparams_error = err
        if self.hparams_warned:
            return
        self.hparams_warned = True
        storage = getattr(self._experiment, "headwatch_storage", None)
        if getattr(storage, "warned", False) and os.path.dirname(path) == getattr(storage, "logdir", None):
            return  # the writer's warning already names this directory and its fault
        warnings.warn(
            f"headwatch: {path} cannot be written ({type(err).__name__}: {err}). Training goes on; it is written "
            "at a later save once the fault clears. (warned once)",
            UserWarning,
            stacklevel=2,
        )
