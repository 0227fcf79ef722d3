"""Lightning front door: what the driver reads of the trainer (reducer, step, loss scale, writers, validation rows)
and its sink."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from headwatch import tensorboard as tb
from headwatch.core.monitor import FailurePolicy, Media


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


def sampler_rows_kept(start: int, rows: int, rank: int, world: int, total: int) -> int:
    """How many of the ``rows`` rows from local position ``start`` of a ``torch.utils.data.DistributedSampler``
    (``drop_last=False``) are real: the sampler pads its index list to a multiple of ``world`` with repeats
    and rank ``rank`` takes positions ``rank, rank + world, ...``, so its local position ``j`` is a repeat when
    ``rank + j * world >= total`` (Lightning's validation sampler under DDP). The repeats are the last ones."""
    real_here = max(0, (total - rank + world - 1) // world)
    return max(0, min(rows, real_here - start))


def loader_rows_kept(loader: Any, batch: Any, batch_idx: int, ids_key: str = "input_ids") -> int | None:
    """The real rows of batch ``batch_idx`` of ``loader`` when its sampler is a ``DistributedSampler`` that pads
    (``drop_last=False``, several replicas; Lightning's validation sampler under DDP): :func:`sampler_rows_kept`
    for the batch's rows (those of ``batch[ids_key]``, else the loader's ``batch_size``); None (all real) for
    any other loader or sampler."""
    from torch.utils.data import DistributedSampler

    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    size = getattr(loader, "batch_size", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or not isinstance(size, int) or sampler.num_replicas <= 1:
        return None
    ids = batch.get(ids_key) if isinstance(batch, dict) else None
    rows = int(ids.shape[0]) if isinstance(ids, Tensor) else size
    return sampler_rows_kept(batch_idx * size, rows, sampler.rank, sampler.num_replicas, len(sampler.dataset))


def validation_rows(trainer: pl.Trainer, batch: Any, batch_idx: int, dataloader_idx: int) -> int | None:
    """The real rows of a validation batch under a ``DistributedSampler`` that pads (Lightning's under DDP):
    :func:`loader_rows_kept`; None (all real) for any other sampler."""
    loaders = trainer.val_dataloaders
    return loader_rows_kept(loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders, batch, batch_idx)


def hand_logged_loss(trainer: pl.Trainer, run: Any, callbacks: Sequence[Any]) -> None:
    """On a logging step, the metric named by a callback's ``compare_loss=`` (this batch's value, in
    ``trainer.callback_metrics``) to the self-check, weighted by the labelled positions its monitor measured in
    this batch's forwards (:meth:`~headwatch.core.self_check.SelfCheck.add_logged_loss`)."""
    cb = next((cb for cb in callbacks if getattr(cb, "compare_loss", None)), None)
    if cb is not None:
        key = cb.compare_loss
        tally = getattr(cb._core(), "capture_tally", None)
        run.check.add_logged_loss(
            key, trainer.callback_metrics, tally, "the LightningModule", f"self.log({key!r}, loss) in training_step"
        )


class LightningSink:
    """The run's sink for one Lightning trainer (through its driver, which holds the trainer).

    Training values go to every logger at ``step`` (one event per TensorBoard writer) and to
    ``trainer.callback_metrics`` (every rank), media to the TensorBoard loggers (rank zero), then one flush.
    Validation values go through ``pl_module.log`` (epoch values, in ``callback_metrics`` for
    ``ModelCheckpoint`` / ``EarlyStopping`` and the alert), media as in training. The step of each name is
    kept in the driver's ``published``.
    """

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        trainer = self.driver.trainer
        if trainer is None or not (numbers or media):
            return
        writers = tensorboard_writers(trainer)
        try:
            if val:
                module = trainer.lightning_module
                for k, v in numbers.items():
                    # identical on every rank already; sync_dist averages equal values (and silences Lightning's warning)
                    module.log(k, v, on_step=False, on_epoch=True, sync_dist=True, add_dataloader_idx=False)
            elif numbers:
                with tb.batched_scalars(writers):  # a TensorBoardLogger writes one event per scalar: one per writer here
                    for logger in trainer.loggers:
                        logger.log_metrics(numbers, step=step)
                trainer.callback_metrics.update({k: torch.tensor(v) for k, v in numbers.items()})
            self.driver.published.update(dict.fromkeys(numbers, step))
            for m in media:
                tb.write_media(writers, m, step)
        finally:
            tb.flush(writers)  # live charts: TensorBoardLogger alone flushes every 120 s
