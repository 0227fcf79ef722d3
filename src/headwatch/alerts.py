"""``SharpnessCollapseAlert``: notice a collapse of the predictions while the run is worth saving.

The rules are pure Python over logged values (:class:`CollapseRules`); the callback only
feeds them the values Lightning already holds in ``trainer.callback_metrics`` and runs
the actions.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from headwatch._base import HeadwatchCallback, check_bool, published_steps
from headwatch._errors import HeadwatchError

WEBHOOK_ENV = "HEADWATCH_WEBHOOK_URL"
"""Environment variable read for the webhook URL when ``webhook_url`` is not given."""

RULES = ("entropy_floor", "kl_ceiling", "entropy_drop", "val_stall")


@dataclass
class Alert:
    """One firing of one rule."""

    time: str
    """UTC time, ISO 8601."""
    step: int
    epoch: int
    rule: str
    metrics: dict[str, float | None]
    """Values at the alert; None where a metric was not logged or was NaN (strict JSON: null)."""
    message: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)


@dataclass
class _RuleState:
    open: bool = False  # an episode is open: the rule fired and has not recovered past the margin
    fired: int = 0


@dataclass
class CollapseRules:
    """The alert rules as a state machine over logged values; every rule is optional.

    Values are observed in order; ``observe_train`` takes the values of one logging step,
    ``observe_val`` those of one validation. Each returns the rules that fire now.

    - ``entropy_floor`` (nats): fires when ``H_k < entropy_floor``; re-arms when
      ``H_k >= entropy_floor + margin * |entropy_floor|``.
    - ``kl_ceiling`` (nats): fires when ``KL_k > kl_ceiling``; re-arms when
      ``KL_k <= kl_ceiling - margin * |kl_ceiling|``.
    - ``entropy_drop`` ``r`` over ``window`` ``N``: with the exponential moving average
      ``S_k = alpha H_k + (1 - alpha) S_{k-1}`` (``S_0 = H_0``), fires when
      ``(S_{k-N} - S_k) / S_{k-N} >= r``; re-arms when the drop is below ``r (1 - margin)``.
    - ``val_stall`` over ``patience`` ``P`` validations: with validation losses ``L_v``
      and the smoothed entropy ``E_v`` at each validation, fires when
      ``L_{v-P} - min(L_{v-P+1}, ..., L_v) < delta`` (validation improved by less than
      ``delta``) and ``(E_{v-P} - E_v) / E_{v-P} >= min_entropy_drop`` (entropy falling);
      re-arms when either stops holding.

    Observations at steps below ``warmup_steps`` are ignored. A NaN value is skipped.
    """

    entropy_floor: float | None = None
    kl_ceiling: float | None = None
    entropy_drop: float | None = None
    window: int = 10
    alpha: float = 0.3
    patience: int | None = None
    delta: float = 0.0
    min_entropy_drop: float = 0.02
    margin: float = 0.05
    warmup_steps: int = 0
    smoothed: float | None = None
    history: deque = field(default_factory=deque)  # smoothed entropy, last window + 1 values
    val_history: deque = field(default_factory=deque)  # (val loss, smoothed entropy), last patience + 1
    states: dict[str, _RuleState] = field(default_factory=lambda: {r: _RuleState() for r in RULES})

    def __post_init__(self) -> None:
        for name in ("entropy_floor", "kl_ceiling"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
                raise HeadwatchError(f"`{name}` must be None or a finite number (nats), got {value!r}")
        if self.entropy_drop is not None and not (isinstance(self.entropy_drop, (int, float)) and 0 < self.entropy_drop < 1):
            raise HeadwatchError(f"`entropy_drop` must be None or a fraction in (0, 1), got {self.entropy_drop!r}")
        for name in ("window",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HeadwatchError(f"`{name}` must be an int >= 1, got {value!r}")
        if self.patience is not None and (not isinstance(self.patience, int) or self.patience < 1):
            raise HeadwatchError(f"`patience` must be None or an int >= 1, got {self.patience!r}")
        if not 0 < self.alpha <= 1:
            raise HeadwatchError(f"`smoothing` (alpha) must be in (0, 1], got {self.alpha!r}")
        if not 0 <= self.margin < 1:
            raise HeadwatchError(f"`rearm_margin` must be in [0, 1), got {self.margin!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise HeadwatchError(f"`warmup_steps` must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.delta, (int, float)) or self.delta < 0:
            raise HeadwatchError(f"`val_delta` must be >= 0, got {self.delta!r}")
        if not isinstance(self.min_entropy_drop, (int, float)) or self.min_entropy_drop < 0:
            raise HeadwatchError(f"`val_min_entropy_drop` must be >= 0, got {self.min_entropy_drop!r}")

    def _update(self, rule: str, condition: bool, recovered: bool) -> bool:
        state = self.states[rule]
        if state.open:
            if recovered:
                state.open = False
            return False
        if condition:
            state.open = True
            state.fired += 1
            return True
        return False

    def observe_train(self, step: int, entropy: float | None, kl_to_uniform: float | None) -> list[str]:
        """Feed one logging step's values; returns the rules that fire."""
        if step < self.warmup_steps:
            return []
        fired = []
        if entropy is not None and not math.isnan(entropy):
            self.smoothed = entropy if self.smoothed is None else self.alpha * entropy + (1 - self.alpha) * self.smoothed
            self.history.append(self.smoothed)
            while len(self.history) > self.window + 1:
                self.history.popleft()
            if self.entropy_floor is not None:
                floor = self.entropy_floor
                if self._update("entropy_floor", entropy < floor, entropy >= floor + self.margin * abs(floor)):
                    fired.append("entropy_floor")
            if self.entropy_drop is not None and len(self.history) == self.window + 1:
                old = self.history[0]
                drop = (old - self.smoothed) / old if old > 0 else 0.0
                if self._update("entropy_drop", drop >= self.entropy_drop, drop < self.entropy_drop * (1 - self.margin)):
                    fired.append("entropy_drop")
        if kl_to_uniform is not None and not math.isnan(kl_to_uniform) and self.kl_ceiling is not None:
            ceiling = self.kl_ceiling
            if self._update("kl_ceiling", kl_to_uniform > ceiling, kl_to_uniform <= ceiling - self.margin * abs(ceiling)):
                fired.append("kl_ceiling")
        return fired

    def observe_val(self, step: int, val_loss: float | None, entropy: float | None = None) -> list[str]:
        """Feed one validation's loss (and the entropy then; default: the smoothed training entropy)."""
        if self.patience is None or step < self.warmup_steps or val_loss is None or math.isnan(val_loss):
            return []
        ent = entropy if entropy is not None and not math.isnan(entropy) else self.smoothed
        if ent is None:
            return []
        self.val_history.append((val_loss, ent))
        while len(self.val_history) > self.patience + 1:
            self.val_history.popleft()
        if len(self.val_history) < self.patience + 1:
            return []
        first_loss, first_ent = self.val_history[0]
        improvement = first_loss - min(loss for loss, _ in list(self.val_history)[1:])
        falling = (first_ent - ent) / first_ent if first_ent > 0 else 0.0
        stalled = improvement < self.delta
        collapsing = falling >= self.min_entropy_drop
        if self._update("val_stall", stalled and collapsing, not stalled or not collapsing):
            return ["val_stall"]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "smoothed": self.smoothed,
            "history": list(self.history),
            "val_history": [list(x) for x in self.val_history],
            "states": {k: {"open": v.open, "fired": v.fired} for k, v in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoothed = state.get("smoothed")
        self.history = deque(state.get("history", []))
        self.val_history = deque(tuple(x) for x in state.get("val_history", []))
        for rule, values in state.get("states", {}).items():
            if rule in self.states:
                self.states[rule] = _RuleState(bool(values.get("open", False)), int(values.get("fired", 0)))


def redact_url(url: str) -> str:
    """``scheme://host[:port]`` only: paths, query strings and tokens of webhook URLs are secrets. Never raises."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}/..."
    except ValueError:
        return "<an unparsable URL>"


def _check_webhook_url(url: str) -> None:
    """http(s) with a host and a numeric port, or HeadwatchError that does not echo the URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises on a non-numeric port (a token in the wrong place)
    except ValueError:
        raise HeadwatchError("the webhook URL cannot be parsed (bad port or brackets); it is not shown here") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HeadwatchError(f"the webhook URL must be http(s)://host/..., got {redact_url(url)}")


class SharpnessCollapseAlert(HeadwatchCallback):
    """Alert when the next-token distributions collapse toward a few safe tokens.

    Watches values already logged by :class:`~headwatch.LogitStatsMonitor` (or any logged
    metric), with the rules of :class:`CollapseRules`, each optional: an entropy floor,
    a kl_to_uniform ceiling, a smoothed relative entropy drop over a window, and entropy
    falling while validation loss stalls. Each rule fires once per episode and re-arms
    after the metric recovers past a margin; every process takes the same decision
    (``trainer.strategy.reduce_boolean_decision``). Each value published by a headwatch
    monitor is evaluated once, at the step it was logged; list the alert after the monitors
    to evaluate it in the same step rather than one logging interval later.

    Actions, composable: a console warning (always); a TensorBoard text entry and a scalar
    marker ``headwatch/alerts/<rule>`` = 1 at the alert step; one JSON object per alert
    appended to ``<log_dir>/headwatch_alerts.jsonl`` (flushed and synced at once);
    user ``actions`` (callables taking an :class:`Alert`); a JSON POST to a webhook
    (``webhook_url`` or the ``HEADWATCH_WEBHOOK_URL`` environment variable; timeout at most
    2 s, bounded retries, sent from a background thread; only ``scheme://host`` of the URL
    is ever printed); ``save_checkpoint`` then ``stop_training`` on every process.

    A failing action is warned about once and counted (``action_failures``); training goes
    on unless ``strict=True``.

    Args:
        entropy_metric: logged metric watched as the entropy (nats).
        kl_metric: logged metric watched as kl_to_uniform (nats).
        val_metric: validation loss for the ``val_stall`` rule.
        val_entropy_metric: entropy at validation (default: the smoothed training entropy
            when this metric is absent).
        entropy_floor, kl_ceiling, entropy_drop, window, smoothing, patience, val_delta,
        val_min_entropy_drop, rearm_margin, warmup_steps: the rules, see :class:`CollapseRules`.
        log_every_n_steps: read the training metrics every this many steps (default: the
            Trainer's, the steps the monitors log).
        jsonl: write the JSON Lines log.
        actions: callables run with each :class:`Alert`.
        webhook_url: URL for a JSON POST of each alert; None reads ``HEADWATCH_WEBHOOK_URL``.
        webhook_timeout: seconds per attempt, at most 2.
        webhook_retries: extra attempts after a failure (at most 5).
        save_checkpoint: save ``<log_dir>/headwatch_alert_step<step>.ckpt`` at an alert.
        stop_training: stop training (on all processes) at an alert.
        strict: raise instead of warning when an action fails.

    Raises:
        HeadwatchError: invalid arguments (every rule off, a bad threshold, a timeout above 2 s).
    """

    def __init__(
        self,
        entropy_floor: float | None = None,
        kl_ceiling: float | None = None,
        entropy_drop: float | None = 0.5,
        window: int = 10,
        smoothing: float = 0.3,
        patience: int | None = None,
        val_delta: float = 0.0,
        val_min_entropy_drop: float = 0.02,
        rearm_margin: float = 0.05,
        warmup_steps: int = 0,
        entropy_metric: str = "headwatch/logits/entropy",
        kl_metric: str = "headwatch/logits/kl_to_uniform",
        val_metric: str = "val_loss",
        val_entropy_metric: str = "headwatch/val/logits/entropy",
        log_every_n_steps: int | None = None,
        jsonl: bool = True,
        actions: Sequence[Callable[[Alert], Any]] = (),
        webhook_url: str | None = None,
        webhook_timeout: float = 2.0,
        webhook_retries: int = 2,
        save_checkpoint: bool = False,
        stop_training: bool = False,
        prefix: str = "headwatch",
        strict: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps, prefix, strict)
        self.rules = CollapseRules(
            entropy_floor=entropy_floor,
            kl_ceiling=kl_ceiling,
            entropy_drop=entropy_drop,
            window=window,
            alpha=smoothing,
            patience=patience,
            delta=val_delta,
            min_entropy_drop=val_min_entropy_drop,
            margin=rearm_margin,
            warmup_steps=warmup_steps,
        )
        if entropy_floor is None and kl_ceiling is None and entropy_drop is None and patience is None:
            raise HeadwatchError("every rule is off: set entropy_floor, kl_ceiling, entropy_drop or patience")
        for name, value in (("entropy_metric", entropy_metric), ("kl_metric", kl_metric), ("val_metric", val_metric)):
            if not isinstance(value, str) or not value:
                raise HeadwatchError(f"`{name}` must be a metric name, got {value!r}")
        for name, value in (("jsonl", jsonl), ("save_checkpoint", save_checkpoint), ("stop_training", stop_training)):
            check_bool(name, value)
        if not all(callable(a) for a in actions):
            raise HeadwatchError("`actions` must be callables taking an Alert")
        if not isinstance(webhook_timeout, (int, float)) or not 0 < webhook_timeout <= 2:
            raise HeadwatchError(f"`webhook_timeout` must be in (0, 2] seconds, got {webhook_timeout!r}")
        if not isinstance(webhook_retries, int) or not 0 <= webhook_retries <= 5:
            raise HeadwatchError(f"`webhook_retries` must be an int in [0, 5], got {webhook_retries!r}")
        url = webhook_url if webhook_url is not None else os.environ.get(WEBHOOK_ENV) or None
        if url is not None:
            _check_webhook_url(url)
        self.entropy_metric = entropy_metric
        self.kl_metric = kl_metric
        self.val_metric = val_metric
        self.val_entropy_metric = val_entropy_metric
        self.jsonl = jsonl
        self.actions = list(actions)
        self._webhook_url = url
        self.webhook_timeout = float(webhook_timeout)
        self.webhook_retries = webhook_retries
        self.save_checkpoint = save_checkpoint
        self.stop_training = stop_training

        self.alerts: list[Alert] = []
        self.action_failures = 0
        self._evaluated: dict[str, int] = {}  # metric -> last published step evaluated
        self._step_at_start = 0
        self._jsonl_path: Path | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._resolve_every(trainer)
        log_dir = trainer.log_dir or trainer.default_root_dir
        self._jsonl_path = Path(log_dir) / "headwatch_alerts.jsonl"
        if self._webhook_url is not None:
            rank_zero_info(f"headwatch: alerts will be posted to {redact_url(self._webhook_url)}")

    @property
    def jsonl_path(self) -> Path | None:
        """Where the JSON Lines log is written (known after ``setup``)."""
        return self._jsonl_path

    # ---------------------------------------------------------------- observing
    @staticmethod
    def _value(trainer: pl.Trainer, name: str) -> float | None:
        value = trainer.callback_metrics.get(name)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)  # logging steps only

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step

    def _fresh(self, trainer: pl.Trainer, name: str) -> tuple[float | None, int | None]:
        """``(value, step)`` of a metric not evaluated yet; ``(None, None)`` if absent or already seen.

        Metrics published by headwatch callbacks carry their step, so each value is evaluated
        exactly once whatever the callbacks' order (an alert listed before its monitor reads each
        value one logging step late). Other logged metrics are read at every logging step.
        """
        value = self._value(trainer, name)
        if value is None:
            return None, None
        step = published_steps(trainer).get(name)
        if step is None:
            return value, None
        if step <= self._evaluated.get(name, -1):
            return None, None
        self._evaluated[name] = step
        return value, step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step_at_start
        if trainer.global_step == step or not self._is_logging_step(step):
            return
        # Every process reaches this point on the same steps and takes part in the decision below,
        # even one that holds no value (a metric logged on rank zero only): no mismatched collectives.
        entropy, entropy_step = self._fresh(trainer, self.entropy_metric)
        kl, kl_step = self._fresh(trainer, self.kl_metric)
        missing = [m for m in (self.entropy_metric, self.kl_metric) if m not in trainer.callback_metrics]
        # monitors log from the first logging step; SynonymCollisionMonitor every 10: allow 20 intervals
        if len(missing) == 2 and step >= 20 * self._every:
            self._warn_once(
                "missing",
                f"SharpnessCollapseAlert: neither {self.entropy_metric!r} nor {self.kl_metric!r} has been logged "
                "by this step; check the names (and that the monitor that logs them is attached). (warned once)",
            )
        fired: list[str] = []
        observed = entropy_step if entropy_step is not None else kl_step if kl_step is not None else step
        if entropy is not None or kl is not None:
            fired = self.rules.observe_train(observed, entropy, kl)
        metrics = {self.entropy_metric: entropy, self.kl_metric: kl, "smoothed_entropy": self.rules.smoothed}
        self._decide(trainer, fired, observed, metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.rules.patience is None:
            return
        loss = self._value(trainer, self.val_metric)
        entropy = self._value(trainer, self.val_entropy_metric)
        fired = self.rules.observe_val(trainer.global_step, loss, entropy)
        metrics = {self.val_metric: loss, self.val_entropy_metric: entropy, "smoothed_entropy": self.rules.smoothed}
        self._decide(trainer, fired, trainer.global_step, metrics)

    def _decide(self, trainer: pl.Trainer, fired: list[str], step: int, metrics: dict[str, float | None]) -> None:
        for rule in RULES:
            if rule not in self._rules_enabled():
                continue
            local = rule in fired
            decision = bool(trainer.strategy.reduce_boolean_decision(local, all=False))
            if decision:
                if not local:  # another process fired: keep this one's episode in step
                    self.rules.states[rule].open = True
                    self.rules.states[rule].fired += 1
                self._alert(trainer, rule, step, metrics)

    def _rules_enabled(self) -> list[str]:
        r = self.rules
        on = {
            "entropy_floor": r.entropy_floor is not None,
            "kl_ceiling": r.kl_ceiling is not None,
            "entropy_drop": r.entropy_drop is not None,
            "val_stall": r.patience is not None,
        }
        return [rule for rule in RULES if on[rule]]

    # ---------------------------------------------------------------- actions
    def _message(self, rule: str, metrics: dict[str, float | None]) -> str:
        r = self.rules
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if v is not None)
        why = {
            "entropy_floor": f"entropy fell below {r.entropy_floor} nats",
            "kl_ceiling": f"kl_to_uniform rose above {r.kl_ceiling} nats",
            "entropy_drop": f"smoothed entropy dropped by >= {r.entropy_drop:.0%} over {r.window} logged values"
            if r.entropy_drop is not None
            else "",
            "val_stall": f"entropy falling while {self.val_metric} improved by < {r.delta} over {r.patience} validations",
        }[rule]
        return f"headwatch sharpness collapse alert ({rule}): {why} ({shown})"

    def _alert(self, trainer: pl.Trainer, rule: str, step: int, metrics: dict[str, float | None]) -> None:
        alert = Alert(
            time=datetime.now(timezone.utc).isoformat(),
            step=step,
            epoch=trainer.current_epoch,
            rule=rule,
            metrics={k: (v if v is not None and math.isfinite(v) else None) for k, v in metrics.items()},
            message=self._message(rule, metrics),
        )
        self.alerts.append(alert)
        rank_zero_warn(alert.message)
        self._run("TensorBoard marker", lambda: self._marker(trainer, alert))
        if self.jsonl:
            self._run("JSON Lines log", lambda: self._append_jsonl(alert))
        for action in self.actions:
            self._run(f"action {getattr(action, '__name__', type(action).__name__)}", lambda a=action: a(alert))
        if self._webhook_url is not None:
            self._run("webhook", lambda: self._post_async(alert))
        if self.save_checkpoint:
            path = Path(trainer.log_dir or trainer.default_root_dir) / f"headwatch_alert_step{step}.ckpt"
            self._run("checkpoint", lambda: trainer.save_checkpoint(path))  # every process: a collective
        if self.stop_training:
            trainer.should_stop = True  # the decision was reduced over processes, so all stop

    def _run(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - an action must not stop training
            self._action_failed(what, err)

    def _action_failed(self, what: str, err: BaseException) -> None:
        with self._lock:
            self.action_failures += 1
        if self.strict:
            raise HeadwatchError(f"SharpnessCollapseAlert: the {what} failed: {type(err).__name__}: {err}") from err
        self._warn_once(
            f"action:{what}",
            f"SharpnessCollapseAlert: the {what} failed ({type(err).__name__}: {err}); training goes on. Failures are "
            "counted in `action_failures`; pass strict=True to raise instead. (warned once)",
        )

    def _marker(self, trainer: pl.Trainer, alert: Alert) -> None:
        self._publish(trainer, {f"{self.prefix}/alerts/{alert.rule}": 1.0}, alert.step)
        self._write_text(trainer, f"{self.prefix}/alerts", alert.message, alert.step)

    @rank_zero_only
    def _append_jsonl(self, alert: Alert) -> None:
        assert self._jsonl_path is not None
        self._jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._jsonl_path, "a", encoding="utf-8") as f:
            f.write(alert.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    @rank_zero_only
    def _post_async(self, alert: Alert) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headwatch-webhook")
        self._pending.append(self._executor.submit(self._post, alert))

    def _post(self, alert: Alert) -> None:
        assert self._webhook_url is not None
        body = alert.to_json().encode()
        last: BaseException | None = None
        for attempt in range(self.webhook_retries + 1):
            request = urllib.request.Request(
                self._webhook_url, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.webhook_timeout) as response:  # noqa: S310
                    if 200 <= response.status < 300:
                        return
                    last = RuntimeError(f"HTTP {response.status}")
            except Exception as err:  # noqa: BLE001
                # the exception text may hold the URL: keep only its type and reason
                reason = getattr(err, "reason", None) or getattr(err, "code", None) or type(err).__name__
                last = RuntimeError(f"{type(err).__name__}: {reason}")
            if attempt < self.webhook_retries:
                time.sleep(min(0.25 * 2**attempt, 1.0))
        self._action_failed(f"webhook POST to {redact_url(self._webhook_url)}", last or RuntimeError("unknown"))

    def flush(self, timeout: float | None = None) -> None:
        """Wait for webhook posts still in flight (bounded by their timeouts and retries)."""
        limit = timeout if timeout is not None else (self.webhook_timeout + 1.0) * (self.webhook_retries + 1) + 1
        for future in self._pending:
            try:
                future.result(timeout=limit)
            except HeadwatchError:
                if self.strict:  # raised by _action_failed in the sender thread
                    raise
            except Exception:  # noqa: BLE001 - a post still running past the limit: recorded when it ends
                pass
        self._pending = [f for f in self._pending if not f.done()]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "rules": self.rules.state_dict(),
            "alerts": [asdict(a) for a in self.alerts],
            "action_failures": self.action_failures,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rules.load_state_dict(state_dict.get("rules", {}))
        self.alerts = [Alert(**a) for a in state_dict.get("alerts", [])]
        self.action_failures = int(state_dict.get("action_failures", 0))
