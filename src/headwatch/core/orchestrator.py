"""``Orchestrator``: the one object per run that drives every monitor, whatever the front door.

A front door (Lightning, the Hugging Face Trainer, a plain loop) only translates its trainer's
events into calls here. The orchestrator owns:

- the monitors of the run (built from names by :func:`build_monitors`, sharing one
  :class:`~headwatch.core.frequency.TokenCounts`);
- the step schedule (each monitor's :class:`~headwatch.core.schedule.Schedule`, set by
  :meth:`Orchestrator.configure`) and the decision which monitors measure a step (:meth:`due`);
- the capture decisions of a forward (:meth:`forward`): the first training forward of a
  micro-batch starts it, a second one of the same micro-batch ends it, an evaluation forward
  outside a training step is a validation batch;
- the failure policy (:meth:`each`: a monitor that fails warns once, is skipped and training goes on;
  ``strict`` raises);
- the reduction (:func:`~headwatch.core.monitor.compute_due`: every rank drops the same failed monitors);
- publishing: one :func:`to_host` transfer per logging step (scalars and histograms together: the
  one host-device sync), then every :class:`Sink` once (one writer flush each);
- state (:meth:`state_dict` / :meth:`load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from headwatch.core.collision import SynonymCollision
from headwatch.core.figures import resolve_figure_interval
from headwatch.core.frequency import TokenCounts
from headwatch.core.gradients import GradientDensity
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import Media, Monitor, compute_due, whole_matrices
from headwatch.core.schedule import Schedule
from headwatch.distributed.fsdp1 import unwrapped
from headwatch.distributed.reduce import Reducer, TorchDistributedReducer
from headwatch.errors import (
    HeadwatchError,
    check_bool,
    check_instance,
    check_int,
    check_optional,
    check_prefix,
    check_sequence,
)
from headwatch.model.batch import BatchFormat

MONITOR_NAMES: dict[str, type[Monitor]] = {
    "logits": LogitStats,
    "gradients": GradientDensity,
    "tokens": TokenCounts,
    "collision": SynonymCollision,
}
"""The names a front door accepts in ``monitors=`` (default: all four)."""


@runtime_checkable
class Sink(Protocol):
    """Where a front door's values go: called once per logging step, on every rank, after the one host transfer.

    ``numbers``: full names -> floats; ``media``: the due monitors' histograms (on the host), texts and
    figures; ``val``: the values of an evaluation. A sink writes what its rank writes (media on rank
    zero) and flushes its writers once.
    """

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None: ...


def build_monitors(monitors: Sequence[Monitor | str] | None, batch_format: BatchFormat | None, prefix: str) -> list[Monitor]:
    """Monitors from names (:data:`MONITOR_NAMES`) or core objects; those that need token counts share one.

    Raises:
        HeadwatchError: an entry that is neither a core monitor nor one of :data:`MONITOR_NAMES`.
    """
    if isinstance(monitors, (str, Monitor)):
        monitors = [monitors]
    if monitors is None:
        items: list[Any] = ["tokens", "logits", "gradients", "collision"]
    else:
        what = f"core monitors or names among {sorted(MONITOR_NAMES)}"
        items = check_sequence("monitors", monitors, what, lambda m: isinstance(m, Monitor) or m in MONITOR_NAMES)
    counts = next((m for m in items if isinstance(m, TokenCounts)), None)
    needs_counts = ("tokens", "gradients", "collision")
    if counts is None and any(m in needs_counts or isinstance(m, (GradientDensity, SynonymCollision)) for m in items):
        counts = TokenCounts(prefix=prefix, batch_format=batch_format)
    built: list[Monitor] = [counts] if counts is not None else []
    for m in items:
        if m == "tokens" or m is counts:
            continue
        if isinstance(m, str):
            cls = MONITOR_NAMES[m]
            if cls in (GradientDensity, SynonymCollision):
                m = cls(frequency=counts, prefix=prefix)
            elif cls is LogitStats:  # counts, when kept, give the calibration's target buckets
                m = cls(prefix=prefix, batch_format=batch_format, frequency=counts)
            else:
                m = cls(prefix=prefix, batch_format=batch_format)
            if batch_format is not None:
                m.batch_format = batch_format
        elif getattr(m, "frequency", counts) is None:
            m.frequency = counts  # type: ignore[attr-defined]
        built.append(m)
    return built


def set_figures(monitors: Sequence[Monitor], figure_every_n_steps: int | str | None) -> None:
    """Set the figure interval of configured monitors (``"auto"``: 10 of each monitor's logging intervals
    when matplotlib is installed; see :func:`headwatch.core.figures.resolve_figure_interval`).

    ``LogitStats`` and ``GradientDensity`` draw every ``figure_every`` steps; ``SynonymCollision``
    draws at each of its measurements when the interval is not 0.

    Raises:
        HeadwatchError: an explicit interval without matplotlib, or a bad value.
    """
    for m in monitors:
        interval = resolve_figure_interval(figure_every_n_steps, m.schedule.every)
        if isinstance(m, (LogitStats, GradientDensity)):
            m.figure_every = interval
        elif isinstance(m, SynonymCollision):
            m.draw_figures = interval > 0


def to_host(scalars: dict[str, Tensor | float], media: Sequence[Media] = ()) -> dict[str, float]:
    """Scalars as Python floats and every histogram of ``media`` on the host, in ONE device-to-host transfer.

    The scalars are stacked (float64) and concatenated with the flattened histogram values; the
    one ``.cpu()`` of that buffer is the logging step's host-device sync. Histograms are replaced
    in place by float64 CPU tensors of their original shape, the ``host`` tensors (read by the
    monitors' ``published``) by CPU tensors of their original shape and dtype.
    """
    hist = [(m.histograms, tag, v, False) for m in media for tag, v in m.histograms.items() if isinstance(v, Tensor)]
    hist += [(m.host, tag, v, True) for m in media for tag, v in m.host.items() if isinstance(v, Tensor)]
    on_device = [k for k, v in scalars.items() if isinstance(v, Tensor)]
    numbers = {k: float(v) for k, v in scalars.items() if not isinstance(v, Tensor)}  # Python numbers: no transfer
    tensors = [scalars[k] for k in on_device] + [v for _, _, v, _ in hist]
    if tensors:
        devices = [t.device for t in tensors if t.device.type != "cpu"]
        device = devices[0] if devices else torch.device("cpu")
        parts = [scalars[k].detach().to(device=device, dtype=torch.float64).reshape(1) for k in on_device]
        parts += [v.detach().to(device=device, dtype=torch.float64).reshape(-1) for _, _, v, _ in hist]
        flat = torch.cat(parts).cpu()  # the one host transfer
        numbers.update(zip(on_device, flat[: len(on_device)].tolist()))
        offset = len(on_device)
        for where, tag, v, own_dtype in hist:  # histograms float64; `host` tensors their own dtype (ids < 2**53 exact)
            moved = flat[offset : offset + v.numel()].reshape(v.shape)
            where[tag] = moved.to(v.dtype) if own_dtype else moved
            offset += v.numel()
    numbers = {k: numbers[k] for k in scalars}  # the scalars' order
    return numbers


class _OfRun:
    """A read-only attribute of a front door that is its orchestrator's attribute of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, door: Any, owner: type | None = None) -> Any:
        return self if door is None else getattr(door.run, self.name)


class Driver:
    """Base of a front door that holds the run's :class:`Orchestrator` as ``run`` (the plain loop, the HF callback).

    ``monitors`` (``list[Monitor]``), ``reducer`` and ``latest`` (the values of the last measurement, by
    full name) are the orchestrator's.
    """

    run: Orchestrator
    monitors = _OfRun()
    reducer = _OfRun()
    latest = _OfRun()


class Orchestrator:
    """Drive the monitors of one run for a front door; see the module docstring for what it owns.

    Args:
        monitors: core monitors or names among :data:`MONITOR_NAMES`; None: all four.
        sinks: where published values go (:class:`Sink`); more can be added to :attr:`sinks`.
        reducer: distributed reductions; default ``torch.distributed`` when initialized.
        strict: raise a ``HeadwatchError`` when a monitor fails instead of warning once and skipping it.
        prefix: first component of every metric name.
        batch_format: how batches are read (default :class:`~headwatch.model.batch.BatchFormat`).

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
    ) -> None:
        check_prefix(prefix)
        check_bool("strict", strict)
        check_optional(check_instance, "reducer", reducer, Reducer, "a headwatch.core.Reducer")
        check_optional(check_instance, "batch_format", batch_format, BatchFormat)
        check_sequence("sinks", sinks, "objects with a publish(numbers, media, step, val) method", lambda s: isinstance(s, Sink))
        self.monitors = build_monitors(monitors, batch_format, prefix)  # checks `monitors`
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
        self._started = False  # the current micro-batch's first training forward was seen

    # ---------------------------------------------------------------- wiring
    def configure(self, every: int, reducer: Reducer | None = None, figure_every_n_steps: int | str | None = None) -> None:
        """Each monitor measures every ``every_factor * every`` steps (0: never); ``figure_every_n_steps`` for
        the monitors built from names (None: leave them)."""
        check_int("every", every, minimum=0)
        if reducer is not None:
            self.reducer = reducer
        for m in self.monitors:
            m.configure(Schedule(m.every_factor * every), self.reducer)
        if figure_every_n_steps is not None:
            set_figures(self.named, figure_every_n_steps)

    def attach(self, model: nn.Module, root: nn.Module | None = None) -> None:
        """Resolve every monitor's modules in ``model`` (hooks); ``root``: the model as the engine wraps it.

        Under FSDP1 or DeepSpeed ZeRO-3 the matrices are gathered whole while resolving (a collective:
        every process calls this at the same point). Raises what the monitors' ``attach`` raises.
        """
        root = model if root is None else root
        with whole_matrices(root, model):
            for m in self.monitors:
                m.root = root  # FSDP1: summoned from on logging steps
                m.attach(unwrapped(model))  # FSDP1: the inner model's names (no `_fsdp_wrapped_module.`)

    def detach(self) -> None:
        """Remove every monitor's hooks (their state stays)."""
        for m in self.monitors:
            m.detach()

    def each(self, where: str, call: Callable[[Monitor], Any], monitors: Sequence[Monitor] | None = None) -> list[Monitor]:
        """``call(m)`` for every monitor; a failure warns once and is skipped (raises when strict). Returns those that failed."""
        failed = []
        for m in self.monitors if monitors is None else monitors:
            try:
                call(m)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                m.fail(err, where)
                failed.append(m)
        return failed

    def warn_once(self, key: str, message: str) -> None:
        """A warning about the run, once (through the first monitor's warn-once record)."""
        if self.monitors:
            self.monitors[0].warn_once(key, message)

    def fail(self, err: Exception, where: str) -> None:
        """A failure of the run's publishing or state: the first monitor's failure policy."""
        if self.monitors:
            self.monitors[0].fail(err, where)

    # ---------------------------------------------------------------- training
    def due(self, step: int, first: bool = False) -> list[Monitor]:
        """The monitors that measure step ``step``; ``first``: the door also logs step 0 (``logging_first_step``)."""
        return [m for m in self.monitors if m.schedule.is_logging_step(step) or (first and step == 0)]

    def begin_step(self, step: int, first: bool = False) -> None:
        """A training step starts (before its first micro-batch): fixes which monitors measure it."""
        self.step, self._started = step, False
        self.logging = self.due(step, first)

    def step_start(self, batch: Any, step: int | None = None) -> None:
        """A (micro-)batch of the current step starts (before its forward)."""
        if step is not None and step != self.step:
            self.begin_step(step)
        s = self.step if self.step is not None else 0
        self.each("starting a batch", lambda m: m.step_start(batch, s, m in self.logging))

    def forward(self, batch: Any, training: bool) -> None:
        """A model forward with ``batch`` (the door's forward pre-hook): decides what it is.

        In a training step, the first training forward of a micro-batch starts it; a second training
        forward of the same micro-batch (a trainer that computes the loss from a second pass) ends the
        first's capture. Outside a training step, an evaluation forward is a validation batch.
        """
        if training and self.step is not None:
            if self._started:
                self.each("ending the batch", lambda m: m.batch_end())
                return
            self._started = True
            self.step_start(batch)
        elif self.step is None and not training:
            self.each("starting a validation batch", lambda m: m.validation_batch_start(batch))

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
        due, self.logging, self.step = self.logging, [], None
        return self.emit(due, step if step is not None else 0)

    def epoch_end(self, step: int, at: int | None = None) -> dict[str, float]:
        """The training epoch ended at step ``step``: publish the monitors that measure at epoch ends (at
        step ``at``, default ``step``: the door's x axis)."""
        if step < 0:
            return {}
        due = [m for m in self.monitors if m.train_epoch_end(step)]
        return self.emit(due, step if at is None else at)

    # ---------------------------------------------------------------- validation
    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        self.each("starting a validation batch", lambda m: m.validation_batch_start(batch, dataloader_idx))

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        self.each("ending a validation batch", lambda m: m.validation_batch_end(dataloader_idx))

    def validation_end(self, step: int, monitors: Sequence[Monitor] | None = None) -> dict[str, float]:
        """An evaluation ended: publish its values (every rank: a collective)."""
        return self.emit(list(self.monitors if monitors is None else monitors), step, val=True)

    # ---------------------------------------------------------------- publishing
    def compute(self, due: Sequence[Monitor], val: bool = False) -> tuple[dict[str, float], list[Monitor]]:
        """Compute ``due`` on every rank (a collective; a monitor failing anywhere is dropped everywhere), then
        move the values and histograms to the host in one transfer and tell the monitors. Returns
        ``(numbers, monitors published)``."""
        if not due:
            return {}, []
        scalars, ok = compute_due(list(due), self.reducer, val)
        if not ok:
            return {}, []
        try:
            numbers = to_host(scalars, [m.media for m in ok])
        except Exception as err:  # noqa: BLE001
            ok[0].fail(err, "moving the values to the host")
            return {}, []
        self.each("publishing the values", lambda m: m.published(numbers), ok)
        return numbers, ok

    def emit(self, due: Sequence[Monitor], step: int, val: bool = False) -> dict[str, float]:
        """:meth:`compute`, then every sink once; a sink that fails warns once (raises when strict)."""
        numbers, ok = self.compute(due, val)
        if not ok:
            return {}
        self.latest.update(numbers)
        media = [m.media for m in ok]
        for sink in self.sinks:
            try:
                sink.publish(numbers, media, step, val)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                self.sink_failed(sink, err)
        return numbers

    def sink_failed(self, sink: Any, err: Exception) -> None:
        """A sink could not write: raise when strict, else warn once per sink; the values were computed and
        are still returned and kept in :attr:`latest`."""
        where = type(sink).__name__
        if any(m.strict for m in self.monitors):
            raise HeadwatchError(f"headwatch could not publish through {where}: {type(err).__name__}: {err}") from err
        self.warn_once(
            f"sink:{where}",
            f"headwatch could not publish through {where} ({type(err).__name__}: {err}); training goes on, the values "
            "are still returned and kept in `.latest`. Pass strict=True to raise instead. (warned once)",
        )

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Every monitor's state (a collective under several processes: call it on every rank)."""
        return {"monitors": [m.state_dict() for m in self.monitors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for m, s in zip(self.monitors, state.get("monitors", [])):
            m.load_state_dict(s)
