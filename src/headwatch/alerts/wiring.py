"""A front door's ``alert=`` argument, trainer-free (no torch, no trainer): checked, made an engine, fed, saved.

The argument is a :class:`~headwatch.alerts.rules.CollapseRules` (the door builds an
:class:`~headwatch.alerts.engine.AlertEngine` with the standard actions) or any object with
``observe_train(step, metrics)`` / ``observe_val(step, metrics)`` (an engine the user built).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from headwatch.alerts.engine import AlertEngine, standard_actions
from headwatch.alerts.rules import CollapseRules
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
    :func:`standard_actions` (``actions``: its keyword arguments); an engine (built here or by the user) takes its
    distributed decision through ``reduce_bool`` and runs the main-process actions where ``main_process``.
    Any other object is returned as it is.

    Raises:
        HeadwatchError: an invalid action argument (:func:`standard_actions`).
    """
    if is_rules(alert):
        alert = AlertEngine(alert, standard_actions(**actions), name=name)
    if isinstance(alert, AlertEngine):
        alert.reduce_bool, alert.main_process = reduce_bool, main_process
    return alert


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
