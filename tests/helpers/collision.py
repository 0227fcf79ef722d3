"""Synonym collision for the tests: brute-force and drift-corrected references, planted duplicates and drift, fixed counts."""

from __future__ import annotations

import math

import numpy as np
import torch

from headwatch import SynonymCollisionMonitor
from headwatch.functional.frequency import FrequencySnapshot, frequency_buckets, rare_tokens


def brute_force(w: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor):
    x = w.double().numpy()
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    xn = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    sims = xn[queries.numpy()] @ xn.T
    sims[:, ~valid.numpy()] = -np.inf
    sims[np.arange(len(queries)), queries.numpy()] = -np.inf
    return sims.max(axis=1), sims.argmax(axis=1)


def planted(V: int = 2048, d: int = 256, tau: float = 0.9, eps: float = 1e-3, seed: int = 0):
    """Gaussian rows, with row 1000 + i planted at cosine tau +/- eps to row i."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, d, generator=g, dtype=torch.float64)
    plants = {}
    for i, target in enumerate([tau + eps, tau - eps, tau + eps, 0.99, tau - eps]):
        u = w[i] / w[i].norm()
        v = torch.randn(d, generator=g, dtype=torch.float64)
        v = v - (v @ u) * u
        v = v / v.norm()
        w[1000 + i] = (target * u + math.sqrt(1 - target**2) * v) * 3.0
        plants[1000 + i] = (i, target)
    return w.float(), plants


def snapshot(counts: torch.Tensor, valid: torch.Tensor, max_count: int | None = None) -> FrequencySnapshot:
    return FrequencySnapshot(counts, valid, frequency_buckets(counts, valid), rare_tokens(counts, valid, max_count))


def corrected_reference(w: torch.Tensor, queries: torch.Tensor, pairable: torch.Tensor, k: int = 1):
    """float64 numpy: mean and top-k principal directions of the pairable rows removed, exact nn cosine."""
    x = w.double().numpy()
    basis = x[pairable.numpy()]
    mu = basis.mean(0)
    u = np.linalg.eigh((basis - mu).T @ (basis - mu))[1][:, ::-1][:, :k]
    y = (x - mu) - (x - mu) @ u @ u.T
    return brute_force(torch.from_numpy(y), queries, pairable)


def collision_monitor(w: torch.Tensor, **kwargs) -> SynonymCollisionMonitor:
    monitor = SynonymCollisionMonitor(**kwargs)
    monitor.tied = True
    monitor._head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    monitor._emb = monitor._head
    monitor._head.weight.data = w
    return monitor


class FixedCounts:
    """A TokenCounts stand-in: one fixed snapshot."""

    def __init__(self, snap: FrequencySnapshot) -> None:
        self.snap = snap

    def snapshot(self) -> FrequencySnapshot:
        return self.snap

    latest_snapshot = snapshot


def confusion_reference(logits: torch.Tensor, labels: torch.Tensor, rare: torch.Tensor, syn: dict) -> tuple[int, int]:
    """Hand count: next-token targets that are rare and grouped; confused when a synonym's logit >= the target's."""
    n = confused = 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target in syn and bool(rare[target]):
                n += 1
                confused += max(float(logits[b, t, s]) for s in syn[target]) >= float(logits[b, t, target])
    return n, confused


def drifted_head(V=3000, d=64, n_rare=1000, planted=100, seed=0):
    """Frequent rows random; rare rows (the last ``n_rare``) = one common direction + small noise.

    Raw cosine between two rare rows is ``s^2 / (s^2 + 1) = 0.97``. ``planted`` pairs of rare rows
    are made near-duplicates of each other (same noise up to 1%).
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, d, generator=g, dtype=torch.float64) / d**0.5  # rows of norm ~1
    common = torch.randn(d, generator=g, dtype=torch.float64)
    common /= common.norm()
    s = (0.97 / 0.03) ** 0.5
    rare = torch.arange(V - n_rare, V)
    w[rare] += s * common
    a, b = rare[: 2 * planted : 2], rare[1 : 2 * planted : 2]
    w[b] = w[a] + 0.01 * torch.randn(planted, d, generator=g, dtype=torch.float64) / d**0.5
    return w.float(), rare, a, b
