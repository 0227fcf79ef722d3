"""Several processes: a gloo run of a worker script, a clean shutdown, free ports, W simulated processes in one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tests.helpers.paths import ROOT


def shutdown_distributed() -> None:
    """A clean gloo shutdown before the interpreter exits (else an abort at exit, now and then)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_gloo_workers(source: str, tmp_path, port_base: int, timeout: float = 240.0) -> list:
    """Run ``source`` (a worker script: ``argv`` = rank, port, repository root, ``tmp_path``) as 2 gloo processes and
    return what each wrote to ``tmp_path/rank<r>.json``; both must exit 0 (their output is the failure message).
    ``port_base``: this test's range of ports (plus ``pid % 2000``), apart from the other tests'."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(tmp_path) / "worker.py"
    script.write_text(source)
    root = str(ROOT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(root) / "src"), "PYTHONWARNINGS": "ignore"}
    port = str(port_base + os.getpid() % 2000)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, root, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads((Path(tmp_path) / f"rank{r}.json").read_text()) for r in range(2)]


class _World:
    """W threads exchanging one value each per collective, in the same order on every thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size
        self.calls = 0

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        if rank == 0:
            self.calls += 1
        self.barrier.wait()  # nobody writes the next collective's value before everyone has read this one
        return out


class ThreadReducer:
    """A :class:`~headwatch.distributed.reduce.Reducer` for one of W threads: every method is a collective."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world = world
        self._rank = rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def rank(self) -> int:
        return self._rank

    def sum(self, tensor: Tensor) -> Tensor:
        parts = self.world.exchange(self._rank, tensor.detach().clone())
        return torch.stack(parts).sum(0).to(tensor.dtype)  # the same order on every rank: bitwise equal results

    def mean(self, tensor: Tensor) -> Tensor:
        return self.sum(tensor) / self.world.size

    def gather(self, tensor: Tensor) -> list[Tensor]:
        return [p.clone() for p in self.world.exchange(self._rank, tensor.detach().clone())]

    def all(self, flag: bool) -> bool:
        return all(self.world.exchange(self._rank, bool(flag)))


def run_ranks(size: int, fn: Callable[[int, ThreadReducer], Any]) -> list[Any]:
    """``fn(rank, reducer)`` on ``size`` threads at once; the results in rank order; the first error re-raised."""
    world = _World(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadReducer(world, rank))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = err
            world.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_measured(path) -> Any:
    """A worker's JSON results without headwatch's own timings (``overhead/*``: each process's wall-clock share, never
    equal between processes or runs), so that N processes are compared with one on what was measured."""

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if not (isinstance(k, str) and "/overhead/" in k)}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    import json
    from pathlib import Path

    return strip(json.loads(Path(path).read_text()))


NOTES = ("no trainer loss to compare", "overhead_budget")
"""Words of the notes a run may say whatever it tests: no loss to compare the NLL with (a loop that passes none), and
the overhead budget's (the cost of a measurement against a step: it depends on the machine's load)."""


def unexpected(said: list[str]) -> list[str]:
    """The warnings of ``said`` that are not one of the :data:`NOTES`."""
    return [w for w in said if not any(note in w for note in NOTES)]
