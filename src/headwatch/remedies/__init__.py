"""Remedies for what the monitors show: untie the head, warm up a new head, a tied-head projection.

``headwatch cost`` (:mod:`headwatch.remedies.cost`) says what untying costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "untie_output_head": "headwatch.remedies.untie",
    "UntieReport": "headwatch.remedies.untie",
    "TiedOutputProjection": "headwatch.remedies.projection",
    "install_tied_projection": "headwatch.remedies.projection",
    "HeadWarmup": "headwatch.remedies.warmup",
    "HeadWarmupCore": "headwatch.remedies.warmup",
}

if TYPE_CHECKING:
    from headwatch.remedies.projection import TiedOutputProjection, install_tied_projection
    from headwatch.remedies.untie import UntieReport, untie_output_head
    from headwatch.remedies.warmup import HeadWarmup, HeadWarmupCore

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'headwatch.remedies' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
