"""``HeadwatchDriver``: the one Lightning callback that drives a trainer's run, as the Hugging Face door's callback does.

The public Lightning classes (``LogitStatsMonitor``, ``GradientDensityMonitor``, ``SynonymCollisionMonitor``,
``TokenFrequency``, ``SharpnessCollapseAlert``) keep their constructors; in ``setup`` each registers with the
trainer's driver (:meth:`HeadwatchDriver.of`: the one in ``trainer.callbacks``, or one inserted there just before
the first headwatch callback), handing it its core monitor or its alert's sink. The driver owns the run's
:class:`~headwatch.core.orchestrator.Orchestrator` and translates Lightning's events into calls on it: one step-end
rule, one computation, one host transfer and one publication per logging step through the run's sinks (every
logger and ``trainer.callback_metrics``; ``pl_module.log`` for validation; the alert; the end-of-training
summary), however many headwatch callbacks there are. It never imports the public classes: it only sees what
they register (:class:`Registrant`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from headwatch.core.driver import Driver
from headwatch.core.monitor import Monitor, whole_matrices
from headwatch.core.orchestrator import Orchestrator
from headwatch.core.publish import Sink
from headwatch.core.schedule import Schedule
from headwatch.errors import HeadwatchError, check_bool
from headwatch.integrations.lightning.door import (
    LightningReducer,
    LightningSink,
    hand_logged_loss,
    lightning_step,
    logging_interval,
    loss_scale,
    validation_rows,
    write_layout,
)
from headwatch.report.summary import SummarySink


class Registrant(Protocol):
    """What a headwatch Lightning callback hands its driver (``MonitorCallback``)."""

    log_every_n_steps: int | None
    compare_loss: str | None

    def _core(self) -> Monitor: ...

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None: ...

    def _measuring_validation(self, trainer: pl.Trainer) -> bool: ...


class HeadwatchDriver(Driver, Callback):
    """The Lightning driver of headwatch's run: one per trainer, found in ``trainer.callbacks``.

    Added by the first headwatch callback's ``setup`` (just before it in ``trainer.callbacks``, so the values
    are published where that callback stands); pass one yourself to set its options:
    ``Trainer(callbacks=[HeadwatchDriver(summary=False), LogitStatsMonitor()])``.

    Args:
        summary: print the end-of-training summary at ``on_fit_end`` (rank zero); its text stays in
            ``driver.summary.text``.
        overhead_budget: the share of training wall time headwatch may take (default 0.01): the collision probe,
            figures and histograms run on probe steps spaced to stay within it (the first logging step, every power
            of two of logging intervals, and ``on_fit_end``); ``overhead/*`` says the cost on every logging step.
            A ``SynonymCollisionMonitor(every_n_steps=...)`` keeps its own cadence. None: off.

    Raises:
        HeadwatchError: a bad argument; more than one driver in ``trainer.callbacks``.
    """

    def __init__(self, summary: bool = True, overhead_budget: float | None = 0.01) -> None:
        check_bool("summary", summary)
        self.run = Orchestrator(monitors=(), overhead_budget=overhead_budget)
        self.run.cost.door_interval = "the Trainer's log_every_n_steps"
        """The run's orchestrator (its monitors: the cores of the registered callbacks)."""
        self.registered: list[Registrant] = []
        """The headwatch callbacks of this trainer, in the order they registered (``trainer.callbacks`` order)."""
        self.published: dict[str, int] = {}
        """Metric name -> the step it was last published at, this run."""
        self.alerts: list[Any] = []
        """The alerts' engines registered (for the summary)."""
        self.summary = SummarySink(rank=lambda: self.run.reducer.rank, alerts=self._alerts)
        self.summary.budget = self.run.cost.budget
        self.run.sinks.append(LightningSink(self))
        self._trainer: Any = None
        self._stage: str | None = None  # the stage set up this round (reset at teardown)
        self._round: set[int] = set()  # ids of the callbacks registered this round
        self._step: int | None = None  # the step the batch in progress belongs to
        self._optimizer_steps = 0
        self._intervals: set[int] = set()  # the alerts' reading intervals
        self._prefixes: dict[str, None] = {}  # the alerts' prefixes
        self.summary_on = summary

    @property
    def trainer(self) -> pl.Trainer | None:
        return self._trainer() if self._trainer is not None else None

    @property
    def state_key(self) -> str:
        return "HeadwatchDriver"

    # ---------------------------------------------------------------- registration
    @classmethod
    def of(cls, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str, before: Any = None) -> HeadwatchDriver:
        """The driver of ``trainer``: the one in ``trainer.callbacks``, else a new one inserted just before ``before``
        (the first headwatch callback to be set up), set up for ``stage``.

        Raises:
            HeadwatchError: several drivers are in ``trainer.callbacks``.
        """
        found = drivers(trainer.callbacks)
        if len(found) > 1:
            raise HeadwatchError(f"{len(found)} HeadwatchDriver callbacks are attached to one Trainer; keep one")
        if found:
            driver = found[0]
        else:
            driver = cls()
            at = next((i for i, cb in enumerate(trainer.callbacks) if cb is before), len(trainer.callbacks))
            trainer.callbacks.insert(at, driver)  # Lightning's loop visits `before` again: registering is idempotent
        driver.setup(trainer, pl_module, stage)
        return driver

    def register(self, callback: Registrant, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> bool:
        """Drive ``callback``'s core monitor in this run (once per round); returns whether it was new this round.

        Its schedule: its own ``log_every_n_steps``, else ``every_factor`` times the Trainer's; the run's logging
        interval is the greatest common divisor of every registered interval (:meth:`schedule`)."""
        if id(callback) in self._round:
            return False
        self._round.add(id(callback))
        if callback not in self.registered:
            self.registered.append(callback)
        core = callback._core()
        every = logging_interval(trainer, callback.log_every_n_steps, core.every_factor, type(callback).__name__)
        core.configure(Schedule(every), self.run.reducer)
        if self._stage == "fit":  # a new fit: the monitor starts empty (a resume loads its checkpoint after setup)
            self.run.each("starting a new run", lambda m: m.reset(), [core])
        self.use()
        return True

    def add_sink(self, sink: Sink, engine: Any = None, every: int | None = None, prefix: str | None = None) -> None:
        """A sink of the run that is not a monitor (an alert's), before the summary. ``engine``: its alert engine
        (the summary lists its alerts); ``every``: it reads the run's values every this many steps (the run's
        logging interval divides it); ``prefix``: its metric prefix (the dashboard layout)."""
        if sink not in self.run.sinks:
            at = self.run.sinks.index(self.summary) if self.summary in self.run.sinks else len(self.run.sinks)
            self.run.sinks.insert(at, sink)
        if engine is not None and engine not in self.alerts:
            self.alerts.append(engine)
        if every:
            self._intervals.add(every)
            self.schedule()
        if prefix is not None:
            self._prefixes[prefix] = None

    def use(self) -> None:
        """Hand the orchestrator the registered cores (token counts first) and the self-check's loss source."""
        named = any(getattr(cb, "compare_loss", None) for cb in self.registered)  # a logged loss instead
        self.run.use_monitors([cb._core() for cb in self.registered], model_loss=not named)
        self.schedule()

    def schedule(self) -> None:
        """The run's logging interval: the greatest common divisor of the registered monitors' and alerts'."""
        intervals = {cb._core().schedule.every for cb in self.registered} | self._intervals
        every = 0
        for n in intervals:
            every = math.gcd(every, n)
        self.run.every = self.run.check.interval = every  # checked the same on every process (agree_interval, sums)
        for m in self.run.all_monitors:
            m.clock = self.run.cost.clock
        self.run.cost.configure(every, self.run.all_monitors, self.run.policy)
        self.run.cost.follow_figures([cb._core() for cb in self.registered if getattr(cb, "figure_every_n_steps", None) == "auto"])

    def _alerts(self) -> list[Any] | None:
        engines = [e for e in self.alerts if hasattr(e, "alerts")]
        return [a for e in engines for a in e.alerts] if engines else None

    def owner(self, core: Monitor) -> Registrant | None:
        return next((cb for cb in self.registered if cb._core() is core), None)

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Once per round (a ``fit``, a ``validate``...): the reducer; a new ``fit`` starts with empty state (a
        resume loads its checkpoint after this). A round ends at ``teardown`` (or an exception)."""
        if self._stage is not None:
            return
        self._stage, self._round, self._intervals = stage, set(), set()
        self._trainer = weakref.ref(trainer)
        reducer = LightningReducer(trainer.strategy)
        self.run.reducer = self.run.check.reducer = self.run.val_check.reducer = reducer
        if self.summary_on and self.summary not in self.run.sinks:
            self.run.sinks.append(self.summary)
        if stage == "fit":
            self.run.start_run(also=[self.summary])
            self.published.clear()

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach every registered callback on the final model (after ``configure_model``); those that cannot are
        refused together (:meth:`Orchestrator.refuse`: one warning naming each cause and what is still measured;
        ``strict`` raises) and training goes on without them."""
        owner = {cb._core(): cb for cb in self.registered}
        attach = lambda core: self.attach_one(owner[core], trainer, pl_module, stage)  # noqa: E731
        self.run.refuse_failed(self.run.attach_each(attach, list(owner)))
        self.use()
        self.run.vocabulary.remember(pl_module, lambda: self.attach(trainer, pl_module, stage))  # resized later: again

    @staticmethod
    def attach_one(callback: Registrant, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach one callback's core to ``pl_module``, with the strategy's wrapped model as its root; under FSDP1
        (after ``on_fit_start``) or DeepSpeed ZeRO-3 on whole matrices (a collective: every process calls it)."""
        core = callback._core()
        wrapped = getattr(trainer.strategy, "model", None)
        core.root = wrapped if isinstance(wrapped, torch.nn.Module) and wrapped is not pl_module else None
        with whole_matrices(core.root if core.root is not None else pl_module, pl_module):
            callback._attach(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(trainer, pl_module, "fit")
        self.write_layout(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":  # after configure_model
            self.attach(trainer, pl_module, "validate")
            self.write_layout(trainer)

    def write_layout(self, trainer: pl.Trainer) -> None:
        """The Custom Scalars layout, once per TensorBoard writer (rank zero), for each prefix of the run."""
        for prefix in {**dict.fromkeys(cb._core().prefix for cb in self.registered), **self._prefixes}:
            write_layout(trainer, prefix, self.run.policy)

    # ---------------------------------------------------------------- training: one step-end rule
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every process, before the first batch: a different ``log_every_n_steps`` on some process raises here."""
        with self.run.guard("starting training"):
            self.run.check.agree_interval(self.run.cost.budget)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        with self.run.guard("starting a batch"):
            self._step, self._optimizer_steps = lightning_step(trainer), trainer.global_step
            self.run.begin_step(self._step)
            self.run.step_start(batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with self.run.guard("reading the gradients"):
            self.run.gradients_ready(loss_scale(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The one step-end rule: a batch that stepped (an optimizer step in automatic optimization, every batch in
        manual optimization) ends the step; its values are published on every rank."""
        with self.run.guard("ending a batch"):
            if self.run.logging:
                hand_logged_loss(trainer, self.run, self.registered)
            self.run.batch_end()
        stepped = (
            not pl_module.automatic_optimization
            or trainer.global_step != self._optimizer_steps
            or (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        )
        if stepped and self.run.step is not None:
            with self.run.guard("publishing the step"):
                self.run.end_step()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self.run.guard("ending the epoch"):
            self.run.epoch_end(lightning_step(trainer) - 1)  # the last step of the epoch

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training ended: the end-of-training summary (rank zero) and the alerts' last deliveries (bounded)."""
        with self.run.guard("ending the run"):
            self.run.end_run(max(lightning_step(trainer) - 1, 0))

    def state_dict(self) -> dict[str, Any]:
        """The end-of-training summary's figures, in Lightning's checkpoint (the monitors keep their own): a resumed
        ``fit`` summarises the whole run."""
        return {"version": 1, "summary": self.summary.sink_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an invalid part is said once and the summary starts from empty."""
        part = state_dict.get("summary") if isinstance(state_dict, dict) else None
        if part is not None and (problem := self.summary.load_sink_state(part)) is not None:
            self.run.state_problem(any(m.strict for m in self.run.monitors), problem)

    # ---------------------------------------------------------------- validation
    def measuring(self, trainer: pl.Trainer) -> list[Monitor]:
        return [cb._core() for cb in self.registered if cb._measuring_validation(trainer) and cb._core() in self.run.monitors]

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for core in self.measuring(trainer):
            if hasattr(core, "val_dataloaders"):  # several: names get /dataloader_idx_<k>
                core.val_dataloaders = max(len(trainer.num_val_batches), 1)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        measuring = self.measuring(trainer)
        with self.run.guard("starting a validation batch"):
            real = validation_rows(trainer, batch, batch_idx, dataloader_idx) if measuring else None
            self.run.validation_batch_start(batch, dataloader_idx, real_rows=real, monitors=measuring)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        with self.run.guard("ending a validation batch"):
            self.run.validation_batch_end(dataloader_idx)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every measuring monitor's values of the validation, published through the run's sinks (``pl_module.log``,
        every rank: a monitor failing on one rank is dropped on every rank)."""
        if trainer.sanity_checking:
            return
        with self.run.guard("publishing the validation"):
            self.run.validation_end(lightning_step(trainer), monitors=self.measuring(trainer))

    # ---------------------------------------------------------------- end
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.run.policy.attempt(self.run.batch_end, "tearing down")
        self._stage = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.run.policy.attempt(self.run.batch_end, "ending after an exception", quiet=True)
        self._stage = None  # Lightning calls no teardown hook after an exception


def drivers(callbacks: Sequence[Any]) -> list[HeadwatchDriver]:
    """The drivers among ``callbacks``."""
    return [cb for cb in callbacks if isinstance(cb, HeadwatchDriver)]
