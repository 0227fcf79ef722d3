"""Pure-torch statistics behind headwatch's monitors (no Lightning).

Every function documents its tensor shapes, units and the source of its definition.
"""

from headwatch.functional.adapters import add_low_rank_, head_weight_gradient, zero_rows
from headwatch.functional.collision import (
    collision_scalars,
    collision_statistics,
    sample_rows,
    synonym_pair_rate,
    top_colliding_pairs,
)
from headwatch.functional.frequency import (
    BUCKETS,
    FrequencySnapshot,
    count_order,
    frequency_buckets,
    frequency_snapshot,
    rare_tokens,
    token_scalars,
)
from headwatch.functional.logits import (
    DEFAULT_MAX_CHUNK_BYTES,
    LogitStatistics,
    compute_dtype,
    entropy,
    kl_from_uniform,
    kl_to_uniform,
    logit_statistics,
    rows_per_chunk,
)
from headwatch.functional.sums import LogitStatSums, logit_stats_compute, logit_stats_update
from headwatch.functional.hidden import hidden_chunk_plan, logit_scale, logit_softcap, logit_statistics_from_hidden
from headwatch.functional.neighbors import Neighbours, chunk_sizes, nearest_neighbours, pair_cosine, synonym_confusion, synonym_table
from headwatch.functional.quantiles import nanquantiles, quantiles, sorted_quantiles
from headwatch.functional.rows import (
    Summary,
    dense_rows,
    finite_histogram_values,
    lookup_gradient,
    rankdata,
    row_cosine,
    row_density,
    row_nonzero,
    row_nonzero_given_norms,
    row_norms,
    spearman,
    summarize,
    summarize_groups,
)
from headwatch.functional.padding import padded_mass
from headwatch.functional.tied import row_group_statistics, tied_flow_statistics

__all__ = [
    "add_low_rank_",
    "head_weight_gradient",
    "zero_rows",
    "BUCKETS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "FrequencySnapshot",
    "LogitStatSums",
    "LogitStatistics",
    "Neighbours",
    "Summary",
    "collision_scalars",
    "collision_statistics",
    "compute_dtype",
    "count_order",
    "dense_rows",
    "entropy",
    "frequency_buckets",
    "frequency_snapshot",
    "hidden_chunk_plan",
    "kl_from_uniform",
    "kl_to_uniform",
    "logit_statistics",
    "logit_statistics_from_hidden",
    "logit_scale",
    "logit_softcap",
    "finite_histogram_values",
    "lookup_gradient",
    "nearest_neighbours",
    "nanquantiles",
    "pair_cosine",
    "quantiles",
    "rankdata",
    "rare_tokens",
    "row_cosine",
    "row_density",
    "row_group_statistics",
    "row_nonzero",
    "row_nonzero_given_norms",
    "row_norms",
    "rows_per_chunk",
    "sample_rows",
    "sorted_quantiles",
    "spearman",
    "summarize",
    "summarize_groups",
    "synonym_confusion",
    "synonym_pair_rate",
    "synonym_table",
    "tied_flow_statistics",
    "token_scalars",
    "padded_mass",
    "top_colliding_pairs",
]

# collision beyond common drift; loss, accuracy and calibration by target frequency
from headwatch.functional.calibration import (  # noqa: E402
    ECE_BINS,
    CalibrationSums,
    calibration_compute,
    calibration_update,
    empty_sums,
)
from headwatch.functional.drift import (  # noqa: E402
    DriftCorrection,
    Pairable,
    apply_correction,
    check_rows,
    default_k,
    mean_resultant_length,
    pairable_rows,
    principal_directions_of,
    remove_top_directions,
    resultant_length,
    top_principal_directions,
    unit_row_sum,
)
from headwatch.functional.drift_pairs import (  # noqa: E402
    CorrectedCollision,
    check_queries,
    collision_from_neighbours,
    corrected_collision,
    rate_above,
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
    "collision_from_neighbours",
    "corrected_collision",
    "default_k",
    "empty_sums",
    "mean_resultant_length",
    "resultant_length",
    "nn_cosine_by_bucket",
    "ordered_pairs",
    "pairable_rows",
    "check_rows",
    "rate_above",
    "chunk_sizes",
    "logit_stats_compute",
    "logit_stats_update",
    "partner_ranks",
    "remove_top_directions",
    "apply_correction",
    "principal_directions_of",
    "unit_row_sum",
    "check_queries",
    "synonym_statistics",
    "top_principal_directions",
]
