"""What the alert rules emit: :class:`AlertEvent` (engine level) and :class:`Alert` (one firing, as logged).

Pure Python (no torch, no Lightning).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Literal

WARNING = "warning"
CRITICAL = "critical"
SEVERITIES = (WARNING, CRITICAL)
"""Severities in increasing order. A plain number given as a threshold is ``critical``."""

FIRED = "fired"
RESOLVED = "resolved"


@dataclass(frozen=True)
class AlertEvent:
    """A change of one episode of one rule at one severity, returned by :class:`CollapseRules`.

    ``kind`` is ``"fired"`` (the condition held for ``for_steps`` consecutive observations) or
    ``"resolved"`` (the value recovered past the re-arm margin; the rule may fire again).
    """

    kind: Literal["fired", "resolved"]
    rule: str
    severity: str
    step: int

    @property
    def key(self) -> str:
        return episode_key(self.rule, self.severity)


def episode_key(rule: str, severity: str) -> str:
    """``"<rule>/<severity>"``: the key of one episode in ``CollapseRules.states``."""
    return f"{rule}/{severity}"


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
    severity: str = CRITICAL
    """``"warning"`` or ``"critical"`` (a rule given one plain threshold is critical)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)


def finite_or_none(metrics: dict[str, float | None]) -> dict[str, float | None]:
    """NaN and infinities as None, so that :meth:`Alert.to_json` is strict JSON."""
    return {k: (float(v) if v is not None and math.isfinite(v) else None) for k, v in metrics.items()}
