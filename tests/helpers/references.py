"""Independent float64 references (NumPy, SciPy) of the per-position logit statistics."""

from __future__ import annotations

import numpy as np
import torch
from scipy import special, stats


def reference(logits: torch.Tensor, mask=None, targets=None, ignore_index=-100) -> dict[str, np.ndarray]:
    """Per-position statistics in float64 with SciPy, row by row (NaN where not valid)."""
    x = logits.detach().double().numpy()  # exact for bf16, fp16, float32 and float64
    V = x.shape[-1]
    lead = x.shape[:-1]
    rows = x.reshape(-1, V)
    n = rows.shape[0]
    m = np.ones(n, bool) if mask is None else mask.numpy().reshape(-1)
    t = None if targets is None else targets.numpy().reshape(-1)
    out = {k: np.full(n, np.nan) for k in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll")}
    out["valid"] = np.zeros(n, bool)
    out["nonfinite"] = np.zeros(n, bool)
    out["invalid_target"] = np.zeros(n, bool)
    out["target_is_argmax"] = np.zeros(n, bool)
    u = np.full(V, 1.0 / V)
    for i, row in enumerate(rows):
        if not m[i]:
            continue
        if np.isnan(row).any() or np.isposinf(row).any() or np.isneginf(row).all():
            out["nonfinite"][i] = True
            continue
        if t is not None:
            if t[i] == ignore_index:
                continue
            if not 0 <= t[i] < V:
                out["invalid_target"][i] = True
                continue
        logp = row - special.logsumexp(row)
        p = np.exp(logp)
        out["valid"][i] = True
        out["entropy"][i] = special.entr(p).sum()
        out["kl_to_uniform"][i] = stats.entropy(p, u)  # sum p log(p / u)
        with np.errstate(divide="ignore"):
            out["kl_from_uniform"][i] = stats.entropy(u, p)  # sum u log(u / p); inf where p = 0
        out["max_prob"][i] = p.max()
        if t is not None:
            out["nll"][i] = -logp[t[i]]
            out["target_is_argmax"][i] = row[t[i]] == row.max()
    return {k: v.reshape(lead) for k, v in out.items()}


def wilson_roots(k: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson (1927) interval's ends as the roots in pi of ``(k/n - pi)^2 = z^2 pi (1 - pi) / n``, float64."""
    import math

    p = k / n
    a, b, c = 1.0 + z * z / n, -(2.0 * p + z * z / n), p * p
    root = math.sqrt(b * b - 4.0 * a * c)
    return (-b - root) / (2.0 * a), (-b + root) / (2.0 * a)
