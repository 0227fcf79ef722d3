"""Pure-torch statistics behind headwatch's monitors (no Lightning).

Every function documents its tensor shapes, units and the source of its definition.
"""

from headwatch.functional.logits import (
    DEFAULT_MAX_CHUNK_BYTES,
    LogitStatistics,
    LogitStatSums,
    entropy,
    kl_from_uniform,
    kl_to_uniform,
    logit_statistics,
    logit_statistics_from_hidden,
)
from headwatch.functional.padding import padded_mass

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "LogitStatSums",
    "LogitStatistics",
    "entropy",
    "kl_from_uniform",
    "kl_to_uniform",
    "logit_statistics",
    "logit_statistics_from_hidden",
    "padded_mass",
]
