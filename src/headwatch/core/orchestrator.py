"""``Orchestrator``: the one object per run that drives every monitor, whatever the front door.

A front door (Lightning, the Hugging Face Trainer, a plain loop) only translates its trainer's
events into calls here. The orchestrator owns:

- the monitors of the run (built from names by :func:`build_monitors`, sharing one
  :class:`~headwatch.core.frequency.TokenCounts`);
- the step schedule (each monitor's :class:`~headwatch.core.schedule.Schedule`, set by
  :meth:`Orchestrator.configure`) and the decision which monitors measure a step (:meth:`due`);
- the capture decisions of a forward (:meth:`forward`, the contract of :mod:`headwatch.core.forwards`):
  the first forward with gradient of a training micro-batch starts it, the first evaluation forward
  that is not ``generate()``'s starts a validation batch; the labels come from the inputs the loss
  is computed with when a trainer takes them out of the model's inputs (:meth:`loss_inputs`);
- the failure policy (:meth:`each`: a monitor that fails warns once and is skipped; ``strict`` raises);
- the reduction (:func:`~headwatch.core.monitor.compute_due`: every monitor's sums and the self-check's in one
  ``all_reduce`` per dtype; every rank drops the same failed monitors);
- publishing: one :func:`to_host` transfer per logging step (the one host-device sync), then every :class:`Sink`;
- the self-check (:class:`~headwatch.core.self_check.SelfCheck`, :attr:`Orchestrator.check`): what was captured on each
  training logging step and its gaps to the trainer's own figures, added before the one transfer, warned about after;
- the vocabulary-sized matrices (:class:`~headwatch.core.vocabulary.VocabularyWatch`); state (:meth:`state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.core.build import build_monitors, set_figures
from headwatch.core.forwards import keep_rows, not_loss_forward, skipped_in_training
from headwatch.core.frequency import TokenCounts
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import FailurePolicy, Monitor, compute_due, whole_matrices
from headwatch.core.overhead import Overhead
from headwatch.core.publish import Sink, named_evaluation, to_host, withhold
from headwatch.core.rl import drop_reference, rl_scalars
from headwatch.core.run_state import restore_run
from headwatch.core.schedule import Schedule
from headwatch.core.self_check import SelfCheck
from headwatch.core.vocabulary import VocabularyWatch
from headwatch.distributed.fsdp1 import unwrapped
from headwatch.distributed.reduce import Reducer, TorchDistributedReducer
from headwatch.errors import (
    HeadwatchError,
    StateError,
    check_bool,
    check_instance,
    check_int,
    check_optional,
    check_prefix,
    check_range,
    check_sequence,
)
from headwatch.model.batch import BatchFormat


class _RunPolicy(FailurePolicy):
    """The run's own failure policy when no monitor is left to say it (every monitor refused)."""

    def __init__(self, run: Orchestrator, strict: bool) -> None:
        self.run, self.strict, self.failures = run, strict, 0

    @property
    def rank(self) -> int:
        return self.run.reducer.rank


class Orchestrator:
    """Drive the monitors of one run for a front door; see the module docstring for what it owns.

    Args:
        monitors: core monitors or names among :data:`MONITOR_NAMES`; None: all four.
        sinks: where published values go (:class:`Sink`); more can be added to :attr:`sinks`.
        reducer: distributed reductions; default ``torch.distributed`` when initialized.
        strict: raise a ``HeadwatchError`` when a monitor fails instead of warning once and skipping it.
        prefix: first component of every metric name.
        batch_format: how batches are read (default :class:`~headwatch.model.batch.BatchFormat`).
        overhead_budget: the share of wall time headwatch may take (:mod:`headwatch.core.overhead`); None: off.

    Raises:
        HeadwatchError: a bad argument.
    """

    def __init__(
        self,
        monitors: Sequence[Monitor | str] | None = None,
        *,
        sinks: Sequence[Sink] = (),
        reducer: Reducer | None = None,
        strict: bool = False,
        prefix: str = "headwatch",
        batch_format: BatchFormat | None = None,
        overhead_budget: float | None = None,
    ) -> None:
        check_prefix(prefix)
        check_bool("strict", strict)
        check_optional(check_instance, "reducer", reducer, Reducer, "a headwatch.core.Reducer")
        check_optional(check_instance, "batch_format", batch_format, BatchFormat)
        check_sequence("sinks", sinks, "objects with a publish(numbers, media, step, val) method", lambda s: isinstance(s, Sink))
        self.monitors = build_monitors(monitors, batch_format, prefix)  # checks `monitors`
        self.all_monitors = list(self.monitors)
        """Every monitor of the run, also those refused at attach (:meth:`attach`); ``monitors``: those measured."""
        self.batch_format = batch_format or BatchFormat()
        self.policy = _RunPolicy(self, strict)
        self.refused: dict[Monitor, Exception] = {}
        """Monitors that cannot measure this run's model, with the cause (not driven; said once)."""
        passed = {id(m) for m in ([monitors] if isinstance(monitors, Monitor) else monitors or ()) if isinstance(m, Monitor)}
        self.named = [m for m in self.monitors if id(m) not in passed]
        """The monitors built here from names (not core objects the caller passed): they take the door's figure setting."""
        for m in self.monitors:
            m.strict = m.strict or strict
        self.prefix = prefix
        self.reducer: Reducer = reducer or TorchDistributedReducer()
        self.sinks: list[Sink] = list(sinks)
        self.latest: dict[str, float] = {}
        """The values of the last publication, by full name."""
        self.step: int | None = None
        """The training step in progress (0-based), None outside one."""
        self.logging: list[Monitor] = []
        """The monitors measuring the step in progress."""
        self.every = 0
        """The run's logging interval in steps (:meth:`configure`; 0: no training logging step)."""
        self.logging_step = False
        """Whether the step in progress is a logging step of the run (:meth:`is_logging_step`)."""
        self.ended = False  # whether end_run was called for this run
        self._started = self._val_started = False  # the micro-batch's first training forward / the eval batch's loss forward seen
        self._loss_inputs: Any = None  # the inputs of the loss being computed (loss_inputs), labels included
        self.sampling_temperature: float | None = None  # an RL run's sampling temperature (sample_at); None: not RL
        self.rl_start: dict[str, float] | None = None
        """The entropy and rare share of the run's first RL logging step (``rl/rare_share_of_entropy_drop``)."""
        self.cost = Overhead(overhead_budget, prefix)
        """The overhead budget: the clock, the probe steps, the ``overhead/`` values (:mod:`headwatch.core.overhead`)."""
        self.check = SelfCheck(prefix, self.reducer)
        """The self-check (docs/self_check.md): doors hand it the trainer's figures (``check.step_loss``, ...)."""
        self.check.strict, self.check.clock = strict, self.cost.clock  # the clock times its hook's work (CopySafeHook)
        self.val_check = SelfCheck(f"{prefix}/val", self.reducer, evaluation=True)  # evaluations: the model's own loss
        self.val_check.strict, self.check.evaluation_check = strict, self.val_check  # one hook on the model serves both
        self.vocabulary = VocabularyWatch()  # the vocabulary-sized matrices as attached, checked on logging steps

    # ---------------------------------------------------------------- wiring
    def configure(self, every: int, reducer: Reducer | None = None, figure_every_n_steps: int | str | None = None) -> None:
        """Each monitor measures every ``every_factor * every`` steps (0: never); ``figure_every_n_steps`` for
        the monitors built from names (None: leave them)."""
        check_int("every", every, minimum=0)
        self.every = self.check.interval = every  # the check verifies it is the same on every process
        if reducer is not None:
            self.reducer = self.check.reducer = self.val_check.reducer = reducer
        for m in self.monitors:
            m.configure(Schedule(self.cost.cadence(m, every)), self.reducer)
            m.clock = self.cost.clock
        self.cost.configure(every, self.monitors, self.policy)
        if figure_every_n_steps is not None:
            set_figures(self.named, figure_every_n_steps)

    def attach(self, model: nn.Module, root: nn.Module | None = None, refuse: bool = False) -> None:
        """Resolve every monitor's modules in ``model`` (hooks); ``root``: the model as the engine wraps it.

        Under FSDP1 or DeepSpeed ZeRO-3 the matrices are gathered whole while resolving (a collective:
        every process calls this at the same point). Without ``refuse``, raises what the monitors'
        ``attach`` raises; with ``refuse`` (a trainer hook), a monitor that cannot attach is refused
        (:meth:`refuse`: one warning, the others go on; ``strict`` raises). Every monitor of the run is
        tried again at each call (a new model may have what the last one lacked).
        """
        root = model if root is None else root

        def attach(m: Monitor) -> None:
            m.root = root  # FSDP1: summoned from on logging steps
            m.attach(unwrapped(model))  # FSDP1: the inner model's names (no `_fsdp_wrapped_module.`)

        with whole_matrices(root, model):
            failed = self.attach_each(attach, refuse=refuse)
        self.refuse_failed(failed)
        self.check.attach(unwrapped(model))  # the model's own `outputs.loss` on logging steps and evaluations
        self.vocabulary.remember(unwrapped(model), lambda: self.attach(model, root, refuse))

    def attach_each(
        self, attach: Callable[[Monitor], Any], monitors: Sequence[Monitor] | None = None, refuse: bool = True
    ) -> dict[Monitor, Exception]:
        """``attach(m)`` for each of ``monitors`` (default: every monitor of the run, refused ones too: a new model
        may have what the last one lacked), in their order; returns those that failed, with the cause (without
        ``refuse``, the first failure is raised instead). :meth:`refuse_failed` then refuses them."""
        failed: dict[Monitor, Exception] = {}
        for m in self.all_monitors if monitors is None else monitors:
            try:
                attach(m)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                if not refuse:
                    raise
                failed[m] = err
        return failed

    def refuse_failed(self, failed: Mapping[Monitor, Exception]) -> None:
        """After attaching every monitor anew (:meth:`attach_each`): all of them measured again, except ``failed``,
        refused together (:meth:`refuse`: one warning; ``strict`` raises)."""
        self.refused.clear()
        self.monitors = list(self.all_monitors)
        if failed:
            self.refuse(failed)

    def use_monitors(self, monitors: Sequence[Monitor], model_loss: bool = True) -> None:
        """Drive ``monitors``, gathered by the door (Lightning's callbacks, in their order): the shared token
        counts first, whatever the order (the others read them), those :attr:`refused` left out. The self-check
        publishes under the logit monitor's prefix (else the first monitor's) and, with ``model_loss`` (no loss
        handed by the door), reads the model's own ``outputs.loss`` (the logit monitor's model)."""
        counts = [m for m in monitors if isinstance(m, TokenCounts)]
        self.all_monitors = counts + [m for m in monitors if not isinstance(m, TokenCounts)]
        self.monitors = [m for m in self.all_monitors if m not in self.refused]
        if monitors:
            logits = next((m for m in monitors if hasattr(m, "capture_tally")), None)
            self.check.prefix = (logits or monitors[0]).prefix
            self.val_check.prefix = f"{self.check.prefix}/val"
            owner = getattr(getattr(logits, "source", None), "owner", None)
            if isinstance(owner, nn.Module) and model_loss:  # the model's own `outputs.loss` (a Hugging Face model)
                self.check.attach(owner)

    def sample_at(self, temperature: float, source: str) -> None:
        """An RL run whose policy samples at ``temperature`` (read from ``source``, said once): every
        :class:`LogitStats` measures ``softmax(logits / temperature)`` and the training steps also publish the RL
        names (:func:`headwatch.core.rl.rl_scalars`; ``docs/rl.md``).

        Raises:
            HeadwatchError: ``temperature`` is not a finite number > 0.
        """
        t = check_range("temperature", temperature, 0, low_open=True)
        for m in self.all_monitors:
            if isinstance(m, LogitStats):
                m.temperature = t
        self.sampling_temperature = t
        self.check.policy_gradient = True
        self.policy.info_once(
            f"headwatch: an RL run sampling at temperature {t} ({source}): the logit statistics are those of "
            f"softmax(logits / {t}) over the completion tokens of the training forward. (said once)"
        )

    def refuse(self, failed: Mapping[Monitor, Exception]) -> None:
        """Stop driving monitors that cannot measure this run, with ONE warning naming each cause and what is
        still measured; ``strict`` raises a ``HeadwatchError`` instead."""
        by_cause: dict[str, list[str]] = {}
        for m, e in failed.items():
            by_cause.setdefault(f"{type(e).__name__}: {e}", []).append(m.name)
        causes = "; ".join(f"{', '.join(names)}: {cause}" for cause, names in by_cause.items())
        if self.policy.strict or any(m.strict for m in failed):
            first = next(iter(failed.values()))
            raise HeadwatchError(f"headwatch cannot measure this model ({causes})") from first
        self.refused.update(failed)
        self.monitors = [m for m in self.monitors if m not in self.refused]
        kept = ", ".join(m.name for m in self.monitors) or "nothing: headwatch publishes no value for this run"
        self.policy.warn_once(
            "refused:" + ",".join(sorted(m.name for m in failed)),
            f"headwatch cannot measure {', '.join(m.name for m in failed)} on this model ({causes}); training "
            f"goes on. Still measured: {kept}. Pass strict=True to raise instead. (warned once)",
        )

    def start_run(self, resumed: bool = False, also: Sequence[Any] = ()) -> None:
        """A run starts (``train()``, ``fit``, a hyperparameter-search trial, step 0 of a plain loop again).

        A fresh run empties every monitor's state (:meth:`Monitor.reset`: token counts, accumulators,
        totals, the step in progress) and the run's last values, and calls ``reset()`` on each object of
        ``also`` (an alert engine: its smoothing and episodes); a run ``resumed`` from a checkpoint keeps
        them (the checkpoint's state is loaded after this). Failures follow the failure policy.
        """
        self.step, self.logging, self._started, self._val_started = None, [], False, False
        self.logging_step, self.ended = False, False
        self.cost.reset()
        if resumed:
            return
        self.latest.clear()
        self.rl_start = None
        self.each("starting a new run", lambda m: m.reset(), self.all_monitors)
        for obj in also:
            with self.guard("starting a new run"):
                obj.reset()

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Around a door's trainer hooks: timed as headwatch's; an exception warns once, training goes on (``strict`` raises)."""
        try:
            with self.cost.clock.kind(None):
                yield
        except Exception as err:  # noqa: BLE001
            if getattr(err, "strict", False) is True:  # a strict part of the run raised on purpose
                raise
            if self.policy.strict or any(m.strict for m in self.all_monitors):
                raise HeadwatchError(f"headwatch failed while {where}: {type(err).__name__}: {err}") from err
            self.policy.failures += 1
            self.policy.warn_once(
                f"guard:{where}",
                f"headwatch failed while {where} ({type(err).__name__}: {err}); training goes on, what this "
                "skipped is not measured. Pass strict=True to raise instead. (warned once)",
            )

    def detach(self) -> None:
        """Remove every monitor's hooks (their state stays)."""
        for m in self.monitors:
            m.detach()
        self.check.detach()

    def each(self, where: str, call: Callable[[Monitor], Any], monitors: Sequence[Monitor] | None = None) -> list[Monitor]:
        """``call(m)`` for every monitor; a failure warns once and is skipped (raises when strict). Returns those that failed."""
        failed = []
        for m in self.monitors if monitors is None else monitors:
            try:
                with m.timed():
                    call(m)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                m.fail(err, where)
                failed.append(m)
        return failed

    def warn_once(self, key: str, message: str) -> None:  # through the first monitor's warn-once record, else the run's
        (self.monitors[0] if self.monitors else self.policy).warn_once(key, message)

    def note_once(self, key: str, message: str) -> None:  # a note about the run, once, never raised
        (self.monitors[0] if self.monitors else self.policy).note_once(key, message)

    def fail(self, err: Exception, where: str) -> None:
        """A failure of the run's publishing or state: the first monitor's failure policy (else the run's)."""
        (self.monitors[0] if self.monitors else self.policy).fail(err, where)

    # ---------------------------------------------------------------- training
    def due(self, step: int, first: bool = False) -> list[Monitor]:
        """The monitors that measure step ``step``; ``first``: the door also logs step 0 (``logging_first_step``)."""
        return [m for m in self.monitors if self.cost.due(m, step, first) or (first and step == 0)]

    def is_logging_step(self, step: int, first: bool = False) -> bool:
        """Whether step ``step`` is a logging step of the run: ``(step + 1) % every == 0`` for the run's interval
        (:meth:`configure`), or step 0 with ``first``. Its sinks hear from every logging step (:class:`Sink`), also
        when no monitor measures it; each monitor measures on its own schedule (:meth:`due`)."""
        return Schedule(self.every).is_logging_step(step) or (first and step == 0)

    def begin_step(self, step: int, first: bool = False) -> None:
        """A training step starts (before its first micro-batch): fixes which monitors measure it."""
        new = step != self.step  # Lightning begins each micro-batch of a step: the check keeps the step's figures
        self.step, self._started = step, False
        self.logging_step = self.is_logging_step(step, first)
        self.cost.begin(step, self.logging_step, first)
        self.logging = self.due(step, first)
        if self.logging and self.vocabulary.check(self.note_once):  # resized or untied since attach: resolved again
            self.logging = self.due(step, first)
        if new:
            self.begin_check()

    def begin_check(self) -> None:
        """The self-check starts a step: it collects the trainer's figures on logging steps; the capture tallies
        start empty."""
        self.check.begin(bool(self.logging))
        for m in self.monitors:
            tally = getattr(m, "capture_tally", None)
            if tally is not None:
                tally.take()

    def step_start(self, batch: Any, step: int | None = None) -> None:
        """A (micro-)batch of the current step starts (before its forward)."""
        if step is not None and step != self.step:
            self.begin_step(step)
        s = self.step if self.step is not None else 0
        self.each("starting a batch", lambda m: m.step_start(batch, s, m in self.logging))

    def forward(self, batch: Any, training: bool, real_rows: int | None = None) -> None:
        """A model forward with ``batch`` (the door's forward pre-hook, called inside the forward): decides what it is:
        the contract of :mod:`headwatch.core.forwards`: in a training step, the first forward run with
        gradient starts the micro-batch (forwards under ``no_grad`` feed no loss: never measured; a later
        forward with gradient is measured too, against its own labels: :meth:`LogitStats.forward_batch`); outside a training step, the
        first evaluation forward that is not part of ``generate()`` starts a validation batch, later ones
        of the same batch are not measured. While :meth:`loss_inputs` is open, the fields the forward
        lacks (the ``labels`` a trainer took out) come from the loss's inputs. ``real_rows`` (evaluation): only
        the batch's first ``real_rows`` rows are real (:func:`eval_rows_kept`); the others, repeats a
        distributed sampler added, are not counted.
        """
        if self.step is not None and self.logging and self.check.active:  # the self-check counts what is left out
            why = skipped_in_training(training, torch.is_grad_enabled())
            if why is not None:
                self.check.skipped_forward(why)
        if training and self.step is not None:
            if not_loss_forward(True, torch.is_grad_enabled(), True) is not None:
                return
            if self._started:  # a later forward of the micro-batch (a second batch of a mix, R-Drop): its own labels
                own, later = self.with_loss_inputs(batch), [m for m in self.logging if isinstance(m, LogitStats)]
                self.each("reading a later forward's batch", lambda m: m.forward_batch(own), later)
                return
            self._started = True
            self.step_start(self.with_loss_inputs(batch))
        elif self.step is None and not training:
            if self._val_started or not_loss_forward(False, torch.is_grad_enabled(), True) is not None:
                return
            self._val_started = True
            self.validation_batch_start(self.with_loss_inputs(batch), real_rows=real_rows)

    @contextmanager
    def loss_inputs(self, inputs: Any) -> Iterator[None]:
        """While inside, ``inputs`` are those the step's loss is computed with (a door wraps its trainer's loss
        computation: the Hugging Face ``Trainer.compute_loss``). A mapping is copied (the trainer may pop its
        ``labels`` before the forward). Forwards inside take the fields they lack from it (:meth:`with_loss_inputs`)."""
        previous = self._loss_inputs
        self._loss_inputs = dict(inputs) if isinstance(inputs, Mapping) else inputs
        try:
            yield
        finally:
            self._loss_inputs = previous

    def with_loss_inputs(self, batch: Any) -> Any:
        """``batch`` (a forward's keyword inputs) completed with the fields of the open :meth:`loss_inputs` it lacks,
        when both are mappings over the same token ids (the same tensor's memory and shape, no comparison of values:
        no host sync); else ``batch`` unchanged (another batch, e.g. a second batch of a mix: its own fields only)."""
        loss = self._loss_inputs
        if not isinstance(loss, Mapping) or not isinstance(batch, Mapping):
            return batch
        key = self.monitors[0].batch_format.ids_key if self.monitors else "input_ids"
        ids, theirs = batch.get(key), loss.get(key)
        if isinstance(ids, Tensor) and isinstance(theirs, Tensor) and (ids.shape != theirs.shape or ids.data_ptr() != theirs.data_ptr()):
            return batch
        return {**{k: v for k, v in loss.items() if k not in batch}, **batch}

    def gradients_ready(self, loss_scale: float | Tensor | None = None) -> None:
        """Gradients are final (after accumulation and unscaling)."""
        self.each("reading the gradients", lambda m: m.gradients_ready(loss_scale))

    def optimizer_stepped(self) -> None:
        self.each("after the optimizer step", lambda m: m.optimizer_stepped())

    def batch_end(self) -> None:
        """A (micro-)batch ended: its forward and backward are done."""
        self._started = False
        self.each("ending the batch", lambda m: m.batch_end())

    def end_step(self, step: int | None = None) -> dict[str, float]:
        """The training step ended (after the optimizer step): publish the due monitors' values."""
        step = self.step if step is None else step
        due, publish = self.logging, self.logging_step or bool(self.logging)
        self.logging, self.logging_step, self.step = [], False, None
        return self.emit(due, step if step is not None else 0, always=publish)

    def epoch_end(self, step: int, at: int | None = None) -> dict[str, float]:
        """The training epoch ended at step ``step``: publish the monitors that measure at epoch ends (at
        step ``at``, default ``step``: the door's x axis)."""
        if step < 0:
            return {}
        wants: list[Monitor] = []
        self.each("ending the epoch", lambda m: wants.append(m) if self.cost.at_epoch_end(m) and m.train_epoch_end(step) else None)
        return self.emit(wants, step if at is None else at)

    # ---------------------------------------------------------------- validation
    def validation_batch_start(
        self, batch: Any, dataloader_idx: int = 0, real_rows: int | None = None, monitors: Sequence[Monitor] | None = None
    ) -> None:
        """A validation batch starts; ``real_rows``: only its first ``real_rows`` rows are real (the others are
        repeats a distributed sampler added to even out the processes: :func:`eval_rows_kept`,
        :func:`sampler_rows_kept`), the monitors see them marked as no prediction (:func:`keep_rows`)."""
        if not self.val_check.active and any(isinstance(m, LogitStats) for m in (self.monitors if monitors is None else monitors)):
            self.val_check.begin(True)  # the evaluation's first measured batch: the model's own losses are read from now on
        if real_rows is not None:
            if self.val_check.active and isinstance(batch, Mapping) and real_rows < getattr(batch.get(self.batch_format.ids_key), "shape", (0,))[0]:
                self.val_check.rows_left_out()
            marked = keep_rows(batch, real_rows, self.batch_format)
            if marked is None:
                self.warn_once(
                    "repeated_rows",
                    f"headwatch cannot leave out the rows a distributed sampler repeats in a {type(batch).__name__} "
                    "batch (no mapping with input_ids); they are counted in the validation values. (warned once)",
                )
            batch = batch if marked is None else marked
        self.each("starting a validation batch", lambda m: m.validation_batch_start(batch, dataloader_idx), monitors)

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        self._val_started = False
        self.each("ending a validation batch", lambda m: m.validation_batch_end(dataloader_idx))

    def validation_end(self, step: int, monitors: Sequence[Monitor] | None = None, name: str | None = None) -> dict[str, float]:
        """An evaluation ended: publish its values (every rank: a collective).

        ``name``: the trainer's own name for this evaluation when it is not its default one (the HF
        Trainer's ``metric_key_prefix``, e.g. ``eval_wiki`` for ``eval_dataset={"wiki": ...}``): the
        published names get the suffix ``/<name>`` (:func:`named_evaluation`). Returns the values under
        the monitors' names (without the suffix).
        """
        numbers = self.emit(list(self.monitors if monitors is None else monitors), step, val=True, name=name, always=True)
        self.val_check.begin(False)  # until the next evaluation's first batch
        return numbers

    # ---------------------------------------------------------------- publishing
    def compute(self, due: Sequence[Monitor], val: bool = False) -> tuple[dict[str, float], list[Monitor]]:
        """Compute ``due`` on every rank (a collective; a monitor failing anywhere is dropped everywhere), then
        move the values and histograms to the host in one transfer and tell the monitors. Returns
        ``(numbers, monitors published)``."""
        if not due:
            return {}, []
        checker = self.val_check if val else self.check
        checked = val or not self.ended  # the end-of-training probe has no step of its own to check
        rode = [] if val else self.cost.ride(self.reducer.world_size)
        check = [checker.local_sums(due)] if checked and self.reducer.world_size > 1 else None  # rides with the sums
        with self.cost.clock.kind("statistics"):
            scalars, ok = compute_due(list(due), self.reducer, val, also=(check or []) + rode)
        if not ok:
            return {}, []
        if checked:
            scalars = checker.checked(scalars, ok, check[0] if check else None)  # a failure adds nothing (said once)
        if checked and not val and self.sampling_temperature is not None:
            scalars = rl_scalars(scalars, self.prefix, self.sampling_temperature, self.rl_start)
        try:
            self.cost.trim([m.media for m in ok] if not val else [])
            with self.cost.clock.kind("publish"):
                numbers = to_host({**scalars, **self.cost.keys(rode)}, [m.media for m in ok])
        except Exception as err:  # noqa: BLE001
            ok[0].fail(err, "moving the values to the host")
            return {}, []
        shared = None if val else self.cost.shared(numbers, self.reducer.world_size)  # the reduced window, popped
        measured, numbers = numbers, withhold(numbers, [*ok, *([checker] if checked else [])], checker.prefix)
        with self.cost.clock.kind("figures" if self.cost.probing else "statistics"):
            self.each("publishing the values", lambda m: m.published(numbers), ok)
        numbers = numbers if val else self.cost.after(numbers, shared)
        if checked:
            checker.attempt(lambda: checker.published(measured), "warning from the self-check")  # names what it withheld
        if checked and not val and self.sampling_temperature is not None and self.rl_start is None:
            self.rl_start = drop_reference(numbers, self.prefix)  # the run's first RL logging step
        return numbers, ok

    def emit(
        self, due: Sequence[Monitor], step: int, val: bool = False, name: str | None = None, always: bool = False
    ) -> dict[str, float]:
        """:meth:`compute`, then every sink once (validation names with ``/<name>``, :func:`named_evaluation`);
        a sink that fails warns once (raises when strict). ``always``: the sinks are called also when nothing was
        computed (a logging step of the run, an evaluation: :class:`Sink`). Returns the values under the monitors'
        names."""
        numbers, ok = self.compute(due, val)
        if not ok and not always:
            return {}
        media = [m.media for m in ok if not val or m.validation_media]
        published = named_evaluation(numbers, media, name, self.prefix)
        self.latest.update(published)
        with self.cost.publishing(val):  # a probe step's drawing and writing are the probe's cost
            self.each_sink("publish", lambda sink: sink.publish(published, media, step, val))
        return numbers

    def each_sink(self, what: str, call: Callable[[Any], Any], method: str | None = None) -> None:
        """``call(sink)`` for every sink (those with a method named ``method``, when given); a sink that fails
        warns once (raises when strict) and the others are still called."""
        for sink in list(self.sinks):
            if method is not None and not callable(getattr(sink, method, None)):
                continue
            try:
                call(sink)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                self.sink_failed(sink, err, what)

    def end_run(self, step: int) -> None:
        """Training ended at ``step`` (the door's end event, on every rank): under an overhead budget, the probes
        measure the last step unless it was a probe step (a collective); then every sink's ``end(step)`` once (the
        end-of-training summary, the alert's last deliveries). A second call for the same run does nothing."""
        if self.ended:
            return
        self.ended = True
        if probes := self.cost.ends(step, self.monitors):
            self.emit(probes, step)
        self.each_sink("ending the run", lambda sink: sink.end(step), "end")

    def close(self) -> None:
        """Release the run's objects: every sink's ``close()``, then every monitor's hooks (their state stays)."""
        self.each_sink("closing", lambda sink: sink.close(), "close")
        self.detach()

    def sink_failed(self, sink: Any, err: Exception, what: str = "publish") -> None:
        """A sink failed (``what``: the call): raise when strict, else warn once per sink; the values were computed
        and are still returned and kept in :attr:`latest`."""
        where = type(sink).__name__
        verb = "publish through" if what == "publish" else f"finish {what} with"
        if self.policy.strict or any(m.strict for m in self.monitors) or getattr(sink, "strict", False):
            error = HeadwatchError(f"headwatch could not {verb} {where}: {type(err).__name__}: {err}")
            error.strict = True  # type: ignore[attr-defined]  # raised through the door's guard too
            raise error from err
        self.warn_once(
            f"sink:{where}:{what}",
            f"headwatch could not {verb} {where} ({type(err).__name__}: {err}); training goes on, the values "
            "are still returned and kept in `.latest`. Pass strict=True to raise instead. (warned once)",
        )

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Every monitor's state (a collective under several processes: call it on every rank)."""
        return {
            "version": 2, "names": [type(m).__name__ for m in self.all_monitors], "monitors": [m.state_dict() for m in self.all_monitors],
            "check": self.check.state_dict(), "rl_start": self.rl_start, "overhead": self.cost.state_dict(),
            "sinks": {type(s).__name__: s.sink_state() for s in self.sinks if callable(getattr(s, "sink_state", None))},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give each monitor its part of ``state`` (matched by class name; a state without names, by position), each
        checked by the monitor (an invalid part restarts that monitor from empty with one warning), and each sink
        with a ``load_sink_state`` its part. A state that is not a dict of parts, or that lacks a monitor's part, is
        said once; ``strict`` raises instead (:func:`headwatch.core.run_state.restore_run`)."""
        restore_run(self, state)

    def state_problem(self, strict: bool, problem: str) -> None:
        """A checkpoint state that cannot be restored as it is: raise :class:`StateError` when ``strict``, else warn once."""
        message = f"headwatch: the checkpoint's monitor state cannot be restored as it is: {problem}."
        if strict:
            raise StateError(message)
        self.warn_once(f"state:{problem}", message + " The resume goes on. Pass strict=True to raise instead. (warned once)")
