"""Lightning front door: the reducer, the step schedule and the driver shared by every callback."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from headwatch import tensorboard as tb
from headwatch.core.monitor import FailurePolicy, Media
from headwatch.core.orchestrator import to_host


class LightningReducer:
    """Reductions through the trainer's strategy (DDP, FSDP, single device)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    def world_size(self) -> int:
        return int(getattr(self.strategy, "world_size", 1))

    @property
    def rank(self) -> int:
        return int(getattr(self.strategy, "global_rank", 0))

    def sum(self, tensor: Tensor) -> Tensor:
        return self.strategy.reduce(tensor.clone(), reduce_op="sum") if self.world_size > 1 else tensor.clone()

    def mean(self, tensor: Tensor) -> Tensor:
        return self.strategy.reduce(tensor.clone(), reduce_op="mean") if self.world_size > 1 else tensor.clone()

    def gather(self, tensor: Tensor) -> list[Tensor]:
        if self.world_size == 1:
            return [tensor]
        from torchmetrics.utilities.distributed import gather_all_tensors

        return gather_all_tensors(tensor)  # tensors of different lengths, unlike strategy.all_gather

    def all(self, flag: bool) -> bool:
        return bool(self.strategy.reduce_boolean_decision(bool(flag), all=True)) if self.world_size > 1 else bool(flag)

    def all_gather(self, tensor: Tensor) -> Tensor:
        return self.strategy.all_gather(tensor) if self.world_size > 1 else tensor.unsqueeze(0)  # (W, *shape)


def lightning_step(trainer: pl.Trainer) -> int:
    """The x axis Lightning logs training metrics at: batches that stepped (one per optimizer step in
    automatic optimization, one per batch in manual optimization, whatever the number of optimizers).

    Read in ``on_train_batch_start`` it is the step the batch belongs to. Lightning has no public
    name for it; ``trainer.global_step`` (optimizer steps) is the fallback and equals it with one
    optimizer.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if isinstance(value, int) else int(trainer.global_step)


def loss_scale(trainer: pl.Trainer) -> Tensor | None:
    """The AMP ``GradScaler`` scale the backward ran with, or None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        return scaler.get_scale()
    return None


def tensorboard_writers(trainer: pl.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger, on rank zero (empty elsewhere)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if not trainer.is_global_zero:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def logging_interval(trainer: pl.Trainer, own: int | None, factor: int, who: str) -> int:
    """The steps between two measurements of a callback: its own ``log_every_n_steps`` (``own``), else ``factor``
    times the Trainer's; 0 (never) is warned about, on rank zero."""
    every = own if own is not None else factor * trainer.log_every_n_steps
    if every == 0:
        rank_zero_warn(f"{who}: log_every_n_steps is 0, training steps are not measured.")
    return every


def write_layout(trainer: pl.Trainer, prefix: str, policy: FailurePolicy) -> None:
    """The Custom Scalars layout, once per TensorBoard writer (rank zero); a failure follows ``policy``."""
    try:
        if trainer.is_global_zero:
            tb.write_layout(tensorboard_writers(trainer), prefix)
    except Exception as err:  # noqa: BLE001
        policy.fail(err, "writing the TensorBoard dashboard layout")


_PUBLISHED: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()


def published_steps(trainer: Any) -> dict[str, int]:
    """Metric name -> the step a headwatch callback last published it at, for this trainer."""
    steps = _PUBLISHED.get(trainer)
    if steps is None:
        steps = _PUBLISHED[trainer] = {}
    return steps


def publish(trainer: pl.Trainer, scalars: dict[str, Tensor | float], step: int, media: list[Media] = ()) -> dict[str, float]:
    """Scalars to every logger at ``step``, to ``trainer.callback_metrics`` (every rank), media to the
    TensorBoard loggers (rank zero), then one flush."""
    numbers = to_host(scalars, media) if any(isinstance(v, Tensor) for v in scalars.values()) else dict(scalars)
    if not numbers:
        return {}
    writers = tensorboard_writers(trainer)
    with tb.batched_scalars(writers):  # a TensorBoardLogger writes one event per scalar: one per writer here
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=step)
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in numbers.items()})
    published_steps(trainer).update(dict.fromkeys(numbers, step))
    try:
        for m in media:
            tb.write_media(writers, m, step)
    finally:
        tb.flush(writers)  # live charts: TensorBoardLogger alone flushes every 120 s
    return numbers


class LightningSink:
    """The orchestrator's sink for one Lightning trainer: :func:`publish` (training values)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = weakref.ref(trainer)

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        trainer = self.trainer()
        if trainer is not None:
            publish(trainer, numbers, step, media)
