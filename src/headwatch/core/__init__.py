"""headwatch's trainer-free core: one object per monitor, driven by a small protocol (see docs/core.md).

No Lightning import here: the front doors (``headwatch.integrations.lightning.door``, the plain-loop
:class:`headwatch.Headwatch`, the Hugging Face callback) feed these objects.
"""

from headwatch.model.batch import BatchFormat, BatchView
from headwatch.core.collision import SynonymCollision
from headwatch.core.frequency import TokenCounts
from headwatch.core.gradients import GradientDensity
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import Media, Monitor
from headwatch.distributed.reduce import NoReducer, Reducer, TorchDistributedReducer
from headwatch.core.schedule import Schedule

__all__ = [
    "BatchFormat",
    "BatchView",
    "GradientDensity",
    "LogitStats",
    "Media",
    "Monitor",
    "NoReducer",
    "Reducer",
    "Schedule",
    "SynonymCollision",
    "TokenCounts",
    "TorchDistributedReducer",
]
