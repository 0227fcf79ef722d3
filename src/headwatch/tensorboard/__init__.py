"""TensorBoard output: scalars, media and the CUSTOM SCALARS layout (:mod:`headwatch.tensorboard.layout`),
and the headwatch tab of TensorBoard (:mod:`headwatch.integrations.tensorboard_plugin`).

Names load on first use: the writers import torch, while the chart declarations
(:mod:`headwatch.tensorboard.charts`) and the TensorBoard plugin, which runs inside the ``tensorboard``
process, import neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

# imported at once (no torch): the function `guard` must shadow its module's name on the package
from headwatch.tensorboard.guard import GuardedFileWriter, guard, storage_status

_HOMES = {
    "GuardedFileWriter": "guard", "guard": "guard", "storage_status": "guard",
    "MarkerSink": "writer", "WriterSink": "writer", "flush": "writer", "guarded": "writer", "prefixed": "writer", "write_histogram": "writer",
    "write_layout": "writer", "write_media": "writer", "batched_scalars": "writer", "write_scalars": "writer",
    "write_text": "writer",
    "SummaryWriter": "summary_writer", "guarded_writer_class": "summary_writer",
}  # fmt: skip

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
