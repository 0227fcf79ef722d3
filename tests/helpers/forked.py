"""A gloo worker script run as 2 processes forked from the test's own process, not 2 fresh interpreters."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
import warnings
from pathlib import Path

from tests.helpers.paths import ROOT


def fork_gloo_workers(source: str, tmp_path, port_base: int, timeout: float = 240.0) -> list:
    """What :func:`tests.helpers.distributed.run_gloo_workers` does (the same ``argv``: rank, port, repository root,
    ``tmp_path``; each rank's ``tmp_path/rank<r>.json`` returned; both must exit 0), the script run in 2 processes
    forked from this one: torch, headwatch and the test helpers are imported already, where a fresh interpreter
    spends most of a small worker's seconds importing them. Each process's output goes to ``tmp_path/rank<r>.log``
    (the failure message). ``port_base``: this test's range of ports (plus ``pid % 2000``)."""
    script = Path(tmp_path) / "worker.py"
    script.write_text(source)
    port = str(port_base + os.getpid() % 2000)
    ctx = multiprocessing.get_context("fork")
    procs = []
    for rank in range(2):
        argv = [str(script), str(rank), port, str(ROOT), str(tmp_path)]
        log = Path(tmp_path) / f"rank{rank}.log"
        procs.append(ctx.Process(target=_run_script, args=(source, argv, log), daemon=True))
        procs[-1].start()
    try:
        for proc in procs:
            proc.join(timeout=timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
    logs = [log.read_text() if log.exists() else "" for log in (Path(tmp_path) / f"rank{r}.log" for r in range(2))]
    assert [p.exitcode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    return [json.loads((Path(tmp_path) / f"rank{r}.json").read_text()) for r in range(2)]


def _run_script(source: str, argv: list[str], log: Path) -> None:
    """The forked process: ``source`` as ``__main__`` with ``argv``; it never returns into the test's process."""
    code = 1
    with open(log, "w", buffering=1) as out:
        os.dup2(out.fileno(), 1)  # torch's and gloo's own output too
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        try:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():  # the test process's own group (one process): not ours
                dist.destroy_process_group()
            torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 for a fresh worker; no OpenMP region after the fork
            warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore
            sys.argv = argv
            exec(compile(source, argv[0], "exec"), {"__name__": "__main__", "__file__": argv[0]})  # noqa: S102
            code = 0
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        except BaseException:  # noqa: BLE001 - the test reads the log
            traceback.print_exc()
        out.flush()
    os._exit(code)
