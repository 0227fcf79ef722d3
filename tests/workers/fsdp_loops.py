"""Run by tests/distributed/test_fsdp.py: several of the 2-process FSDP workers (``fsdp_ops``, ``fsdp_plain``,
``fsdp_drift``, ``fsdp1_plain``) one after the other in ONE launch of 2 CPU processes, each in its own process group
(``work(rank, OUT_DIR, PORT)`` of each module, its own port): starting processes and importing torch is most of
each worker's cost. ``fsdp1_plain`` patches classes to make rank 1 fail (its last scenario): it runs last.

usage: python tests/workers/fsdp_loops.py NAME,NAME,... OUT_DIR PORT,PORT,...
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def work(rank: int, names: list[str], out_dir: str, ports: list[str]) -> None:
    for name, port in zip(names, ports, strict=True):
        importlib.import_module(name).work(rank, out_dir, port)


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(",")), nprocs=2)
