"""Storage faults for the tests: a filled tmpfs, a read-only remount, the events read back and checked complete."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch.tensorboard import storage_status
from headwatch.tensorboard.guard import STORAGE_TAGS

ENTROPY = "headwatch/logits/entropy"
STEPS, FAULT_AT, CLEAR_AT = 12, 4, 8


def fill(mount: Path) -> Path:
    """Fill the file system with a ballast file until ENOSPC; returns it."""
    ballast = mount / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (4096, 1):  # pages, then the last bytes
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as err:
                assert err.errno == 28  # ENOSPC
    finally:
        os.close(fd)
    return ballast


def read_back(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def check_nothing_lost(logdir: Path, returned: list[dict[str, float]], messages: list[str], writer, first: int = 0) -> None:
    """Every step from ``first`` on is in the event files, with the value returned to the caller."""
    assert all(ENTROPY in values for values in returned), "every logging step returns its values to the caller"
    acc = read_back(logdir)
    steps = sorted({e.step for e in acc.Scalars(ENTROPY)})
    assert steps == list(range(first, STEPS)), f"every logging step's entropy is written: {steps}"
    by_step = {e.step: e.value for e in acc.Scalars(ENTROPY)}
    for step, values in enumerate(returned[first:], start=first):  # the values written are those returned
        assert by_step[step] == pytest.approx(values[ENTROPY], rel=1e-6)
    stopped = [m for m in messages if "cannot be written" in m]
    assert len(stopped) == 1, messages
    assert any("written to" in m and "again" in m for m in messages), messages
    status = storage_status(writer)
    assert status["lost_events"] == 0 and status["delayed_events"] > 0
    delayed = acc.Scalars(STORAGE_TAGS[0])
    assert delayed and delayed[-1].value == status["delayed_events"]
    assert acc.Scalars(STORAGE_TAGS[1])[-1].value == 0


def remount(mount: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True, capture_output=True, timeout=30)
