"""``MonitorCallback``: the Lightning hooks of one headwatch monitor, feeding the trainer's one orchestrator."""

from __future__ import annotations

from typing import Any

import weakref

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from headwatch import tensorboard as tb
from headwatch.core.monitor import Monitor, whole_matrices
from headwatch.core.schedule import Schedule
from headwatch.errors import HeadwatchError
from headwatch.core.orchestrator import Orchestrator, loader_rows_kept
from headwatch.integrations.lightning.door import (
    LightningReducer,
    LightningSink,
    lightning_step,
    logging_interval,
    loss_scale,
    published_steps,
    tensorboard_writers,
    write_layout,
)


class MonitorCallback(Callback):
    """Feeds a core :class:`~headwatch.core.monitor.Monitor` (the same object) from Lightning's hooks.

    A Lightning monitor is ``class XMonitor(XCore, MonitorCallback)``, as Lightning's own
    ``SpikeDetection`` is the Fabric class plus a callback. Measures on the steps Lightning
    logs (:func:`lightning_step`, :class:`~headwatch.core.schedule.Schedule`); resolves the
    model's modules in ``setup`` or, when the model is built later (``configure_model``,
    ``LightningModule.setup``), in ``on_fit_start``, before the first forward.
    """

    log_every_n_steps: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)  # type: ignore[attr-defined]

    def _core(self) -> Monitor:
        return self  # type: ignore[return-value]

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        core = self._core()
        if stage == "fit" and self._drives(trainer):  # a new fit: fresh state (a resume loads its checkpoint after setup)
            lightning_run(trainer).start_run()
            published_steps(trainer).clear()
        every = logging_interval(trainer, self.log_every_n_steps, core.every_factor, type(self).__name__)
        core.configure(Schedule(every), LightningReducer(trainer.strategy))
        self._attach_error: HeadwatchError | None = None
        # Lightning calls configure_model after this hook (it may untie or build the head), and
        # on_fit_start / on_validation_start attach again: say the set-up lines then, on the final model.
        self._hw_provisional = stage in ("fit", "validate")
        try:
            self._attach_wrapped(trainer, pl_module, stage)
        except Exception as err:  # noqa: BLE001 - the model may be built later (configure_model, LightningModule.setup)
            self._attach_error = err
        finally:
            self._hw_provisional = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives(trainer):
            self._attach_or_refuse(trainer, pl_module, "fit")
        self._write_layout(trainer)

    def _write_layout(self, trainer: pl.Trainer) -> None:
        write_layout(trainer, self.prefix, self._core())  # type: ignore[attr-defined]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate" and self._drives(trainer):  # after configure_model
            self._attach_or_refuse(trainer, pl_module, "validate")
        if trainer.state.fn == "validate":
            self._write_layout(trainer)

    def _attach_or_refuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The driving callback attaches every headwatch callback on the final model; those that cannot are
        refused by the run together (:meth:`Orchestrator.refuse`: one warning naming each cause and what is
        still measured; ``strict`` raises) and training goes on without them."""
        owner = {cb._core(): cb for cb in monitor_callbacks(trainer)}  # in trainer.callbacks order
        run = lightning_run(trainer)
        run.refuse_failed(run.attach_each(lambda core: owner[core]._attach_wrapped(trainer, pl_module, stage), list(owner)))

    def _attach_wrapped(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """:meth:`_attach` with the strategy's wrapped model as the monitor's root; under FSDP1
        (``FSDPStrategy``, after ``on_fit_start``) inside ``summon_full_params`` of the units that
        hold vocabulary-sized matrices, so the head and embedding are resolved on full weights."""
        core = self._core()
        wrapped = getattr(trainer.strategy, "model", None)
        core.root = wrapped if isinstance(wrapped, torch.nn.Module) and wrapped is not pl_module else None
        with whole_matrices(core.root if core.root is not None else pl_module, pl_module):  # FSDP1 / ZeRO-3 (a collective)
            self._attach(trainer, pl_module, stage)

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve modules and register hooks (idempotent); subclasses add their set-up."""
        self._core().attach(pl_module)
        self._attach_error = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_batch("tearing down")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end_batch("ending after an exception", quiet=True)

    def _end_batch(self, where: str, quiet: bool = False) -> None:
        """End the batch in progress (:meth:`FailurePolicy.attempt`: ``quiet`` when the run is already failing)."""
        self._core().attempt(self._core().batch_end, where, quiet)

    def _info_once(self, message: str) -> None:
        """A set-up line, said once per callback; not while ``setup`` resolves a model that
        ``configure_model`` may still change (the attach that follows says it)."""
        warned = self._core()._warned
        if not getattr(self, "_hw_provisional", False) and message not in warned:
            warned.add(message)
            rank_zero_info(message)

    # ---------------------------------------------------------------- training
    def _drives(self, trainer: pl.Trainer) -> bool:
        """The first headwatch callback in ``trainer.callbacks`` drives the run's one orchestrator for all of them
        (before an alert placed after the monitors reads their values)."""
        callbacks = monitor_callbacks(trainer)
        return bool(callbacks) and callbacks[0] is self

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._drives(trainer):
            return
        run = lightning_run(trainer)
        with run.guard("starting a batch"):
            self._hw_step, self._hw_global_step = lightning_step(trainer), trainer.global_step
            run.begin_step(self._hw_step)
            run.step_start(batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._drives(trainer):
            run = lightning_run(trainer)
            with run.guard("reading the gradients"):
                run.gradients_ready(loss_scale(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._drives(trainer):
            return
        run = lightning_run(trainer)
        if run.logging:
            hand_logged_loss(trainer, run, batch)
        run.batch_end()
        stepped = (
            not pl_module.automatic_optimization
            or trainer.global_step != self._hw_global_step
            or (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        )
        if stepped and run.step is not None:
            run.end_step()  # the due monitors' values, one host transfer, one publication

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives(trainer):
            lightning_run(trainer).epoch_end(lightning_step(trainer) - 1)  # the last step of the epoch

    # ---------------------------------------------------------------- validation
    validation_media = False
    """Write the monitor's media (histograms) after each validation epoch too."""

    def _measuring_validation(self, trainer: pl.Trainer) -> bool:
        return False  # a monitor that measures validation batches says when

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._drives(trainer):
            measuring = [cb._core() for cb in monitor_callbacks(trainer) if cb._measuring_validation(trainer)]
            run = lightning_run(trainer)
            with run.guard("starting a validation batch"):
                real = validation_rows(trainer, batch, batch_idx, dataloader_idx) if measuring else None
                run.validation_batch_start(batch, dataloader_idx, real_rows=real, monitors=measuring)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._drives(trainer):
            lightning_run(trainer).validation_batch_end(dataloader_idx)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._drives(trainer):  # the first headwatch callback publishes every measuring monitor at once
            return
        measuring = [cb for cb in monitor_callbacks(trainer) if cb._measuring_validation(trainer)]
        run = lightning_run(trainer)
        numbers, ok = run.compute([cb._core() for cb in measuring], val=True)  # one failing rank: dropped everywhere
        if not ok:
            return
        try:
            for k, v in numbers.items():
                # identical on every rank already; sync_dist averages equal values (and silences Lightning's warning)
                pl_module.log(k, v, on_step=False, on_epoch=True, sync_dist=True, add_dataloader_idx=False)
            media = [cb._core().media for cb in measuring if cb.validation_media and cb._core() in ok]
            if media:
                writers = tensorboard_writers(trainer)
                for m in media:
                    tb.write_media(writers, m, trainer.global_step)
                tb.flush(writers)
        except Exception as err:  # noqa: BLE001
            ok[0].fail(err, "logging the validation statistics")


_RUNS: "weakref.WeakKeyDictionary[Any, Orchestrator]" = weakref.WeakKeyDictionary()


def lightning_run(trainer: pl.Trainer) -> Orchestrator:
    """The one orchestrator of ``trainer``'s run, driving the cores of every headwatch callback in
    ``trainer.callbacks`` (in that order): one computation, one host transfer and one publication per
    logging step, however many headwatch callbacks there are."""
    run = _RUNS.get(trainer)
    if run is None:
        run = _RUNS[trainer] = Orchestrator(monitors=(), reducer=LightningReducer(trainer.strategy), sinks=[LightningSink(trainer)])
    named = any(getattr(cb, "compare_loss", None) for cb in monitor_callbacks(trainer))  # a logged loss instead
    run.use_monitors([cb._core() for cb in monitor_callbacks(trainer)], model_loss=not named)
    return run


def validation_rows(trainer: pl.Trainer, batch: Any, batch_idx: int, dataloader_idx: int) -> int | None:
    """The real rows of a validation batch under a ``DistributedSampler`` that pads (Lightning's under DDP):
    :func:`~headwatch.core.orchestrator.loader_rows_kept`; None (all real) for any other sampler."""
    loaders = trainer.val_dataloaders
    return loader_rows_kept(loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders, batch, batch_idx)


def hand_logged_loss(trainer: pl.Trainer, run: Orchestrator, batch: Any) -> None:
    """On a logging step, the metric named by a monitor's ``compare_loss=`` (this batch's value, in
    ``trainer.callback_metrics``) to the self-check, weighted by the batch's labelled positions."""
    cb = next((cb for cb in monitor_callbacks(trainer) if getattr(cb, "compare_loss", None)), None)
    if cb is not None:
        key = cb.compare_loss
        run.check.add_logged_loss(
            key, trainer.callback_metrics, batch, cb._core().batch_format, "the LightningModule", f"self.log({key!r}, loss) in training_step"
        )


def monitor_callbacks(trainer: pl.Trainer) -> list[MonitorCallback]:
    """The headwatch monitor callbacks of ``trainer``, in ``trainer.callbacks`` order."""
    return [cb for cb in trainer.callbacks if isinstance(cb, MonitorCallback)]
