"""Hugging Face ``transformers.Trainer`` front door: one ``TrainerCallback`` feeding headwatch's orchestrator.

Use either::

    from headwatch.integrations.transformers import HeadwatchCallback, attach

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[HeadwatchCallback()])
    # or, after building the trainer (keeps the trainer reference explicitly):
    attach(trainer, HeadwatchCallback())

Works the same with TRL's ``SFTTrainer`` (a ``Trainer`` subclass) and under ``accelerate``
/ ``torchrun`` (reductions through ``torch.distributed``). See :class:`HeadwatchCallback`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import Trainer, TrainerCallback

from headwatch.alerts.wiring import EngineSink, check_alert, is_rules
from headwatch.core.figures import check_figure_argument
from headwatch.core.monitor import Monitor
from headwatch.core.orchestrator import Orchestrator
from headwatch.distributed.reduce import Reducer
from headwatch.errors import HeadwatchError, check_bool, check_int, check_optional
from headwatch.integrations.hf_checkpoint import restore_state, resume_dir, save_state
from headwatch.integrations.hf_publish import TrainerSink, console_filter
from headwatch.integrations.hf_support import (
    TrainerLink,
    evaluation_prefix,
    find_trainer,
    gradient_scale,
    in_evaluation,
    wire_alert,
)
from headwatch.integrations.hf_trl import fused_head_note, trl_marks, trl_step_values
from headwatch.model.batch import BatchFormat
from headwatch.model.hooks import InputsHook
from headwatch.report.summary import SummarySink

__all__ = ["HeadwatchCallback", "attach"]


class HeadwatchCallback(TrainerLink, TrainerCallback):
    """Watch the embedding and the head of the model a ``transformers.Trainer`` trains.

    One callback drives the run's orchestrator (:class:`headwatch.core.orchestrator.Orchestrator`;
    default monitors: all four, sharing one token count). It attaches when the Trainer is built
    (``on_init_end``, or :func:`attach`; so ``evaluate()`` before or without ``train()`` is measured)
    and again in ``on_train_begin``, where a run starts with empty state unless it resumes from a
    checkpoint (``docs/evaluation.md``), and measures on the Trainer's logging steps (``DefaultFlowCallback``'s rule: ``global_step %
    logging_steps == 0``, and step 1 with ``logging_first_step``; collision on the probe steps
    of ``overhead_budget`` and at each epoch end). A forward pre-hook reads the batch (``model(**inputs)``); gradients are
    read in ``on_pre_optimizer_step`` (after accumulation and unscaling, after clipping: row norms
    are scaled by the clip coefficient, densities and cosines are not). Values go through
    ``trainer.log`` at ``state.global_step`` (every ``report_to`` integration; TensorBoard shows
    ``train/headwatch/...`` with the Custom Scalars layout and media); each evaluation is published under the Trainer's name for it (``headwatch/val/logits/*``
    for ``metric_key_prefix="eval"``, ``.../<metric_key_prefix>`` for each set of an ``eval_dataset`` dict)
    and adds ``<metric_key_prefix>_headwatch/val/logits/*`` to ``evaluate()``'s metrics, over the real rows
    (the repeats of an even distributed split left out); ``on_save`` writes the monitors' state
    to ``<output_dir>/checkpoint-<step>/headwatch_state.pt`` and a resumed ``train`` loads it. Under
    TRL's fused LM head the logit statistics come from the final hidden states and the head's weight
    (no ``(B, T, V)`` logits); the synonym confusion of ``"collision"`` is not counted there.

    Args:
        monitors: core monitors (``headwatch.core``) or names among ``"logits"``,
            ``"gradients"``, ``"tokens"``, ``"collision"``; None: all four.
        batch_format: how the model's keyword inputs are read (default: ``input_ids``,
            ``labels`` shifted as in causal LMs, ``attention_mask``, ``ignore_index=-100``).
        prefix: first component of every metric name.
        reducer: distributed reductions; default ``torch.distributed`` (what accelerate uses).
        alert: the collapse alert: a :class:`headwatch.alerts.CollapseRules` (an ``AlertEngine`` is
            built in ``on_train_begin`` with the standard actions: console, a marker in the Trainer's
            TensorBoard, ``<output_dir>/headwatch_alerts.jsonl``, a webhook to ``$HEADWATCH_WEBHOOK_URL``
            when set), or any object with ``observe_train(step, metrics)`` / ``observe_val(step, metrics)``
            (an ``AlertEngine`` you built: its distributed decision is then taken through ``reducer``). Called
            on every rank at every logging step with the published values (one of the run's sinks,
            :class:`headwatch.alerts.wiring.EngineSink`); validation also sees the Trainer's ``eval_*`` metrics (use
            ``CollapseRules(val_metric="eval_loss")``).
        stop_on_critical: on a critical alert, set the Trainer's ``control.should_training_stop``.
        checkpoint_on_critical: on a critical alert, set the Trainer's ``control.should_save``
            (a checkpoint at that step).
        strict: raise on a failed measurement instead of warning once.
        console_keys: which values the Trainer's console printers (``ProgressCallback``,
            ``PrinterCallback``) show: None, a handful of headline names
            (:data:`headwatch.names.CONSOLE_KEYS`); names with or without ``<prefix>/``; ``"all"``:
            every value; ``()``: none. The reporting integrations (``report_to``) and
            ``state.log_history`` always receive every value.
        figure_every_n_steps: images (IMAGES tab, under ``train/headwatch/``) of the monitors built
            from names, as in the Lightning callbacks: ``"auto"`` (default) on the probe steps
            (``overhead_budget``; None: every ``10 * logging_steps`` steps) when matplotlib is installed, else none; an int: every this
            many steps (needs matplotlib); None or 0: none (see :func:`headwatch.core.orchestrator.set_figures`).
            Core monitors passed in keep their own settings.
        summary: print the end-of-training summary at ``on_train_end`` (rank zero; :mod:`headwatch.report.summary`).
        overhead_budget: the share of training wall time headwatch may take (default 0.01): the collision probe,
            figures and histograms run on probe steps spaced to stay within it (the first logging step, every power
            of two of ``logging_steps``, and ``on_train_end``); ``overhead/*`` says the cost on every logging step.
            ``logging_steps`` is kept: when the logging statistics alone exceed the budget at it (TRL's configs
            default to 10), one warning says so with the interval that fits. None: off (the collision every 10
            logging intervals).
        vocab_size: the tokenizer's vocabulary size; None: ``len`` of the Trainer's ``processing_class`` (a
            processor's ``.tokenizer``) when it has one. The model's rows past it (a vocabulary padded to a multiple
            of 64 or 128) are left out of the row figures (gradient and update densities, collision) and
            ``logits/padded_mass`` is published. Monitors passed in with their own ``vocab_size`` keep it.

    Raises:
        HeadwatchError: a bad argument. No trainer hook raises: a monitor that cannot measure the model
            (no head or embedding found) is left out with one warning naming the cause and what is still
            measured; with ``strict=True`` that, and any other monitoring failure, raises instead. The one
            exception: ``on_train_begin`` raises on every process when the processes' ``logging_steps`` differ.
    """

    def __init__(
        self,
        monitors: Sequence[Monitor | str] | None = None,
        batch_format: BatchFormat | None = None,
        prefix: str = "headwatch",
        reducer: Reducer | None = None,
        alert: Any = None,
        stop_on_critical: bool = False,
        checkpoint_on_critical: bool = False,
        strict: bool = False,
        console_keys: Sequence[str] | str | None = None,
        figure_every_n_steps: int | str | None = "auto",
        summary: bool = True,
        overhead_budget: float | None = 0.01,
        vocab_size: int | None = None,
    ) -> None:
        check_figure_argument(figure_every_n_steps)
        self.vocab_size = check_optional(check_int, "vocab_size", vocab_size, minimum=1)
        self._door_vocab: dict[int, int] = {}  # the vocabulary sizes this door gave monitors, by id of the monitor
        check_alert(alert)
        check_bool("stop_on_critical", stop_on_critical)
        check_bool("checkpoint_on_critical", checkpoint_on_critical)
        check_bool("summary", summary)
        self.run = Orchestrator(
            monitors, batch_format=batch_format, prefix=prefix, reducer=reducer, strict=strict, sinks=[TrainerSink(self)],
            overhead_budget=overhead_budget,
        )  # fmt: skip
        self.run.cost.door_interval, self.run.cost.warn_statistics = "logging_steps", True
        owned = is_rules(alert)
        self.run.sinks.append(EngineSink(lambda: self.alert, extra=lambda val: self._eval_metrics if val else {}, owned=owned))
        self.summary = SummarySink(prefix, rank=lambda: self.run.reducer.rank, alerts=lambda: getattr(self.alert, "alerts", None))
        """The end-of-training summary (printed at ``on_train_end`` on rank zero; its text in ``.summary.text``)."""
        self.summary.budget = self.run.cost.budget
        if summary:
            self.run.sinks.append(self.summary)
        self.stop_on_critical, self.checkpoint_on_critical = stop_on_critical, checkpoint_on_critical
        self.figure_every_n_steps = figure_every_n_steps
        self.prefix, self.alert = prefix, alert
        self.console_keys = console_filter(console_keys, prefix)
        """Full names the console printers show (None: all)."""
        self._trainer: Any = None
        self.inputs = InputsHook(self._on_forward)
        self._first = False
        self._control: Any = None
        self._eval_metrics: dict[str, Any] = {}

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        """The Trainer is built: attach to its model now, so that an ``evaluate()`` before (or without)
        ``train()`` is measured from its first batch. ``on_train_begin`` attaches again to the model it trains."""
        with self.run.guard("attaching at the Trainer's construction"):
            if self.trainer is None and (found := find_trainer(self)) is not None:
                self.set_trainer(found)
            if model is not None:
                self.attach_model(model, self.logging_every(args, state))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        """A run starts: fresh state unless it resumes from a checkpoint (:meth:`Orchestrator.start_run`),
        attach to the model it trains, restore a resumed run's state. Never raises (``strict`` does)."""
        with self.run.guard("starting the run"):
            self.begin_run(args, state, control, model)

    def begin_run(self, args: Any, state: Any, control: Any, model: nn.Module | None) -> None:
        if model is None:
            raise HeadwatchError("HeadwatchCallback.on_train_begin received no `model`; use it inside a transformers.Trainer")
        if (found := self.trainer or find_trainer(self)) is not None:
            self.set_trainer(found)
        also = [a for a in (self.alert, self.summary) if callable(getattr(a, "reset", None)) and not is_rules(a)]
        self.run.start_run(resumed=resume_dir(self, args, state) is not None, also=also)
        every = self.logging_every(args, state)
        if args.logging_strategy == "epoch":
            self.run.warn_once(
                "epoch_strategy",
                "HeadwatchCallback measures on logging steps; with logging_strategy='epoch' only collision "
                "(at epoch ends) and logging_first_step are measured. Use logging_strategy='steps'. (warned once)",
            )
        self._first = bool(args.logging_first_step)
        self.attach_model(model, every)
        self.run.check.agree_interval(self.run.cost.budget)  # every process, before the first step: differences raise
        self._control = control
        wire_alert(self, args)
        restore_state(self, args, state)  # the monitors' and the alert's state of the checkpoint's step
        self.write_layout()

    # ---------------------------------------------------------------- the batch
    def _on_forward(self, module: nn.Module, batch: dict, kwargs: dict) -> None:
        with self.run.guard("reading the batch"):
            self.read_forward(module, batch, kwargs)

    def read_forward(self, module: nn.Module, batch: dict, kwargs: dict) -> None:
        fused_head_note(self.run, kwargs)
        if not module.training and self.run.step is None and not in_evaluation():
            return  # the user's own call outside the Trainer's evaluation: no loss of the run uses it
        self.run.forward(batch, training=module.training, real_rows=self.real_rows(batch, module.training))

    # ---------------------------------------------------------------- training
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.guard("starting a step"):
            self.run.begin_step(state.global_step, first=self._first)  # DefaultFlowCallback's rule, global_step = step + 1
            self._trl_marks = trl_marks(self.trainer) if self.run.logging else {}

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.cost.clock.kind(None):  # headwatch's work, for the overhead budget
            self.run.batch_end()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.guard("reading the gradients"):
            scale = gradient_scale(self.trainer, args)  # read on every step: the step's clip coefficient is forgotten
            self.run.gradients_ready(scale if self.run.logging else None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.cost.clock.kind(None):
            self.run.optimizer_stepped()
            self.run.batch_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._control = control
        with self.run.cost.clock.kind(None):
            if self.run.logging and not control.should_log and self.flow_decided():
                self.run.warn_once("should_log", "HeadwatchCallback measured a step the Trainer does not log. (warned once)")
        with self.run.guard("publishing the step"):
            if self.run.logging:  # TRL's own entropy and token accuracy of this step, for the self-check
                self.run.check.trainer_metrics(**trl_step_values(self.trainer, getattr(self, "_trl_marks", {})))
            self.run.end_step(state.global_step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.guard("ending the epoch"):
            self.run.epoch_end(state.global_step - 1, at=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training ended: the end-of-training summary (rank zero) and the alert's last deliveries (bounded)."""
        with self.run.guard("ending the run"):
            self.run.end_run(state.global_step)

    # ---------------------------------------------------------------- evaluation
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.cost.clock.kind(None):
            self.run.validation_batch_end()

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict | None = None, **kwargs: Any) -> None:
        """Publish the evaluation under the Trainer's name for it (``metric_key_prefix``, read from its
        ``<prefix>_runtime`` metric): ``eval`` keeps the plain ``<prefix>/val/...`` names, any other (each
        dataset of an ``eval_dataset`` dict: ``eval_<name>``) adds ``/<metric_key_prefix>``; ``evaluate()``'s
        metrics get ``<metric_key_prefix>_<name>``, as the Trainer's own ``<metric_key_prefix>_loss``."""
        with self.run.guard("publishing the evaluation"):
            self._control, self._eval_metrics = control, dict(metrics or {})
            key = evaluation_prefix(metrics)
            numbers = self.run.validation_end(state.global_step, name=None if key == "eval" else key)
            if metrics is not None:
                metrics.update({f"{key}_{k}": v for k, v in numbers.items()})

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        with self.run.guard("resetting after predict"):
            self.run.each("resetting after predict", lambda m: m.validation_epoch_end())  # predict() logs nothing

    # ---------------------------------------------------------------- state
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the monitors' state to ``<output_dir>/checkpoint-<step>/headwatch_state.pt``: every rank
        takes the (collective) state, the process that saves the Trainer's state (``args.should_save``) writes."""
        with self.run.cost.clock.kind(None):
            save_state(self, args, state)


def attach(trainer: Trainer, callback: HeadwatchCallback | None = None, **kwargs: Any) -> HeadwatchCallback:
    """Add ``callback`` (default ``HeadwatchCallback(**kwargs)``) to ``trainer`` and keep the trainer reference.

    Raises:
        HeadwatchError: ``trainer`` is not a ``transformers.Trainer``, or both ``callback`` and kwargs are given.
    """
    if not isinstance(trainer, Trainer):
        raise HeadwatchError(f"`trainer` must be a transformers.Trainer, got {type(trainer).__name__}")
    if callback is not None and kwargs:
        raise HeadwatchError(f"pass either `callback` or HeadwatchCallback arguments, got both ({sorted(kwargs)})")
    callback = callback if callback is not None else HeadwatchCallback(**kwargs)
    if not any(cb is callback for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(callback)
    callback.set_trainer(trainer)
    if callback.run.step is None and trainer.model is not None:  # built already: attach now (evaluate() before train())
        callback.on_init_end(trainer.args, trainer.state, trainer.control, model=trainer.model)
    return callback
