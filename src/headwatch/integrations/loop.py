"""``Headwatch``: the front door for a plain PyTorch training loop, writing to a ``SummaryWriter``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from headwatch import tensorboard as tb
from headwatch.alerts.actions import JSONL_NAME
from headwatch.alerts.wiring import EngineSink, check_alert, is_rules, load_alert_state, wire_alert, with_alert_state
from headwatch.core.build import set_figures
from headwatch.core.figures import check_figure_argument
from headwatch.core.gradients import GradientDensity
from headwatch.core.monitor import Monitor
from headwatch.core.driver import Driver
from headwatch.core.orchestrator import Orchestrator
from headwatch.distributed.reduce import Reducer
from headwatch.errors import HeadwatchError, check_bool, check_instance, check_positive_int, check_sequence
from headwatch.model.batch import BatchFormat
from headwatch.report.summary import SummarySink

__all__ = ["Headwatch"]


class Headwatch(Driver):
    """Watch the embedding and the head of ``model`` in your own training loop.

    Example::

        with Headwatch(model, writer=SummaryWriter("runs/x"), log_every_n_steps=50) as hw:
            for step, batch in enumerate(loader):
                hw.step_start(batch, step)          # before the forward (each micro-batch)
                loss = model(**batch).loss
                loss.backward()
                hw.before_optimizer_step()          # gradients final (after scaler.unscale_)
                optimizer.step()
                hw.after_optimizer_step()
                optimizer.zero_grad()
                values = hw.step_end()              # on logging steps: {name: float}, written to the writer
        # leaving the block (or hw.close()) ends the run: the end-of-training summary, the alert's last
        # deliveries, the hooks removed

    or ``with hw.step(batch, step): ...`` around forward, backward and optimizer step
    (then call :meth:`before_optimizer_step` yourself if you want gradient statistics). Without
    :meth:`close` (or the ``with`` block) nothing runs at the end of training: no summary, and alerts still
    in flight to a webhook may not be delivered.

    Args:
        model: the model being trained (build it, and ``torch.compile`` it, before or after:
            hooks are registered here, before its first forward).
        monitors: core monitors (``headwatch.core``) or names among ``"logits"``,
            ``"gradients"``, ``"tokens"``, ``"collision"``; default: all four. Monitors that
            need token counts share one :class:`~headwatch.core.TokenCounts` (added if absent).
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or several); None: values are
            only returned by :meth:`step_end`. ``headwatch.tensorboard.SummaryWriter(log_dir)`` also
            survives a log directory that cannot be written when it is made (``docs/faults.md``).
        log_every_n_steps: measure on steps ``s`` with ``(s + 1) % n == 0`` (default 50, Lightning's; the collision
            probe: see ``overhead_budget``).
        batch_format: how batches are read (:class:`~headwatch.core.BatchFormat`).
        reducer: distributed reductions; default ``torch.distributed`` when initialized.
        prefix: first component of every metric name.
        figure_every_n_steps: images of the monitors built from names (``"logits"``: entropy over
            the run, ``"gradients"``: row norm against frequency rank, ``"collision"``: similarity
            histograms at its measurements), as in the Lightning callbacks: ``"auto"`` (default)
            on the probe steps (``overhead_budget``; None: every 10 logging intervals) when matplotlib is installed, else none; an int: every this
            many steps (needs matplotlib); None or 0: none. Core monitors passed in keep their own
            ``figure_every`` / ``figures``.
        strict: raise a ``HeadwatchError`` when a monitor fails; default: warn once, skip that
            monitor's values of the step (on every rank alike) and go on training.
        alert: the collapse alert: a :class:`headwatch.alerts.CollapseRules` (an ``AlertEngine`` is built with
            the standard actions: console, a marker and the message in the writers, ``headwatch_alerts.jsonl``
            in the first writer's ``log_dir``, a webhook to ``$HEADWATCH_WEBHOOK_URL`` when set), or any object
            with ``observe_train(step, metrics)`` / ``observe_val(step, metrics)`` (an ``AlertEngine`` you built:
            its distributed decision is then taken through the run's reducer). Fed every logging step's values
            on every rank. A critical alert sets :attr:`should_stop`.
        summary: print the end-of-training summary at :meth:`close` (rank zero); its text stays in
            ``hw.summary.text``.
        overhead_budget: the share of training wall time headwatch may take (default 0.01): the collision probe,
            figures and histograms run on probe steps spaced to stay within it (the first logging step, every
            power of two of logging intervals, and at :meth:`close`); ``overhead/*`` says the cost on every
            logging step (``docs/definitions.md``). None: off (the collision every 10 logging intervals).

    Raises:
        HeadwatchError: a bad argument (``figure_every_n_steps`` > 0 without matplotlib, ``overhead_budget`` not
            None nor in (0, 1)), or the
            head/embedding cannot be found in ``model``; in a process group, another process passed another
            ``log_every_n_steps`` (compared here, one gather: every process constructs it; ``docs/distributed.md``).
    """

    def __init__(
        self,
        model: nn.Module,
        monitors: Sequence[Monitor | str] | None = None,
        writer: Any = None,
        log_every_n_steps: int = 50,
        batch_format: BatchFormat | None = None,
        reducer: Reducer | None = None,
        prefix: str = "headwatch",
        figure_every_n_steps: int | str | None = "auto",
        strict: bool = False,
        alert: Any = None,
        summary: bool = True,
        overhead_budget: float | None = 0.01,
    ) -> None:
        check_figure_argument(figure_every_n_steps)
        check_instance("model", model, nn.Module)
        check_positive_int("log_every_n_steps", log_every_n_steps)
        check_alert(alert)
        check_bool("summary", summary)
        writers = [] if writer is None else list(writer) if isinstance(writer, (list, tuple)) else [writer]
        self.writers = check_sequence("writer", writers, "SummaryWriter objects (with add_scalar)", lambda w: callable(getattr(w, "add_scalar", None)))
        self.run = Orchestrator(
            monitors, batch_format=batch_format, prefix=prefix, reducer=reducer, strict=strict, overhead_budget=overhead_budget
        )
        self.run.cost.door_interval = "log_every_n_steps"
        self.run.sinks.append(tb.WriterSink(self.rank_writers))
        self.prefix = prefix
        self.should_stop = False
        """True once a critical alert fired (every rank alike): stop the loop when you read it."""
        self._owns_alert = is_rules(alert)
        self.alert = self._wire_alert(alert)
        self.run.sinks.append(EngineSink(lambda: self.alert, owned=self._owns_alert))
        self.summary = SummarySink(prefix, rank=lambda: self.run.reducer.rank, alerts=lambda: getattr(self.alert, "alerts", None))
        self.summary.budget = self.run.cost.budget
        if summary:
            self.run.sinks.append(self.summary)
        self.run.configure(log_every_n_steps)
        self.run.check.agree_interval(self.run.cost.budget)  # every process constructs it: different ones raise here
        self.run.attach(model)  # FSDP1 / DeepSpeed ZeRO-3: full shapes while resolving (a collective)
        self.figure_every_n_steps = figure_every_n_steps
        set_figures(self.run.named, figure_every_n_steps)
        if figure_every_n_steps == "auto":  # drawn on the probe steps under a budget
            self.run.cost.follow_figures(self.run.named)
        self.step_index = 0
        self._open = False  # a step_start since the last step_end
        self._gradients_read = False  # a before_optimizer_step since the last step_end
        self._closed = False  # close() removed the hooks: a later step is refused
        if self.run.reducer.rank == 0:
            try:
                tb.write_layout(self.writers, prefix)
            except Exception as err:  # noqa: BLE001 - an unwritable log directory never stops training
                self.run.sink_failed(self.run.sinks[0], err)

    def rank_writers(self) -> list[Any]:
        """The writers this process writes to (rank zero's; none elsewhere)."""
        return self.writers if self.run.reducer.rank == 0 else []

    def _wire_alert(self, alert: Any) -> Any:
        """The engine of ``alert`` (rules: built with the standard actions of this door)."""
        if alert is None:
            return None
        log_dir = next((getattr(w, "log_dir", None) for w in self.writers if isinstance(getattr(w, "log_dir", None), str)), None)
        return wire_alert(
            alert, lambda fired: not self.run.reducer.all(not fired), self.run.reducer.rank == 0, "Headwatch alert",
            sink=tb.MarkerSink(self.rank_writers), prefix=self.prefix,
            jsonl_path=None if log_dir is None else f"{log_dir}/{JSONL_NAME}", stop=self._stop,
        )  # fmt: skip

    def _stop(self, alert: Any = None) -> None:
        """An alert action: a critical alert asks the loop to stop (:attr:`should_stop`)."""
        self.should_stop = True

    # ---------------------------------------------------------------- protocol
    def step_start(self, batch: Any, step: int | None = None) -> None:
        """Before the forward of each (micro-)batch of step ``step`` (default: an internal counter).

        Raises:
            HeadwatchError: ``step`` is not a non-negative int; called after :meth:`close`.
        """
        if self._closed:
            raise HeadwatchError("step_start() after close(): its hooks are removed; build a new Headwatch for a new run")
        if step is not None:
            if isinstance(step, bool) or not hasattr(step, "__index__") or int(step) < 0:
                raise HeadwatchError(f"`step` must be None or an int >= 0, got {step!r}")
            if self._open and int(step) != self.step_index:
                raise HeadwatchError(
                    f"step_start(step={int(step)}) while step {self.step_index} has not ended: call step_end() once after "
                    "each optimizer step (its micro-batches share one step number)"
                )
            if int(step) == 0 and self.step_index > 0 and not self._open:
                self.run.note_once(
                    "new_run",
                    f"headwatch: step 0 again after step {self.step_index - 1}: a new run starts with empty state (token "
                    "counts, accumulators, totals). To continue a run instead, load its state with load_state_dict "
                    "and go on from its step. (said once)",
                )
                self.new_run()
            self.step_index = int(step)
        self._open = True
        with self.run.cost.clock.kind(None):  # headwatch's work, for the overhead budget
            if self.run.step != self.step_index:
                self.run.begin_step(self.step_index)
            self.run.step_start(batch)

    def before_optimizer_step(self, loss_scale: float | Tensor | None = None) -> None:
        """Gradients are final (after accumulation and ``scaler.unscale_``; pass ``scaler.get_scale()`` then), before
        clipping: the tied split sets the lookup flow captured in the backward against ``.grad``, so a ``.grad``
        scaled since (``clip_grad_norm_``) needs ``loss_scale=1 / coefficient``."""
        self._gradients_read = True
        with self.run.cost.clock.kind(None):
            self.run.gradients_ready(loss_scale)

    def after_optimizer_step(self) -> None:
        with self.run.cost.clock.kind(None):
            self.run.optimizer_stepped()

    def step_end(self, loss: Tensor | float | None = None) -> dict[str, float]:
        """After the optimizer step: on a logging step, compute (every rank), write (rank 0), return the values.

        A monitor that fails is skipped on every rank (its values of this step are dropped everywhere).

        Args:
            loss: the step's token-mean cross-entropy over its measured forward(s) (with gradient
                accumulation: over all its micro-batches), for the self-check (``docs/self_check.md``):
                published as ``debug/check/reference_nll`` beside ``check/nll_gap``. None: a Hugging Face model's
                own ``outputs.loss`` of the step's training forwards, when it returns one. Read on logging
                steps only (a device tensor is moved with the step's one transfer).

        Raises:
            HeadwatchError: no :meth:`step_start` since the last ``step_end``; ``loss`` neither a scalar tensor nor a number.
        """
        if not self._open:
            raise HeadwatchError(
                f"step_end() was called without a step_start(batch, step) since the last step_end() (step {self.step_index}); "
                "call step_start before each (micro-)batch's forward and step_end once after the optimizer step"
            )
        if loss is not None:
            check_instance("loss", loss, (Tensor, float, int), "a scalar tensor or a number")
            if isinstance(loss, Tensor) and loss.numel() != 1:  # numel: the shape, no device read
                raise HeadwatchError(f"`loss` must be a scalar tensor or a number, got a tensor of shape {tuple(loss.shape)}")
        self._open = False
        with self.run.cost.clock.kind(None):
            return self._step_end(self.step_index, loss)

    def _step_end(self, step: int, loss: Tensor | float | None) -> dict[str, float]:
        if loss is not None and self.run.logging:
            self.run.check.step_loss(loss)
        if not self._gradients_read and any(isinstance(m, GradientDensity) for m in self.run.logging):
            self.run.warn_once(
                "no_before_optimizer_step",
                f"Headwatch: logging step {step} ended without a call to before_optimizer_step(), so the gradient "
                "and update statistics (grad/*, update/*) were not taken and are not published. Fix: call "
                "hw.before_optimizer_step() after the backward (after scaler.unscale_(optimizer) with AMP) and before "
                "optimizer.step(), then hw.after_optimizer_step(), on every step. (warned once)",
            )
        self._gradients_read = False
        self.run.batch_end()
        numbers = self.run.end_step(step)
        self.step_index = step + 1
        return numbers

    def new_run(self) -> None:
        """A new run with this object (a hyperparameter trial, a second training of the same model): empty
        state, counting from step 0 (:meth:`Orchestrator.start_run`). Called by :meth:`step_start` when
        ``step=0`` comes again after later steps. :meth:`load_state_dict` continues a run instead."""
        self.run.start_run(also=[a for a in (self.alert, self.summary) if callable(getattr(a, "reset", None)) and not is_rules(a)])
        self.step_index, self._open, self.should_stop, self._gradients_read = 0, False, False, False

    @contextmanager
    def step(self, batch: Any, step: int | None = None) -> Iterator[Headwatch]:
        """``with hw.step(batch): forward, backward, optimizer step`` (calls :meth:`step_start` and :meth:`step_end`)."""
        self.step_start(batch, step)
        yield self
        self.step_end()

    def end(self) -> None:
        """Training ended: the end-of-training summary (rank zero) and the alert's last deliveries (bounded);
        the hooks stay. :meth:`close` calls it; a second call does nothing."""
        with self.run.guard("ending the run"):
            self.run.end_run(max(self.step_index - 1, 0))

    def close(self) -> None:
        """End the run (:meth:`end`), release the alert's webhook thread and remove every hook (the state stays)."""
        self.end()
        self._closed = True
        with self.run.guard("closing"):
            self.run.close()

    def __enter__(self) -> Headwatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The step counter, every monitor's state and, with an alert engine, its state under ``"alert"``."""
        return with_alert_state({"step": self.step_index, **self.run.state_dict()}, self.alert)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step counter, every monitor and the alert, each part checked (an invalid part restarts from
        empty with one warning; ``strict=True`` raises :class:`~headwatch.errors.StateError`)."""
        step = state.get("step", 0) if isinstance(state, dict) else 0
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            self.run.state_problem(any(m.strict for m in self.run.monitors), f"`step` must be an int >= 0, got {step!r}")
            step = 0
        self.step_index = step
        self.run.load_state_dict(state)
        load_alert_state(self.alert, state)
