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

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "LogitStatSums",
    "LogitStatistics",
    "entropy",
    "kl_from_uniform",
    "kl_to_uniform",
    "logit_statistics",
    "logit_statistics_from_hidden",
]

# issue 12: collision beyond common drift; loss, accuracy and calibration by target frequency
from headwatch.functional.calibration import (  # noqa: E402
    ECE_BINS,
    CalibrationSums,
    calibration_compute,
    calibration_update,
)
from headwatch.functional.drift import (  # noqa: E402
    DriftCorrection,
    Pairable,
    default_k,
    mean_resultant_length,
    pairable_rows,
    remove_top_directions,
    top_principal_directions,
)
from headwatch.functional.drift_pairs import (  # noqa: E402
    CorrectedCollision,
    corrected_collision,
    nn_cosine_by_bucket,
    ordered_pairs,
    partner_ranks,
    synonym_statistics,
)

__all__ += [
    "ECE_BINS",
    "CalibrationSums",
    "CorrectedCollision",
    "DriftCorrection",
    "Pairable",
    "calibration_compute",
    "calibration_update",
    "corrected_collision",
    "default_k",
    "mean_resultant_length",
    "nn_cosine_by_bucket",
    "ordered_pairs",
    "pairable_rows",
    "partner_ranks",
    "remove_top_directions",
    "synonym_statistics",
    "top_principal_directions",
]
