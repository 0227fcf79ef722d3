"""Remedies for what the monitors show: untie the head, warm up a new head, a tied-head projection.

``headwatch cost`` (:mod:`headwatch.remedies.cost`) says what untying costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwatch.lazy import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
