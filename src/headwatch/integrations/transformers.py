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

import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import DefaultFlowCallback, Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback

from headwatch import tensorboard as tb
from headwatch.alerts.wiring import check_alert, load_alert_state, with_alert_state
from headwatch.core.figures import check_figure_argument
from headwatch.core.monitor import Monitor
from headwatch.core.orchestrator import Driver, Orchestrator, eval_rows_kept
from headwatch.core.trl import fused_head_note, trl_marks, trl_step_values, understand_trainer
from headwatch.distributed.reduce import Reducer
from headwatch.errors import HeadwatchError, check_bool
from headwatch.integrations.hf_support import (
    TB_PREFIX,
    TrainerSink,
    console_filter,
    evaluation_prefix,
    find_trainer,
    hand_loss_inputs,
    in_evaluation,
    loss_scale,
    restore_state,
    resume_dir,
    save_state,
    unwrap,
    wire_alert,
)
from headwatch.model.batch import BatchFormat

__all__ = ["HeadwatchCallback", "attach"]


class HeadwatchCallback(Driver, TrainerCallback):
    """Watch the embedding and the head of the model a ``transformers.Trainer`` trains.

    One callback drives the run's orchestrator (:class:`headwatch.core.orchestrator.Orchestrator`;
    default monitors: all four, sharing one token count). It attaches when the Trainer is built
    (``on_init_end``, or :func:`attach`; so ``evaluate()`` before or without ``train()`` is measured)
    and again in ``on_train_begin``, where a run starts with empty state unless it resumes from a
    checkpoint (``docs/evaluation.md``), and measures on the Trainer's logging steps (``DefaultFlowCallback``'s rule: ``global_step %
    logging_steps == 0``, and step 1 with ``logging_first_step``; collision every 10 logging steps
    and at each epoch end). A forward pre-hook reads the batch (``model(**inputs)``); gradients are
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
            TensorBoard, ``<output_dir>/headwatch_alerts.jsonl``), or any object with
            ``observe_train(step, metrics)`` / ``observe_val(step, metrics)`` (an ``AlertEngine`` you
            built: its distributed decision is then taken through ``reducer``). Called on every rank
            with the published values; validation also sees the Trainer's ``eval_*`` metrics (use
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
            from names, as in the Lightning callbacks: ``"auto"`` (default) every 10 logging intervals
            (``10 * logging_steps`` steps) when matplotlib is installed, else none; an int: every this
            many steps (needs matplotlib); None or 0: none (see :func:`headwatch.core.orchestrator.set_figures`).
            Core monitors passed in keep their own settings.

    Raises:
        HeadwatchError: a bad argument. No trainer hook raises: a monitor that cannot measure the model
            (no head or embedding found) is left out with one warning naming the cause and what is still
            measured; with ``strict=True`` that, and any other monitoring failure, raises instead.
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
    ) -> None:
        check_figure_argument(figure_every_n_steps)
        check_alert(alert)
        check_bool("stop_on_critical", stop_on_critical)
        check_bool("checkpoint_on_critical", checkpoint_on_critical)
        self.run = Orchestrator(monitors, batch_format=batch_format, prefix=prefix, reducer=reducer, strict=strict, sinks=[TrainerSink(self)])
        self.stop_on_critical, self.checkpoint_on_critical = stop_on_critical, checkpoint_on_critical
        self.figure_every_n_steps = figure_every_n_steps
        self.prefix, self.alert = prefix, alert
        self.console_keys = console_filter(console_keys, prefix)
        """Full names the console printers show (None: all)."""
        self._trainer: Any = None
        self._hooks: list[Any] = []
        self._model: nn.Module | None = None
        self._first = False
        self._control: Any = None
        self._eval_metrics: dict[str, Any] = {}

    # ---------------------------------------------------------------- wiring
    @property
    def trainer(self) -> Trainer | None:
        return self._trainer() if self._trainer is not None else None

    def set_trainer(self, trainer: Trainer) -> None:
        """Keep a (weak) reference to the trainer whose ``log`` receives the values, and let the run see the
        inputs of its loss (``labels`` included) whenever it computes one (:func:`hand_loss_inputs`). Its
        ``TensorBoardCallback`` makes ``headwatch.tensorboard.SummaryWriter`` (an unwritable log directory at
        ``on_train_begin`` no longer stops the run: ``docs/faults.md``)."""
        self._trainer = weakref.ref(trainer)
        hand_loss_inputs(trainer, self.run)
        for cb in trainer.callback_handler.callbacks:  # its writer, made at on_train_begin, survives an unwritable log dir
            if isinstance(cb, TensorBoardCallback):
                cb._SummaryWriter = tb.guarded_writer_class(cb._SummaryWriter)  # noqa: SLF001 - docs/faults.md

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        """The Trainer is built: attach to its model now, so that an ``evaluate()`` before (or without)
        ``train()`` is measured from its first batch. ``on_train_begin`` attaches again to the model it trains."""
        with self.run.guard("attaching at the Trainer's construction"):
            if self.trainer is None and (found := find_trainer(self)) is not None:
                self.set_trainer(found)
            if model is not None:
                self.attach_model(model, self.logging_every(args, state))

    @staticmethod
    def logging_every(args: Any, state: Any) -> int:
        """The Trainer's logging interval in steps (0: not by steps)."""
        return int(getattr(state, "logging_steps", 0) or args.logging_steps) if args.logging_strategy == "steps" else 0

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
        self.run.start_run(resumed=resume_dir(self, args, state) is not None, also=[self.alert] if hasattr(self.alert, "reset") else [])
        every = self.logging_every(args, state)
        if args.logging_strategy == "epoch":
            self.run.warn_once(
                "epoch_strategy",
                "HeadwatchCallback measures on logging steps; with logging_strategy='epoch' only collision "
                "(at epoch ends) and logging_first_step are measured. Use logging_strategy='steps'. (warned once)",
            )
        self._first = bool(args.logging_first_step)
        self.attach_model(model, every)
        self._control = control
        wire_alert(self, args)
        restore_state(self, args, state)  # the monitors' and the alert's state of the checkpoint's step
        self.write_layout()

    def write_layout(self) -> None:
        """The Custom Scalars layout, once per TensorBoard writer of the Trainer (rank zero): called at
        ``on_train_begin`` and after every publication, so a writer the ``TensorBoardCallback`` creates
        later (callbacks in any order, an evaluation-only script) gets it too."""
        if self.reducer.rank == 0:
            try:
                tb.write_layout(self.writers(), TB_PREFIX + self.prefix, category=self.prefix)
            except Exception as err:  # noqa: BLE001
                self.run.fail(err, "writing the TensorBoard dashboard layout")

    def attach_model(self, model: nn.Module, every: int) -> None:
        """Configure every monitor (schedule ``every`` steps), attach it and hook the model's forward."""
        self.run.configure(every, figure_every_n_steps=self.figure_every_n_steps)
        self.run.attach(unwrap(model), root=model, refuse=True)  # FSDP1 (accelerate): summoned from the wrapped model
        self.understand_trainer()
        inner = unwrap(model)
        if self._model is not inner:
            self.close()
            self._hooks = [inner.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
            self._model = inner

    def understand_trainer(self) -> None:
        """TRL's RL trainers: measure the policy's sampling distribution (``docs/rl.md``); TRL trainers the door
        does not understand: the logit statistics refused with one message (:func:`headwatch.core.trl.understand_trainer`)."""
        trainer = self.trainer or find_trainer(self)
        if trainer is not None:
            understand_trainer(self.run, trainer)

    def stop_training(self, alert: Any = None) -> None:
        """An alert action: the Trainer stops after this step (every rank decides alike)."""
        self._control.should_training_stop = True

    def save_checkpoint(self, alert: Any = None) -> None:
        """An alert action: the Trainer saves a checkpoint at this step."""
        self._control.should_save = True

    def close(self) -> None:
        """Remove the forward pre-hook (the monitors keep their hooks and state; ``m.detach()`` removes those)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._model = [], None

    def writers(self) -> list[Any]:
        """The ``SummaryWriter`` of the Trainer's ``TensorBoardCallback`` (``report_to`` tensorboard), rank zero."""
        trainer = self.trainer
        if trainer is None or self.reducer.rank != 0:
            return []
        return [cb.tb_writer for cb in trainer.callback_handler.callbacks if isinstance(cb, TensorBoardCallback) and cb.tb_writer]

    # ---------------------------------------------------------------- the batch
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with self.run.guard("reading the batch"):
            self.read_forward(module, args, kwargs)

    def real_rows(self, batch: dict, training: bool) -> int | None:
        """Evaluation: how many rows of this batch ``gather_for_metrics`` keeps (the last batch of an even
        distributed split holds repeats; :func:`headwatch.core.orchestrator.eval_rows_kept`); None: all."""
        if training or self.run.step is not None:
            return None
        accelerator = getattr(self.trainer, "accelerator", None)
        state = getattr(accelerator, "gradient_state", None)
        ids = batch.get("input_ids")
        if state is None or not state.end_of_dataloader or ids is None or not hasattr(ids, "shape"):
            return None
        return eval_rows_kept(int(ids.shape[0]), int(accelerator.process_index), int(state.remainder))

    def read_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        batch = dict(kwargs)
        if args and "input_ids" not in batch:
            batch["input_ids"] = args[0]
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
        self.run.batch_end()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.guard("reading the gradients"):
            self.run.gradients_ready(loss_scale(self.trainer, args) if self.run.logging else None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.optimizer_stepped()
        self.run.batch_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._control = control
        if self.run.logging and not control.should_log and self.flow_decided():
            self.run.warn_once("should_log", "HeadwatchCallback measured a step the Trainer does not log. (warned once)")
        with self.run.guard("publishing the step"):
            if self.run.logging:  # TRL's own entropy and token accuracy of this step, for the self-check
                self.run.check.trainer_metrics(**trl_step_values(self.trainer, getattr(self, "_trl_marks", {})))
            self.run.end_step(state.global_step)

    def flow_decided(self) -> bool:
        """Whether the Trainer's ``DefaultFlowCallback`` (which sets ``control.should_log``) ran before this
        callback at each event (it does unless this callback was put ahead of it)."""
        callbacks = self.trainer.callback_handler.callbacks if self.trainer is not None else []
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        mine = [i for i, cb in enumerate(callbacks) if cb is self]
        return not flow or not mine or flow[0] < mine[0]

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.run.guard("ending the epoch"):
            self.run.epoch_end(state.global_step - 1, at=state.global_step)

    # ---------------------------------------------------------------- evaluation
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
        save_state(self, args, state)

    def state_dict(self) -> dict[str, Any]:
        """The monitors' state and, with an alert engine, its state (smoothing, episodes, alerts) under ``"alert"``."""
        return with_alert_state(self.run.state_dict(), self.alert)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (each part checked; an invalid part restarts from empty with one warning)."""
        self.run.load_state_dict(state)
        load_alert_state(self.alert, state)


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
