"""Time of one collision measurement (``SynonymCollision.measure``), this checkout against another, in one process.

An untied ``(V, d_model)`` head and embedding (Gaussian rows), Zipf(1.1) token counts over a random
permutation, the monitor's defaults (a rare panel of 1024 rows at the first probe, 8192 rows before 0.4;
1024 rows per bucket). The other checkout's package is imported first, its ``SynonymCollision`` kept, then
``sys.modules`` cleared and this one's imported; the two are then called alternately (``--repeats`` each,
after a warm-up), so both see the same machine load. Prints the medians and the ratio of the medians, and the load average.

Run: ``PYTHONPATH=src python bench/collision_step.py --other /path/to/other/src [--V 32000 --d 256 --repeats 5]``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path


def load(src: str):
    for name in [m for m in sys.modules if m == "headwatch" or m.startswith("headwatch.")]:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        collision = importlib.import_module("headwatch.core.collision")
        frequency = importlib.import_module("headwatch.functional.frequency")
    finally:
        sys.path.remove(src)
    return collision.SynonymCollision, frequency.frequency_snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, help="the src/ folder of the checkout to compare with")
    parser.add_argument("--V", type=int, default=32000)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    g = torch.Generator().manual_seed(0)
    head, emb = torch.randn(args.V, args.d, generator=g), torch.randn(args.V, args.d, generator=g)
    counts = (1e7 / torch.arange(1, args.V + 1, dtype=torch.float64) ** 1.1).long()[torch.randperm(args.V, generator=g)]
    valid = torch.ones(args.V, dtype=torch.bool)
    here = str(Path(__file__).resolve().parents[1] / "src")
    runs = {}
    for label, src in (("other", args.other), ("this", here)):
        cls, snapshot = load(src)
        m = cls()
        m.tied, m._head, m._emb = False, torch.nn.Linear(args.d, args.V, bias=False), torch.nn.Embedding(args.V, args.d)
        m._head.weight.data, m._emb.weight.data = head, emb
        snap = snapshot(counts, valid)
        runs[label] = (m, snap)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for i in range(args.repeats + 1):
        for label, (m, snap) in runs.items():
            t = time.perf_counter()
            m.measure(snap, step=0)
            if i:
                times[label].append(time.perf_counter() - t)
    mid = {label: statistics.median(v) for label, v in times.items()}
    print(f"V={args.V} d={args.d} untied, rare rows {int(snap.rare.sum())}, threads {torch.get_num_threads()}, load {os.getloadavg()}")
    for label, v in times.items():
        print(f"{label:5s}: median {mid[label]:.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")
    print(f"this / other = {mid['this'] / mid['other']:.3f}")


if __name__ == "__main__":
    main()
