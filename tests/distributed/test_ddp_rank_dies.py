"""A rank that dies ends the others within the process group's timeout (2 CPU processes, gloo,
timeout 10 s, forked; the worker is tests/workers/ddp_rank_dies.py). Rank 1 dies hard (``os._exit`` between two steps, or SIGKILL
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


MODES = ("exit", "kill", "stop")


@pytest.fixture(scope="module")
def deaths(tmp_path_factory) -> dict[str, tuple[list, object]]:
    """The three modes started together (the ``stop`` one mostly waits out the timeout): each mode's two processes,
    ended, and its folder."""
    # forked from this process, with torch and headwatch imported already (a fresh interpreter spends ~30 s importing
    # on a loaded machine); tests/workers/ddp_rank_dies.py also runs from the command line
    ctx = multiprocessing.get_context("fork")
    started = {}
    for mode in MODES:
        out, port = tmp_path_factory.mktemp(f"rank_dies_{mode}"), str(free_port())
        started[mode] = ([ctx.Process(target=run, args=(r, port, out, mode), daemon=True) for r in range(2)], out)
        for p in started[mode][0]:
            p.start()
    try:
        for mode, (procs, _) in started.items():
            procs[0].join(timeout=120 + TIMEOUT_S)  # None: rank 0 hangs
            if mode != "stop":
                procs[1].join(timeout=10)
    finally:
        for procs, _ in started.values():
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)  # a stopped process ends on SIGKILL
        for procs, _ in started.values():
            for p in procs:
                p.join(timeout=10)
    return started


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_dies_ends_the_other_within_the_timeout(deaths, mode):
    procs, tmp_path = deaths[mode]
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
