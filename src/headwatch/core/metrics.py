"""torchmetrics ``Metric`` classes: sums and counts on the device, exact under DDP reduction."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from headwatch.errors import check_bool, check_int, check_positive_int
from headwatch.functional.quantiles import nanquantiles
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES, logit_statistics
from headwatch.functional.sums import KEYS, LogitStatSums, logit_stats_compute, logit_stats_update

ENTROPY_QUANTILES = (0.05, 0.50, 0.95)
"""Quantiles of per-position entropy reported by :class:`LogitStatsMetric` (p05, p50, p95)."""

SCALAR_KEYS = (*KEYS, *(f"entropy_p{round(q * 100):02d}" for q in ENTROPY_QUANTILES))
"""The scalars of :meth:`LogitStatsMetric.compute`: :data:`headwatch.functional.sums.KEYS` (derived from the
fields of :class:`~headwatch.functional.LogitStatistics`) and the entropy quantiles."""


class LogitStatsMetric(Metric):
    """Entropy and sharpness of next-token distributions, accumulated over batches.

    State is float64 sums and counts (``dist_reduce_fx="sum"``) plus, when
    ``keep_entropies`` is True, the per-position entropies (``"cat"``) for exact
    quantiles; so the values computed on N processes equal those of one process on the
    same global batch.

    Args:
        ignore_index: target value marking positions that are not predictions.
        max_chunk_bytes: working-memory bound per chunk, see
            :func:`headwatch.functional.logit_statistics`.
        keep_entropies: keep every valid position's entropy for quantiles and histograms
            (4 bytes a position).
        pad_entropies: ``entropy_values`` keeps every position, NaN where it is not valid (no host
            sync: a boolean selection waits for the device; the reader drops the NaNs on the host).

    ``update(logits (..., V), mask (...) bool | None, targets (...) int | None)``;
    ``compute()`` returns a dict of float64 scalars named :data:`SCALAR_KEYS`: the mean of every
    per-position statistic of :class:`~headwatch.functional.LogitStatistics` over the valid
    positions (NaN when there were none; ``nll`` as ``target_nll`` and ``target_is_argmax`` as
    ``target_argmax_rate``, over the positions with a target), the counts ``positions``,
    ``nonfinite_positions``, ``invalid_target_positions``, see
    :mod:`headwatch.functional.sums`; ``entropy_p05``, ``entropy_p50``, ``entropy_p95``; and
    ``entropy_values`` (the 1-D tensor of per-position entropies; NaN-padded with
    ``pad_entropies``) when ``keep_entropies``. The quantiles make no host sync; dropping the NaNs
    of ``entropy_values`` does one (not with ``pad_entropies``).
    Units and definitions: :data:`headwatch.names.METRICS`.

    Raises:
        HeadwatchError: an invalid argument (``**kwargs`` are torchmetrics' own, checked by it).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(
        self,
        ignore_index: int = -100,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        keep_entropies: bool = True,
        pad_entropies: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.ignore_index = check_int("ignore_index", ignore_index)
        self.max_chunk_bytes = check_positive_int("max_chunk_bytes", max_chunk_bytes)
        self.keep_entropies = check_bool("keep_entropies", keep_entropies)
        self.pad_entropies = check_bool("pad_entropies", pad_entropies)
        for name in LogitStatSums._fields:
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        if keep_entropies:
            self.add_state("entropies", default=[], dist_reduce_fx="cat")

    def update(self, logits: Tensor, mask: Tensor | None = None, targets: Tensor | None = None) -> None:
        stats = logit_statistics(
            logits, mask=mask, targets=targets, ignore_index=self.ignore_index, max_chunk_bytes=self.max_chunk_bytes
        )
        self.update_from_statistics(stats)

    def update_from_statistics(self, stats: Any) -> None:
        """Add per-position statistics already computed by :func:`logit_statistics` (no host sync)."""
        sums = logit_stats_update(stats)
        for name, value in sums._asdict().items():
            setattr(self, name, getattr(self, name) + value)
        if self.keep_entropies:
            # Boolean indexing syncs on accelerators; keep NaN-padded rows and drop them at compute.
            self.entropies.append(stats.entropy.reshape(-1).float())

    def compute(self) -> dict[str, Tensor]:
        sums = LogitStatSums(**{name: getattr(self, name) for name in LogitStatSums._fields})
        if not self.keep_entropies:
            return logit_stats_compute(sums)
        values = dim_zero_cat(self.entropies) if len(self.entropies) else torch.zeros(0, device=sums.positions.device)
        return logit_stats_values(sums, values, self.pad_entropies)


def logit_stats_values(sums: LogitStatSums, entropies: Tensor, pad_entropies: bool = True) -> dict[str, Tensor]:
    """:meth:`LogitStatsMetric.compute` from its state: the float64 ``sums`` and the ``(N,)`` float32 per-position
    ``entropies`` (NaN at the positions that are not valid), of one process or of every process (summed and
    concatenated): the means and counts of :func:`~headwatch.functional.sums.logit_stats_compute`, ``entropy_p05``,
    ``entropy_p50``, ``entropy_p95`` and ``entropy_values`` (the NaNs kept with ``pad_entropies``; dropping them
    is a host sync)."""
    out = logit_stats_compute(sums)
    for q, v in zip(ENTROPY_QUANTILES, nanquantiles(entropies, ENTROPY_QUANTILES)):  # invalid positions are NaN
        out[f"entropy_p{round(q * 100):02d}"] = v
    out["entropy_values"] = entropies if pad_entropies else entropies[~torch.isnan(entropies)]
    return out
