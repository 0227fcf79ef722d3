"""Lightning front door: the callbacks (one per monitor, as Lightning's own ``SpikeDetection``) and the alert.

The callbacks load Lightning; they are imported on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from headwatch.integrations.lightning.callback import MonitorCallback, lightning_run
from headwatch.integrations.lightning.door import (
    LightningReducer,
    lightning_step,
    loss_scale,
    publish,
    published_steps,
    tensorboard_writers,
)

if TYPE_CHECKING:
    from headwatch.integrations.lightning.alert import SharpnessCollapseAlert
    from headwatch.integrations.lightning.collision import SynonymCollisionMonitor
    from headwatch.integrations.lightning.frequency import TokenFrequency
    from headwatch.integrations.lightning.gradient_density import GradientDensityMonitor
    from headwatch.integrations.lightning.logger import TensorBoardLogger
    from headwatch.integrations.lightning.logit_stats import LogitStatsMonitor

_CALLBACKS = {
    "LogitStatsMonitor": "logit_stats",
    "GradientDensityMonitor": "gradient_density",
    "SynonymCollisionMonitor": "collision",
    "TokenFrequency": "frequency",
    "SharpnessCollapseAlert": "alert",
    "TensorBoardLogger": "logger",
}

__all__ = [
    "GradientDensityMonitor",
    "LightningReducer",
    "LogitStatsMonitor",
    "MonitorCallback",
    "lightning_run",
    "SharpnessCollapseAlert",
    "SynonymCollisionMonitor",
    "TensorBoardLogger",
    "TokenFrequency",
    "lightning_step",
    "loss_scale",
    "publish",
    "published_steps",
    "tensorboard_writers",
]


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        return getattr(importlib.import_module(f"{__name__}.{_CALLBACKS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
