"""Loss, accuracy and calibration of next-token predictions, by the frequency of the target token.

Why. "Tying makes the model blind to rare tokens" is a claim about the loss and the accuracy
on rare *targets*; "the model is over-confident" is a claim about confidence above accuracy, not
about entropy falling. Both are measured here from the per-position quantities that
:func:`headwatch.functional.logit_statistics` already returns (target NLL, target-is-argmax,
max probability), so the logits are read once.

Definitions, over the valid positions ``n`` (mask, finite logits, target not ``ignore_index``),
with target ``y_n``, ``p_n = softmax(logits_n)``, confidence ``c_n = max_v p_{n,v}`` and
correctness ``a_n = [y_n is the argmax]`` (ties count as the argmax):

- per target-frequency bucket ``g`` (the bucket of the *target* token, as ``TokenFrequency``
  assigns it; and the rare targets; and all positions): mean NLL ``sum_{n in g} -log p_{n,y_n} /
  |g|`` (nats), accuracy ``sum a_n / |g|``, mean confidence ``sum c_n / |g|``;
- expected calibration error of the top-1 prediction (Naeini et al., AAAI 2015; Guo et al.,
  ICML 2017), with ``M`` equal-width bins (default ``M = 15``, :data:`ECE_BINS`)
  ``B_m = [m/M, (m+1)/M)`` for ``m < M - 1`` and the last one closed, ``B_{M-1} = [1 - 1/M, 1]``:
  a confidence of exactly 1 is in the last bin, there is no extra bin (torchmetrics' ``_binning_bucketize``
  counts it in a hidden ``(M+1)``-th bin: Lightning-AI/torchmetrics#3510). The bin is decided on the
  exact value of ``c_n`` (:func:`ece_bin_index`), so a confidence equal to an edge ``m/M`` is in
  ``B_m``. ``ECE = sum_m |sum_{n in B_m} (c_n - a_n)| / N``;
- over-confidence gap: ``mean c_n - mean a_n`` (positive: more confident than accurate).

Everything is kept as float64 sums and counts, so a sum over processes (DDP) is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError, check_int
from headwatch.functional.logits import LogitStatistics

ECE_BINS = 15
"""Equal-width confidence bins of the expected calibration error (the default ``n_bins``)."""
MAX_ECE_BINS = 2**22
"""Most bins :func:`ece_bin_index` compares exactly (``lo * M`` exact in float64 needs ``M <= 2**22``)."""


class CalibrationSums(NamedTuple):
    """Float64 sums over valid positions. Groups ``(G,)`` = the buckets, then ``rare``, then ``all``;
    bins ``(2, n_bins)``: row 0 all positions, row 1 rare targets."""

    positions: Tensor
    nll: Tensor
    correct: Tensor
    confidence: Tensor
    bin_positions: Tensor
    bin_confidence: Tensor
    bin_correct: Tensor


def empty_sums(num_buckets: int, n_bins: int = ECE_BINS, device: torch.device | str | None = None) -> CalibrationSums:
    """Zero sums for ``num_buckets`` buckets and ``n_bins`` bins."""
    g = torch.zeros(num_buckets + 2, dtype=torch.float64, device=device)
    b = torch.zeros(2, n_bins, dtype=torch.float64, device=device)
    return CalibrationSums(g, g.clone(), g.clone(), g.clone(), b, b.clone(), b.clone())


@torch.no_grad()
def ece_bin_index(confidence: Tensor, n_bins: int = ECE_BINS) -> Tensor:
    """The equal-width ECE bin of each confidence: ``m`` with ``m/M <= c < (m+1)/M``, last bin closed.

    Args:
        confidence: ``(N,)`` probabilities in ``[0, 1]`` (float32 or float64; compared exactly).
        n_bins: ``M``, the number of bins (an int in ``[1, 2**22]``).

    Returns:
        ``(N,)`` int64 in ``[0, M - 1]``: ``floor(M c)`` in exact arithmetic, ``M - 1`` for
        ``c = 1`` (no extra bin; torchmetrics#3510), ``0`` for ``c <= 0`` and for a NaN ``c`` (a
        confidence that could not be known: its NaN then reaches the bin's sums, never an index).

    Exactness: ``c`` is split as ``hi + lo`` with ``hi`` its float32 rounding; ``hi * M`` and
    ``lo * M`` are exact in float64 (at most 24 + 23 and 30 + 23 significant bits), and the floor of their
    rounded sum is corrected by the sign of ``(hi M - k) + lo M``, which rounding never flips. So an
    edge ``m/M`` that a float cannot hold exactly is still compared exactly, and float64 and float32
    confidences of the same value land in the same bin. No host sync.
    """
    check_int("n_bins", n_bins, minimum=1, maximum=MAX_ECE_BINS)
    c = confidence.double()
    hi = c.float().double()  # float32 rounding of c: hi * M is exact
    lo = c - hi  # exact (Sterbenz)
    hm, lm = hi * n_bins, lo * n_bins  # both exact
    k = torch.floor(hm + lm)  # off by at most one where c * M is within half an ulp of an integer
    k = torch.where((hm - k) + lm < 0, k - 1, k)  # c < k / M
    k = torch.where((hm - (k + 1)) + lm >= 0, k + 1, k)  # c >= (k + 1) / M
    return k.nan_to_num(0.0).clamp(0, n_bins - 1).long()


def _check(stats: LogitStatistics, targets: Tensor, bucket: Tensor, rare: Tensor | None, n_bins: int) -> None:
    if stats.nll is None or stats.target_is_argmax is None:
        raise HeadwatchError("expected logit statistics computed with targets (stats.nll is None)")
    if not isinstance(targets, Tensor) or targets.shape != stats.valid.shape or targets.is_floating_point():
        got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise HeadwatchError(f"expected integer targets of shape {tuple(stats.valid.shape)}, got {got}")
    if not isinstance(bucket, Tensor) or bucket.ndim != 1 or bucket.is_floating_point():
        raise HeadwatchError("expected `bucket` as a 1-D integer tensor of shape (vocab_size,)")
    if rare is not None and (rare.shape != bucket.shape or rare.dtype != torch.bool):
        raise HeadwatchError(f"expected `rare` of shape {tuple(bucket.shape)} and dtype bool, got {tuple(rare.shape)} {rare.dtype}")
    check_int("n_bins", n_bins, minimum=1, maximum=MAX_ECE_BINS)


@torch.no_grad()
def calibration_update(
    stats: LogitStatistics,
    targets: Tensor,
    bucket: Tensor,
    num_buckets: int,
    rare: Tensor | None = None,
    n_bins: int = ECE_BINS,
) -> CalibrationSums:
    """Per-batch sums for loss, accuracy and calibration by target bucket (no host sync).

    Args:
        stats: from :func:`headwatch.functional.logit_statistics` with ``targets``; fields ``(...)``.
        targets: ``(...)`` the same targets (integer ids; positions not ``stats.valid`` are ignored).
        bucket: ``(V,)`` integer bucket of each vocabulary row (``TokenFrequency``'s
            ``FrequencySnapshot.bucket``: an index into its ``BUCKETS``; -1 for rows that are
            not valid, counted in ``all`` only).
        num_buckets: number of buckets (``len(BUCKETS)``).
        rare: ``(V,)`` bool, the rare tokens (None: no rare group).
        n_bins: ``M``, equal-width confidence bins of the ECE (default 15; see :func:`ece_bin_index`).

    Returns:
        :class:`CalibrationSums` on the statistics' device.

    Raises:
        HeadwatchError: statistics without targets, or shapes and dtypes that do not agree.
    """
    _check(stats, targets, bucket, rare, n_bins)
    valid = stats.valid.reshape(-1)
    dev = valid.device
    V = bucket.numel()
    t = targets.reshape(-1).to(dev).long()
    t = torch.where(valid & (t >= 0) & (t < V), t, torch.zeros_like(t))  # valid targets are in range
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    conf = torch.where(valid, stats.max_prob.reshape(-1).double(), zero)
    values = torch.stack(
        [valid.double(), torch.where(valid, stats.nll.reshape(-1).double(), zero),
         (stats.target_is_argmax.reshape(-1) & valid).double(), conf],
        dim=1,
    )  # (N, 4): count, nll, correct, confidence
    b = bucket.to(dev).long().index_select(0, t)
    in_bucket = (b >= 0) & (b < num_buckets)
    groups = torch.zeros(num_buckets + 2, 4, dtype=torch.float64, device=dev)
    groups[:num_buckets].index_add_(0, torch.where(in_bucket, b, torch.zeros_like(b)), values * in_bucket.unsqueeze(1))
    is_rare = rare.to(dev).index_select(0, t) & valid if rare is not None else torch.zeros_like(valid)
    groups[num_buckets] = (values * is_rare.unsqueeze(1)).sum(0)
    groups[num_buckets + 1] = values.sum(0)
    # B_m = [m/M, (m+1)/M), the last bin closed: c = 1 is in bin M - 1 (no extra bin, torchmetrics#3510)
    index = ece_bin_index(conf, n_bins)  # conf: 0 at positions that are not valid (they add zeros)
    bins = torch.zeros(2, n_bins, 3, dtype=torch.float64, device=dev)
    per_bin = values[:, [0, 3, 2]]  # count, confidence, correct
    bins[0].index_add_(0, index, per_bin)
    bins[1].index_add_(0, index, per_bin * is_rare.unsqueeze(1))
    return CalibrationSums(*groups.unbind(1), *bins.unbind(2))


def calibration_compute(sums: CalibrationSums, bucket_names: Sequence[str]) -> dict[str, Tensor]:
    """Means from sums: float64 scalars, NaN for a group without positions.

    Keys: for ``g`` in ``bucket_names`` and ``rare``: ``nll_<g>`` (nats), ``accuracy_<g>``,
    ``confidence_<g>``, ``positions_<g>``; over all positions: ``nll``, ``accuracy``,
    ``confidence``, ``positions``, ``ece``, ``overconfidence``; over rare targets: ``ece_rare``,
    ``overconfidence_rare``.
    """
    if len(bucket_names) + 2 != sums.positions.numel():
        raise HeadwatchError(f"expected {sums.positions.numel() - 2} bucket names, got {len(bucket_names)}")
    def mean(total: Tensor, count: Tensor) -> Tensor:
        return torch.where(count > 0, total / count.clamp(min=1), float("nan"))

    out: dict[str, Tensor] = {}
    for i, name in enumerate([*bucket_names, "rare", None]):
        suffix = "" if name is None else f"_{name}"
        count = sums.positions[i]
        out[f"nll{suffix}"] = mean(sums.nll[i], count)
        out[f"accuracy{suffix}"] = mean(sums.correct[i], count)
        out[f"confidence{suffix}"] = mean(sums.confidence[i], count)
        out[f"positions{suffix}"] = count
    for row, suffix in ((0, ""), (1, "_rare")):
        count = sums.bin_positions[row].sum()
        gap = sums.bin_confidence[row] - sums.bin_correct[row]
        out[f"ece{suffix}"] = mean(gap.abs().sum(), count)
        out[f"overconfidence{suffix}"] = mean(gap.sum(), count)
    return out
