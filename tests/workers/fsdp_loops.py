"""Run by tests/distributed/test_fsdp.py: several of the 2-process FSDP workers (``fsdp_ops``, ``fsdp_plain``,
``fsdp_drift``, ``fsdp1_plain``) one after the other in ONE launch of 2 CPU processes, each in its own process group
(``work(rank, OUT_DIR, PORT)`` of each module, its own port): starting processes and importing torch is most of
each worker's cost (forked, the 2 processes also share this one's imports). ``fsdp1_plain`` patches classes to make
rank 1 fail (its last scenario): it runs last.

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
    names = sys.argv[1].split(",")
    for name in names:  # imported before the fork: the 2 processes start with them (and torch) imported
        importlib.import_module(name)
    mp.start_processes(work, args=(names, sys.argv[2], sys.argv[3].split(",")), nprocs=2, start_method="fork")
