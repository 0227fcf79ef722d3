"""headwatch: watch the input embedding and the output head of a language model while it trains.

Importing this package is cheap: the Lightning callbacks (and with them Lightning and
torchmetrics) load on first use of their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headwatch._errors import HeadwatchError

__version__ = "0.1.0"

_LAZY = {
    "LogitStatsMonitor": "headwatch.logit_stats",
    "LogitStatsMetric": "headwatch.metrics",
    "find_output_head": "headwatch._capture",
    "find_input_embedding": "headwatch._capture",
    "GradientDensityMonitor": "headwatch.gradient_density",
    "TokenFrequency": "headwatch.frequency",
    "SynonymCollisionMonitor": "headwatch.collision",
    "SharpnessCollapseAlert": "headwatch.alerts",
    "Alert": "headwatch.alerts",
    "Headwatch": "headwatch.loop",
    "BatchFormat": "headwatch.core.batch",
}

if TYPE_CHECKING:
    from headwatch._capture import find_input_embedding, find_output_head
    from headwatch.frequency import TokenFrequency
    from headwatch.alerts import Alert, SharpnessCollapseAlert
    from headwatch.collision import SynonymCollisionMonitor
    from headwatch.gradient_density import GradientDensityMonitor
    from headwatch.logit_stats import LogitStatsMonitor
    from headwatch.metrics import LogitStatsMetric
    from headwatch.core.batch import BatchFormat
    from headwatch.loop import Headwatch

__all__ = [
    "Alert",
    "BatchFormat",
    "GradientDensityMonitor",
    "Headwatch",
    "HeadwatchError",
    "LogitStatsMetric",
    "LogitStatsMonitor",
    "SharpnessCollapseAlert",
    "SynonymCollisionMonitor",
    "TokenFrequency",
    "__version__",
    "find_input_embedding",
    "find_output_head",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'headwatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
