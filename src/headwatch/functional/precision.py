"""Execution helpers shared by the functional statistics: full precision and CPU threading.

- :func:`full_precision`: the statistics are defined in float32 (float64 for float64
  input) whatever the caller's autocast region says. Under ``torch.autocast`` ops such as
  matrix products and ``torch.linalg.vecdot`` would otherwise run in bf16/fp16 (per-position
  entropy errors of about 1e-2 nats), and on CUDA float32 matrix products may use TF32
  (``torch.set_float32_matmul_precision("high")``, about 1e-3 relative).
- :func:`map_rows_single_threaded`: on the CPU, many small multi-threaded ops over
  cache-sized chunks each open an OpenMP parallel region whose threads must all be
  scheduled; on a machine where another process is busy every region waits for a time
  slice (measured: 4-6 s instead of 65 ms). Splitting the *chunks* across threads that
  each run single-threaded ops keeps every core busy with no per-op barrier, idle or not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__: list[str] = []  # plumbing of the other functional modules, not part of the API

T = TypeVar("T")


@contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Disable autocast for ``device``'s type (and TF32 matrix products on CUDA) inside the block."""
    kind = device.type
    available = torch.amp.is_autocast_available(kind)
    previous = torch.get_float32_matmul_precision() if kind == "cuda" else None
    if previous is not None and previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        if available:
            with torch.autocast(kind, enabled=False):
                yield
        else:
            yield
    finally:
        if previous is not None and previous != "highest":
            torch.set_float32_matmul_precision(previous)


SMALL_DENSE = 1024
"""On the CPU, a dense factorisation of a matrix up to this size (``torch.linalg.eigh`` of a ``(d, d)`` covariance) runs
single-threaded: it is a sequence of small parallel regions, each of which waits for a time slice for every thread on
a busy machine (measured at d 256 on 2 cores with other processes running: 0.2-6 s with 2 threads, 7-30 ms with 1)."""


@contextmanager
def single_threaded(device: torch.device, size: int) -> Iterator[None]:
    """Inside the block, torch's CPU ops run on one thread when ``device`` is the CPU and ``size`` (the matrix's
    side) is at most :data:`SMALL_DENSE`; the thread count is restored afterwards. Elsewhere nothing changes."""
    if device.type != "cpu" or size > SMALL_DENSE or torch.get_num_threads() == 1:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_workers(device: torch.device, tasks: int) -> int:
    """Threads to split ``tasks`` CPU chunks across: torch's intra-op thread count, 1 off the CPU."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), tasks))


def map_rows_single_threaded(
    fn: Callable[[T, int], None], tasks: Sequence[T], workers: int
) -> None:
    """Call ``fn(task, worker_index)`` for every task, on ``workers`` threads running single-threaded torch ops.

    Tasks are handed out one at a time from a shared queue, so a thread that the OS
    deschedules delays only the task it holds (the others take the rest). torch's thread
    count is set to 1 for the call (new threads read it when they first run an op) and
    restored afterwards; the caller's grad mode and inference mode are carried into the threads (autocast is
    not: it starts disabled there). ``fn`` must write to disjoint outputs; exceptions are
    re-raised.
    """
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            fn(task, 0)
        return
    lock = threading.Lock()
    queue = iter(tasks)
    grad = torch.is_grad_enabled()  # thread-local in torch: new threads start with grad enabled
    # inference mode too (Lightning validates under it): outputs allocated by the caller are then
    # inference tensors, which a thread outside inference mode may not update in place
    inference = torch.is_inference_mode_enabled()

    def work(worker: int) -> None:
        # inference_mode(False) would switch grad mode on: enter it only when the caller is in it, grad mode inside
        with torch.inference_mode() if inference else contextlib.nullcontext(), torch.set_grad_enabled(grad):
            while True:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                fn(task, worker)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="headwatch") as pool:
            for future in [pool.submit(work, w) for w in range(workers)]:
                future.result()
    finally:
        torch.set_num_threads(previous)
