"""A front door's ``alert=`` argument, trainer-free (no torch, no trainer): checked, made an engine, fed as a
sink, saved.

The argument is a :class:`~headwatch.alerts.rules.CollapseRules` (the door builds an
:class:`~headwatch.alerts.engine.AlertEngine` with the standard actions, a webhook included when
``HEADWATCH_WEBHOOK_URL`` is set) or any object with ``observe_train(step, metrics)`` /
``observe_val(step, metrics)`` (an engine the user built). Every door feeds it the same way: as one of its
run's sinks (:class:`EngineSink`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from headwatch.alerts.engine import AlertEngine, standard_actions
from headwatch.alerts.rules import CollapseRules
from headwatch.alerts.webhook import WebhookSender, redact_url, resolve_webhook_url
from headwatch.errors import check_protocol


def is_rules(alert: Any) -> bool:
    """Whether ``alert`` is rules still to be made an engine (a :class:`CollapseRules`)."""
    return isinstance(alert, CollapseRules)


def check_alert(alert: Any) -> Any:
    """``alert`` as given: None, a :class:`CollapseRules`, or an object with ``observe_train`` and ``observe_val``.

    Raises:
        HeadwatchError: anything else.
    """
    if alert is not None and not is_rules(alert):
        check_protocol("alert", alert, ("observe_train", "observe_val"), "a headwatch.alerts.CollapseRules or have observe_train and observe_val methods (an AlertEngine)")
    return alert


def wire_alert(alert: Any, reduce_bool: Callable[[bool], bool], main_process: bool, name: str, **actions: Any) -> Any:
    """The engine of a door's ``alert``: rules become an :class:`AlertEngine` named ``name`` with
    :func:`standard_actions` (``actions``: its keyword arguments; a ``webhook`` to ``$HEADWATCH_WEBHOOK_URL`` when
    that variable is set and ``actions`` has none); an engine (built here or by the user) takes its distributed
    decision through ``reduce_bool`` and runs the main-process actions where ``main_process``. Any other object is
    returned as it is.

    Raises:
        HeadwatchError: an invalid action argument (:func:`standard_actions`), an invalid ``$HEADWATCH_WEBHOOK_URL``.
    """
    if is_rules(alert):
        url = resolve_webhook_url(None) if actions.get("webhook") is None else None
        if url is not None:
            actions["webhook"] = WebhookSender(url)
        alert = AlertEngine(alert, standard_actions(**actions), name=name)
        if url is not None and main_process:
            alert.info(f"headwatch: alerts will be posted to {redact_url(url)}")
    if isinstance(alert, AlertEngine):
        alert.reduce_bool, alert.main_process = reduce_bool, main_process
    return alert


class EngineSink:
    """A door's alert as one of its run's sinks (:class:`~headwatch.core.publish.Sink`): each training logging
    step's values to ``observe_train``, each evaluation's to ``observe_val`` (:func:`observe`), on every rank.

    Args:
        alert: returns the door's alert now (rules not yet made an engine, an engine, or None: nothing observed).
        extra: ``extra(val)``: the trainer's own metrics beside headwatch's at an evaluation (``eval_loss``).
        owned: the door built the engine from rules: it flushes it at the end of training and closes it at
            :meth:`close` (an engine the user built is only flushed).
    """

    def __init__(self, alert: Callable[[], Any], extra: Callable[[bool], Mapping[str, Any]] | None = None,
                 owned: Callable[[], bool] | bool = True) -> None:  # fmt: skip
        self.alert, self.extra, self.owned = alert, extra, owned

    def publish(self, numbers: dict[str, float], media: Any, step: int, val: bool) -> None:
        observe(self.alert(), step, numbers, val, self.extra(val) if self.extra is not None else ())

    def end(self, step: int) -> None:
        """Training ended: wait (bounded) for deliveries in flight and write the records kept back."""
        alert = self.alert()
        if not is_rules(alert) and callable(getattr(alert, "flush", None)):
            alert.flush()

    def close(self) -> None:
        """Release the engine's webhook thread when the door built the engine."""
        alert = self.alert()
        owned = self.owned() if callable(self.owned) else self.owned
        if owned and not is_rules(alert) and callable(getattr(alert, "close", None)):
            alert.close()


def observe(alert: Any, step: int, numbers: Mapping[str, float], val: bool, extra: Mapping[str, Any] = ()) -> None:
    """Hand one publication to ``alert`` (every rank): a training step's values to ``observe_train``, an
    evaluation's to ``observe_val`` with the trainer's own numeric ``extra`` metrics (``eval_loss``) beside them.
    Nothing while ``alert`` is None or rules not yet made an engine."""
    if alert is None or is_rules(alert):
        return
    if val:
        alert.observe_val(step, {**{k: v for k, v in dict(extra).items() if isinstance(v, (int, float))}, **numbers})
    else:
        alert.observe_train(step, numbers)


def with_alert_state(state: dict[str, Any], alert: Any) -> dict[str, Any]:
    """``state`` (the monitors') with ``alert``'s state under ``"alert"`` when it has one (an engine)."""
    if hasattr(alert, "state_dict") and not is_rules(alert):
        state["alert"] = alert.state_dict()
    return state


def load_alert_state(alert: Any, state: Any) -> None:
    """Restore the ``"alert"`` part of a :func:`with_alert_state` state into ``alert`` (when both have one)."""
    if isinstance(state, dict) and "alert" in state and hasattr(alert, "load_state_dict") and not is_rules(alert):
        alert.load_state_dict(state["alert"])
