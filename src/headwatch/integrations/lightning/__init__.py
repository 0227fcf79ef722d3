"""Lightning front door: the driver (:class:`HeadwatchDriver`, one per trainer), the callbacks (one per monitor, as
Lightning's own ``SpikeDetection``) that configure it, and the alert.

The callbacks load Lightning; they are imported on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from headwatch.integrations.lightning.callback import MonitorCallback
from headwatch.integrations.lightning.door import LightningReducer, LightningSink, lightning_step, loss_scale, tensorboard_writers
from headwatch.integrations.lightning.driver import HeadwatchDriver

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
    "HeadwatchDriver",
    "LightningReducer",
    "LightningSink",
    "LogitStatsMonitor",
    "MonitorCallback",
    "SharpnessCollapseAlert",
    "SynonymCollisionMonitor",
    "TensorBoardLogger",
    "TokenFrequency",
    "lightning_step",
    "loss_scale",
    "tensorboard_writers",
]


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        return getattr(importlib.import_module(f"{__name__}.{_CALLBACKS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
