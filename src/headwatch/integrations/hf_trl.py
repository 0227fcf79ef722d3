"""What the Hugging Face door knows of TRL's trainers, read from the trainer object (no import of ``trl``).

- which TRL trainers the logit statistics understand (:data:`UNDERSTOOD_TRL`), and the refusal of the others
  (:func:`refuse_unknown_trainer`);
- an RL trainer's sampling temperature (:func:`sampling_temperature`), which makes the run an RL run
  (:meth:`~headwatch.core.orchestrator.Orchestrator.sample_at`, ``docs/rl.md``);
- TRL's own per-micro-batch training metrics of a step, for the self-check (:func:`trl_marks`,
  :func:`trl_step_values`);
- the note that TRL's logged metrics are a logging window's means (:func:`window_note`);
- the note that TRL's fused LM head never calls the head (:func:`fused_head_note`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from headwatch.errors import HeadwatchError

RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
"""TRL trainers whose training forward headwatch measures as an RL policy's (``docs/rl.md``): TRL's fused LM head
with ``labels`` = the sampled completion tokens (prompt and padding ``-100``), logits divided by ``temperature``."""
PREFERENCE_TRAINERS = ("DPOTrainer",)
"""TRL preference trainers whose policy forward headwatch measures (``docs/rl.md``): one forward with gradient through
TRL's fused LM head over the chosen and rejected completions, ``labels`` = their tokens (prompt and padding
``-100``): the per-token log-probabilities the loss sums; the reference model's pass runs without gradient (in
evaluation it comes after the policy's, or in a model of its own) and is never measured."""
UNDERSTOOD_TRL = ("SFTTrainer", *RL_TRAINERS, *PREFERENCE_TRAINERS)
"""TRL trainers the door understands (``docs/capture.md``, ``docs/rl.md``); any other TRL trainer is refused."""


def trl_trainer(trainer: Any) -> str | None:
    """The name of the first TRL trainer class in ``trainer``'s class hierarchy (a user's subclass of
    ``GRPOTrainer`` is a ``GRPOTrainer``), or None when none comes from the ``trl`` package."""
    for cls in type(trainer).__mro__:
        if (
            cls.__module__.split(".")[0] == "trl"
            and cls.__name__.endswith("Trainer")
            and cls.__name__ != "_BaseTrainer"
        ):
            return cls.__name__
    return None


def sampling_temperature(trainer: Any) -> float | None:
    """An RL trainer's sampling temperature: ``trainer.temperature`` (TRL sets it from ``args.temperature``, puts it
    in the ``GenerationConfig`` it samples with and divides the training logits by it), else ``args.temperature``;
    None when ``trainer`` is not one of :data:`RL_TRAINERS`."""
    if trl_trainer(trainer) not in RL_TRAINERS:
        return None
    value = getattr(trainer, "temperature", None)
    return (
        value
        if value is not None
        else getattr(getattr(trainer, "args", None), "temperature", None)
    )


def rows_per_example(trainer: Any) -> int:
    """How many rows of a collated batch each example of the data set becomes: 2 under ``DPOTrainer`` (its collator
    puts the chosen completions, then the rejected ones), else 1."""
    return 2 if trl_trainer(trainer) == "DPOTrainer" else 1


def refuse_unknown_trainer(run: Any, trainer: Any) -> None:
    """Under a TRL trainer the door does not understand (``KTOTrainer``, ``RewardTrainer``, ...), refuse the logit
    statistics with ONE message (:meth:`Orchestrator.refuse`): their forwards score mismatched completions ahead of
    the loss's (KTO's KL pass, first in evaluation, where no gradient tells them apart) or a reward head, and the
    figures would silently mean something else."""
    from headwatch.core.logits import LogitStats

    name = trl_trainer(trainer)
    if name is None or name in UNDERSTOOD_TRL:
        return
    logits = [m for m in run.monitors if isinstance(m, LogitStats)]
    if not logits:
        return
    cause = HeadwatchError(
        f"TRL's {name} is not supported by the logit statistics: its forwards do not score one completion against its "
        f"labels as the statistics assume (KTO scores mismatched completions for its KL term before the loss's, and "
        f"in evaluation no gradient tells that pass apart; a reward model has no language-model head), so they would "
        f"mean something else. Supported TRL trainers: "
        f"{', '.join(UNDERSTOOD_TRL)} (docs/rl.md). The gradient, update, frequency, token and collision statistics "
        f"do not depend on it; an alert on the entropy (CollapseRules, rl_collapse_rules) has nothing to read and never "
        f"fires, and the self-check has no NLL to compare"
    )
    run.refuse({m: cause for m in logits})


def understand_trainer(run: Any, trainer: Any) -> None:
    """Tell ``run`` (an :class:`~headwatch.core.orchestrator.Orchestrator`) what kind of TRL trainer drives it: a
    TRL trainer the door does not understand has its logit statistics refused (:func:`refuse_unknown_trainer`);
    an RL trainer's policy is measured at its sampling temperature (:meth:`Orchestrator.sample_at`). Any other
    trainer: nothing."""
    refuse_unknown_trainer(run, trainer)
    if (
        trl_trainer(trainer) in UNDERSTOOD_TRL
    ):  # its fused head projects in float32 when asked to (GRPO, RLOO)
        from headwatch.core.logits import LogitStats

        fp32 = bool(
            getattr(getattr(trainer, "args", None), "cast_lm_head_to_fp32", False)
        )
        for m in run.all_monitors:
            if isinstance(m, LogitStats):
                m.fused_head_in_float32 = fp32
    window_note(run, trainer)
    temperature = sampling_temperature(trainer)
    if temperature is not None:
        run.sample_at(
            temperature,
            f"{type(trainer).__name__}.temperature, from its args.temperature",
        )


def window_note(run: Any, trainer: Any) -> None:
    """Say once, under a TRL trainer that logs its own ``entropy`` with a logging window of several steps, that TRL's
    logged figure is the window's mean while ``logits/entropy`` and ``check/entropy_gap`` are the logging step's own:
    the two curves differ by the entropy's change within the window (0.55 nats of 3.85 on a tiny collapsing GRPO
    run at ``logging_steps=5``), which no gap shows."""
    name = trl_trainer(trainer)
    args = getattr(trainer, "args", None)
    steps = getattr(args, "logging_steps", 1)
    strategy = getattr(args, "logging_strategy", "steps")
    strategy = getattr(strategy, "value", strategy)  # an IntervalStrategy or its string
    if name not in UNDERSTOOD_TRL or strategy != "steps":
        return
    window = f"logging_steps={steps}"
    if 0 < steps < 1:
        # a fraction of the run: the window is ceil(max_steps * logging_steps) steps (TrainerState.compute_steps),
        # known once training starts; before (the Trainer's construction) nothing is said, training says it
        max_steps = getattr(getattr(trainer, "state", None), "max_steps", 0) or 0
        if max_steps <= 0:
            return
        steps = math.ceil(max_steps * steps)
        window = f"{window} of {max_steps} steps: {steps} steps"
    if steps == 1:
        return
    from headwatch.core.logits import LogitStats

    if not any(isinstance(m, LogitStats) for m in run.monitors):
        return
    run.note_once(
        "trl_logging_window",
        f"headwatch: {name} logs `entropy` as the mean of its values over each logging window ({window}: "
        f"the steps since its previous log), while headwatch/logits/entropy is the logging step's own batch, and "
        f"check/entropy_gap compares it with TRL's value of that same step. The two logged curves differ by the "
        f"entropy's change within the window (TRL's lags while the entropy falls); with logging_steps=1 they are "
        f"equal (docs/rl.md). (said once)",
    )


def fused_head_note(run: Any, kwargs: Mapping[str, Any]) -> None:
    """Warn once when a forward runs TRL's fused LM head (``fused_lm_head=True`` among its keyword inputs) while a
    monitor counts synonym confusion at the head: the fused path never calls the head."""
    if kwargs.get("fused_lm_head") and any(
        getattr(m, "synonym_groups", None) for m in run.monitors
    ):
        run.warn_once(
            "fused_confusion",
            "HeadwatchCallback: TRL's fused LM head never calls the head, so collision/synonym_confusion_rate is "
            "not counted on these forwards (the logit statistics use the hidden states). (warned once)",
        )


TRL_METRICS = {"entropy": "entropy", "accuracy": "mean_token_accuracy"}
"""The self-check's names -> TRL's per-micro-batch training metrics (``SFTTrainer._metrics["train"][...]``)."""


def trl_marks(trainer: Any) -> dict[str, int]:
    """How many entries TRL's training metrics hold now (at a step's start); empty without TRL's ``_metrics``."""
    metrics = getattr(trainer, "_metrics", None)
    train = metrics.get("train") if isinstance(metrics, dict) else None
    if not isinstance(train, dict):
        return {}
    return {ours: len(train.get(theirs, ())) for ours, theirs in TRL_METRICS.items()}


def trl_step_values(trainer: Any, marks: dict[str, int]) -> dict[str, list[float]]:
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
        new = (
            values[start:] if start <= len(values) else values
        )  # cleared since (TRL's log): all of them
        if new and all(isinstance(v, (int, float)) for v in new):
            out[ours] = [float(v) for v in new]
    return out
