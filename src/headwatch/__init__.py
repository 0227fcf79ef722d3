"""headwatch: watch the input embedding and the output head of a language model while it trains.

Importing this package is cheap: the Lightning callbacks (and with them Lightning and
torchmetrics) load on first use of their names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

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


# Module paths of 0.2, moved in 0.3 (see docs/core.md, "Where code lives"): importing an old path gives the
# module at its new home, so code and LightningCLI configs written for 0.2 keep working.
MOVED_MODULES = {
    "headwatch._errors": "headwatch.errors",
    "headwatch._capture": "headwatch.model.find",
    "headwatch.sources": "headwatch.model.sources",
    "headwatch._sources_capture": "headwatch.model.capture",
    "headwatch._sources_stats": "headwatch.model.captured",
    "headwatch.adapters": "headwatch.model.adapters",
    "headwatch.weights": "headwatch.model.weights",
    "headwatch.weight_hooks": "headwatch.model.flows",
    "headwatch.core.batch": "headwatch.model.batch",
    "headwatch.core.reduce": "headwatch.distributed.reduce",
    "headwatch.core.fsdp1": "headwatch.distributed.fsdp1",
    "headwatch.core.zero": "headwatch.distributed.zero",
    "headwatch.core.sharded": "headwatch.distributed.sharded",
    "headwatch.core.sharded_drift": "headwatch.distributed.sharded_drift",
    "headwatch.metrics": "headwatch.core.metrics",
    "headwatch.metrics_evidence": "headwatch.core.metrics_evidence",
    "headwatch.figures": "headwatch.core.figures",
    "headwatch.dashboard": "headwatch.tensorboard.layout",
    "headwatch.logit_stats": "headwatch.integrations.lightning.logit_stats",
    "headwatch.gradient_density": "headwatch.integrations.lightning.gradient_density",
    "headwatch.collision": "headwatch.integrations.lightning.collision",
    "headwatch.frequency": "headwatch.integrations.lightning.frequency",
    "headwatch.alerts.lightning": "headwatch.integrations.lightning.alert",
    "headwatch.loop": "headwatch.integrations.loop",
    "headwatch.cost": "headwatch.remedies.cost",
}
"""Old module path -> the module it is now (one object under both names)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of a 0.2 module path with the module at its 0.3 home (the same module object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module was executed at its new home."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
