"""A rank that dies ends the others within the process group's timeout (2 CPU processes, gloo,
timeout 20 s, forked; the worker is tests/workers/ddp_rank_dies.py). Rank 1 dies hard (``os._exit`` between two steps, or SIGKILL
right before a logging step's first collective); rank 0, waiting in headwatch's reduction, must end (raise) within
the timeout instead of hanging, and every step it logged before the death must be in its TensorBoard event file with
the values ``step_end`` returned. headwatch adds no wait of its own and does not swallow the error."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.distributed import free_port
from tests.workers.ddp_rank_dies import DIE_AT, TIMEOUT_S, run

ENTROPY = "headwatch/logits/entropy"


@pytest.mark.parametrize("mode", ["exit", "kill", "stop"])
def test_a_rank_that_dies_ends_the_other_within_the_timeout(tmp_path, mode):
    # forked from this process, with torch and headwatch imported already (a fresh interpreter spends ~30 s importing
    # on a loaded machine); tests/workers/ddp_rank_dies.py also runs from the command line
    port, ctx = str(free_port()), multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run, args=(r, port, tmp_path, mode), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=120 + TIMEOUT_S)  # None: rank 0 hangs
        if mode != "stop":
            procs[1].join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # a stopped process ends on SIGKILL
        for p in procs:
            p.join(timeout=10)
    assert procs[0].exitcode == 3, f"rank 0: {procs[0].exitcode} (None: still running)"
    assert procs[1].exitcode == {"exit": 1, "kill": -9, "stop": -9}[mode]
    end = json.loads((tmp_path / "rank0_end.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(DIE_AT)), "rank 0 logged every step before the death, none after"
    waited = end["t"] - records[-1]["t"]  # from rank 0's last logged step to its end
    assert end["error"] and end["error"].startswith("RuntimeError"), end  # raised, not swallowed
    if mode == "stop":  # the peer's sockets stay open: the process group's timeout ends the wait
        assert TIMEOUT_S - 1 < waited < TIMEOUT_S + 5, (waited, end)
    else:  # the peer's sockets close with it: gloo sees it at once
        assert waited < 5, (waited, end)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    written = {e.step: e.value for e in acc.Scalars(ENTROPY)}
    assert written == pytest.approx({r["step"]: r["values"][ENTROPY] for r in records}, rel=1e-6)
