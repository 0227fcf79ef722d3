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

Everything is sums and counts on the device, and the per-position values the quantiles need; at compute
:meth:`SplitSums.local_sums` hands them to the step's one reduction (exact under DDP: float64 sums,
values concatenated) and :meth:`SplitSums.from_sums` makes the values from what every process measured.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics.utilities import dim_zero_cat

from headwatch.distributed.reduce import Reducer, Values, reduce_step
from headwatch.functional.calibration import ECE_BINS, CalibrationSums, calibration_compute, empty_sums
from headwatch.functional.frequency import BUCKETS
from headwatch.functional.logits import LogitStatistics
from headwatch.functional.sums import LogitStatSums
from headwatch.core.metrics import ENTROPY_QUANTILES, LogitStatsMetric, logit_stats_values
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

    def empty_sums(self, by_frequency: bool, padded: bool) -> dict[str, Tensor | Values]:
        """The layout of :meth:`local_sums` with nothing measured (zeros, no values)."""
        device = self.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        out: dict[str, Tensor | Values] = {f"stats/{name}": zero.clone() for name in LogitStatSums._fields}
        out.update({f"calibration/{k}": v for k, v in empty_sums(len(BUCKETS), self.calibration.n_bins, device)._asdict().items()})
        if by_frequency:
            out["bucket_entropy"] = torch.zeros(2, len(BUCKETS) + 1, dtype=torch.float64, device=device)
        if padded:
            out["padded"] = torch.zeros(2, dtype=torch.float64, device=device)
        out["entropies"] = Values(torch.zeros(0, dtype=torch.float32, device=device))
        out["max_probs"] = Values(torch.zeros(0, dtype=torch.float32, device=device))
        return out

    def local_sums(self, by_frequency: bool, padded: bool) -> dict[str, Tensor | Values]:
        """This process's float64 sums and per-position values (entropy, top-1 probability; NaN where not valid),
        named as :meth:`empty_sums`; empties the split (no collective, no host sync)."""
        out = self.empty_sums(by_frequency, padded)
        try:
            for name in LogitStatSums._fields:
                out[f"stats/{name}"] = getattr(self.stats, name)
            for name in CalibrationSums._fields:
                out[f"calibration/{name}"] = getattr(self.calibration, name)
            kept = self.stats.entropies
            if isinstance(kept, Tensor) or len(kept):
                out["entropies"] = Values(dim_zero_cat(kept))
            if self.max_probs:
                out["max_probs"] = Values(torch.cat(self.max_probs))
            if by_frequency and self.bucket_entropy is not None:
                out["bucket_entropy"] = self.bucket_entropy
            if padded:
                out["padded"] = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in self.padded])
        finally:
            self.stats.reset()
            self.calibration.reset()
            self.max_probs, self.bucket_entropy, self.padded = [], None, [0.0, 0.0]
            self.labelled = set()
        return out

    def from_sums(self, total: dict[str, Tensor], by_frequency: bool, padded: bool) -> dict[str, Tensor]:
        """The values (names relative to the split's group) from :meth:`local_sums` summed over processes.

        Keys: those of :class:`LogitStatsMetric` (with ``entropy_values``, NaN at the positions
        that are not valid: no host sync), ``max_prob_p05``, ``max_prob_p50``, ``max_prob_p95``, ``ece``,
        ``overconfidence``; with ``by_frequency`` also ``rare/ece``, ``rare/overconfidence`` and
        ``<bucket>/{target_nll,target_argmax_rate,max_prob,positions,entropy}`` for every bucket and
        ``rare``; with ``padded``, ``padded_mass``. Max-prob quantiles: linear interpolation over the valid
        positions of every process, as the entropy's; NaN without positions.
        """
        sums = LogitStatSums(**{name: total[f"stats/{name}"] for name in LogitStatSums._fields})
        out = logit_stats_values(sums, total["entropies"])
        cal = calibration_compute(CalibrationSums(**{n: total[f"calibration/{n}"] for n in CalibrationSums._fields}), BUCKETS)
        for key in CALIBRATION_KEYS:
            out[key] = cal[key]
        quantiles = nanquantiles(total["max_probs"], ENTROPY_QUANTILES)
        out.update({f"max_prob_p{round(q * 100):02d}": v for q, v in zip(ENTROPY_QUANTILES, quantiles)})
        if by_frequency:
            for key in CALIBRATION_KEYS:
                out[f"rare/{key}"] = cal[f"{key}_rare"]
            for bucket in (*BUCKETS, "rare"):
                for ours, theirs in BUCKET_KEYS.items():
                    out[f"{bucket}/{ours}"] = cal[f"{theirs}_{bucket}"]
            both = total["bucket_entropy"]
            mean = torch.where(both[1] > 0, both[0] / both[1].clamp(min=1), torch.full_like(both[0], float("nan")))
            out.update({f"{name}/entropy": mean[i] for i, name in enumerate((*BUCKETS, "rare"))})
        if padded:
            both = total["padded"]
            out["padded_mass"] = torch.where(both[1] > 0, both[0] / both[1].clamp(min=1), torch.full_like(both[0], float("nan")))
        return out

    def compute(self, reducer: Reducer, by_frequency: bool, padded: bool) -> dict[str, Tensor]:
        """:meth:`from_sums` of :meth:`local_sums` reduced over ``reducer``'s processes (a collective:
        :func:`~headwatch.distributed.reduce.reduce_step`); resets the sums."""
        part = self.local_sums(by_frequency, padded)
        return self.from_sums(reduce_step([part], reducer)[0][0], by_frequency, padded)
