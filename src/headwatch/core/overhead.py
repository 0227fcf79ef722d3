"""The overhead budget: headwatch times its own work and spaces its probes to stay within a share of wall time.

- :class:`OverheadClock` times headwatch's work by kind (:data:`KINDS`), nested kinds counted once (in the
  innermost). On a GPU each span is a pair of ``torch.cuda.Event`` recorded without a sync and read at the next
  logging step, after that step's one transfer (the events are complete by then); a span costs the longer of its
  device time and its host time. On a CPU: ``time.perf_counter``.
- :func:`probe_interval`: the smallest power of two ``m`` such that the amortised cost of the logging statistics
  at the logging interval and of a probe every ``m`` logging intervals stays within the budget.
- :class:`Overhead`: the run's clock, budget and probe schedule, driven by the
  :class:`~headwatch.core.orchestrator.Orchestrator`. Its decisions read only values reduced over processes (the
  timings of the last window ride with the logging step's sums: no collective of its own), so every rank probes
  on the same steps.

Definitions: ``docs/definitions.md`` (Overhead).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError

KINDS = ("statistics", "probe", "figures", "publish")
"""What headwatch's work is timed as: the logging statistics (every logging step), the probes (the collision
measurement), the figures and histograms, the publishing (host transfer and sinks)."""
MAX_MULTIPLE = 1024
"""The longest probe interval, in logging intervals."""
FIRST_MULTIPLE = 8
"""The probe interval, in logging intervals, until a cost was measured (about the former collision cadence of 10)."""
SHRINK_MARGIN = 4
"""The interval halves only when a quarter of it would fit the budget: intervals change rarely."""
MAX_PROBE_SECONDS = 86400.0
"""A probe's cost read from a checkpoint is at most a day: a larger one is a damaged state, not a measurement (it
would keep the probes at the longest interval until the next probe measured again)."""
NOTE_WINDOWS = 3
"""The windows whose statistics must all exceed the budget before the note says so (and the smallest share is said)."""
WINDOW = ("statistics", "probe", "wall", "probed")
"""The timings of one window between logging steps that ride with the step's sums (seconds; ``probed``: 1 when
the window held a probe). The process's budget and its square ride after them (:meth:`Overhead.shared`)."""


def check_budget(value: Any) -> float | None:
    """``overhead_budget``: None (off) or a fraction of training wall time in (0, 1), a real number of any type (a
    Python or numpy float), returned as a Python float.

    Raises:
        HeadwatchError: anything else (0, 1, out of range, NaN, infinite, a bool, a string, a tensor).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < 1:  # numpy's floats too
        raise HeadwatchError(f"`overhead_budget` must be None or a float in (0, 1) (a fraction of wall time), got {value!r}")
    return float(value)


def agree_budgets(budgets: Sequence[float | None], rank: int) -> None:
    """Every process's ``overhead_budget`` (by rank, gathered at start-up with the logging interval:
    :meth:`~headwatch.core.self_check.SelfCheck.agree_interval`), read by process ``rank``. Budgets that differ are
    kept (every process spaces the probes by their mean: :meth:`Overhead.shared`); a budget on some processes and
    None on others is refused: their logging steps would measure different monitors, so the steps' sums would differ
    in layout (gloo aborts, NCCL hangs) before any shared value could say so.

    Raises:
        HeadwatchError: some budgets are None and others not (on every process alike, marked ``strict``: the run is
            misconfigured, not a monitoring failure).
    """
    if len({b is None for b in budgets}) > 1:
        error = HeadwatchError(
            f"headwatch: overhead_budget is set on some processes and None on others (by rank: "
            f"{', '.join(repr(b) for b in budgets)}; this process, rank {rank}: {budgets[rank]!r}); their logging "
            "steps would probe differently and the run would abort at the first one. Pass the same overhead_budget "
            "on every process (None on all of them turns the budget off)."
        )
        error.strict = True  # type: ignore[attr-defined]
        raise error


def probe_interval(
    statistics: float, probe: float, step_seconds: float, every: int, budget: float, fixed: float = 0.0
) -> tuple[int, bool]:
    """The smallest power of two ``m`` (1 to :data:`MAX_MULTIPLE`) with
    ``statistics / every + fixed + probe / (m * every) <= budget * step_seconds``.

    Args:
        statistics: seconds of headwatch's work per logging step, probes excluded.
        probe: seconds of one probe (its figures included).
        step_seconds: wall seconds of one training step.
        every: the logging interval (steps).
        budget: the fraction of wall time headwatch may take.
        fixed: seconds per step already promised (the first probe, the end-of-training probes of the run's earlier
            segments and its own, amortised over the steps so far: :meth:`Overhead.decide`).

    Returns:
        ``(m, fits)``: ``fits`` is False when even :data:`MAX_MULTIPLE` is over the budget (then ``m`` is it).
    """
    allowed = budget * step_seconds - statistics / every - fixed
    m = 1
    while m < MAX_MULTIPLE and probe / (m * every) > allowed:
        m *= 2
    return m, probe / (m * every) <= allowed


def steady_interval(current: int, needed: int) -> int:
    """The next probe interval (logging intervals) from the ``current`` one and the one the budget ``needed``
    (:func:`probe_interval`): up at once when over budget; down by one halving only when ``needed`` is at most
    ``current / SHRINK_MARGIN``; else unchanged."""
    if needed > current:
        return needed
    if needed * SHRINK_MARGIN <= current:
        return max(1, current // 2)
    return current


class OverheadClock:
    """Times headwatch's work by kind (:data:`KINDS`); :meth:`kind` spans nest, the inner kind's time is not also
    the outer's. Spans are read by :meth:`read` after a host sync (the logging step's one transfer)."""

    def __init__(self) -> None:
        self._stack: list[list[Any]] = []  # [kind, start mark]
        self._spans: list[tuple[str, Any, Any]] = []
        self.seconds = dict.fromkeys(KINDS, 0.0)
        """Seconds read so far by kind (:meth:`read`); :meth:`take` empties them."""
        self.on_idle: Any = None
        """Called (no arguments) each time the outermost span ends: headwatch's work of the moment is over."""

    @staticmethod
    def _mark() -> tuple[float, Any]:
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # no host sync: read at the next logging step
        return time.perf_counter(), event

    @contextmanager
    def kind(self, name: str | None) -> Iterator[None]:
        """Inside, headwatch's work is counted as ``name`` (one of :data:`KINDS`; None: the kind around it, else
        ``statistics``)."""
        if name is None:
            name = self._stack[-1][0] if self._stack else "statistics"
        start = self._mark()
        if self._stack:
            outer = self._stack[-1]
            self._spans.append((outer[0], outer[1], start))
        self._stack.append([name, start])
        try:
            yield
        finally:
            end = self._mark()
            k, began = self._stack.pop()
            self._spans.append((k, began, end))
            if self._stack:
                self._stack[-1][1] = end
            elif self.on_idle is not None:
                self.on_idle()

    def read(self) -> None:
        """Add the spans that are complete to :attr:`seconds` (call after a host sync: no sync here)."""
        left = []
        for k, (h0, e0), (h1, e1) in self._spans:
            if e0 is not None and e1 is not None and not e1.query():
                left.append((k, (h0, e0), (h1, e1)))
                continue
            device = e0.elapsed_time(e1) / 1e3 if e0 is not None and e1 is not None else 0.0
            self.seconds[k] += max(h1 - h0, device)
        self._spans = left

    def take(self) -> dict[str, float]:
        """The seconds read since the last call, by kind."""
        out, self.seconds = self.seconds, dict.fromkeys(KINDS, 0.0)
        return out


class _NoClock(OverheadClock):
    """The clock of a run without a budget: times nothing."""

    @contextmanager
    def kind(self, name: str | None) -> Iterator[None]:
        yield

    def read(self) -> None:
        pass


NO_CLOCK = _NoClock()


class Overhead:
    """The run's overhead budget and probe schedule (``budget`` None: off, nothing timed or published).

    Probe steps (the probe monitors, ``Monitor.probe``, measure; figures and histograms are kept): the run's first
    logging step, then every ``multiple * every`` steps (``(step + 1) % (multiple * every) == 0``), and the end of
    training (:meth:`Orchestrator.end_run`). A probe monitor with its own cadence (``Monitor.every_n_steps``, or an
    ``every_factor`` set on it) keeps it, with one note when it exceeds the budget.
    """

    def __init__(self, budget: float | None, prefix: str) -> None:
        self.budget = check_budget(budget)
        self.prefix = prefix
        self.clock: OverheadClock = OverheadClock() if self.budget is not None else NO_CLOCK
        if self.budget is not None:
            self.clock.on_idle = self.settle
        self.every = 0
        self.multiple = FIRST_MULTIPLE
        """The probe interval in logging intervals (a power of two)."""
        self.figures: list[Any] = []
        """Monitors whose figures follow the probe steps (their figure interval is set to the probe interval)."""
        self.probed_at: int | None = None
        """The last step probed (the end of training probes unless it was one)."""
        self.first: int | None = None
        self.fits = True
        self.monitors: list[Any] = []
        self.policy: Any = None
        """Says the notes (``note_once(key, message)``, ``info_once(message)``: a ``FailurePolicy``); None: silent."""
        self.door_interval = "the logging interval"
        """How the door names its logging interval (in the note that it alone exceeds the budget)."""
        self.said: set[str] = set()
        """The notes' keys said already (:meth:`_say`)."""
        self.warn_statistics = False
        """Say that the logging statistics alone exceed the budget as a warning (the Hugging Face door, whose
        ``logging_steps`` is kept as the user's trainer has it); else at INFO (logger ``headwatch``)."""
        self.reset()

    @property
    def on(self) -> bool:
        return self.budget is not None

    def reset(self) -> None:
        """A new run: the clock's timings, the window and the interval start again."""
        self.clock.take()
        self.agreed = self.budget
        """The budget the decisions use: this process's, or the mean over processes when theirs differ."""
        self.multiple, self.probed_at, self.first, self.fits = FIRST_MULTIPLE, None, None, True
        self.step: int | None = None
        """The step that began last (0-based, the run's own count: a resumed run goes on counting)."""
        self.shares: list[float] = []
        """The logging statistics' share of the last windows (:meth:`notes`)."""
        self.window = [0.0] * len(WINDOW)  # this process's last window read, ridden with the next logging step's sums
        self.started: float | None = None
        self.window_start: float | None = None
        self.run_seconds = [0.0, 0.0]  # headwatch's seconds, wall seconds
        self.run_probe_seconds = 0.0
        """The probes' share of ``run_seconds[0]`` (the first, periodic and end probes, their figures included)."""
        self.probe_seconds = 0.0
        self.segment_ends = 0
        """The end-of-training probes of the run's earlier segments (each resume from a checkpoint counts one: the
        segment that saved it ended with one, unless killed; an upper bound), reserved for in :meth:`decide`."""
        self.probing = False
        self.last: dict[str, float] = {}
        self.last_probe = 0.0
        self.closing: list[float] | None = None
        """The window a logging step closes (:meth:`publishable`), until its step's work is over (:meth:`settle`)."""
        self.closed_at = 0.0
        self.closed = 0
        """Windows completed in the run."""
        self.ended = False
        """Training ended (:meth:`ends`): headwatch's later work joins the run's totals."""

    def state_dict(self) -> dict[str, Any]:
        """The probe schedule of the run (the same on every rank): a resumed run probes on the steps it would have;
        and the run's totals (``run``: headwatch's seconds, wall seconds, the probes' seconds; the saving process's),
        so that a resumed run's ``fraction_run`` and ``probe_fraction_run`` go on over the whole run; and ``ends``,
        the end-of-training probes of the run's segments before this one (:attr:`segment_ends`)."""
        run = [float(self.run_seconds[0]), float(self.run_seconds[1]), float(self.run_probe_seconds)]
        state = {"multiple": self.multiple, "probe_seconds": self.probe_seconds, "first": self.first, "run": run}
        return {**state, "ends": self.segment_ends}

    def load_state_dict(self, state: Any) -> str | None:
        """Restore :meth:`state_dict` (None, a checkpoint from before the budget: nothing); returns the problem of an
        invalid state (then nothing is restored), else None."""
        if state is None:
            return None
        keys = {"multiple", "probe_seconds", "first"}
        ok = isinstance(state, dict) and set(state) in (keys, keys | {"run"}, keys | {"run", "ends"})  # older: fewer
        m, seconds, first = (state.get("multiple"), state.get("probe_seconds"), state.get("first")) if ok else (0, 0, 0)
        run = state.get("run", [0.0, 0.0, 0.0]) if ok else None
        ok = ok and isinstance(run, list) and len(run) == 3 and all(type(v) is float and math.isfinite(v) for v in run)
        ok = ok and 0 <= run[2] <= run[1] and 0 <= run[0] <= run[1]
        ok = ok and isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= MAX_MULTIPLE and m & (m - 1) == 0
        ok = ok and isinstance(seconds, float) and math.isfinite(seconds) and 0 <= seconds <= MAX_PROBE_SECONDS
        ok = ok and (first is None or (isinstance(first, int) and not isinstance(first, bool) and first >= 0))
        ends = state.get("ends", 0) if ok else 0
        ok = ok and isinstance(ends, int) and not isinstance(ends, bool) and ends >= 0
        if not ok:
            return (
                f"`overhead` must be a dict of a power-of-two `multiple` <= {MAX_MULTIPLE}, `probe_seconds` in "
                f"[0, {MAX_PROBE_SECONDS:g}], `first` and (optional) `run`: three finite seconds, none above the "
                f"second (the wall time), and (optional) `ends`: a count >= 0, got {state!r}"
            )
        self.multiple, self.probe_seconds, self.first = m, seconds, first
        self.last_probe = seconds  # published as `probe_seconds` until the next probe: the cost the schedule uses
        self.run_seconds, self.run_probe_seconds = [run[0], run[1]], run[2]
        self.segment_ends = ends + 1  # the segment that saved this state has ended since, with its end probe
        return None

    def configure(self, every: int, monitors: Sequence[Any], policy: Any = None) -> None:
        """The run's logging interval ``every``, its ``monitors`` and the ``policy`` that says the notes once."""
        self.every = every
        self.monitors = list(monitors)
        self.policy = policy if policy is not None else self.policy

    def cadence(self, m: Any, every: int) -> int:
        """Monitor ``m``'s own interval in steps: its ``every_n_steps`` when set, else ``every_factor * every``."""
        return int(m.every_n_steps) if getattr(m, "every_n_steps", None) else m.every_factor * every

    def explicit(self, m: Any) -> bool:
        """Whether a probe monitor has a cadence of the user's (``every_n_steps``, or an ``every_factor`` set on it)."""
        return bool(getattr(m, "every_n_steps", None)) or "every_factor" in vars(m)

    def due(self, m: Any, step: int, first: bool) -> bool:
        """Whether monitor ``m`` measures step ``step`` (``first``: the door logs step 0 too): a probe monitor on the
        probe steps when the budget is on and its cadence is not the user's; else on its own schedule."""
        if self.on and getattr(m, "probe", False) and not self.explicit(m):
            return self.is_probe_step(step, first)
        return m.schedule.is_logging_step(step)

    def at_epoch_end(self, m: Any) -> bool:
        """Whether monitor ``m`` may measure at a training epoch's end: not a probe under the budget (its probe steps
        and the end of training stand for it), unless its cadence is the user's."""
        return not (self.on and getattr(m, "probe", False) and not self.explicit(m))

    def is_probe_step(self, step: int, first: bool = False) -> bool:
        if self.every <= 0:
            return False
        logging = (step + 1) % self.every == 0 or (first and step == 0)
        return logging and (self.first in (None, step) or (step + 1) % (self.multiple * self.every) == 0)

    def ends(self, step: int, monitors: Sequence[Any]) -> list[Any]:
        """Training ended at ``step``: the probe monitors that measure it now (none when ``step`` was a probe step or
        without a budget); the probe's cost is published with its values."""
        self.ended = True
        if not self.on or self.probed_at == step:
            return []
        probes = [m for m in monitors if getattr(m, "probe", False) and not self.explicit(m)]
        self.probing = bool(probes)
        return probes

    def begin(self, step: int, logging: bool, first: bool) -> None:
        """A training step starts (``logging``: a logging step of the run)."""
        now = time.perf_counter()
        if self.started is None:  # the run's first step: its set-up (attaching) is outside every window
            self.started = self.window_start = now
            self.clock.read()
            self.clock.take()
        if logging and self.first is None:
            self.first = step
        self.probing = self.on and logging and self.is_probe_step(step, first)
        if self.probing:
            self.probed_at = step
        self.step = step
        for m in self.figures:  # their rule, (step + 1) % figure_every == 0, then holds on probe steps only
            m.figure_every = step + 1 if self.probing else step + 2

    def ride(self, world_size: int) -> list[dict[str, Tensor]]:
        """The last window's timings as sums riding with the logging step's (several processes; else nothing)."""
        if not self.on or world_size <= 1:
            return []
        from headwatch.distributed.reduce import collective_device

        sums = torch.zeros(len(WINDOW) + 2, dtype=torch.float64, device=collective_device())
        for i, v in enumerate([*self.window, self.budget, self.budget**2]):
            if v:
                sums[i] = v  # a fill, not a host-to-device copy
        return [{"overhead": sums}]

    def keys(self, rode: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """The reduced window (:meth:`ride`) as scalars moved with the step's one transfer (popped by :meth:`after`)."""
        return {f"{self.prefix}/overhead/_window{i}": v for i, v in enumerate(rode[0]["overhead"])} if rode else {}

    def trim(self, media: Sequence[Any]) -> None:
        """On a logging step that is not a probe step, the histograms are not moved nor published."""
        if self.on and not self.probing:
            for m in media:
                m.histograms = {}

    def shared(self, numbers: dict[str, float], world_size: int) -> list[float] | None:
        """Pop the reduced window (:meth:`keys`) from a logging step's ``numbers``: the means over processes of the
        last window's timings, the same on every rank; with one process, its own last window. None: no budget.

        Budgets that differ between processes (their mean and mean square ride too) would space the probes
        differently on each, and the logging step's sums would then differ in layout: every process decides from
        their mean (:attr:`agreed`), and one note says when they differ."""
        if not self.on:
            return None
        reduced = [numbers.pop(f"{self.prefix}/overhead/_window{i}", None) for i in range(len(WINDOW) + 2)]
        if reduced[0] is not None:
            mean, square = reduced[-2] / world_size, reduced[-1] / world_size
            self.agreed = mean  # even budgets a rounding apart: each process decides with the same number
            if square - mean**2 > 1e-9 * mean**2:
                self._say(
                    "overhead:budgets",
                    f"headwatch: overhead_budget differs between processes; every process spaces the probes by their "
                    f"mean, {mean:g}, so that they probe on the same steps. Pass the same overhead_budget on every "
                    "process. (said once)",
                )
            return [v / world_size for v in reduced[: len(WINDOW)]]
        return list(self.window) if world_size <= 1 else None

    def after(self, numbers: dict[str, float], shared: list[float] | None) -> dict[str, float]:
        """The end of a logging step (after its one transfer and the monitors' host work): decide the probe
        interval from the ``shared`` window (:meth:`shared`), read the clock, and return ``numbers`` with the
        ``overhead/`` values (none without a budget)."""
        if not self.on:
            return numbers
        if shared is not None:
            self.decide(*shared, steps=self.steps_watched())
        return {**numbers, **self.publishable()}

    def steps_watched(self) -> int | None:
        """The steps of the run up to the one that began last, from the start of its first logging interval (the
        checkpoint's :attr:`first` in a resumed run: its earlier steps count; a door counting from a late step without
        one, watching from mid-training, counts only the steps watched). None before the first step."""
        if self.step is None:
            return None
        begun = max(0, self.first + 1 - self.every) if self.first is not None else 0
        return max(1, self.step + 1 - begun)

    def decide(self, statistics: float, probe: float, wall: float, probed: float, steps: int | None = None) -> None:
        """The probe interval from one window's timings, the same on every rank (means over processes).

        ``steps``: the steps run so far (:meth:`steps_watched`). The first probe (spent), the end-of-training probes of
        the run's earlier segments (spent: :attr:`segment_ends`, a run resumed from checkpoints) and this segment's
        (to come), each costing about the last probe, are amortised over them and taken off what the periodic probes
        may spend, so that a run ending now would have kept its whole cost, every fixed probe included, within the
        budget once it is long enough to hold them (early in a run the periodic probes wait at the longest
        interval)."""
        if wall <= 0 or self.every <= 0:
            return
        if probed > 0:
            self.probe_seconds = probe / probed
        step_s, budget = wall / self.every, self.agreed or 0.0
        fixed = (2 + self.segment_ends) * self.probe_seconds / steps if steps else 0.0
        needed, self.fits = probe_interval(statistics, self.probe_seconds, step_s, self.every, budget, fixed)
        self.notes(statistics, step_s, budget)
        if self.probe_seconds > 0 or not self.fits:
            self.multiple = steady_interval(self.multiple, needed)

    def notes(self, statistics: float, step_s: float, budget: float) -> None:
        """Say once when the logging statistics alone exceed the budget on each of the last :data:`NOTE_WINDOWS`
        windows (the smallest of their shares is said, with the logging interval it fits: one window on a busy
        machine can be several times another), with the figure cadences of the user's they hold; and when a probe
        cadence of the user's exceeds it."""
        share_now = statistics / self.every / step_s if step_s > 0 else math.inf
        self.shares = [*self.shares[1 - NOTE_WINDOWS :], share_now]
        share = min(self.shares)
        if len(self.shares) == NOTE_WINDOWS and share > budget:
            fits = self.every * 2 ** math.ceil(math.log2(share / budget))
            # figures at a cadence of the user's are drawn off the probe steps too: timed with the statistics
            own = [f"{m.name} every {m.figure_every} steps (figure_every_n_steps={m.figure_every})" for m in self.monitors
                   if getattr(m, "figure_every", 0) > 0 and m not in self.figures]  # fmt: skip
            figures = (
                f" They include the figures drawn at a cadence of yours, kept as set: {', '.join(own)}; space them, or "
                "pass figure_every_n_steps='auto' to draw them on the probe steps."
                if own
                else ""
            )
            self._say(
                "overhead:statistics",
                f"headwatch: its logging statistics alone take {share:.1%} of the training "
                f"time at a logging interval of {self.every} steps, over overhead_budget={budget:g}; the probes are spaced to "
                f"the longest interval and `overhead/fraction` says the cost. To fit, raise {self.door_interval} to "
                f"{fits} or more, or pass overhead_budget=None to accept the cost.{figures} The first and the "
                "end-of-training probes run in every run (`overhead/probe_fraction_run` says their share: most of a "
                "short run's cost). (said once)",
            )
        for m in self.monitors:
            if getattr(m, "probe", False) and self.explicit(m) and self.probe_seconds > 0:
                own = self.cadence(m, self.every)
                if statistics / self.every + self.probe_seconds / own > budget * step_s:
                    self._say(
                        f"overhead:{m.name}",
                        f"headwatch: {m.name} measures every {own} steps as set, which takes more than "
                        f"overhead_budget={budget:g} of the training time (a measurement costs "
                        f"{self.probe_seconds:.3g} s, a step {step_s:.3g} s); your cadence is kept. (said once)",
                    )

    def _say(self, key: str, message: str) -> None:
        if self.policy is None or key in self.said:
            return
        self.said.add(key)  # once per key: the policy's INFO note is once per message, which holds this window's share
        if key == "overhead:statistics" and not self.warn_statistics:
            self.policy.info_once(message)
        else:
            self.policy.note_once(key, message)

    def publishable(self) -> dict[str, float]:
        """Read the clock (after the host sync) and start closing the window: the ``overhead/`` values of this step.

        The window ends when this step's work is over (:meth:`settle`: its sinks, the rest of the door's call); the
        values published now hold the window up to this step's transfer."""
        self.clock.read()
        seconds = self.clock.take()
        now = time.perf_counter()
        wall = now - (self.window_start if self.window_start is not None else now)
        spent = sum(seconds.values())
        probe = seconds["probe"] + seconds["figures"]
        self.closing, self.closed_at = [spent - probe, probe, wall, 1.0 if probe > 0 else 0.0], now
        run_spent, run_wall = self.run_seconds[0] + spent, self.run_seconds[1] + wall
        p = f"{self.prefix}/overhead"
        self.last = {
            f"{p}/fraction": spent / wall if wall > 0 else 0.0,
            f"{p}/fraction_run": run_spent / run_wall if run_wall > 0 else 0.0,
            f"{p}/probe_fraction_run": (self.run_probe_seconds + probe) / run_wall if run_wall > 0 else 0.0,
            f"{p}/probe_interval": float(self.multiple * self.every),
            f"{p}/probe_seconds": probe if probe > 0 else self.last_probe,
        }
        if self.ended:  # the end of training's probe closes no window of training steps: its cost is in the run's
            del self.last[f"{p}/fraction"]  # fractions and in probe_seconds, never a `fraction` near 1 on the chart
        return dict(self.last)

    def settle(self) -> None:
        """headwatch's work of the moment is over (the clock's outermost span ended). After :meth:`publishable`, the
        step's later work (its sinks, the rest of the door's call) joins the closing window, which ends now: a
        window holds whole steps, from the end of one logging step's work to the end of the next one's. On a probe
        step its sinks' work (drawing and writing its figures and histograms) is the probe's. After the end of
        training, headwatch's last work (the end of training's sinks, closing) joins the run's totals."""
        if self.closing is None and not self.ended:
            return
        self.clock.read()  # spans not complete yet (a GPU stream behind) stay with the next window
        seconds = self.clock.take()
        tail, drawn = sum(seconds.values()), seconds["probe"] + seconds["figures"] + seconds["publish"]
        now = time.perf_counter()
        if self.closing is not None:
            statistics, probe, wall, probed = self.closing
            if probed > 0 or self.probing:
                statistics, probe = statistics + tail - drawn, probe + drawn
            else:
                statistics += tail
            self.window = [statistics, probe, wall + now - self.closed_at, 1.0 if probe > 0 else 0.0]
            self.closing, self.closed = None, self.closed + 1
            if probe > 0:
                self.last_probe = probe
            spent, wall, probed_s = statistics + probe, self.window[2], probe
        else:
            spent, wall = tail, now - (self.window_start if self.window_start is not None else now)
            probed_s = drawn if self.probing else seconds["probe"] + seconds["figures"]
        self.run_seconds = [self.run_seconds[0] + spent, self.run_seconds[1] + wall]
        self.run_probe_seconds += probed_s
        self.window_start = now

    @contextmanager
    def publishing(self, val: bool = False) -> Iterator[None]:
        """The sinks publish a step's values inside (timed as ``publish``; on a probe step, as the probe's, by
        :meth:`settle`)."""
        with self.clock.kind("publish"):
            yield

    def follow_figures(self, monitors: Sequence[Any]) -> None:
        """Under a budget, ``monitors`` that draw figures (``figure_every`` > 0) draw them on probe steps only
        (:meth:`begin` sets their ``figure_every`` each step)."""
        if self.on:
            self.figures = [m for m in monitors if getattr(m, "figure_every", 0) > 0]
