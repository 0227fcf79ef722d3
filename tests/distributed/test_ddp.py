"""Two CPU processes (DDP, gloo) log the same numbers as one process on the same global batches:
logit statistics, token counts, and gradient densities of a tied matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import WORKERS

SCRIPT = WORKERS / "ddp_logit_stats.py"


def _start(out: Path, devices: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), str(out), str(devices), "8"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(proc: subprocess.Popen, out: Path, devices: int) -> list[dict]:
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def test_ddp_two_processes_equal_one_process(tmp_path):
    # both runs at once: each spends much of its time starting (imports, gloo), not computing
    single_run, ddp_run = _start(tmp_path / "single", 1), _start(tmp_path / "ddp", 2)
    try:
        (single,) = _results(single_run, tmp_path / "single", 1)
        ranks = _results(ddp_run, tmp_path / "ddp", 2)
    finally:
        for proc in (single_run, ddp_run):
            proc.kill()
    assert ranks[0] == ranks[1], "every rank must hold the same synchronised values"
    ddp = ranks[0]
    assert sorted(single["train"]) == sorted(ddp["train"]) == ["0", "1", "2"]
    for step, values in single["train"].items():
        for key, value in values.items():
            assert ddp["train"][step][key] == pytest.approx(value, rel=1e-5, nan_ok=True), (step, key)
    last = single["train"]["2"]
    assert last["tokens/total"] == sum(last["counts"]) > 0  # token counts summed over both processes
    assert last["rare/positions"] > 0 and 0 < last["ece"] < 1  # calibration measured, not all NaN
    assert 0 < last["grad/embedding_row_density"] < 1 and last["grad/head_row_density"] == 1.0
    # the checkpoint holds the counts of both processes, not rank zero's alone
    assert single["saved_counts"] == ddp["saved_counts"] == last["counts"]
    assert single["train"]["0"]["positions"] > 0
    assert single["val"] and single["val"].keys() == ddp["val"].keys()
    for step, values in single["val"].items():
        assert values, "validation metrics missing"
        for key, value in values.items():
            assert ddp["val"][step][key] == pytest.approx(value, rel=1e-5, nan_ok=True), (step, key)
