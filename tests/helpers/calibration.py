"""Calibration by target frequency, for the tests: seeded batches of logits, targets and masks, buckets and rare tokens."""

from __future__ import annotations

import torch

from headwatch.functional.frequency import BUCKETS

V = 50


def batch(seed: int, B=4, T=30, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * scale
    targets = torch.randint(0, V, (B, T), generator=g)
    # make some predictions right, so accuracy is not ~1/V
    hit = torch.rand(B, T, generator=g) < 0.4
    targets = torch.where(hit, logits.argmax(-1), targets)
    targets[0, :3] = -100
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -4:] = False
    return logits, targets, mask


def buckets_and_rare(seed=9):
    g = torch.Generator().manual_seed(seed)
    bucket = torch.randint(0, len(BUCKETS), (V,), generator=g)
    bucket[-3:] = -1  # padded rows
    rare = bucket == BUCKETS.index("tail")
    return bucket, rare
