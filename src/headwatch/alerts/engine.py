"""``AlertEngine``: the collapse rules plus their actions, for any training loop (no torch, no Lightning).

A front door (the Lightning callback, a Hugging Face ``TrainerCallback``, a plain loop) only
feeds it the values of each logging step and each validation, and supplies the distributed
decision and the process rank::

    engine = AlertEngine(CollapseRules(entropy_floor=(1.5, 1.0), for_steps=3),
                         standard_actions(jsonl_path="runs/headwatch_alerts.jsonl"))
    for step in range(n):
        ...
        engine.observe_train(step, {"headwatch/logits/entropy": h, "headwatch/logits/kl_to_uniform": kl})
    engine.close()
"""

from __future__ import annotations

import difflib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from headwatch.errors import (
    HeadwatchError,
    StateError,
    StateReader,
    check_bool,
    check_callable,
    check_instance,
    check_int,
    check_optional,
    check_prefix,
    check_protocol,
    check_sequence,
    check_str,
)
from headwatch.alerts.actions import (
    KEEP_CHECKPOINTS,
    AlertSink,
    CheckpointOnCritical,
    ConsoleWarning,
    JsonlLog,
    OnCritical,
    SinkMarker,
    action_name,
    runs_for,
)
from headwatch.alerts.events import CRITICAL, FIRED, RESOLVED, Alert, AlertEvent, finite_or_none
from headwatch.alerts.rules import CollapseRules, check_values
from headwatch.alerts.webhook import CLOSE_TIMEOUT, WebhookSender


def describe_error(err: BaseException) -> str:
    """``"Type: text"`` of an exception, even one whose ``str`` raises."""
    try:
        text = str(err)
    except Exception:  # noqa: BLE001
        text = "<its message cannot be shown>"
    return f"{type(err).__name__}: {text}"


def _identity(fired: bool) -> bool:
    return fired


def standard_actions(
    *,
    warn: Callable[[str], Any] | None = None,
    sink: AlertSink | None = None,
    prefix: str = "headwatch",
    jsonl_path: str | os.PathLike[str] | None = None,
    callables: Iterable[Callable[[Alert], Any]] = (),
    webhook: WebhookSender | None = None,
    save_checkpoint: Callable[[Alert], Any] | None = None,
    stop: Callable[[Alert], Any] | None = None,
    keep_checkpoints: int = KEEP_CHECKPOINTS,
) -> list[Any]:
    """The actions in their usual order: console, marker + text, JSON Lines, ``callables``, webhook,
    checkpoint (critical only, once per step; :class:`~headwatch.alerts.actions.CheckpointOnCritical` keeps the
    latest ``keep_checkpoints`` files ``save_checkpoint`` returns), stop (critical only). None leaves an action
    out (the console is always on).

    Raises:
        HeadwatchError: an invalid argument (a ``prefix`` ending in ``/``, a non-callable, ...).
    """
    for name, fn in (("warn", warn), ("webhook", webhook), ("save_checkpoint", save_checkpoint), ("stop", stop)):
        check_optional(check_callable, name, fn)
    check_optional(check_protocol, "sink", sink, ["scalar", "text"], "an AlertSink (scalar and text methods)")
    check_prefix(prefix)
    check_int("keep_checkpoints", keep_checkpoints, minimum=1)
    check_optional(check_instance, "jsonl_path", jsonl_path, (str, os.PathLike), "a path (str or os.PathLike)")
    callables = check_actions(callables, "callables")
    actions: list[Any] = [ConsoleWarning(warn)]
    if sink is not None:
        actions.append(SinkMarker(sink, prefix))
    if jsonl_path is not None:
        actions.append(JsonlLog(jsonl_path))
    actions += list(callables)
    if webhook is not None:
        actions.append(webhook)
    if save_checkpoint is not None:
        actions.append(CheckpointOnCritical(save_checkpoint, keep_checkpoints))
    if stop is not None:
        actions.append(OnCritical("stop", stop))
    return actions


MISSING_AFTER = 20
"""Logging steps with values but without a watched metric before the engine warns that its rules cannot fire
(the collision monitor publishes every 10 logging steps)."""


def closest_names(name: str, logged: Sequence[str]) -> str:
    """The logged names closest to ``name`` (difflib), as a clause for a warning about a metric never logged."""
    close = difflib.get_close_matches(name, list(logged), n=3, cutoff=0.5)
    if close:
        return "the closest logged names are " + ", ".join(repr(c) for c in close)
    return f"no logged name is close (logged: {', '.join(repr(k) for k in sorted(logged)[:10]) or 'none'})"


def check_alert_args(rules: CollapseRules, actions: Sequence[Any], critical_actions: bool) -> None:
    """The checks every front door makes beyond :class:`CollapseRules`' own: some rule on, ``actions``
    callables, a critical rule for checkpoint/stop (``critical_actions``). Raises HeadwatchError."""
    if not rules.enabled():
        raise HeadwatchError("every rule is off: set entropy_floor, entropy_ceiling, kl_ceiling, entropy_drop, rare_nll_rise or patience")
    if critical_actions and not any(s == CRITICAL for _, s in rules.enabled()):
        raise HeadwatchError("save_checkpoint / stop_training act on critical alerts, and every rule is warning-only: "
                             "give a critical threshold (a plain number is critical)")
    check_actions(actions)


def check_actions(actions: Any, name: str = "actions") -> list[Any]:
    """Callables taking an :class:`Alert` (read once; returned as a list)."""
    return check_sequence(name, actions, "callables taking an Alert", callable)


class AlertEngine:
    """Evaluate :class:`CollapseRules` on logged values and run the actions of each alert.

    Args:
        rules: the rules and their state.
        actions: callables taking an :class:`Alert`, run in order (see :func:`standard_actions`;
            attributes ``main_process_only`` and ``severities`` restrict where and when).
        reduce_bool: the distributed decision, ``reduce_bool(fired_here) -> fired_anywhere``; called
            once per enabled (rule, severity) at every observation, on every process in the same
            order (a collective). Default: identity (one process).
        main_process: whether this process runs ``main_process_only`` actions (rank zero).
        strict: raise :class:`HeadwatchError` when an action fails instead of warning once.
        warn: message function for warnings (default ``warnings.warn``).
        info: message function for information (default: nothing).
        name: used in messages.

    Each value is evaluated as given: a front door passes each logged value once.
    A failing action is warned about once (per action) and counted in ``action_failures``.

    Raises:
        HeadwatchError: an invalid argument (``rules`` not a CollapseRules, ``actions`` not callables,
            ...); a logged value that is not a real number or None (NaN is taken: it never fires); with ``strict``, a
            failed action.
    """

    def __init__(
        self,
        rules: CollapseRules,
        actions: Sequence[Callable[[Alert], Any]] = (),
        *,
        reduce_bool: Callable[[bool], bool] = _identity,
        main_process: bool = True,
        strict: bool = False,
        warn: Callable[[str], Any] | None = None,
        info: Callable[[str], Any] | None = None,
        name: str = "SharpnessCollapseAlert",
    ) -> None:
        self.rules = check_instance("rules", rules, CollapseRules)
        self.actions = check_actions(actions)
        self.reduce_bool = check_callable("reduce_bool", reduce_bool, "a callable bool -> bool")
        self.main_process = check_bool("main_process", main_process)
        self.strict = check_bool("strict", strict)
        check_optional(check_callable, "warn", warn, "a callable taking a message")
        check_optional(check_callable, "info", info, "a callable taking a message")
        self.warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
        self.info = info or (lambda message: None)
        self.name = check_str("name", name)
        self.alerts: list[Alert] = []
        self.action_failures = 0
        self._published_failures = 0
        self._missing: dict[str, int] = {}  # watched metric -> observations without it (-1: seen, or warned)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ observing
    def observe_train(self, step: int, metrics: Mapping[str, float | None], epoch: int = 0,
                      published: Collection[str] = ()) -> list[Alert]:  # fmt: skip
        """One logging step's values (``{metric name: value}``); returns the alerts raised now.

        Call it on every process at every logging step, also with an empty dict: the decision is a collective.
        A value may be None or NaN (not measured at this step: skipped, it neither fires nor restarts a count).
        ``published``: every name the run publishes besides ``metrics`` (a door that hands the engine the watched
        values only), offered when a watched name is never published (a misspelt ``entropy_metric``).
        """
        check_values(metrics, f"{self.name}.observe_train")
        observed = any(v is not None for v in metrics.values())
        events = self.rules.observe_train(step, metrics) if observed else []
        if observed:
            self._check_watched(metrics, published)
        self._check_ceiling(metrics)
        r = self.rules
        shown = {name: metrics.get(name) for name in (r.entropy_metric, r.kl_metric)}
        if r.thresholds["rare_nll_rise"]:
            shown.update({name: metrics.get(name) for name in (r.rare_nll_metric, r.nll_metric)})
        alerts = self._decide("train", events, step, epoch, shown)
        self.publish_failures(step)
        return alerts

    def watched_train_metrics(self) -> dict[str, list[str]]:
        """The training metrics the rules with a threshold read: name -> those rules (``entropy_metric`` for the
        entropy rules, ``kl_metric`` for ``kl_ceiling``, the two NLLs for ``rare_nll_rise``)."""
        r, t = self.rules, self.rules.thresholds
        needs = {r.entropy_metric: ("entropy_floor", "entropy_drop", "entropy_ceiling"), r.kl_metric: ("kl_ceiling",),
                 r.rare_nll_metric: ("rare_nll_rise",), r.nll_metric: ("rare_nll_rise",)}  # fmt: skip
        out = {name: [rule for rule in rules if t.get(rule)] for name, rules in needs.items()}
        return {name: rules for name, rules in out.items() if rules}

    def _check_watched(self, metrics: Mapping[str, float | None], names: Collection[str] = ()) -> None:
        """Warn once per watched metric absent from :data:`MISSING_AFTER` logging steps that published values and
        never present (a misspelt ``entropy_metric``: its rules could never fire), with the closest published names."""
        for name, rules in self.watched_train_metrics().items():
            count = self._missing.get(name, 0)
            if count < 0:
                continue
            if metrics.get(name) is not None:
                self._missing[name] = -1
                continue
            self._missing[name] = count + 1
            if count + 1 >= MISSING_AFTER:
                self._missing[name] = -1
                published = sorted({*names, *(k for k, v in metrics.items() if v is not None)})
                readers = " and ".join(rules) + (" read" if len(rules) > 1 else " reads")
                self.warn(f"{self.name}: {name!r}, which {readers}, has not been published in {MISSING_AFTER} "
                          f"logging steps, so {'they' if len(rules) > 1 else 'it'} cannot fire; {closest_names(name, published)}. "
                          "Check the rules' *_metric names. (warned once)")  # fmt: skip

    def publish_failures(self, step: int) -> None:
        """Write ``<prefix>/alerts/action_failures`` through every marker sink when the count changed since the
        last time (a failed webhook POST is counted later, from its thread: it shows at the next logging step)."""
        failures = self.action_failures
        if failures == self._published_failures:
            return
        self._published_failures = failures
        for action in self.actions:
            if isinstance(action, SinkMarker) and runs_for(action, Alert("", step, 0, "", {}, ""), self.main_process):
                tag = f"{action.prefix}/alerts/action_failures"
                self._run(action_name(action), lambda a=action: a.sink.scalar(tag, float(failures), step))

    def observe_val(self, step: int, metrics: Mapping[str, float | None], dataloader_idx: int = 0, epoch: int = 0) -> list[Alert]:
        """One validation's values for dataloader ``dataloader_idx`` (names without the ``/dataloader_idx_k`` suffix)."""
        check_values(metrics, f"{self.name}.observe_val")
        observed = any(v is not None for v in metrics.values())
        events = self.rules.observe_val(step, metrics, dataloader_idx) if observed else []
        r = self.rules
        shown = {r.val_metric: metrics.get(r.val_metric), r.val_entropy_metric: metrics.get(r.val_entropy_metric)}
        return self._decide("val", events, step, epoch, shown)

    def _check_ceiling(self, metrics: Mapping[str, float | None]) -> None:
        """Warn once when an ``entropy_ceiling`` is at or above ``log V = H + kl_to_uniform``: it can never fire."""
        ceilings = self.rules.thresholds["entropy_ceiling"]
        h, kl = metrics.get(self.rules.entropy_metric), metrics.get(self.rules.kl_metric)
        if not ceilings or h is None or kl is None or "ceiling" in self._warned or not math.isfinite(h + kl):
            return
        log_v = h + kl
        never = {s: t for s, t in ceilings.items() if t >= log_v}
        if never:
            self._warned.add("ceiling")
            self.warn(f"{self.name}: entropy_ceiling {never} is at or above log V = {log_v:.4g} nats (entropy + "
                      "kl_to_uniform), the largest entropy possible: it can never fire. (warned once)")

    def _decide(self, kind: str, events: list[AlertEvent], step: int, epoch: int, shown: dict) -> list[Alert]:
        fired_here = {(e.rule, e.severity) for e in events if e.kind == FIRED}
        raised = []
        for rule, severity in self.rules.enabled(kind):
            local = (rule, severity) in fired_here
            if bool(self.reduce_bool(local)):
                if not local:  # another process fired: keep this one's episode in step
                    self.rules.force_fire(rule, severity)
                raised.append(self._alert(rule, severity, step, epoch, {**shown, "smoothed_entropy": self.rules.smoothed}))
        for event in events:
            if event.kind == RESOLVED:
                self.info(f"headwatch: {event.rule} ({event.severity}) resolved at step {event.step}; it may fire again")
        return raised

    # ------------------------------------------------------------------ actions
    def message(self, rule: str, severity: str, metrics: Mapping[str, float | None]) -> str:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if v is not None)
        label = rule if severity == CRITICAL else f"{rule}, {severity}"
        return f"headwatch sharpness collapse alert ({label}): {self.rules.describe(rule, severity)} ({shown})"

    def _alert(self, rule: str, severity: str, step: int, epoch: int, metrics: dict[str, float | None]) -> Alert:
        alert = Alert(
            time=datetime.now(timezone.utc).isoformat(),
            step=step,
            epoch=epoch,
            rule=rule,
            metrics=finite_or_none(metrics),
            message=self.message(rule, severity, metrics),
            severity=severity,
        )
        self.alerts.append(alert)  # the record first: no action can lose it
        interrupt: BaseException | None = None
        for action in self.actions:
            if isinstance(action, WebhookSender):
                self._wire_webhook(action)
            if runs_for(action, alert, self.main_process):
                try:
                    self._run(action_name(action), lambda a=action: a(alert))
                except (KeyboardInterrupt, SystemExit) as err:  # raised again once every action has run
                    interrupt = interrupt or err
        if interrupt is not None:
            raise interrupt
        return alert

    def _run(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - an action must not stop training, whatever it raises
            self.action_failed(what, err)

    def action_failed(self, what: str, err: BaseException) -> None:
        """Count a failed action; warn once per action, or raise with ``strict`` (thread-safe)."""
        with self._lock:
            self.action_failures += 1
            first = what not in self._warned
            self._warned.add(what)
        if self.strict:
            raise HeadwatchError(f"{self.name}: the {what} failed: {describe_error(err)}") from err
        if first:
            self.warn(
                f"{self.name}: the {what} failed ({describe_error(err)}); training goes on. Failures are "
                "counted in `action_failures`; pass strict=True to raise instead. (warned once)"
            )

    def _wire_webhook(self, sender: WebhookSender) -> None:
        """Whatever the wiring, a failed delivery is counted and warned, an undelivered one recorded."""
        if sender.on_failure is None:
            sender.on_failure = self.action_failed
        if sender.on_undelivered is None:
            sender.on_undelivered = lambda alerts, seconds: self.undelivered(sender, alerts, seconds)

    def undelivered(self, sender: WebhookSender, alerts: list[Alert], seconds: float) -> None:
        """Alerts ``sender`` gave up at close: counted in ``action_failures``, each written to the JSON Lines log
        as its record plus ``"undelivered": "webhook <scheme://host>"``, and one warning (``strict``: raised)."""
        with self._lock:
            self.action_failures += len(alerts)
        where = []
        for action in self.actions:
            if isinstance(action, JsonlLog) and self.main_process:
                self._run(action_name(action), lambda a=action: a.mark_undelivered(alerts, f"webhook {sender.redacted}"))
                where.append(str(action.path))
        steps = ", ".join(str(a.step) for a in alerts[:5]) + (", ..." if len(alerts) > 5 else "")
        marked = f"marked undelivered in {' and '.join(where)}" if where else "not recorded (no JSON Lines log)"
        message = (f"{self.name}: {len(alerts)} alert(s) (steps {steps}) not delivered to {sender.redacted} within "
                   f"{seconds:g} s at close; {marked}. Check the server, or give close(timeout=...) more time.")
        if self.strict:
            raise HeadwatchError(message)
        self.warn(message)

    def flush(self, timeout: float | None = None) -> None:
        """Wait (bounded) for actions still in flight (the webhook); write the alert records a full or read-only
        disk kept back (:class:`~headwatch.alerts.actions.JsonlLog`; a failure is counted and warned once)."""
        for action in self.actions:
            if isinstance(action, WebhookSender):
                action.flush(timeout, strict=self.strict)
            elif isinstance(action, JsonlLog):
                self._run(action_name(action), action.flush)

    def close(self, timeout: float | None = None) -> None:
        """Release the webhook thread and write the alert records kept back; returns within ``timeout`` seconds in
        all (default :data:`~headwatch.alerts.webhook.CLOSE_TIMEOUT`, 2 s) plus the time to write them. An alert the
        webhook has not delivered by then is counted, marked ``"undelivered"`` in the JSON Lines log and warned about
        once (:meth:`undelivered`)."""
        end = time.monotonic() + (CLOSE_TIMEOUT if timeout is None else timeout)
        for action in self.actions:
            if isinstance(action, WebhookSender):
                self._wire_webhook(action)
                action.close(max(end - time.monotonic(), 0.0))
                action.flush(0.0, strict=self.strict)  # a strict failure policy's error, raised here
        for action in self.actions:
            if isinstance(action, JsonlLog):
                self._run(action_name(action), action.flush)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            "rules": self.rules.state_dict(),
            "alerts": [asdict(a) for a in self.alerts],
            "action_failures": self.action_failures,
        }

    def reset(self) -> None:
        """A new run: the rules' smoothing and episodes, the alerts raised and the failure count emptied."""
        self.rules.reset()
        self.alerts, self.action_failures = [], 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; reads keys with defaults, so version-1 states (0.1 checkpoints) load.

        Every value is checked first: an invalid state restarts the rules and the alert list from empty with one
        warning naming the key, and the resume goes on; ``strict`` raises :class:`~headwatch.errors.StateError`.
        """
        try:
            r = StateReader(state, self.name, versions=(1, 2))
            fields = set(Alert.__dataclass_fields__)
            records = r.items("alerts", lambda a: isinstance(a, dict) and set(a) <= fields and {"time", "step", "epoch", "rule", "metrics", "message"} <= set(a)
                              and isinstance(a["step"], int) and isinstance(a["metrics"], dict),
                              "a list of alert records (dicts of time, step, epoch, rule, metrics, message, severity)")  # fmt: skip
            alerts = [Alert(**a) for a in records]
            failures = r.count("action_failures")
            rules = r.mapping("rules")
            self.rules.load_state_dict(rules)  # checks everything before changing anything
        except StateError as err:
            if self.strict:
                raise
            self.warn(f"{self.name}: the checkpoint's alert state is not valid ({err}); the alert restarts from empty "
                      "(its smoothing, episodes and alert list) and the resume goes on. Pass strict=True to raise instead.")
            self.rules.load_state_dict({})
            alerts, failures = [], 0
        self.alerts = alerts
        self.action_failures = self._published_failures = failures
