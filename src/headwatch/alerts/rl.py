"""A ready alert preset for RL fine-tuning (GRPO, RLOO, PPO-style): entropy collapse of the policy (``docs/rl.md``).

:func:`rl_collapse_rules` returns a :class:`~headwatch.alerts.rules.CollapseRules` with two rules, both held
for ``for_steps`` consecutive logging steps before they fire:

- a **relative fall** (the default that matters): the smoothed entropy of the sampling distribution lost at
  least a fraction ``fall`` of the run's starting entropy (``entropy_drop`` with ``drop_from="start"``; or of
  its value ``window`` logged steps earlier with ``window=N``). Relative, because
  absolute entropies differ by model, temperature and aggregation: a run's own start is the safe reference;
- an **absolute floor** ``floor`` nats (``entropy_floor``): below it the policy is close to deterministic
  whatever the model (0.05 nats needs a top-1 probability of about 0.99 or more at a typical token), so sampling
  several completions of a prompt explores nothing and the group advantages of GRPO vanish.

No torch import: the rules are a pure state machine; a front door's ``alert=`` takes them.
"""

from __future__ import annotations

from headwatch.alerts.rules import CollapseRules, Threshold
from headwatch.errors import HeadwatchError

PRESET_NAMES = {"entropy_floor": "floor", "entropy_drop": "fall", "alpha": "smoothing"}
""":class:`CollapseRules` argument -> the preset's name for it (errors name the argument the user typed)."""

RL_DEFAULTS = {"floor": 0.05, "fall": (0.3, 0.5), "window": None, "for_steps": 2, "smoothing": 0.5}
"""The preset's defaults; their justification is in ``docs/rl.md`` ("Alerts")."""


def rl_collapse_rules(
    *,
    floor: Threshold = RL_DEFAULTS["floor"],  # type: ignore[assignment]
    fall: Threshold = RL_DEFAULTS["fall"],  # type: ignore[assignment]
    window: int | None = RL_DEFAULTS["window"],  # type: ignore[assignment]
    for_steps: int = RL_DEFAULTS["for_steps"],  # type: ignore[assignment]
    smoothing: float = RL_DEFAULTS["smoothing"],  # type: ignore[assignment]
    warmup_steps: int = 0,
    margin: float = 0.1,
    entropy_metric: str = "headwatch/logits/entropy",
) -> CollapseRules:
    """The RL entropy-collapse preset (module docstring), as :class:`CollapseRules`.

    Args:
        floor: absolute entropy floor in nats (a number: critical; ``(warning, critical)``; None: off).
        fall: the fraction of the starting entropy lost that fires, in (0, 1) (``(warning, critical)``:
            0.3 warns, 0.5 is critical by default; None: off).
        window: None: the fall is measured from the run's start (``S_0`` to ``S_k``, smoothed values); ``N``:
            over the last ``N`` logged steps (``S_{k-N}`` to ``S_k``), for long runs that may lose entropy slowly.
        for_steps: consecutive logging steps a condition must hold before the rule fires (hold time).
        smoothing: ``alpha`` of the exponential smoothing ``S_k = alpha H_k + (1 - alpha) S_{k-1}``.
        warmup_steps: logging steps below this step are not observed.
        margin: re-arm band (a fraction of the threshold).
        entropy_metric: the logged entropy (under the Hugging Face door on a GRPO/RLOO run: the entropy of
            ``softmax(logits / T)`` over completion tokens, equal to TRL's ``entropy``).

    Raises:
        HeadwatchError: as :class:`CollapseRules` (a fall outside (0, 1), a bad window, ...), naming the preset's
            argument; a ``floor`` that is not above 0 nats (an entropy is never below 0: it could not fire).
    """
    floors = floor if isinstance(floor, (tuple, list)) else () if floor is None else (floor,)
    if any(isinstance(f, (int, float)) and not isinstance(f, bool) and not f > 0 for f in floors):
        raise HeadwatchError(f"`floor` must be above 0 nats (an entropy is never below 0, so it could not fire) or None, got {floor!r}")
    try:
        return CollapseRules(
            entropy_floor=floor, entropy_drop=fall, window=window if window is not None else 10, for_steps=for_steps,
            alpha=smoothing, warmup_steps=warmup_steps, margin=margin, entropy_metric=entropy_metric,
            drop_from="start" if window is None else "window",
        )  # fmt: skip
    except HeadwatchError as err:
        message = str(err).replace("`alpha` (`smoothing`)", "`alpha`")
        for theirs, ours in PRESET_NAMES.items():
            message = message.replace(f"`{theirs}`", f"`{ours}`").replace(f"{theirs} ", f"{ours} ")
        raise HeadwatchError(message) from err
