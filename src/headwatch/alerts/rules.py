"""The collapse rules as a pure state machine over logged values (no torch, no Lightning).

Feed :meth:`CollapseRules.observe_train` the values of one logging step and
:meth:`CollapseRules.observe_val` those of one validation (a ``{metric name: value}`` dict);
each returns the :class:`~headwatch.alerts.events.AlertEvent` s (fired / resolved) of that
observation. ``state_dict`` / ``load_state_dict`` round-trip through JSON.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from headwatch.errors import HeadwatchError, StateReader, argument_error, check_instance, check_int, check_optional, check_range, check_str
from headwatch.alerts.events import CRITICAL, FIRED, RESOLVED, SEVERITIES, AlertEvent, episode_key

from headwatch.names import ALERT_RULES as RULES  # declared once with the metric names
VAL_RULES = ("val_stall",)
TRAIN_RULES = tuple(r for r in RULES if r not in VAL_RULES)

Threshold = Union[float, Mapping[str, float], tuple, None]
"""A plain number (critical), ``(warning, critical)`` or ``{"warning": w, "critical": c}``; None: off."""


@dataclass
class _Episode:
    open: bool = False  # the rule fired and has not recovered past the margin
    fired: int = 0  # episodes so far
    pending: int = 0  # consecutive observations with the condition true, while not open


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_values(metrics: Any, where: str) -> None:
    """``metrics`` a mapping of names to real numbers or None (NaN and infinities are numbers: the rules skip them),
    else HeadwatchError naming the metric and ``where`` (a string or a tensor handed by mistake)."""
    if not isinstance(metrics, Mapping):
        raise HeadwatchError(f"{where}: `metrics` must be a dict of metric name -> number, got {type(metrics).__name__}")
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise HeadwatchError(f"{where}: the value of {name!r} must be a real number or None (NaN is taken and "
                                 f"skipped), got a {type(value).__name__}; pass float(value)")


def _push(history: deque, value: Any, keep: int) -> bool:
    """Append ``value`` to a window that keeps the last ``keep`` values; True when the window is full."""
    history.append(value)
    while len(history) > keep:
        history.popleft()
    return len(history) == keep


def parse_threshold(name: str, value: Threshold) -> dict[str, float]:
    """``{severity: threshold}`` from the accepted forms; HeadwatchError naming ``name`` otherwise."""
    if value is None:
        return {}
    if _is_number(value):
        return {CRITICAL: float(value)}
    pair = dict(zip(SEVERITIES, value)) if isinstance(value, tuple) and len(value) == 2 else value
    if isinstance(pair, Mapping) and set(pair) <= set(SEVERITIES):
        out = {s: pair[s] for s in SEVERITIES if pair.get(s) is not None}
        if out and all(_is_number(v) for v in out.values()):
            return {s: float(v) for s, v in out.items()}
    raise argument_error(
        name, f"None, a finite number (critical), a (warning, critical) pair or a dict with keys {SEVERITIES}", value
    )


def _check_order(name: str, thresholds: dict[str, float], warning_first_when_higher: bool) -> None:
    if len(thresholds) < 2:
        return
    w, c = thresholds["warning"], thresholds[CRITICAL]
    if (w < c) if warning_first_when_higher else (w > c):
        relation = ">=" if warning_first_when_higher else "<="
        raise HeadwatchError(f"`{name}`: the warning threshold must be {relation} the critical one (the warning "
                             f"comes first), got warning={w}, critical={c}")


@dataclass
class CollapseRules:
    """The alert rules as a state machine over logged values; every rule is optional.

    Values are observed in order: ``observe_train(step, metrics)`` takes the values of one
    logging step, ``observe_val(step, metrics, dataloader_idx)`` those of one validation
    (``metrics``: metric name -> value, read with the ``*_metric`` names). With ``H_k`` the
    entropy (nats) and ``KL_k`` the kl_to_uniform (nats) of observation ``k``:

    - ``entropy_floor``: fires when ``H_k < t``; re-arms when ``H_k >= t + margin * |t|``.
    - ``entropy_ceiling`` (predictions going flat): fires when ``H_k > t``; re-arms when
      ``H_k <= t - margin * |t|``. Absolute nats, like ``kl_ceiling``; ``H`` is at most
      ``log V`` (``log V = H_k + KL_k``).
    - ``kl_ceiling``: fires when ``KL_k > t``; re-arms when ``KL_k <= t - margin * |t|``.
    - ``entropy_drop`` ``r`` over ``window`` ``N``: with ``S_k = alpha H_k + (1 - alpha) S_{k-1}``
      (``S_0 = H_0``), fires when ``(S_{k-N} - S_k) / S_{k-N} >= r``; re-arms when the drop is
      below ``r (1 - margin)``. With ``drop_from="start"``: ``(S_0 - S_k) / S_0 >= r``, the fraction
      of the run's starting entropy lost (the RL preset, :func:`headwatch.alerts.rl_collapse_rules`).
    - ``val_stall`` over ``patience`` ``P`` validations of dataloader ``val_dataloader_idx``:
      with validation losses ``L_v`` and the entropy ``E_v`` at each validation (the
      ``val_entropy_metric`` value, else the smoothed training entropy ``S``), fires when
      ``L_{v-P} - min(L_{v-P+1}, ..., L_v) < delta`` and ``(E_{v-P} - E_v) / E_{v-P} >=
      min_entropy_drop``; re-arms when either stops holding. Critical only.
    - ``rare_nll_rise`` ``t`` nats over ``rare_window`` ``N`` (off by default: the
      rare targets getting worse while the average improves): with ``R_k`` the rare-target NLL
      (``rare_nll_metric``) and ``L_k`` the overall target NLL (``nll_metric``), both smoothed
      like the entropy (``R~_k = alpha R_k + (1 - alpha) R~_{k-1}``, ``R~_0 = R_0``; same for
      ``L~``), at observations holding both values: fires when ``R~_k - R~_{k-N} > t`` and
      ``L~_k < L~_{k-N}``; re-arms when the rise is ``<= t - margin * |t|`` or ``L~_k >= L~_{k-N}``.

    Each threshold rule takes one plain number (severity ``critical``) or two thresholds,
    ``(warning, critical)`` or ``{"warning": w, "critical": c}``: each severity has its own
    episode and hysteresis. A rule fires when its condition holds at ``for_steps``
    consecutive observations (``for_steps=1``: at the first one, like Prometheus ``for: 0``); an
    observation where it does not hold restarts the count; an open episode does not fire again
    until it re-arms (a ``resolved`` event). Observations at steps below ``warmup_steps`` are
    ignored; a non-finite (NaN, +-inf) or absent value is skipped (it neither counts nor restarts the
    count, and never enters the smoothed values or the windows).

    Raises:
        HeadwatchError: a threshold that is not a finite number (or a pair in the wrong order:
            a warning floor below the critical floor), ``entropy_drop`` outside (0, 1), an
            invalid ``window``, ``patience``, ``for_steps``, ``alpha``, ``margin``, ``warmup_steps``,
            ``delta``, ``min_entropy_drop``, ``val_dataloader_idx``, ``rare_window``, or a metric
            name that is not a non-empty string.
    """

    entropy_floor: Threshold = None
    kl_ceiling: Threshold = None
    entropy_drop: Threshold = None
    window: int = 10
    alpha: float = 0.3
    patience: int | None = None
    delta: float = 0.0
    min_entropy_drop: float = 0.02
    margin: float = 0.05
    warmup_steps: int = 0
    entropy_ceiling: Threshold = None
    for_steps: int = 1
    val_dataloader_idx: int = 0
    entropy_metric: str = "headwatch/logits/entropy"
    kl_metric: str = "headwatch/logits/kl_to_uniform"
    val_metric: str = "val_loss"
    val_entropy_metric: str = "headwatch/val/logits/entropy"
    rare_nll_rise: Threshold = None
    rare_window: int = 10
    rare_nll_metric: str = "headwatch/logits/rare/target_nll"
    nll_metric: str = "headwatch/logits/target_nll"
    smoothed: float | None = None
    history: deque = field(default_factory=deque)  # smoothed entropy, last window + 1 values
    val_history: deque = field(default_factory=deque)  # (val loss, entropy), last patience + 1
    states: dict[str, _Episode] = field(default_factory=dict)  # episode_key(rule, severity) -> episode
    nll_history: deque = field(default_factory=deque)  # (smoothed rare NLL, smoothed NLL), last rare_window + 1
    drop_from: str = "window"
    """``entropy_drop``'s reference: ``"window"`` (``S_{k-N}``) or ``"start"`` (``S_0``, the run's first observed
    entropy after ``warmup_steps``: the fraction of the starting entropy lost; ``window`` unused)."""

    def __post_init__(self) -> None:
        self.thresholds = {
            rule: parse_threshold(rule, getattr(self, rule)) for rule in TRAIN_RULES
        }
        _check_order("entropy_floor", self.thresholds["entropy_floor"], warning_first_when_higher=True)
        for rule in ("entropy_ceiling", "kl_ceiling", "entropy_drop", "rare_nll_rise"):
            _check_order(rule, self.thresholds[rule], warning_first_when_higher=False)
        if not all(t > 0 for t in self.thresholds["rare_nll_rise"].values()):
            raise argument_error("rare_nll_rise", "None or rises > 0 (nats)", self.rare_nll_rise)
        if not all(0 < r < 1 for r in self.thresholds["entropy_drop"].values()):
            raise argument_error("entropy_drop", "None or fractions in (0, 1)", self.entropy_drop)
        for name, low in (("window", 1), ("rare_window", 1), ("for_steps", 1), ("warmup_steps", 0), ("val_dataloader_idx", 0)):
            check_int(name, getattr(self, name), minimum=low)
        check_optional(check_int, "patience", self.patience, minimum=1)
        if self.drop_from not in ("window", "start"):
            raise argument_error("drop_from", "'window' or 'start'", self.drop_from)
        # each field named with the argument of SharpnessCollapseAlert (Lightning) that sets it
        check_range("`alpha` (`smoothing`)", self.alpha, 0, 1, low_open=True)
        check_range("`margin` (`rearm_margin`)", self.margin, 0, 1, high_open=True)
        check_range("`delta` (`val_delta`)", self.delta, 0)
        check_range("`min_entropy_drop` (`val_min_entropy_drop`)", self.min_entropy_drop, 0)
        for name in ("entropy_metric", "kl_metric", "val_metric", "val_entropy_metric", "rare_nll_metric", "nll_metric"):
            check_str(name, getattr(self, name))  # a logged metric's name
        # the state (restored by load_state_dict; given only when copying a state)
        check_optional(check_range, "smoothed", self.smoothed)
        for name in ("history", "val_history", "nll_history"):
            check_instance(name, getattr(self, name), deque)
        check_instance("states", self.states, dict)
        for key in self.episodes():
            self.states.setdefault(key, _Episode())

    # ------------------------------------------------------------------ configuration
    def enabled(self, kind: str = "all") -> list[tuple[str, str]]:
        """``(rule, severity)`` pairs that are on, in a fixed order; ``kind``: "train", "val" or "all"."""
        pairs = [(rule, s) for rule in TRAIN_RULES for s in SEVERITIES if s in self.thresholds[rule]]
        val = [("val_stall", CRITICAL)] if self.patience is not None else []
        return {"train": pairs, "val": val, "all": pairs + val}[kind]

    def episodes(self) -> list[str]:
        return [episode_key(rule, s) for rule, s in self.enabled()]

    def episode(self, rule: str, severity: str = CRITICAL) -> _Episode:
        """The episode state of one rule at one severity (``open``, ``fired``, ``pending``)."""
        return self.states[episode_key(rule, severity)]

    def describe(self, rule: str, severity: str = CRITICAL) -> str:
        """One sentence: why ``rule`` fires at ``severity``."""
        t = self.thresholds.get(rule, {}).get(severity)
        return {
            "entropy_floor": f"entropy fell below {t} nats",
            "entropy_ceiling": f"entropy rose above {t} nats (predictions going flat)",
            "kl_ceiling": f"kl_to_uniform rose above {t} nats",
            "entropy_drop": (f"smoothed entropy dropped by >= {t:.0%} over {self.window} logged values" if self.drop_from
                             == "window" else f"smoothed entropy lost >= {t:.0%} of the run's starting entropy") if t else "",
            "rare_nll_rise": f"rare-target NLL (smoothed) rose by more than {t} nats over {self.rare_window} logged "
            "values while the overall target NLL fell",
            "val_stall": f"entropy falling while {self.val_metric} (dataloader {self.val_dataloader_idx}) improved by "
            f"< {self.delta} over {self.patience} validations",
        }[rule]

    # ------------------------------------------------------------------ transitions
    def _update(self, rule: str, severity: str, condition: bool, recovered: bool, step: int) -> list[AlertEvent]:
        state = self.episode(rule, severity)
        if state.open:
            if recovered:
                state.open = False
                return [AlertEvent(RESOLVED, rule, severity, step)]
            return []
        state.pending = state.pending + 1 if condition else 0
        if state.pending >= self.for_steps:
            state.open, state.pending = True, 0
            state.fired += 1
            return [AlertEvent(FIRED, rule, severity, step)]
        return []

    def force_fire(self, rule: str, severity: str = CRITICAL) -> None:
        """Open an episode that fired on another process, so that this one stays in step."""
        state = self.episode(rule, severity)
        if not state.open:
            state.open, state.pending = True, 0
            state.fired += 1

    def _level(self, rule: str, value: float, below: bool, step: int) -> list[AlertEvent]:
        events = []
        for severity, t in self.thresholds[rule].items():
            band = self.margin * abs(t)
            condition, recovered = (value < t, value >= t + band) if below else (value > t, value <= t - band)
            events += self._update(rule, severity, condition, recovered, step)
        return events

    # ------------------------------------------------------------------ observing
    @staticmethod
    def _read(metrics: Mapping[str, float | None], name: str) -> float | None:
        value = metrics.get(name)
        # inf too: one infinite entropy would leave the smoothed value inf (or NaN) for good
        return None if value is None or not math.isfinite(value) else float(value)

    def observe_train(self, step: int, metrics: Mapping[str, float | None]) -> list[AlertEvent]:
        """Feed one logging step's values (``{metric name: value}``); returns the events of this step.

        Raises:
            HeadwatchError: a value that is not a real number or None (NaN is taken and skipped).
        """
        check_values(metrics, "CollapseRules.observe_train")
        if step < self.warmup_steps:
            return []
        events: list[AlertEvent] = []
        entropy = self._read(metrics, self.entropy_metric)
        if entropy is not None:
            self.smoothed = entropy if self.smoothed is None else self.alpha * entropy + (1 - self.alpha) * self.smoothed
            if self.drop_from == "start":  # the history keeps S_0 only: the run's starting entropy
                full = True
                if not self.history:
                    self.history.append(self.smoothed)
            else:
                full = _push(self.history, self.smoothed, self.window + 1)
            events += self._level("entropy_floor", entropy, True, step)
            events += self._level("entropy_ceiling", entropy, False, step)
            if full:
                old = self.history[0]
                drop = (old - self.smoothed) / old if old > 0 else 0.0
                for severity, r in self.thresholds["entropy_drop"].items():
                    events += self._update("entropy_drop", severity, drop >= r, drop < r * (1 - self.margin), step)
        kl = self._read(metrics, self.kl_metric)
        if kl is not None:
            events += self._level("kl_ceiling", kl, False, step)
        return events + self._rare(metrics, step)

    def _rare(self, metrics: Mapping[str, float | None], step: int) -> list[AlertEvent]:
        """``rare_nll_rise``: the smoothed rare-target NLL rising over the window while the overall one falls."""
        rare, nll = self._read(metrics, self.rare_nll_metric), self._read(metrics, self.nll_metric)
        if not self.thresholds["rare_nll_rise"] or rare is None or nll is None:
            return []
        if self.nll_history:
            last_rare, last_nll = self.nll_history[-1]
            rare, nll = self.alpha * rare + (1 - self.alpha) * last_rare, self.alpha * nll + (1 - self.alpha) * last_nll
        if not _push(self.nll_history, (rare, nll), self.rare_window + 1):
            return []
        old_rare, old_nll = self.nll_history[0]
        rise, falling = rare - old_rare, nll < old_nll
        events: list[AlertEvent] = []
        for severity, t in self.thresholds["rare_nll_rise"].items():
            recovered = rise <= t - self.margin * abs(t) or not falling
            events += self._update("rare_nll_rise", severity, rise > t and falling, recovered, step)
        return events

    def observe_val(self, step: int, metrics: Mapping[str, float | None], dataloader_idx: int = 0) -> list[AlertEvent]:
        """Feed one validation's values of one dataloader; only ``val_dataloader_idx`` is watched (values: as in
        :meth:`observe_train`)."""
        check_values(metrics, "CollapseRules.observe_val")
        loss = self._read(metrics, self.val_metric)
        if self.patience is None or dataloader_idx != self.val_dataloader_idx or step < self.warmup_steps or loss is None:
            return []
        entropy = self._read(metrics, self.val_entropy_metric)
        ent = entropy if entropy is not None else self.smoothed
        if ent is None:
            return []
        if not _push(self.val_history, (loss, ent), self.patience + 1):
            return []
        first_loss, first_ent = self.val_history[0]
        improvement = first_loss - min(loss for loss, _ in list(self.val_history)[1:])
        falling = (first_ent - ent) / first_ent if first_ent > 0 else 0.0
        holds = improvement < self.delta and falling >= self.min_entropy_drop
        return self._update("val_stall", CRITICAL, holds, not holds, step)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            "smoothed": self.smoothed,
            "nll_history": [list(x) for x in self.nll_history],
            "history": list(self.history),
            "val_history": [list(x) for x in self.val_history],
            "states": {k: {"open": v.open, "fired": v.fired, "pending": v.pending} for k, v in self.states.items()},
        }

    def reset(self) -> None:
        """A new run: the smoothing, the histories and every episode start empty."""
        self.smoothed = None
        self.history, self.val_history, self.nll_history = deque(), deque(), deque()
        self.states = {key: _Episode() for key in self.states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; a version-1 state (episodes keyed by the bare rule name) loads as critical.

        Every value is checked before anything changes (finite numbers, pairs of them, episode counts >= 0).

        Raises:
            StateError: an invalid state, naming the key; nothing was changed.
        """
        r = StateReader(state, "CollapseRules", versions=(1, 2))
        smoothed = r.optional_number("smoothed")
        history = r.items("history", _is_number, "a list of finite numbers")

        def pairs(key: str) -> list[tuple[float, float]]:
            ok = lambda x: isinstance(x, (list, tuple)) and len(x) == 2 and all(_is_number(v) for v in x)  # noqa: E731
            return [tuple(x) for x in r.items(key, ok, "a list of pairs of finite numbers")]

        val_history, nll_history = pairs("val_history"), pairs("nll_history")
        episodes: dict[str, _Episode] = {}
        for key, values in r.mapping("states").items():
            e = StateReader(values, f"CollapseRules episode {key!r}", versions=(r.version,))
            episode = _Episode(e.flag("open"), e.count("fired"), e.count("pending"))
            key = key if "/" in str(key) else episode_key(key, CRITICAL)
            if key in self.states:
                episodes[key] = episode
        self.smoothed = smoothed
        self.history = deque(history)
        self.val_history = deque(val_history)
        self.nll_history = deque(nll_history)
        for key in self.states:
            self.states[key] = episodes.get(key, _Episode())
