"""Cost of the exact rare-token nearest-neighbour search, relative to one matrix product.

R = 8192 rare rows against V = 32768 rows of d_model 512, float32, on the CPU, in one run:

- ``matmul (reference)``: ``rare_rows @ W.T``, the single product of the same shapes
  (it materialises the full ``(R, V)`` similarity matrix, 1 GiB);
- ``headwatch nearest_neighbours``: exact cosine nearest neighbour of every rare row
  among the other valid rows, chunked (normalisation, self-exclusion and running max
  included), working memory bounded by ``max_chunk_bytes`` (default 64 MiB);
- ``SynonymCollision.measure``: everything the monitor computes at one measurement
  (rare rows plus up to 1024 sampled rows per frequency bucket) for one matrix: the
  trainer-free core of ``SynonymCollisionMonitor`` attached, through its public
  ``attach``, to a model whose ``embed_tokens`` and ``lm_head`` share the matrix.

Times: 1 warm-up, then the median of ``--repeats`` runs, round-robin. Peak extra memory:
one run of each method in a fresh process (``multiprocessing`` spawn) that first builds the
same inputs; the growth of the process's peak resident memory (VmHWM) during the
call, so the inputs are not counted. (The profiler's memory events double-count nested
operators: it reports 2048 MiB for the 1024 MiB product.)

Run: ``python bench/collision.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time

import torch

from torch import nn

from headwatch.core import SynonymCollision
from headwatch.functional import FrequencySnapshot, frequency_buckets, rare_tokens
from headwatch.functional import nearest_neighbours


def build(V: int, R: int, d: int):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, d, generator=g)
    rare_ids = torch.randperm(V, generator=g)[:R].sort().values
    rare_rows = W[rare_ids]
    valid = torch.ones(V, dtype=torch.bool)
    counts = torch.full((V,), 1000, dtype=torch.long)
    counts[rare_ids] = 1
    snap = FrequencySnapshot(counts, valid, frequency_buckets(counts, valid), rare_tokens(counts, valid, max_count=1))
    monitor = SynonymCollision(max_rare=R)
    monitor.attach(TiedModel(W))
    return {
        "matmul rare_rows @ W.T (reference)": lambda: rare_rows @ W.T,
        "headwatch nearest_neighbours": lambda: nearest_neighbours(W, rare_ids, valid),
        "SynonymCollision.measure (1 matrix)": lambda: monitor.measure(snap),
    }


class TiedModel(nn.Module):
    """The two ends of a tied language model around ``W`` (V, d): what the monitor attaches to."""

    def __init__(self, W: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(*W.shape, _weight=W)
        self.lm_head = nn.Linear(W.shape[1], W.shape[0], bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied: one Parameter


def _peak_kib() -> int:
    """Peak resident memory of this process in KiB: VmHWM on Linux (``ru_maxrss`` is inherited
    from the parent across fork + exec there, so a child of a large parent would show no growth)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_child(name: str, V: int, R: int, d: int, queue) -> None:
    fn = build(V, R, d)[name]
    before = _peak_kib()
    fn()
    queue.put((_peak_kib() - before) / 1024)  # KiB -> MiB


def peak_extra_mib(name: str, V: int, R: int, d: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(name, V, R, d, queue))
    proc.start()
    value = queue.get()
    proc.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rare", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    V, R, d = args.vocab, args.rare, args.d_model
    methods = build(V, R, d)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["matmul rare_rows @ W.T (reference)"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"R={R}, V={V}, d_model={d}, float32, {args.repeats} repeats")
    print(f"{'method':44s} {'median':>9s} {'vs matmul':>10s} {'peak extra':>11s}")
    for name, fn in methods.items():
        med = statistics.median(times[name])
        print(f"{name:44s} {med:8.3f}s {med / ref:9.2f}x {peak_extra_mib(name, V, R, d):8.1f} MiB")
    W = torch.randn(2048, d, generator=torch.Generator().manual_seed(1))
    check = nearest_neighbours(W, torch.arange(64), None)
    sims = torch.nn.functional.normalize(W[:64].double(), dim=1) @ torch.nn.functional.normalize(W[:2048].double(), dim=1).T
    sims[torch.arange(64), torch.arange(64)] = -2
    print(f"check vs float64 brute force (64 queries): max |cos diff| = {(check.cosine.double() - sims.max(1).values).abs().max():.2e}")


if __name__ == "__main__":
    main()
