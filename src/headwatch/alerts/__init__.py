"""Collapse alerts: a trainer-free rule engine and its actions.

- :mod:`headwatch.alerts.rules`: :class:`CollapseRules`, the rules as a pure state machine;
- :mod:`headwatch.alerts.rl`: :func:`rl_collapse_rules`, the preset for RL fine-tuning (``docs/rl.md``);
- :mod:`headwatch.alerts.engine`: :class:`AlertEngine`, rules + actions for any loop;
- :mod:`headwatch.alerts.actions`, :mod:`headwatch.alerts.webhook`: what happens at an alert;
- :mod:`headwatch.alerts.wiring`: a front door's ``alert=`` argument (checked, made an engine, fed, saved);
- :mod:`headwatch.alerts.feed`: :class:`~headwatch.alerts.feed.LoggedFeed`, what an alert reads of a trainer's
  logged metrics;
- :mod:`headwatch.alerts.collapse`: :class:`~headwatch.alerts.collapse.CollapseAlert`, the alert callback's
  trainer-free part (imports torch, for the failure policy of :mod:`headwatch.core.monitor`; everything else
  here imports neither torch nor a trainer).

The Lightning callback, ``SharpnessCollapseAlert``, is a front door's: import it from ``headwatch`` (or
:mod:`headwatch.integrations.lightning`).
"""

from __future__ import annotations

from headwatch.alerts.actions import (
    AlertSink,
    CheckpointOnCritical,
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
    "CheckpointOnCritical",
    "CollapseRules",
    "ConsoleWarning",
    "JsonlLog",
    "OnCritical",
    "SinkMarker",
    "SummaryWriterSink",
    "WebhookSender",
    "marker_name",
    "redact_url",
    "rl_collapse_rules",
    "standard_actions",
]

