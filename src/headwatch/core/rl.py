"""RL fine-tuning (GRPO, RLOO): the policy's sampling distribution and the names of what it is measured on.

In RL fine-tuning the policy samples completions at a temperature ``T`` and the loss is an advantage-weighted
log-probability of the sampled tokens. The orchestrator (:meth:`headwatch.core.orchestrator.Orchestrator.sample_at`)
then has :class:`~headwatch.core.logits.LogitStats` measure ``softmax(logits / T)`` on the training forward's
completion positions (the positions whose label, the sampled token, is not ``ignore_index``), and adds the
names of :data:`SAMPLED_NAMES`: the "target" of an RL step is the token the policy sampled, not a label, so
its NLL is published as ``rl/sampled_nll`` (next to ``logits/target_nll``, the same number under its
generic name). See ``docs/rl.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from headwatch.functional.frequency import BUCKETS

SAMPLED_NAMES = {"logits/target_nll": "rl/sampled_nll", "logits/target_argmax_rate": "rl/sampled_top1_rate"}
"""``logits/`` name -> its RL name, on RL training logging steps."""

DROP_FLOOR = 0.01
"""``rl/rare_share_of_entropy_drop`` is NaN unless the entropy fell by more than this fraction of ``H(start)``: below
it the denominator is sampling noise of the step's batch (a drop of 0.0016 of 6.91 nats gave shares of -4732 and
116), not a fall a share can be taken of."""


def rl_scalars(scalars: dict[str, Any], prefix: str, temperature: float, start: dict[str, float] | None = None) -> dict[str, Any]:
    """``scalars`` of a training logging step with the RL names added (device tensors, no sync).

    - ``rl/sampled_nll`` (nats): ``mean -log p_T(sampled token)`` over completion positions, ``p_T`` the
      sampling distribution ``softmax(logits / T)``; equals ``-mean(per_token_logps)`` of TRL;
    - ``rl/sampled_top1_rate`` (fraction): sampled tokens that were the policy's top-1;
    - ``rl/temperature``: ``T``;
    - ``rl/entropy_share/<bucket>`` (nats; buckets and ``rare``): ``w_b H_b``, the bucket's share of positions
      times its mean entropy; over the buckets (not ``rare``) they add up to ``logits/entropy``, less the part of
      the positions whose sampled token has no bucket (the embedding's ``padding_idx`` row, rows past the
      tokenizer's ``vocab_size``), so the drop of one bucket's share between two steps is its part of the entropy
      drop (``docs/rl.md``);
    - ``rl/rare_share_of_entropy_drop`` (fraction), with ``start`` (the host values of the run's first RL logging
      step, :func:`drop_reference`): ``(S_rare(start) - S_rare(now)) / (H(start) - H(now))``, ``S_rare`` the rare
      tokens' ``entropy_share``, ``H`` the entropy; the part of the entropy lost since the start that rare tokens
      account for (may exceed 1 or be negative when other buckets gained); NaN while the entropy has not fallen by
      more than :data:`DROP_FLOOR` (1%) of ``H(start)`` (a drop within noise: the same on every rank, the
      entropy being reduced over processes).
    """
    out = dict(scalars)
    for ours, theirs in SAMPLED_NAMES.items():
        if f"{prefix}/{ours}" in scalars:
            out[f"{prefix}/{theirs}"] = scalars[f"{prefix}/{ours}"]
    out[f"{prefix}/rl/temperature"] = float(temperature)
    total = scalars.get(f"{prefix}/logits/positions")
    for bucket in (*BUCKETS, "rare"):
        h, n = scalars.get(f"{prefix}/logits/{bucket}/entropy"), scalars.get(f"{prefix}/logits/{bucket}/positions")
        if isinstance(h, Tensor) and isinstance(n, Tensor) and isinstance(total, Tensor):
            share = n.double() / total.double().clamp(min=1)
            out[f"{prefix}/rl/entropy_share/{bucket}"] = torch.where(n > 0, share * h.double(), torch.zeros_like(share))
    rare, entropy = out.get(f"{prefix}/rl/entropy_share/rare"), scalars.get(f"{prefix}/logits/entropy")
    if start is not None and isinstance(rare, Tensor) and isinstance(entropy, Tensor):
        drop = start["entropy"] - entropy.double()  # a host float minus a device tensor: no sync
        out[f"{prefix}/rl/rare_share_of_entropy_drop"] = torch.where(
            drop > DROP_FLOOR * start["entropy"], (start["rare"] - rare) / drop, torch.nan
        )
    return out


def drop_reference(numbers: dict[str, float], prefix: str) -> dict[str, float] | None:
    """The reference of ``rl/rare_share_of_entropy_drop`` from a published step's host values (None when they lack
    the entropy or the rare share, or are not finite)."""
    entropy, rare = numbers.get(f"{prefix}/logits/entropy"), numbers.get(f"{prefix}/rl/entropy_share/rare")
    if entropy is None or rare is None or not math.isfinite(entropy) or not math.isfinite(rare):
        return None
    return {"entropy": float(entropy), "rare": float(rare)}
