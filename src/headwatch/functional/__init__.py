"""Pure-torch statistics behind headwatch's monitors (no Lightning).

Every function documents its tensor shapes, units and the source of its definition. Through this package
(``headwatch.functional.<name>``) every function first checks that its tensor arguments are tensors (and
token ids integer ones): a :class:`~headwatch.errors.HeadwatchError` names the argument otherwise.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from headwatch.errors import argument_error, check_int

from headwatch.functional.adapters import add_low_rank_, head_weight_gradient, zero_rows
from headwatch.functional.collision import (
    collision_scalars,
    collision_statistics,
    panel_mask,
    panel_order,
    sample_mask,
    sample_rows,
    synonym_pair_rate,
    top_colliding_pairs,
    top_colliding_pairs_fixed,
)
from headwatch.functional.frequency import (
    BUCKETS,
    FrequencySnapshot,
    bucket_capacity,
    count_order,
    frequency_buckets,
    frequency_snapshot,
    rare_tokens,
    seen_count_ranks,
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
from headwatch.functional.neighbors import (
    Neighbours,
    chunk_sizes,
    merge_maxima,
    nearest_neighbours,
    nearest_neighbours_masked,
    nearest_neighbours_masked_sets,
    pair_cosine,
    row_max,
    similarity_chunks,
    synonym_confusion,
    synonym_table,
    unit_rows,
)
from headwatch.functional.quantiles import nanquantiles, quantiles, sort_key, sorted_quantiles
from headwatch.functional.rows import (
    Summary,
    dense_rows,
    finite_histogram_values,
    lookup_gradient,
    norm_ratio,
    rankdata,
    row_cosine,
    row_density,
    row_nonzero,
    row_nonzero_given_norms,
    row_norms_given_nonzero,
    row_norms,
    row_norms_and_nonzero,
    selected_ranks,
    spearman,
    spearman_of_ranks,
    summarize,
    summarize_groups,
    tie_groups,
)
from headwatch.functional.intervals import Z95, wilson_interval
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
    "norm_ratio",
    "row_nonzero",
    "row_nonzero_given_norms",
    "row_norms_given_nonzero",
    "row_norms",
    "rows_per_chunk",
    "panel_mask",
    "panel_order",
    "sample_rows",
    "sort_key",
    "sorted_quantiles",
    "row_norms_and_nonzero",
    "seen_count_ranks",
    "selected_ranks",
    "spearman",
    "spearman_of_ranks",
    "summarize",
    "summarize_groups",
    "synonym_confusion",
    "synonym_pair_rate",
    "synonym_table",
    "tie_groups",
    "tied_flow_statistics",
    "token_scalars",
    "padded_mass",
    "top_colliding_pairs",
    "wilson_interval",
    "Z95",
]

# collision beyond common drift; loss, accuracy and calibration by target frequency
from headwatch.functional.calibration import (  # noqa: E402
    ECE_BINS,
    MAX_ECE_BINS,
    CalibrationSums,
    calibration_compute,
    calibration_update,
    ece_bin_index,
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
    principal_directions_masked,
    principal_directions_of,
    remove_top_directions,
    resultant_length,
    top_principal_directions,
    unit_row_sum,
    unit_row_sum_masked,
)
from headwatch.functional.drift_pairs import (  # noqa: E402
    CorrectedCollision,
    FixedCollision,
    check_queries,
    collision_from_neighbours,
    corrected_collision,
    corrected_collision_groups,
    corrected_collision_masked,
    rate_above,
    rate_above_masked,
    nn_cosine_by_bucket,
    ordered_pairs,
    partner_ranks,
    synonym_statistics,
    synonym_statistics_masked,
)

__all__ += [
    "ECE_BINS",
    "MAX_ECE_BINS",
    "CalibrationSums",
    "CorrectedCollision",
    "DriftCorrection",
    "Pairable",
    "calibration_compute",
    "calibration_update",
    "ece_bin_index",
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
    "similarity_chunks",
    "row_max",
    "unit_rows",
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
    # the collision measurement without host reads (fixed-size selections, masks)
    "FixedCollision",
    "corrected_collision_groups",
    "corrected_collision_masked",
    "nearest_neighbours_masked_sets",
    "merge_maxima",
    "bucket_capacity",
    "nearest_neighbours_masked",
    "principal_directions_masked",
    "rate_above_masked",
    "sample_mask",
    "synonym_statistics_masked",
    "top_colliding_pairs_fixed",
    "unit_row_sum_masked",
]


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose tensor arguments are checked first: each parameter annotated as a ``Tensor`` must be a
    ``torch.Tensor`` (None where the annotation allows it), and token ids (:data:`_ID_NAMES`) an integer, not a
    bool, tensor; ``ignore_index`` an int (not a bool); otherwise a :class:`~headwatch.errors.HeadwatchError` names
    the argument, what it must be and what it got. The function's own checks (dtypes, shapes, ranges) follow."""
    signature = inspect.signature(fn)
    tensors = {
        name: "None" in str(p.annotation)
        for name, p in signature.parameters.items()
        if str(p.annotation).replace("torch.", "") in ("Tensor", "Tensor | None", "None | Tensor", "Optional[Tensor]")
    }
    if not tensors:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return fn(*args, **kwargs)  # Python's own message for a wrong call
        for name, optional in tensors.items():
            if name not in bound:
                continue
            value = bound[name]
            if value is None and optional:
                continue
            if not isinstance(value, torch.Tensor):
                raise argument_error(name, "a torch.Tensor" + (" or None" if optional else ""), value)
            if name in _ID_NAMES and (value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex):
                raise argument_error(name, "an integer tensor of token ids", value)
        if "ignore_index" in bound:  # a float -100.0 or True would compare with the targets and pass unnoticed
            check_int("ignore_index", bound["ignore_index"])
        return fn(*args, **kwargs)

    return wrapper


_ID_NAMES = frozenset({"targets", "ids", "token_ids", "input_ids", "labels", "queries", "neighbour"})
"""Parameters that hold token ids or row indices."""

for _name in __all__:
    _obj = globals()[_name]
    if inspect.isfunction(_obj):
        globals()[_name] = _checked(_obj)
del _name, _obj
