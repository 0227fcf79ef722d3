"""Pieces of the Hugging Face front door (:mod:`headwatch.integrations.transformers`) that need no callback state."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback

from headwatch import tensorboard as tb
from headwatch.errors import HeadwatchError
from headwatch.core.monitor import Media
from headwatch.model.capture import called_from


TB_PREFIX = "train/"
"""What the Trainer's ``TensorBoardCallback`` puts before every logged key (``rewrite_logs``)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / accelerate / ``torch.compile`` wrappers."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def find_trainer(callback: TrainerCallback) -> Trainer | None:
    """The ``Trainer`` whose callback handler holds ``callback``, found up the call stack.

    Callbacks are not handed the trainer; its methods (``_inner_training_loop``,
    ``evaluate``) are on the stack whenever it calls a callback.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(cb is callback for cb in owner.callback_handler.callbacks):
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


def in_evaluation() -> bool:
    """True when the caller runs inside a ``Trainer.prediction_step`` (``evaluate()``, ``predict()``, any subclass's
    override): an evaluation forward. A forward of the model outside it (the user's own call after ``train()``)
    is no evaluation batch."""
    return called_from("prediction_step", Trainer)


STATE_NAME = "headwatch_state.pt"
"""The monitors' state in each Trainer checkpoint folder (``<output_dir>/checkpoint-<step>/``)."""


def resume_dir(callback: TrainerCallback, args: Any, state: Any) -> str | None:
    """The checkpoint folder a resumed ``train`` started from, or None for a fresh run.

    ``Trainer.train(resume_from_checkpoint=...)`` is read on the call stack (the callback is not
    handed it; ``True`` is already the resolved folder there), else ``args.resume_from_checkpoint``;
    a run whose state starts past step 0 without either resumed from
    ``<output_dir>/checkpoint-<global_step>``.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner, path = frame.f_locals.get("self"), frame.f_locals.get("resume_from_checkpoint")
            if isinstance(owner, Trainer) and isinstance(path, str) and any(cb is callback for cb in owner.callback_handler.callbacks):
                return path
            frame = frame.f_back
    finally:
        del frame
    if isinstance(getattr(args, "resume_from_checkpoint", None), str):
        return args.resume_from_checkpoint
    if state.global_step > 0:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    return None


def restore_state(callback: Any, args: Any, state: Any) -> None:
    """On a resumed run, load into ``callback`` the state its ``on_save`` wrote in the checkpoint folder
    the run resumes from; warn once when that folder holds none."""
    import torch

    folder = resume_dir(callback, args, state)
    if folder is None:
        return
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        callback.run.warn_once(
            "no_state",
            f"HeadwatchCallback: the run resumes from {folder!r}, which holds no {STATE_NAME}; the monitors' "
            "counts start afresh. (warned once)",
        )
        return
    try:
        callback.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as err:  # noqa: BLE001
        callback.run.fail(err, f"restoring the monitors' state from {path}")


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


def is_rules(alert: Any) -> bool:
    from headwatch.alerts import CollapseRules

    return isinstance(alert, CollapseRules)


def wire_alert(callback: Any, args: Any) -> None:
    """Build the ``AlertEngine`` of a callback's ``CollapseRules`` (standard actions: console, a marker in the
    Trainer's TensorBoard, ``<output_dir>/headwatch_alerts.jsonl``); decisions through its reducer, rank zero
    runs the main-process actions."""
    from headwatch.alerts import AlertEngine, standard_actions
    from headwatch.alerts.actions import JSONL_NAME

    if is_rules(callback.alert):
        actions = standard_actions(
            sink=WritersSink(callback), prefix=callback.prefix, jsonl_path=Path(args.output_dir) / JSONL_NAME,
            save_checkpoint=callback.save_checkpoint if callback.checkpoint_on_critical else None,
            stop=callback.stop_training if callback.stop_on_critical else None,
        )  # fmt: skip
        callback.alert = AlertEngine(callback.alert, actions, name="HeadwatchCallback alert")
    if isinstance(callback.alert, AlertEngine):
        callback.alert.reduce_bool = lambda fired: not callback.reducer.all(not fired)
        callback.alert.main_process = callback.reducer.rank == 0


def save_state(callback: Any, args: Any, state: Any) -> None:
    """Write the callback's state to ``<output_dir>/checkpoint-<step>/headwatch_state.pt``: every rank takes the
    (collective) state, the process that saves the Trainer's state (``args.should_save``) writes."""
    import torch
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    try:
        state_dict = callback.state_dict()
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save:
            os.makedirs(folder, exist_ok=True)
            torch.save(state_dict, os.path.join(folder, STATE_NAME))
    except Exception as err:  # noqa: BLE001
        callback.run.fail(err, "saving the monitors' state in the checkpoint")


class WritersSink:
    """The alert's markers and messages in the Trainer's TensorBoard writer, beside its ``train/`` scalars."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def scalar(self, tag: str, value: float, step: int) -> None:
        writers = self.callback.writers()
        tb.write_scalars(writers, {TB_PREFIX + tag: value}, step)
        tb.flush(writers)

    def text(self, tag: str, text: str, step: int) -> None:
        writers = self.callback.writers()
        tb.write_text(writers, TB_PREFIX + tag, text, step)
        tb.flush(writers)


class TrainerSink:
    """The values through ``Trainer.log`` (every ``report_to`` integration, ``log_history``, the console's
    headline keys), media to the Trainer's TensorBoard writer under ``train/``, then the alert."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        cb, trainer = self.callback, self.callback.trainer
        writers = cb.writers()
        for m in media:  # before Trainer.log, whose TensorBoardCallback flushes the writer: one flush
            tb.write_media(writers, tb.prefixed(m, TB_PREFIX), step)
        if trainer is not None:
            should_log = trainer.control.should_log
            # the base method: a subclass's log (TRL's) would flush its own averaged metrics into this record
            with console_shows(trainer, cb.console_keys):  # the console: headline values; report_to: all
                Trainer.log(trainer, dict(numbers))  # its on_log event clears control.should_log ...
            trainer.control.should_log = should_log  # ... which must still log the loss of this step
            cb.write_layout()  # a writer created by that log (callbacks in any order, evaluate() only)
        else:
            tb.flush(writers)
            cb.run.warn_once(
                "no_trainer",
                "HeadwatchCallback could not find its Trainer; values are only kept in `.latest`. Attach it with "
                "headwatch.integrations.transformers.attach(trainer, callback). (warned once)",
            )
        if cb.alert is not None and not is_rules(cb.alert):
            if val:
                extra = {k: v for k, v in cb._eval_metrics.items() if isinstance(v, (int, float))}
                cb.alert.observe_val(step, {**extra, **numbers})
            else:
                cb.alert.observe_train(step, numbers)



RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
"""TRL trainers whose training forward headwatch measures as an RL policy's (``docs/rl.md``): TRL's fused LM head
with ``labels`` = the sampled completion tokens (prompt and padding ``-100``), logits divided by ``temperature``."""
UNDERSTOOD_TRL = ("SFTTrainer", *RL_TRAINERS)
"""TRL trainers the door understands (``docs/capture.md``, ``docs/rl.md``); any other TRL trainer is refused."""


def trl_trainer(trainer: Any) -> str | None:
    """The name of the first TRL trainer class in ``trainer``'s class hierarchy (a user's subclass of
    ``GRPOTrainer`` is a ``GRPOTrainer``), or None when none comes from the ``trl`` package."""
    for cls in type(trainer).__mro__:
        if cls.__module__.split(".")[0] == "trl" and cls.__name__.endswith("Trainer") and cls.__name__ != "_BaseTrainer":
            return cls.__name__
    return None


def sampling_temperature(trainer: Any) -> float | None:
    """An RL trainer's sampling temperature: ``trainer.temperature`` (TRL sets it from ``args.temperature``, puts it
    in the ``GenerationConfig`` it samples with and divides the training logits by it), else ``args.temperature``;
    None when ``trainer`` is not one of :data:`RL_TRAINERS`."""
    if trl_trainer(trainer) not in RL_TRAINERS:
        return None
    value = getattr(trainer, "temperature", None)
    return value if value is not None else getattr(getattr(trainer, "args", None), "temperature", None)


def refuse_unknown_trainer(run: Any, trainer: Any) -> None:
    """Under a TRL trainer the door does not understand (``DPOTrainer``, ``KTOTrainer``, ``RewardTrainer``, ...),
    refuse the logit statistics with ONE message (:meth:`Orchestrator.refuse`): their forwards score pairs of
    completions, a reference model or a reward head, and the figures would silently mean something else."""
    from headwatch.core.logits import LogitStats

    name = trl_trainer(trainer)
    if name is None or name in UNDERSTOOD_TRL:
        return
    logits = [m for m in run.monitors if isinstance(m, LogitStats)]
    if not logits:
        return
    cause = HeadwatchError(
        f"TRL's {name} is not supported by the logit statistics: its training forward does not score one completion "
        f"against its labels as the statistics assume (DPO concatenates chosen and rejected completions and compares "
        f"them with a reference model), so they would mean something else. Supported TRL trainers: "
        f"{', '.join(UNDERSTOOD_TRL)} (docs/rl.md). Gradient, token and collision statistics do not depend on it"
    )
    run.refuse({m: cause for m in logits})


TRL_METRICS = {"entropy": "entropy", "accuracy": "mean_token_accuracy"}
"""The self-check's names -> TRL's per-micro-batch training metrics (``SFTTrainer._metrics["train"][...]``)."""


def trl_marks(trainer: Trainer | None) -> dict[str, int]:
    """How many entries TRL's training metrics hold now (at a step's start); empty without TRL's ``_metrics``."""
    metrics = getattr(trainer, "_metrics", None)
    train = metrics.get("train") if isinstance(metrics, dict) else None
    if not isinstance(train, dict):
        return {}
    return {ours: len(train.get(theirs, ())) for ours, theirs in TRL_METRICS.items()}


def trl_step_values(trainer: Trainer | None, marks: dict[str, int]) -> dict[str, list[float]]:
    """TRL's training metrics appended since ``marks`` (this step's micro-batches: each a token mean over the
    micro-batch, gathered over processes, already Python floats); not the logging window's mean."""
    metrics = getattr(trainer, "_metrics", None)
    train = metrics.get("train") if isinstance(metrics, dict) else None
    if not isinstance(train, dict) or not marks:
        return {}
    out = {}
    for ours, theirs in TRL_METRICS.items():
        values = list(train.get(theirs, ()))
        start = marks.get(ours, 0)
        new = values[start:] if start <= len(values) else values  # cleared since (TRL's log): all of them
        if new and all(isinstance(v, (int, float)) for v in new):
            out[ours] = [float(v) for v in new]
    return out


CONSOLE_PRINTERS = (ProgressCallback, PrinterCallback)
"""The Trainer's callbacks that print every logged record on the console (tqdm bar / ``disable_tqdm``)."""


def console_filter(console_keys: Sequence[str] | str | None, prefix: str) -> frozenset[str] | None:
    """The full names shown on the console: ``None`` -> :data:`headwatch.names.CONSOLE_KEYS`, ``"all"`` -> None
    (no filter); otherwise each name with or without ``<prefix>/``.

    Raises:
        HeadwatchError: ``console_keys`` is not None, ``"all"`` or a sequence of str.
    """
    from headwatch.names import CONSOLE_KEYS

    if console_keys == "all":
        return None
    keys = CONSOLE_KEYS if console_keys is None else console_keys
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
        raise HeadwatchError(f"`console_keys` must be None, 'all' or a sequence of metric names, got {console_keys!r}")
    return frozenset(k if k.startswith(prefix + "/") else f"{prefix}/{k}" for k in keys)


class _ConsoleView(TrainerCallback):
    """A printing callback that sees only the shown keys of one record (nothing when none is shown)."""

    def __init__(self, printer: TrainerCallback, shown: frozenset[str]) -> None:
        self.printer, self.shown = printer, shown

    def __getattr__(self, name: str) -> Any:
        return getattr(self.printer, name)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> Any:
        kept = {k: v for k, v in (logs or {}).items() if k in self.shown}
        if kept:
            extra = {k: logs[k] for k in ("epoch",) if logs and k in logs}
            return self.printer.on_log(args, state, control, logs={**kept, **extra}, **kwargs)
        return None


@contextmanager
def console_shows(trainer: Trainer, shown: frozenset[str] | None) -> Iterator[None]:
    """While inside, the Trainer's console printers print only ``shown`` keys; every other callback (the
    reporting integrations: TensorBoard, W&B ...) receives the whole record. ``shown=None``: no change."""
    callbacks = trainer.callback_handler.callbacks
    swapped = [] if shown is None else [(i, cb) for i, cb in enumerate(callbacks) if isinstance(cb, CONSOLE_PRINTERS)]
    try:
        for i, cb in swapped:
            callbacks[i] = _ConsoleView(cb, shown)
        yield
    finally:
        for i, cb in swapped:
            callbacks[i] = cb
