"""A run killed by SIGTERM (Lightning, which takes SIGTERM as a request and trains on: SIGKILL) in the middle of training and resumed from its last checkpoint restores exactly the
state of the checkpoint's step, on the plain loop and Lightning (the Hugging Face door:
tests/integrations/transformers/test_transformers_checkpoint.py). Each run is a real process (tests/workers/sigterm_worker.py): killed at the
start of step 5, resumed from the checkpoint of step 4, it ends with the monitors' and the alert's state of
the uninterrupted run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import ROOT, WORKERS

WORKER = WORKERS / "sigterm_worker.py"


def run(door: str, out: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if door == "lightning":  # Lightning 2.6 takes SIGTERM as a request and trains on: SIGKILL interrupts it for real
        env["HW_SIGKILL"] = "1"
    return subprocess.run([sys.executable, str(WORKER), door, str(out), mode], check=False, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def same(a, b, where: str = "") -> None:
    """Equal nested states (tensors exactly; alerts without their wall-clock time; the overhead budget's probe
    schedule without what timing decided: its last probe's seconds, the interval they set and the run's timed
    totals, and without the count of the run's earlier segments, one more in the resumed run; the summary's figures
    without the published timings, ``<prefix>/overhead/*``)."""
    if isinstance(a, dict):
        timed = {"probe_seconds", "multiple", "run", "ends"} if where.endswith("overhead") else set()
        timed |= {k for k in set(a) | set(b) if isinstance(k, str) and "/overhead/" in k}
        keys = set(a) - {"time"} - timed
        assert keys == set(b) - {"time"} - timed, where
        for k in keys:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        assert a == b or nan, (where, a, b)


@pytest.mark.parametrize("door", ["plain", "lightning"])
def test_a_run_killed_by_sigterm_resumes_the_exact_state_of_its_checkpoint(tmp_path, door):
    whole = run(door, tmp_path / "whole", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(door, tmp_path / "cut", "kill")
    if door == "lightning":
        assert killed.returncode == -signal.SIGKILL and not (tmp_path / "cut" / "ckpt" / "epoch=0-step=6.ckpt").exists()
    else:
        assert killed.returncode == -signal.SIGTERM and "finished" not in killed.stdout, (killed.returncode, killed.stderr[-3000:])
        assert not (tmp_path / "cut" / "step-6.pt").exists()
    resumed = run(door, tmp_path / "cut", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "whole" / "final-whole.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "final-resume.pt", weights_only=False)
    assert a["alert"]["alerts"], "the alert fired in the run: its state is worth restoring"
    same(a, b)
