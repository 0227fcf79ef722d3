"""The core monitor protocol: trainer-free, driven by a front door (Lightning, Hugging Face, a plain loop)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.errors import HeadwatchError, StateError, StateReader, check_bool, check_instance, check_optional, check_prefix
from headwatch.model.batch import BatchFormat
from headwatch.distributed.reduce import NoReducer, Part, Reducer, Values, check_part, collective_device, reduce_step
from headwatch.core.overhead import NO_CLOCK, OverheadClock
from headwatch.core.schedule import Schedule


FAILED_ELSEWHERE = HeadwatchError(
    "it failed on another process (whose warning is not shown: warnings come from rank zero); "
    "its values of this step are dropped on every process"
)
"""The error a process that succeeded reports when the same measurement failed on another one."""
FAILED_ELSEWHERE.warn_key = "failed_elsewhere"  # type: ignore[attr-defined]  # said once per monitor, wherever


class StepFailed(HeadwatchError):
    """Raised by :meth:`Monitor.local_sums` when this step's measurement already failed on this process and was said
    then (``where``: what it was doing): :func:`compute_due` drops the monitor on every process without saying it again."""


@dataclass
class Media:
    """What a measurement produced besides scalars; written by rank zero only."""

    histograms: dict[str, Tensor] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    """tag -> ``matplotlib.figure.Figure``."""
    host: dict[str, Tensor] = field(default_factory=dict)
    """Tensors the monitor reads on the host in :meth:`Monitor.published` (per-row results, ids): moved in
    the logging step's one transfer with the histograms, their dtype and shape kept; never published."""


class FailurePolicy:
    """The one failure policy of headwatch (monitors, the orchestrator, the Lightning alert).

    A failure to measure or publish warns once per cause, on rank zero, is counted in
    :attr:`failures` and training goes on; with ``strict`` it raises a :class:`HeadwatchError`
    naming the class, what it was doing and the cause.
    """

    strict: bool = False
    failures: int = 0

    @property
    def rank(self) -> int:
        """This process's rank (warnings are said on rank zero only)."""
        return 0

    @property
    def _warned(self) -> set[str]:
        """The keys and messages already said."""
        return self.__dict__.setdefault("_warned_keys", set())

    @_warned.setter
    def _warned(self, value: set[str]) -> None:
        self.__dict__["_warned_keys"] = value

    def warn_once(self, key: str, message: str) -> None:
        """Warn once per object and key, on rank zero; with ``strict``, raise a :class:`HeadwatchError` with the
        message instead (on every rank: strict raises wherever the default would warn)."""
        if self.strict:
            raise HeadwatchError(message)
        if key in self._warned:
            return
        self._warned.add(key)
        if self.rank == 0:
            warnings.warn(message, UserWarning, stacklevel=2)

    def note_once(self, key: str, message: str) -> None:
        """Warn once per object and key, on rank zero, even with ``strict``: a note on what is measured and how
        (not a limitation; nothing to raise about)."""
        if key in self._warned:
            return
        self._warned.add(key)
        if self.rank == 0:
            warnings.warn(message, UserWarning, stacklevel=2)

    def info_once(self, message: str) -> None:
        """Say ``message`` once per object (``logging`` at INFO, logger ``headwatch``), on rank zero."""
        if message in self._warned:
            return
        self._warned.add(message)
        if self.rank == 0:
            import logging

            logging.getLogger("headwatch").info(message)

    def fail(self, err: Exception, where: str) -> None:
        """A measurement failed: raise when ``strict``, else warn once, count it and go on."""
        label = type(self).__name__
        if self.strict:
            raise HeadwatchError(f"{label} failed while {where}: {type(err).__name__}: {err}") from err
        self.failures += 1
        self.warn_once(
            getattr(err, "warn_key", f"fail:{where}"),  # one cause met at several places: said once
            f"{label} failed while {where} ({type(err).__name__}: {err}); training goes on and "
            "this measurement is skipped. Pass strict=True to raise instead. (warned once)",
        )

    def attempt(self, call: Callable[[], Any], where: str, quiet: bool = False) -> None:
        """``call()``; a failure follows this policy (:meth:`fail`), or with ``quiet`` (the run is already failing:
        a trainer's exception hook) is dropped, never raised over the run's own exception, even when strict."""
        try:
            call()
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            if not quiet:
                self.fail(err, where)


    def restore(self, state: Any, read: Callable[[StateReader], Callable[[], None]], versions: tuple[int, ...] = (1,)) -> bool:
        """Load a checkpoint state through ``read``, which checks every value (a :class:`StateReader`) and returns
        the assignment to make; an invalid state changes nothing checked, restarts this object from its empty state
        (``read`` of an empty state) with one warning naming the part and the reason, and the resume goes on.
        ``strict``: raise the :class:`StateError` instead. Returns whether ``state`` was valid."""
        part = type(self).__name__
        try:
            apply = read(StateReader(state, part, versions))
            valid = True
        except StateError as err:
            if self.strict:
                raise
            self.warn_once(
                f"state:{part}",
                f"headwatch: the checkpoint's {part} state is not valid ({err}); {part} restarts from empty and the "
                "resume goes on. Pass strict=True to raise instead. (warned once)",
            )
            apply = read(StateReader({}, part, versions))
            valid = False
        apply()
        return valid


class Monitor(FailurePolicy):
    """Base of the trainer-free monitors. See ``docs/core.md`` for the call order.

    A front door calls, per training step ``s`` (its logging x axis):

    - :meth:`step_start` ``(batch, step, logging)`` before each (micro-)batch's forward;
    - :meth:`gradients_ready` once gradients are final (after accumulation, after AMP unscaling);
    - :meth:`optimizer_stepped` after the optimizer step;
    - :meth:`batch_end` after each (micro-)batch;
    - :meth:`compute` at the end of a logging step, on every rank (a collective); it returns
      scalars and leaves histograms/texts/figures in :attr:`media`. A monitor with sums implements it in
      two phases, so that :func:`compute_due` reduces every monitor's sums of the step together (one
      ``all_reduce`` per dtype): :meth:`local_sums` (this process's, no collective), then
      :meth:`from_sums` (the scalars from the sums over every process); :meth:`empty_sums` is the layout
      a process where :meth:`local_sums` failed contributes instead.

    Validation: :meth:`validation_batch_start`, :meth:`validation_batch_end`,
    :meth:`validation_epoch_end` (returns scalars, a collective).

    Failures to measure warn once and are counted (``failures``) unless ``strict``.
    """

    name = "monitor"
    """Short name used in messages."""
    every_factor = 1
    """Default schedule: this many times the engine's logging interval."""
    probe = False
    """A probe (a costly measurement, the collision search): under an overhead budget it measures on the run's probe
    steps (:class:`~headwatch.core.overhead.Overhead`) instead of its own schedule."""
    every_n_steps: int | None = None
    """The user's own interval in steps for a probe (set on the object): it wins over the budget's probe steps."""
    clock: OverheadClock = NO_CLOCK
    """The run's overhead clock (set by the orchestrator): the monitor's work is timed as ``probe`` or ``statistics``."""

    def timed(self, measuring: bool = False) -> Any:
        """Context: the work inside is timed on :attr:`clock` as ``probe`` for a probe's measurement (``measuring``),
        else as the kind around it (``statistics`` when none)."""
        return self.clock.kind("probe" if measuring and self.probe else None)
    validation_media = False
    """Whether an evaluation's publication carries this monitor's media (its own validation histograms); else
    only its values are published at an evaluation (its media are those of its last training measurement)."""

    def __init__(self, prefix: str = "headwatch", strict: bool = False, batch_format: BatchFormat | None = None) -> None:
        self.prefix = check_prefix(prefix)
        self.strict = check_bool("strict", strict)
        self.batch_format = check_optional(check_instance, "batch_format", batch_format, BatchFormat) or BatchFormat()
        self.reducer: Reducer = NoReducer()
        self.schedule = Schedule(0)
        self.model: nn.Module | None = None
        self.root: nn.Module | None = None
        """The model as the engine wraps it (FSDP1's ``FullyShardedDataParallel`` root), when it is
        not the attached model; :meth:`full_matrices` summons from it. None: the attached model."""
        self.media = Media()
        self.failures = 0
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ wiring
    def configure(self, schedule: Schedule | None = None, reducer: Reducer | None = None) -> None:
        """Set the schedule and the reducer (front doors call this before :meth:`attach`)."""
        if schedule is not None:
            self.schedule = schedule
        if reducer is not None:
            self.reducer = reducer

    def attach(self, model: nn.Module) -> None:
        """Resolve the modules to watch in ``model`` and register hooks; idempotent for the same model."""
        self.model = model

    def detach(self) -> None:
        """Remove every hook; the monitor keeps its state."""
        self.model = None

    def full_matrices(self, modules: list[nn.Module | None] | None, with_grads: bool = False) -> Any:
        """Context: ``modules``' full weights (and gradients) under FSDP1, a no-op otherwise (:mod:`headwatch.distributed.fsdp1`).

        A collective under FSDP1: enter it on every process at the same point.
        """
        from headwatch.distributed.fsdp1 import full_matrices

        return full_matrices(self.root if self.root is not None else self.model, modules, with_grads)

    # ------------------------------------------------------------------ training
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        """A (micro-)batch of step ``step`` starts; ``logging``: this step is measured."""

    def gradients_ready(self, loss_scale: float | Tensor | None = None) -> None:
        """Gradients are final for this step; ``loss_scale``: the AMP scale the backward ran with."""

    def optimizer_stepped(self) -> None:
        """The optimizer stepped (weights changed)."""

    def batch_end(self) -> None:
        """A (micro-)batch ended (forward and backward done)."""

    def compute(self) -> dict[str, Tensor]:
        """Scalars of the logging step just completed, full names; a collective. Resets per-step state.

        By default :meth:`from_sums` of :meth:`local_sums` summed over processes: by :func:`compute_due` with every
        other monitor's sums of the step (:attr:`reduced_sums`), else here (:func:`reduce_step`).
        """
        return self._reduced(False)

    def local_sums(self, val: bool = False) -> dict[str, Tensor | Values]:
        """Phase one of :meth:`compute` (``val``: of :meth:`validation_epoch_end`): this process's sums of the step
        (name -> tensor, summed element-wise over processes) and per-position :class:`Values` (concatenated over
        processes), with no collective and no host sync; every process gives the same names, shapes and dtypes
        (:meth:`empty_sums` plus what it measured). Hands the step's sums over: the accumulators start again."""
        return self.empty_sums(val)

    def empty_sums(self, val: bool = False) -> dict[str, Tensor | Values]:
        """The layout of :meth:`local_sums` with nothing measured (zeros; empty values): what a process where
        :meth:`local_sums` failed contributes, so that every process runs the same collectives."""
        return {}

    def from_sums(self, total: dict[str, Tensor], val: bool = False) -> dict[str, Tensor]:
        """Phase two: the scalars (full names) from :meth:`local_sums` summed over every process (``total``: the same
        names; values concatenated). Runs on every process; the collectives that cannot ride with the sums
        (gathers of row-sharded matrices, ``docs/distributed.md``) happen here, in the same order everywhere."""
        return {}

    def skip_sums(self, val: bool = False) -> None:
        """The step's values are dropped before :meth:`from_sums` (:meth:`local_sums` failed here or on another
        process): empty what the step accumulated and what :meth:`local_sums` kept, as :meth:`from_sums` would."""

    reduced_sums: dict[str, Tensor] | None = None
    """Set by :func:`compute_due` while it calls :meth:`compute`: this step's :meth:`local_sums`, already summed over
    processes with every other monitor's. None: :meth:`compute` takes and reduces them itself."""

    def _reduced(self, val: bool) -> dict[str, Tensor]:
        total, self.reduced_sums = self.reduced_sums, None
        if total is None:
            part = self.local_sums(val)
            total = reduce_step([part], self.reducer)[0][0] if part else {}
        return self.from_sums(total, val)

    def published(self, numbers: dict[str, float]) -> None:
        """The front door published these values (as floats, after its one host sync): warnings, totals."""

    def withheld(self, numbers: dict[str, float]) -> dict[str, str]:
        """Names of this step's figures to withhold, with the cause, decided from ``numbers`` (the step's values on the
        host, before they are published). Read only values reduced over processes (the same on every rank): every
        rank then withholds the same figures (the key-set rule). Default: none."""
        return {}

    def train_epoch_end(self, step: int) -> bool:
        """The training epoch ended at step ``step``; True when the monitor wants a :meth:`compute` now."""
        return False

    # ------------------------------------------------------------------ validation
    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        """A validation batch starts."""

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        """A validation batch ended."""

    def validation_epoch_end(self) -> dict[str, Tensor]:
        """Scalars of the validation epoch (a collective); two phases as :meth:`compute`."""
        return self._reduced(True)

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the state of a run (a new run starts with the same object): what :meth:`load_state_dict`
        restores, set to its empty value, and the measurement in progress dropped. The warnings already
        said are not said again. Subclasses that accumulate outside their state dict extend it."""
        self.load_state_dict({})
        self.media = Media()

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "failures": self.failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values, each checked; an invalid state restarts from empty (see :meth:`restore`)."""

        def read(r: StateReader) -> Callable[[], None]:
            failures = r.count("failures")
            return lambda: setattr(self, "failures", failures)

        self.restore(state_dict, read)

    # ------------------------------------------------------------------ failure policy
    @property
    def rank(self) -> int:
        return self.reducer.rank

    def agree(self, ok: bool, where: str) -> bool:
        """Whether the measurement succeeded on every process (a collective with several processes).

        A process where it succeeded but failed elsewhere says so once (the failing process's own
        warning is not shown: warnings come from rank zero), so every rank drops the same values.
        """
        if self.reducer.world_size <= 1:
            return ok
        everywhere = self.reducer.all(ok)
        if ok and not everywhere:
            self.fail(FAILED_ELSEWHERE, where)
        return everywhere


@contextmanager
def whole_matrices(root: nn.Module, model: nn.Module) -> Iterator[None]:
    """Inside, the vocabulary-sized matrices are whole, for a front door to :meth:`Monitor.attach` (resolve) them.

    FSDP1 units that hold them are summoned from ``root`` (the model as the engine wraps it,
    :mod:`headwatch.distributed.fsdp1`); DeepSpeed ZeRO-3 Parameters of ``model`` are gathered
    (:mod:`headwatch.distributed.zero`). A collective under either (every process enters it); a no-op otherwise.
    """
    from headwatch.distributed.fsdp1 import full_matrices
    from headwatch.distributed.zero import gathered

    with gathered(model), full_matrices(root, None):
        yield


def compute_due(
    due: list[Monitor], reducer: Reducer, val: bool = False, also: list[dict[str, Tensor]] | None = None
) -> tuple[dict[str, Tensor], list[Monitor]]:
    """``compute()`` (or ``validation_epoch_end()`` with ``val``) of every monitor in ``due``, on every rank.

    The sums of every monitor of the step travel together (:func:`~headwatch.distributed.reduce.reduce_step`):

    1. each monitor's :meth:`~Monitor.local_sums` (no collective; a failure contributes :meth:`~Monitor.empty_sums`);
    2. one ``all_reduce`` per dtype of every sum, the local failures with them, then one ``all_gather`` per dtype of
       the per-position values; a monitor that failed on any process is dropped on every process here
       (:meth:`~Monitor.skip_sums`);
    3. each monitor's ``compute()`` (``validation_epoch_end()``), in order: :class:`Monitor`'s own makes its values
       from the sums of step 2 (:meth:`~Monitor.from_sums`); an override that calls it gets them too (an override
       that does not makes its own reductions here, and the sums its ``local_sums`` handed over are not used);
    4. one ``all_reduce`` of a failure flag per monitor: a monitor whose step 3 failed on any process is dropped on
       every process, so that every rank publishes the same keys.

    A monitor that raises warns once (``Monitor.fail``; raises when strict). ``also``: further sums (name ->
    tensor, the same layout on every process: the self-check's) reduced with the monitors' in step 2; each dict
    is replaced in place by its sums over processes. One process: no collective. Returns ``(scalars, monitors to
    publish)`` (with ``val``, those that returned values).
    """
    parts: list[Part] = []
    failed: list[Monitor] = []
    for m in due:
        try:
            with m.timed(measuring=True):
                part = m.local_sums(val)
            check_part(part)
            parts.append(part)
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            if not isinstance(err, StepFailed):  # StepFailed: said when it failed
                m.fail(err, "computing the statistics")
            failed.append(m)
            parts.append(_empty(m, val))
    extra = list(also or [])
    totals, anywhere = reduce_step(parts + extra, reducer, [m in failed for m in due] + [False] * len(extra))
    for given, total in zip(extra, totals[len(due) :]):
        given.clear()
        given.update(total)
    _dropped_elsewhere([m for m, f in zip(due, anywhere) if f], failed)
    for m in failed:
        try:
            m.skip_sums(val)
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            m.fail(err, "dropping the step's values")
    scalars: dict[Monitor, dict[str, Tensor]] = {}
    late: list[Monitor] = []
    for m, total in zip(due, totals):
        if m in failed:
            continue
        m.reduced_sums = total  # for Monitor.compute / validation_epoch_end, called now
        try:
            with m.timed(measuring=True):
                scalars[m] = m.validation_epoch_end() if val else m.compute()
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            m.fail(err, "computing the statistics")
            late.append(m)
        finally:
            m.reduced_sums = None
    computed = [m for m in due if m not in failed]
    if reducer.world_size > 1 and computed:
        flags = torch.zeros(len(computed), dtype=torch.long, device=_device(scalars, totals))
        for i, m in enumerate(computed):
            if m in late:
                flags[i] = 1  # a fill, not a copy
        _dropped_elsewhere([m for m, n in zip(computed, reducer.sum(flags).tolist()) if n > 0], late)
    failed += late
    # validation: a monitor without values keeps the media of its last training measurement (not published)
    ok = [m for m in due if m not in failed and (scalars[m] or not val)]
    return {k: v for m in ok for k, v in scalars[m].items()}, ok


def _empty(m: Monitor, val: bool) -> Part:
    """``m.empty_sums(val)``; nothing when even that fails (the same on every process: a layout is configuration)."""
    try:
        part = m.empty_sums(val)
        check_part(part)
        return part
    except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
        m.fail(err, "computing the statistics")
        return {}


def _dropped_elsewhere(anywhere: list[Monitor], failed: list[Monitor]) -> None:
    """Monitors that failed on another process (``anywhere`` minus this process's ``failed``) say so once and are
    added to ``failed``."""
    for m in anywhere:
        if m not in failed:
            m.fail(FAILED_ELSEWHERE, "computing the statistics")
            failed.append(m)


def _device(scalars: dict[Monitor, dict[str, Tensor]], sums: list[dict[str, Tensor]]) -> torch.device:
    """The device of the step's tensors (where the failure flags are reduced), else where collectives run."""
    for values in (*scalars.values(), *sums):
        for v in values.values():
            if isinstance(v, Tensor):
                return v.device
    return collective_device()


def to_floats(scalars: dict[str, Tensor | float]) -> dict[str, float]:
    """Scalars (tensors on any device, or numbers) as Python floats with one host sync."""
    if not scalars:
        return {}
    devices = [v.device for v in scalars.values() if isinstance(v, Tensor) and v.device.type != "cpu"]
    device = devices[0] if devices else torch.device("cpu")
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in scalars.values()])
    return dict(zip(scalars, stacked.tolist()))  # the one host sync of a logging step
