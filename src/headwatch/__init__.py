"""headwatch: watch the input embedding and the output head of a language model while it trains.

Importing this package is cheap: the Lightning callbacks (and with them Lightning and
torchmetrics) load on first use of their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwatch.errors import HeadwatchError
from headwatch.lazy import lazy_names

__version__ = "0.3.0"
"""The version of headwatch, written only here (``pyproject.toml`` reads it; ``headwatch --version`` prints it)."""

_LAZY = {
    "LogitStatsMonitor": "headwatch.integrations.lightning.logit_stats",
    "LogitStatsMetric": "headwatch.core.metrics",
    "find_output_head": "headwatch.model.find",
    "find_input_embedding": "headwatch.model.find",
    "GradientDensityMonitor": "headwatch.integrations.lightning.gradient_density",
    "TokenFrequency": "headwatch.integrations.lightning.frequency",
    "SynonymCollisionMonitor": "headwatch.integrations.lightning.collision",
    "SharpnessCollapseAlert": "headwatch.integrations.lightning.alert",
    "TensorBoardLogger": "headwatch.integrations.lightning.logger",
    "Alert": "headwatch.alerts",
    "Headwatch": "headwatch.integrations.loop",
    "BatchFormat": "headwatch.model.batch",
}

if TYPE_CHECKING:
    from headwatch.model.find import find_input_embedding, find_output_head
    from headwatch.integrations.lightning.frequency import TokenFrequency
    from headwatch.alerts import Alert
    from headwatch.integrations.lightning.alert import SharpnessCollapseAlert
    from headwatch.integrations.lightning.collision import SynonymCollisionMonitor
    from headwatch.integrations.lightning.gradient_density import GradientDensityMonitor
    from headwatch.integrations.lightning.logit_stats import LogitStatsMonitor
    from headwatch.integrations.lightning.logger import TensorBoardLogger
    from headwatch.core.metrics import LogitStatsMetric
    from headwatch.model.batch import BatchFormat
    from headwatch.integrations.loop import Headwatch

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
    "TensorBoardLogger",
    "TokenFrequency",
    "__version__",
    "find_input_embedding",
    "find_output_head",
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)

