"""``Headwatch``: the front door for a plain PyTorch training loop, writing to a ``SummaryWriter``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from headwatch import tensorboard as tb
from headwatch.errors import HeadwatchError
from headwatch.distributed import fsdp1
from headwatch.model.batch import BatchFormat
from headwatch.core.collision import SynonymCollision
from headwatch.core.frequency import TokenCounts
from headwatch.core.gradients import GradientDensity
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import Monitor, compute_due, to_floats, whole_matrices
from headwatch.distributed.reduce import Reducer, TorchDistributedReducer
from headwatch.core.schedule import Schedule
from headwatch.core.figures import check_figure_argument, resolve_figure_interval

_BY_NAME = {"logits": LogitStats, "gradients": GradientDensity, "tokens": TokenCounts, "collision": SynonymCollision}


class Headwatch:
    """Watch the embedding and the head of ``model`` in your own training loop.

    Example::

        hw = Headwatch(model, writer=SummaryWriter("runs/x"), log_every_n_steps=10)
        for step, batch in enumerate(loader):
            hw.step_start(batch, step)          # before the forward (each micro-batch)
            loss = model(**batch).loss
            loss.backward()
            hw.before_optimizer_step()          # gradients final (after scaler.unscale_)
            optimizer.step()
            hw.after_optimizer_step()
            optimizer.zero_grad()
            values = hw.step_end()              # on logging steps: {name: float}, written to the writer

    or ``with hw.step(batch, step): ...`` around forward, backward and optimizer step
    (then call :meth:`before_optimizer_step` yourself if you want gradient statistics).

    Args:
        model: the model being trained (build it, and ``torch.compile`` it, before or after:
            hooks are registered here, before its first forward).
        monitors: core monitors (``headwatch.core``) or names among ``"logits"``,
            ``"gradients"``, ``"tokens"``, ``"collision"``; default: all four. Monitors that
            need token counts share one :class:`~headwatch.core.TokenCounts` (added if absent).
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or several); None: values are
            only returned by :meth:`step_end`.
        log_every_n_steps: measure on steps ``s`` with ``(s + 1) % n == 0`` (collision: 10 n).
        batch_format: how batches are read (:class:`~headwatch.core.BatchFormat`).
        reducer: distributed reductions; default ``torch.distributed`` when initialized.
        prefix: first component of every metric name.
        figure_every_n_steps: images of the monitors built from names (``"logits"``: entropy over
            the run, ``"gradients"``: row norm against frequency rank, ``"collision"``: similarity
            histograms at its measurements), as in the Lightning callbacks: ``"auto"`` (default)
            every 10 logging intervals when matplotlib is installed, else none; an int: every this
            many steps (needs matplotlib); None or 0: none. Core monitors passed in keep their own
            ``figure_every`` / ``figures``.
        strict: raise a ``HeadwatchError`` when a monitor fails; default: warn once, skip that
            monitor's values of the step (on every rank alike) and go on training.

    Raises:
        HeadwatchError: a bad argument (``figure_every_n_steps`` > 0 without matplotlib), or the
            head/embedding cannot be found in ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        monitors: Sequence[Monitor | str] | None = None,
        writer: Any = None,
        log_every_n_steps: int = 10,
        batch_format: BatchFormat | None = None,
        reducer: Reducer | None = None,
        prefix: str = "headwatch",
        figure_every_n_steps: int | str | None = "auto",
        strict: bool = False,
    ) -> None:
        check_figure_argument(figure_every_n_steps)
        if not isinstance(model, nn.Module):
            raise HeadwatchError(f"`model` must be an nn.Module, got {type(model).__name__}")
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise HeadwatchError(f"`log_every_n_steps` must be an int >= 1, got {log_every_n_steps!r}")
        if not isinstance(strict, bool):
            raise HeadwatchError(f"`strict` must be a bool, got {strict!r}")
        if reducer is not None and not isinstance(reducer, Reducer):
            raise HeadwatchError(f"`reducer` must implement headwatch.core.Reducer (or be None), got {type(reducer).__name__}")
        self.writers = [] if writer is None else list(writer) if isinstance(writer, (list, tuple)) else [writer]
        bad = [type(w).__name__ for w in self.writers if not callable(getattr(w, "add_scalar", None))]
        if bad:
            raise HeadwatchError(f"`writer` must be None, a SummaryWriter or a list of them, got {bad}")
        if isinstance(monitors, (str, Monitor)):
            monitors = [monitors]
        self.monitors = self._build(monitors, batch_format, prefix)
        for m in self.monitors:
            m.strict = m.strict or strict
        self.reducer = reducer or TorchDistributedReducer()
        self.prefix = prefix
        with whole_matrices(model, model):  # FSDP1 / DeepSpeed ZeRO-3: full shapes while resolving (a collective)
            for m in self.monitors:
                m.configure(Schedule(m.every_factor * log_every_n_steps), self.reducer)
                m.root = model  # FSDP1: the wrapped model, summoned from on logging steps
                m.attach(fsdp1.unwrapped(model))  # FSDP1: the inner model's names (no `_fsdp_wrapped_module.`)
        self.figure_every_n_steps = figure_every_n_steps
        set_figures(self._named_monitors(monitors), figure_every_n_steps)
        self.step_index = 0
        self._open = False  # a step_start since the last step_end
        self.latest: dict[str, float] = {}
        self._logging: dict[int, bool] = {}
        if self.reducer.rank == 0:
            tb.write_layout(self.writers, prefix)

    def _named_monitors(self, given: Sequence[Monitor | str] | None) -> list[Monitor]:
        """The monitors built here from names (not the core monitors the caller passed)."""
        passed = {id(m) for m in given or () if isinstance(m, Monitor)}
        return [m for m in self.monitors if id(m) not in passed]

    @staticmethod
    def _build(monitors: Sequence[Monitor | str] | None, fmt: BatchFormat | None, prefix: str) -> list[Monitor]:
        items = list(monitors) if monitors is not None else ["tokens", "logits", "gradients", "collision"]
        bad = [m for m in items if not isinstance(m, Monitor) and m not in _BY_NAME]
        if bad:
            raise HeadwatchError(f"`monitors` entries must be core monitors or one of {sorted(_BY_NAME)}, got {bad!r}")
        counts = next((m for m in items if isinstance(m, TokenCounts)), None)
        if counts is None and any(m in ("tokens", "gradients", "collision") or isinstance(m, (GradientDensity, SynonymCollision)) for m in items):
            counts = TokenCounts(prefix=prefix, batch_format=fmt)
        built: list[Monitor] = [counts] if counts is not None else []
        for m in items:
            if m == "tokens" or m is counts:
                continue
            if isinstance(m, str):
                cls = _BY_NAME[m]
                if cls in (GradientDensity, SynonymCollision):
                    m = cls(frequency=counts, prefix=prefix)
                elif cls is LogitStats:  # counts, when kept, give the calibration's target buckets
                    m = cls(prefix=prefix, batch_format=fmt, frequency=counts)
                else:
                    m = cls(prefix=prefix, batch_format=fmt)
                if fmt is not None:
                    m.batch_format = fmt
            elif getattr(m, "frequency", counts) is None:
                m.frequency = counts  # type: ignore[attr-defined]
            built.append(m)
        return built

    # ---------------------------------------------------------------- protocol
    def _each(self, where: str, call: Any, monitors: Sequence[Monitor] | None = None) -> list[Monitor]:
        """``call(m)`` for every monitor; a failure warns once and is skipped (raises when strict).

        Returns the monitors that failed.
        """
        failed = []
        for m in self.monitors if monitors is None else monitors:
            try:
                call(m)
            except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
                m.fail(err, where)
                failed.append(m)
        return failed

    def step_start(self, batch: Any, step: int | None = None) -> None:
        """Before the forward of each (micro-)batch of step ``step`` (default: an internal counter).

        Raises:
            HeadwatchError: ``step`` is not a non-negative int.
        """
        if step is not None:
            if isinstance(step, bool) or not hasattr(step, "__index__") or int(step) < 0:
                raise HeadwatchError(f"`step` must be None or an int >= 0, got {step!r}")
            self.step_index = int(step)
        self._open = True
        s = self.step_index
        self._each("starting a batch", lambda m: m.step_start(batch, s, m.schedule.is_logging_step(s)))

    def before_optimizer_step(self, loss_scale: float | Tensor | None = None) -> None:
        """Gradients are final (after accumulation and ``scaler.unscale_``; pass ``scaler.get_scale()`` then)."""
        self._each("reading the gradients", lambda m: m.gradients_ready(loss_scale))

    def after_optimizer_step(self) -> None:
        self._each("after the optimizer step", lambda m: m.optimizer_stepped())

    def step_end(self) -> dict[str, float]:
        """After the optimizer step: on a logging step, compute (every rank), write (rank 0), return the values.

        A monitor that fails is skipped on every rank (its values of this step are dropped everywhere).

        Raises:
            HeadwatchError: no :meth:`step_start` since the last ``step_end``.
        """
        if not self._open:
            raise HeadwatchError(
                f"step_end() was called without a step_start(batch, step) since the last step_end() (step {self.step_index}); "
                "call step_start before each (micro-)batch's forward and step_end once after the optimizer step"
            )
        self._open = False
        step = self.step_index
        self._each("ending the batch", lambda m: m.batch_end())
        due = [m for m in self.monitors if m.schedule.is_logging_step(step)]
        scalars, due = compute_due(due, self.reducer)  # a failed monitor is dropped on every rank
        numbers = to_floats(scalars)
        self._each("publishing the values", lambda m: m.published(numbers), due)
        if self.reducer.rank == 0 and self.writers and numbers:
            try:
                tb.write_scalars(self.writers, numbers, step)
                for m in due:
                    tb.write_media(self.writers, m.media, step)
                tb.flush(self.writers)
            except Exception as err:  # noqa: BLE001
                due[0].fail(err, "writing to the SummaryWriter")
        self.latest.update(numbers)
        self.step_index = step + 1
        return numbers

    @contextmanager
    def step(self, batch: Any, step: int | None = None) -> Iterator[Headwatch]:
        """``with hw.step(batch): forward, backward, optimizer step`` (calls :meth:`step_start` and :meth:`step_end`)."""
        self.step_start(batch, step)
        yield self
        self.step_end()

    def close(self) -> None:
        """Remove every hook."""
        for m in self.monitors:
            m.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_index, "monitors": [m.state_dict() for m in self.monitors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = int(state.get("step", 0))
        for m, s in zip(self.monitors, state.get("monitors", [])):
            m.load_state_dict(s)


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
