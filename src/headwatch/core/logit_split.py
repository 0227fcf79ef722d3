"""One split's sums for :class:`headwatch.core.LogitStats`: logit statistics, calibration, padded mass.

A split is the training logging step, or one validation dataloader's epoch. Each keeps:

- a :class:`~headwatch.core.metrics.LogitStatsMetric` (entropy, sharpness, target NLL, ...);
- a :class:`~headwatch.core.metrics_evidence.FrequencyCalibrationMetric` fed from the *same*
  per-position statistics (no second pass over the logits): per target-frequency bucket mean
  target NLL, accuracy and confidence, and the ECE (``ece_bins`` equal-width bins, default 15, the last one
  closed: ``docs/calibration.md``) and over-confidence gap overall and
  for rare targets (:mod:`headwatch.functional.calibration`);
- float64 sums of the entropy by target-frequency bucket (the bucket of the position's target: in RL,
  of the sampled token), published as ``<bucket>/entropy``;
- float64 sums of the padded mass (:func:`headwatch.functional.padding.padded_mass`).

Everything is sums and counts on the device, reduced over processes at compute: exact under DDP.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from headwatch.distributed.reduce import Reducer
from headwatch.functional.calibration import ECE_BINS
from headwatch.functional.frequency import BUCKETS
from headwatch.functional.logits import LogitStatistics
from headwatch.core.metrics import ENTROPY_QUANTILES, LogitStatsMetric
from headwatch.functional.quantiles import nanquantiles
from headwatch.core.metrics_evidence import FrequencyCalibrationMetric

CALIBRATION_KEYS = ("ece", "overconfidence")
"""Published for every split: ECE of the top-1 prediction and mean confidence minus accuracy."""
BUCKET_KEYS = {"target_nll": "nll", "target_argmax_rate": "accuracy", "max_prob": "confidence", "positions": "positions"}
"""Published per target bucket (``<bucket>/<key>``, buckets and ``rare``) when frequencies are known:
our name -> :func:`~headwatch.functional.calibration.calibration_compute`'s."""


class SplitSums:
    """The sums of one split (see the module docstring); ``update`` adds one forward, ``compute`` reads them."""

    def __init__(self, ignore_index: int, max_chunk_bytes: int, ece_bins: int = ECE_BINS) -> None:
        self.stats = LogitStatsMetric(ignore_index=ignore_index, max_chunk_bytes=max_chunk_bytes, pad_entropies=True)
        self.calibration = FrequencyCalibrationMetric(bucket_names=BUCKETS, n_bins=ece_bins, ignore_index=ignore_index)
        self.padded: list[Tensor | float] = [0.0, 0.0]  # float64 (sum, count)
        self.max_probs: list[Tensor] = []  # per forward: (B*T,) top-1 probabilities, NaN where not valid
        self.bucket_entropy: Tensor | None = None  # (2, len(BUCKETS) + 1) float64: entropy sums, counts (last: rare)
        self._no_bucket: Tensor | None = None  # (V,) of -1: calibration without frequencies
        self.labelled: set[bool] = set()
        """Whether the forwards pooled since the last ``compute`` had labels (True), none (False), or both."""

    @property
    def device(self) -> torch.device:
        return self.stats.device

    def update(
        self,
        stats: LogitStatistics,
        targets: Tensor | None,
        frequency: tuple[Tensor, Tensor] | None,
        padded_mass: Tensor | None,
        vocab_size: int,
    ) -> None:
        """Add one forward's per-position ``stats`` (fields ``(B, T)``), no host sync.

        Args:
            stats: from :func:`headwatch.model.captured.captured_statistics`.
            targets: ``(B, T)`` targets the statistics were computed with (None: no calibration).
            frequency: ``(bucket (V,) int64, rare (V,) bool)`` of the shared token counts, or None.
            padded_mass: ``(B, T)`` probability on padded columns, or None.
            vocab_size: ``V``, the number of logits (for the bucket table without frequencies).
        """
        device = stats.valid.device
        if self.device != device:
            self.stats.to(device)
            self.calibration.to(device)
        self.stats.update_from_statistics(stats)
        self.max_probs.append(torch.where(stats.valid, stats.max_prob, float("nan")).reshape(-1).float())
        if targets is not None and stats.nll is not None:
            if frequency is None:
                V = vocab_size
                if self._no_bucket is None or self._no_bucket.numel() != V or self._no_bucket.device != device:
                    self._no_bucket = torch.full((V,), -1, dtype=torch.long, device=device)
                bucket, rare = self._no_bucket, None
            else:
                bucket, rare = frequency
            self.calibration.update_from_statistics(stats, targets.to(device), bucket.to(device), rare)
            if frequency is not None:
                self._add_bucket_entropy(stats, targets.to(device), bucket.to(device), rare)
        if padded_mass is not None:
            valid = stats.valid
            self.padded[0] = self.padded[0] + torch.where(valid, padded_mass, 0.0).sum(dtype=torch.float64)
            self.padded[1] = self.padded[1] + valid.sum(dtype=torch.float64)

    def _add_bucket_entropy(self, stats: LogitStatistics, targets: Tensor, bucket: Tensor, rare: Tensor | None) -> None:
        """Entropy and count of the valid positions by their target's bucket (scatter-adds, no host sync)."""
        nb, V = len(BUCKETS), bucket.numel()
        t = targets.clamp(0, V - 1).reshape(-1)
        b = bucket[t]
        ok = stats.valid.reshape(-1) & (targets.reshape(-1) >= 0) & (targets.reshape(-1) < V) & (b >= 0)
        h = torch.where(ok, stats.entropy.reshape(-1).double(), 0.0)
        w = ok.double()
        add = torch.zeros(2, nb + 1, dtype=torch.float64, device=h.device)
        where = b.clamp(0, nb - 1)
        add[0, :nb].scatter_add_(0, where, h)
        add[1, :nb].scatter_add_(0, where, w)
        if rare is not None:
            r = rare[t].double()
            add[0, nb], add[1, nb] = (h * r).sum(), (w * r).sum()
        self.bucket_entropy = add if self.bucket_entropy is None else self.bucket_entropy + add

    def _max_prob_quantiles(self, reducer: Reducer) -> dict[str, Tensor]:
        """``max_prob_p05``, ``_p50``, ``_p95``: quantiles of the per-position top-1 probability over the valid
        positions of every process (a gather; linear interpolation, as the entropy's); NaN without positions."""
        values = torch.cat(self.max_probs) if self.max_probs else torch.zeros(0, device=self.device)
        self.max_probs = []
        if reducer.world_size > 1:
            values = torch.cat([v.to(values.device) for v in reducer.gather(values)])
        quantiles = nanquantiles(values, ENTROPY_QUANTILES)
        return {f"max_prob_p{round(q * 100):02d}": v for q, v in zip(ENTROPY_QUANTILES, quantiles)}

    def _bucket_entropy(self, reducer: Reducer) -> dict[str, Tensor]:
        """``<bucket>/entropy`` (buckets and ``rare``): mean entropy over positions whose target is in the bucket,
        summed over processes (a collective); NaN for an empty bucket."""
        sums = self.bucket_entropy
        self.bucket_entropy = None
        if sums is None:
            sums = torch.zeros(2, len(BUCKETS) + 1, dtype=torch.float64, device=self.device)
        sums = reducer.sum(sums) if reducer.world_size > 1 else sums
        mean = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1), torch.full_like(sums[0], float("nan")))
        return {f"{name}/entropy": mean[i] for i, name in enumerate((*BUCKETS, "rare"))}

    def compute(self, reducer: Reducer, by_frequency: bool, padded: bool) -> dict[str, Tensor]:
        """Synchronised values (a collective), names relative to the split's group; resets the sums.

        Keys: those of :class:`LogitStatsMetric` (with ``entropy_values``, NaN at the positions
        that are not valid: no host sync), ``max_prob_p05``, ``max_prob_p50``, ``max_prob_p95``, ``ece``,
        ``overconfidence``; with ``by_frequency`` also ``rare/ece``, ``rare/overconfidence`` and
        ``<bucket>/{target_nll,target_argmax_rate,max_prob,positions,entropy}`` for every bucket and
        ``rare``; with ``padded``, ``padded_mass``.
        """
        for metric in (self.stats, self.calibration):
            metric.dist_sync_fn = lambda t, group=None: reducer.gather(t)
            metric.distributed_available_fn = lambda: reducer.world_size > 1
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                out = dict(self.stats.compute())
                cal = self.calibration.compute()
        finally:
            self.stats.reset()
            self.calibration.reset()
            self.labelled = set()
        for key in CALIBRATION_KEYS:
            out[key] = cal[key]
        out.update(self._max_prob_quantiles(reducer))
        if by_frequency:
            for key in CALIBRATION_KEYS:
                out[f"rare/{key}"] = cal[f"{key}_rare"]
            for bucket in (*BUCKETS, "rare"):
                for ours, theirs in BUCKET_KEYS.items():
                    out[f"{bucket}/{ours}"] = cal[f"{theirs}_{bucket}"]
            out.update(self._bucket_entropy(reducer))
        if padded:
            out["padded_mass"] = self._padded_mass(reducer)
        return out

    def _padded_mass(self, reducer: Reducer) -> Tensor:
        """Mean padded mass over measured positions, summed over processes."""
        total, count = (torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in self.padded)
        self.padded = [0.0, 0.0]
        both = reducer.sum(torch.stack([total, count]))
        return torch.where(both[1] > 0, both[0] / both[1].clamp(min=1), torch.full_like(both[0], float("nan")))

