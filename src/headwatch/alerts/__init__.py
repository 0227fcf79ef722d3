"""Collapse alerts: a trainer-free rule engine and actions, and the Lightning callback.

- :mod:`headwatch.alerts.rules`: :class:`CollapseRules`, the rules as a pure state machine;
- :mod:`headwatch.alerts.rl`: :func:`rl_collapse_rules`, the preset for RL fine-tuning (``docs/rl.md``);
- :mod:`headwatch.alerts.engine`: :class:`AlertEngine`, rules + actions for any loop;
- :mod:`headwatch.alerts.actions`, :mod:`headwatch.alerts.webhook`: what happens at an alert;
- :mod:`headwatch.alerts.wiring`: a front door's ``alert=`` argument (checked, made an engine, fed, saved);
- :mod:`headwatch.alerts.feed`: :class:`~headwatch.alerts.feed.LoggedFeed`, what an alert reads of a trainer's
  logged metrics;
- :mod:`headwatch.alerts.collapse`: :class:`~headwatch.alerts.collapse.CollapseAlert`, the alert callback's
  trainer-free part (imports torch, for the failure policy of :mod:`headwatch.core.monitor`);
- :mod:`headwatch.integrations.lightning.alert`: :class:`SharpnessCollapseAlert` (imports Lightning, loaded
  on first use of its name; everything else here but ``collapse`` imports neither torch nor Lightning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headwatch.alerts.actions import (
    AlertSink,
    ConsoleWarning,
    JsonlLog,
    OnCritical,
    SinkMarker,
    SummaryWriterSink,
    marker_name,
)
from headwatch.alerts.engine import AlertEngine, standard_actions
from headwatch.alerts.events import CRITICAL, SEVERITIES, WARNING, Alert, AlertEvent
from headwatch.alerts.rl import RL_DEFAULTS, rl_collapse_rules
from headwatch.alerts.rules import RULES, CollapseRules
from headwatch.alerts.webhook import WEBHOOK_ENV, WebhookSender, redact_url

if TYPE_CHECKING:
    from headwatch.integrations.lightning.alert import SharpnessCollapseAlert

__all__ = [
    "CRITICAL",
    "RL_DEFAULTS",
    "RULES",
    "SEVERITIES",
    "WARNING",
    "WEBHOOK_ENV",
    "Alert",
    "AlertEngine",
    "AlertEvent",
    "AlertSink",
    "CollapseRules",
    "ConsoleWarning",
    "JsonlLog",
    "OnCritical",
    "SharpnessCollapseAlert",
    "SinkMarker",
    "SummaryWriterSink",
    "WebhookSender",
    "marker_name",
    "redact_url",
    "rl_collapse_rules",
    "standard_actions",
]


def __getattr__(name: str) -> Any:
    if name == "SharpnessCollapseAlert":
        from headwatch.integrations.lightning.alert import SharpnessCollapseAlert

        return SharpnessCollapseAlert
    raise AttributeError(f"module 'headwatch.alerts' has no attribute {name!r}")
