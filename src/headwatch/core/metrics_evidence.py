"""torchmetrics ``Metric`` for loss, accuracy and calibration by target frequency (sums, DDP-exact).

The math is :mod:`headwatch.functional.calibration`; this class only holds its sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torchmetrics import Metric

from headwatch.errors import HeadwatchError, check_int, check_positive_int, check_sequence
from headwatch.functional.calibration import (
    ECE_BINS,
    MAX_ECE_BINS,
    CalibrationSums,
    calibration_compute,
    calibration_update,
    empty_sums,
)
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES, LogitStatistics, logit_statistics


class FrequencyCalibrationMetric(Metric):
    """Mean target NLL, accuracy, confidence, ECE and over-confidence, by target-frequency bucket.

    State: float64 sums and counts (``dist_reduce_fx="sum"``), so values computed on N processes
    equal those of one process on the same global batch. The bucket of each target is the one
    given to ``update`` (frequencies grow during training; pass the current
    ``FrequencySnapshot.bucket`` and ``.rare``).

    Args:
        bucket_names: names of the buckets, in the order of the bucket ids (None:
            ``TokenFrequency``'s ``BUCKETS``: top1, top10, top50, tail, unseen).
        n_bins: ``M``, equal-width confidence bins of the ECE (default 15, at most ``2**22``): ``[m/M, (m+1)/M)``,
            the last one ``[1 - 1/M, 1]`` closed (no extra bin for a confidence of 1; see
            :func:`headwatch.functional.calibration.ece_bin_index` and ``docs/calibration.md``).
        ignore_index: target value marking positions that are not predictions.
        max_chunk_bytes: working-memory bound of :func:`headwatch.functional.logit_statistics`.

    ``update(logits (..., V), targets (...), bucket (V,) int, rare (V,) bool | None, mask (...) | None)``
    or, to reuse the statistics of one pass over the logits,
    ``update_from_statistics(stats, targets, bucket, rare)``; ``compute()`` returns the dict of
    :func:`headwatch.functional.calibration.calibration_compute` (float64 scalars; NaN for a group
    without positions): ``nll_<b>`` (nats), ``accuracy_<b>``, ``confidence_<b>``,
    ``positions_<b>`` for each bucket and ``rare``; ``nll``, ``accuracy``, ``confidence``,
    ``positions``, ``ece``, ``overconfidence``, ``ece_rare``, ``overconfidence_rare``.

    Raises:
        HeadwatchError: bad arguments (at construction) or shapes (at update).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(
        self,
        bucket_names: Sequence[str] | None = None,
        n_bins: int = ECE_BINS,
        ignore_index: int = -100,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if bucket_names is None:
            from headwatch.functional.frequency import BUCKETS

            bucket_names = BUCKETS
        self.bucket_names = tuple(check_sequence("bucket_names", bucket_names, "strings", lambda n: isinstance(n, str), empty=False))
        self.n_bins = check_int("n_bins", check_positive_int("n_bins", n_bins), maximum=MAX_ECE_BINS)
        self.ignore_index = check_int("ignore_index", ignore_index)
        self.max_chunk_bytes = check_positive_int("max_chunk_bytes", max_chunk_bytes)
        for name, default in empty_sums(len(self.bucket_names), n_bins)._asdict().items():
            self.add_state(name, default=default, dist_reduce_fx="sum")

    def update(
        self,
        logits: Tensor | LogitStatistics,
        targets: Tensor,
        bucket: Tensor,
        rare: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> None:
        """Add a batch: ``logits`` ``(..., V)``, or the :class:`LogitStatistics` of one pass over them."""
        if isinstance(logits, LogitStatistics):
            if mask is not None:
                raise HeadwatchError("`mask` is already part of the statistics: pass mask=None with LogitStatistics")
            stats = logits
        else:
            stats = logit_statistics(
                logits, mask=mask, targets=targets, ignore_index=self.ignore_index, max_chunk_bytes=self.max_chunk_bytes
            )
        sums = calibration_update(stats, targets, bucket, len(self.bucket_names), rare, self.n_bins)
        for name, value in sums._asdict().items():
            setattr(self, name, getattr(self, name) + value)

    def update_from_statistics(
        self, stats: LogitStatistics, targets: Tensor, bucket: Tensor, rare: Tensor | None = None
    ) -> None:
        """Add statistics already computed by :func:`logit_statistics` with ``targets`` (no host sync).

        Goes through ``update`` so torchmetrics' bookkeeping (update count, compute cache) holds."""
        self.update(stats, targets, bucket, rare)

    def compute(self) -> dict[str, Tensor]:
        sums = CalibrationSums(**{name: getattr(self, name) for name in CalibrationSums._fields})
        return calibration_compute(sums, self.bucket_names)
