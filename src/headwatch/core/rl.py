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

from typing import Any

import torch
from torch import Tensor

from headwatch.functional.frequency import BUCKETS

SAMPLED_NAMES = {"logits/target_nll": "rl/sampled_nll", "logits/target_argmax_rate": "rl/sampled_top1_rate"}
"""``logits/`` name -> its RL name, on RL training logging steps."""


def rl_scalars(scalars: dict[str, Any], prefix: str, temperature: float) -> dict[str, Any]:
    """``scalars`` of a training logging step with the RL names added (device tensors, no sync).

    - ``rl/sampled_nll`` (nats): ``mean -log p_T(sampled token)`` over completion positions, ``p_T`` the
      sampling distribution ``softmax(logits / T)``; equals ``-mean(per_token_logps)`` of TRL;
    - ``rl/sampled_top1_rate`` (fraction): sampled tokens that were the policy's top-1;
    - ``rl/temperature``: ``T``;
    - ``rl/entropy_share/<bucket>`` (nats; buckets and ``rare``): ``w_b H_b``, the bucket's share of positions
      times its mean entropy; over the buckets (not ``rare``) they add up to ``logits/entropy``, so the
      drop of one bucket's share between two steps is its part of the entropy drop (``docs/rl.md``).
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
    return out
