"""The Hugging Face Trainer as its front door (:mod:`headwatch.integrations.transformers`) sees it: finding it, its
model, its checkpoints, its loss scale, and :class:`TrainerLink`, what the door holds of it."""

from __future__ import annotations

import inspect
import weakref
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from transformers import DefaultFlowCallback, Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback

from headwatch import tensorboard as tb
from headwatch.alerts.actions import JSONL_NAME
from headwatch.alerts.wiring import load_alert_state, with_alert_state
from headwatch.alerts.wiring import wire_alert as wire_engine
from headwatch.core.driver import Driver
from headwatch.core.vocabulary import set_vocab_size
from headwatch.integrations.hf_publish import TB_PREFIX
from headwatch.integrations.hf_trl import (
    rows_per_example,
    trl_trainer,
    understand_trainer,
)
from headwatch.model.capture import called_from
from headwatch.model.hooks import InputsHook
from headwatch.model.weights import declared_shape


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / accelerate / ``torch.compile`` wrappers."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def eval_rows_kept(rows: int, rank: int, remainder: int) -> int:
    """How many of this process's ``rows`` rows of an evaluation's LAST batch are real, not repeats.

    A distributed sampler that evens out the last batch (accelerate's ``even_batches``, the Hugging
    Face Trainer's default) repeats rows of the data set; ``Accelerator.gather_for_metrics`` keeps
    the first ``remainder`` rows (``len(dataset) % total_batch_size``) of the rank-ordered gathered
    batch and drops the rest. The same rows are kept here: on rank ``rank``, the first
    ``clamp(remainder - rank * rows, 0, rows)``. ``remainder <= 0``: every row is real.
    """
    if remainder <= 0:
        return rows
    return max(0, min(rows, remainder - rank * rows))


def find_trainer(callback: TrainerCallback) -> Trainer | None:
    """The ``Trainer`` whose callback handler holds ``callback``, found up the call stack.

    Callbacks are not handed the trainer; its methods (``_inner_training_loop``,
    ``evaluate``) are on the stack whenever it calls a callback.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(
                cb is callback for cb in owner.callback_handler.callbacks
            ):
                return owner
            frame = frame.f_back
    finally:
        del frame
    return None


def evaluation_prefix(metrics: dict | None) -> str:
    """The ``metric_key_prefix`` of an ``evaluate()`` call, from its metrics (every evaluation has
    ``<prefix>_runtime``, ``speed_metrics``); ``"eval"`` when it cannot be read."""
    for key in metrics or {}:
        if key.endswith("_runtime"):
            return key[: -len("_runtime")]
    return "eval"


def hand_loss_inputs(trainer: Trainer, run: Any) -> None:
    """Wrap ``trainer.compute_loss`` (once per trainer and run) so that ``run`` sees the inputs the loss is
    computed with, ``labels`` included, for the duration of the call (:meth:`Orchestrator.loss_inputs`).

    ``Trainer.compute_loss`` pops ``labels`` from the inputs before the forward under label smoothing or a
    ``compute_loss_func`` (TRL's ``SFTTrainer`` makes a label-free forward there); the forward pre-hook
    then sees no labels. Which forward is measured stays the orchestrator's decision.
    """
    current = getattr(trainer, "compute_loss", None)
    if current is None or getattr(current, "__headwatch_run__", None) is run:
        return
    original = current

    def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with run.loss_inputs(inputs):
            return original(model, inputs, *args, **kwargs)

    compute_loss.__headwatch_run__ = run  # type: ignore[attr-defined]
    compute_loss.__wrapped__ = original  # type: ignore[attr-defined]
    trainer.compute_loss = compute_loss  # type: ignore[method-assign]


def batch_scalars_of(callback: Any) -> None:
    """Make a ``TensorBoardCallback`` write each ``Trainer.log`` call's scalars as one event per step
    (:func:`headwatch.tensorboard.batched_scalars`; 150 headwatch values at a logging step: 24 ms -> about 3 ms)."""
    original = callback.on_log
    if getattr(original, "__headwatch_batched__", False):
        return

    def on_log(*args: Any, **kwargs: Any) -> Any:
        with tb.batched_scalars([callback.tb_writer]):
            return original(*args, **kwargs)

    on_log.__headwatch_batched__ = True  # type: ignore[attr-defined]
    callback.on_log = on_log


def tokenizer_size(trainer: Trainer | None) -> int | None:
    """``len(tokenizer)`` of the Trainer's ``processing_class`` (a processor's ``.tokenizer``): the ids the tokenizer
    can produce, added tokens included; None without one (or an image processor, which has no length)."""
    tok = getattr(trainer, "processing_class", None)
    if tok is not None and not hasattr(tok, "__len__"):
        tok = getattr(tok, "tokenizer", None)  # a ProcessorMixin: its text tokenizer
    try:
        return len(tok) if tok is not None and hasattr(tok, "__len__") else None
    except TypeError:
        return None


def in_evaluation() -> bool:
    """True when the caller runs inside a ``Trainer.prediction_step`` (``evaluate()``, ``predict()``, any subclass's
    override): an evaluation forward. A forward of the model outside it (the user's own call after ``train()``)
    is no evaluation batch."""
    return called_from("prediction_step", Trainer)


def loss_scale(trainer: Trainer | None, args: Any) -> Tensor | None:
    """The fp16 ``GradScaler`` scale the backward ran with (gradients unscaled in place first), or None.

    The Trainer unscales gradients in place when it clips (``max_grad_norm > 0``); without
    clipping they are unscaled here, as clipping would (``GradScaler.step`` then skips it).
    """
    accelerator = getattr(trainer, "accelerator", None)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if not args.max_grad_norm or args.max_grad_norm <= 0:
        accelerator.unscale_gradients()
    return scaler.get_scale()


def watch_clipping(trainer: Trainer) -> None:
    """Keep the coefficient of the Trainer's gradient clipping, which runs before ``on_pre_optimizer_step``: its
    accelerator's ``clip_grad_norm_`` is wrapped once, and the coefficient torch applies to every gradient,
    ``min(1, max_norm / (total_norm + 1e-6))``, is kept as a device tensor (no host sync) until
    :func:`gradient_scale` reads it. Without it the tied split would set the captured lookup flow (unclipped)
    against the clipped ``.grad`` (docs/matrices.md)."""
    accelerator = getattr(trainer, "accelerator", None)
    clip = getattr(accelerator, "clip_grad_norm_", None)
    if clip is None or getattr(clip, "headwatch_clip", False):
        return

    def clipped(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        norm = clip(parameters, max_norm, *args, **kwargs)
        if isinstance(norm, Tensor):  # DeepSpeed clips inside its engine and returns None: nothing known
            accelerator.headwatch_clip = (float(max_norm) / (norm.detach().float() + 1e-6)).clamp(max=1.0)
        return norm

    clipped.headwatch_clip = True  # type: ignore[attr-defined]
    accelerator.clip_grad_norm_ = clipped


def gradient_scale(trainer: Trainer | None, args: Any) -> Tensor | float | None:
    """What the captured gradient flows are divided by to equal this step's final ``.grad``: the fp16 loss scale
    (:func:`loss_scale`) over the step's clip coefficient (:func:`watch_clipping`), or None when neither applies.
    Reads (and forgets) the step's clip coefficient, so call it on every optimizer step."""
    accelerator = getattr(trainer, "accelerator", None)
    clip = getattr(accelerator, "headwatch_clip", None)
    if clip is not None:
        accelerator.headwatch_clip = None  # type: ignore[union-attr]
    scale = loss_scale(trainer, args)
    if clip is None:
        return scale
    return (scale if scale is not None else 1.0) / clip


def wire_alert(callback: Any, args: Any) -> None:
    """Build the ``AlertEngine`` of a callback's ``CollapseRules`` (standard actions: console, a marker in the
    Trainer's TensorBoard, ``<output_dir>/headwatch_alerts.jsonl``); decisions through its reducer, rank zero
    runs the main-process actions (:func:`headwatch.alerts.wiring.wire_alert`)."""
    callback.alert = wire_engine(
        callback.alert, lambda fired: not callback.reducer.all(not fired), callback.reducer.rank == 0, "HeadwatchCallback alert",
        sink=tb.MarkerSink(callback.writers, TB_PREFIX), prefix=callback.prefix, jsonl_path=Path(args.output_dir) / JSONL_NAME,
        save_checkpoint=callback.save_checkpoint if callback.checkpoint_on_critical else None,
        stop=callback.stop_training if callback.stop_on_critical else None,
    )  # fmt: skip


class TrainerLink(Driver):
    """What the Hugging Face door holds of its Trainer, beside the hooks that translate the Trainer's events
    (:class:`~headwatch.integrations.transformers.HeadwatchCallback`, which sets the attributes below): the
    trainer (a weak reference), the forward pre-hook on its model, its TensorBoard writers, the alert's
    actions on its ``control``, and the state of a checkpoint.
    """

    prefix: str
    figure_every_n_steps: int | str | None
    vocab_size: int | None = None
    _door_vocab: dict[int, int]
    alert: Any
    inputs: InputsHook
    """The forward pre-hook on the trained model (:class:`~headwatch.model.hooks.InputsHook`)."""
    _trainer: Any = None
    _control: Any = None

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
        watch_clipping(trainer)
        for cb in (
            trainer.callback_handler.callbacks
        ):  # its writer, made at on_train_begin, survives an unwritable log dir
            if isinstance(cb, TensorBoardCallback):
                cb._SummaryWriter = tb.guarded_writer_class(
                    cb._SummaryWriter
                )  # docs/faults.md
                batch_scalars_of(cb)

    @staticmethod
    def logging_every(args: Any, state: Any) -> int:
        """The Trainer's logging interval in steps (0: not by steps)."""
        return (
            int(getattr(state, "logging_steps", 0) or args.logging_steps)
            if args.logging_strategy == "steps"
            else 0
        )

    def write_layout(self) -> None:
        """The Custom Scalars layout, once per TensorBoard writer of the Trainer (rank zero): called at
        ``on_train_begin`` and after every publication, so a writer the ``TensorBoardCallback`` creates
        later (callbacks in any order, an evaluation-only script) gets it too."""
        if self.reducer.rank == 0:
            try:
                tb.write_layout(
                    self.writers(), TB_PREFIX + self.prefix, category=self.prefix
                )
            except Exception as err:  # noqa: BLE001
                self.run.fail(err, "writing the TensorBoard dashboard layout")

    def attach_model(self, model: nn.Module, every: int) -> None:
        """Configure every monitor (schedule ``every`` steps), attach it and hook the model's forward."""
        self.run.configure(every, figure_every_n_steps=self.figure_every_n_steps)
        if (
            self.figure_every_n_steps == "auto"
        ):  # drawn on the probe steps under a budget
            self.run.cost.follow_figures(self.run.named)
        self.use_vocabulary(unwrap(model))
        self.run.attach(
            unwrap(model), root=model, refuse=True
        )  # FSDP1 (accelerate): summoned from the wrapped model
        self.run.vocabulary.again = lambda: self.attach_model(
            model, every
        )  # resized after attach: the tokenizer again
        self.understand_trainer()
        self.inputs.watch(unwrap(model))

    def use_vocabulary(self, model: nn.Module) -> None:
        """The run's vocabulary: ``vocab_size=``, else ``len`` of the Trainer's tokenizer (:func:`tokenizer_size`), handed
        to the token counts and the logit statistics not given one (:func:`set_vocab_size`): the model's rows beyond it
        are left out of the row figures and ``logits/padded_mass`` is published. A tokenizer larger than the model's
        embedding is not used (one warning: its ids past the rows cannot be looked up)."""
        size = (
            self.vocab_size
            if self.vocab_size is not None
            else tokenizer_size(self.trainer or find_trainer(self))
        )
        if size is None:
            return
        getter = getattr(model, "get_input_embeddings", None)
        rows = (declared_shape(getter()) or (None,))[0] if callable(getter) else None
        if self.vocab_size is None and rows is not None and size > rows:
            self.run.warn_once(
                "tokenizer_rows",
                f"headwatch: the Trainer's tokenizer has {size} tokens but the model's input embedding {rows} rows, so "
                "the tokenizer's size is not used (no padded rows are left out, no logits/padded_mass). Fix: "
                "model.resize_token_embeddings(len(tokenizer)), or HeadwatchCallback(vocab_size=...). (warned once)",
            )
            return
        set_vocab_size(self.run.all_monitors, size, self._door_vocab)

    def understand_trainer(self) -> None:
        """TRL's RL trainers: measure the policy's sampling distribution (``docs/rl.md``); TRL trainers the door
        does not understand: the logit statistics refused with one message (:func:`headwatch.integrations.hf_trl.understand_trainer`)."""
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
        self.inputs.remove()

    def writers(self) -> list[Any]:
        """The ``SummaryWriter`` of the Trainer's ``TensorBoardCallback`` (``report_to`` tensorboard), rank zero."""
        trainer = self.trainer
        if trainer is None or self.reducer.rank != 0:
            return []
        return [
            cb.tb_writer
            for cb in trainer.callback_handler.callbacks
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer
        ]

    def real_rows(self, batch: dict, training: bool) -> int | None:
        """Evaluation: how many rows of this batch ``gather_for_metrics`` keeps (the last batch of an even
        distributed split holds repeats; :func:`eval_rows_kept`); None: all."""
        if training or self.run.step is not None:
            return None
        accelerator = getattr(self.trainer, "accelerator", None)
        state = getattr(accelerator, "gradient_state", None)
        ids = batch.get("input_ids")
        if (
            state is None
            or not state.end_of_dataloader
            or ids is None
            or not hasattr(ids, "shape")
        ):
            return None
        if int(getattr(accelerator, "num_processes", 1)) <= 1:
            return None  # one process: no sampler repeats a row, whatever rows the collator made of each example
        if rows_per_example(self.trainer) != 1:
            self.run.warn_once(
                "repeated_rows_per_example",
                f"headwatch: {trl_trainer(self.trainer)} collates several rows per example (DPO: the chosen and "
                "the rejected completion), so the rows the distributed sampler repeats in an evaluation's last "
                "batch cannot be told apart and are counted in val/logits. To leave none, make the evaluation "
                "set a multiple of the processes times the evaluation batch size. (warned once)",
            )
            return None
        return eval_rows_kept(
            int(ids.shape[0]), int(accelerator.process_index), int(state.remainder)
        )

    def flow_decided(self) -> bool:
        """Whether the Trainer's ``DefaultFlowCallback`` (which sets ``control.should_log``) ran before this
        callback at each event (it does unless this callback was put ahead of it)."""
        callbacks = (
            self.trainer.callback_handler.callbacks if self.trainer is not None else []
        )
        flow = [
            i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)
        ]
        mine = [i for i, cb in enumerate(callbacks) if cb is self]
        return not flow or not mine or flow[0] < mine[0]

    def state_dict(self) -> dict[str, Any]:
        """The monitors' state and, with an alert engine, its state (smoothing, episodes, alerts) under ``"alert"``."""
        return with_alert_state(self.run.state_dict(), self.alert)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (each part checked; an invalid part restarts from empty with one warning)."""
        self.run.load_state_dict(state)
        load_alert_state(self.alert, state)
