"""The prepared GPU check (bench/gpu_check.py) runs end to end on the CPU with tiny sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_gpu_check_smoke_on_cpu():
    """Every part of the script but the CUDA sync count, on tiny sizes; values against float64 within 1e-5."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for line in ("training step without headwatch", "non-logging step overhead", "logging step overhead",
                 "logit_statistics vs torch.logsumexp on (64, 512) bf16"):
        assert line in out, out
    # the values headwatch logged at the last step against the float64 recomputation of the test script
    diffs = [float(d) for d in re.findall(r"\(\|diff\| ([0-9.e+-]+|nan)\)", out)]
    assert len(diffs) == 2 and all(d < 1e-5 for d in diffs), out
    autocast = re.findall(r"max \|diff\| ([0-9.e+-]+) nats", out)
    assert len(autocast) == 2 and all(float(d) < 1e-5 for d in autocast), out
