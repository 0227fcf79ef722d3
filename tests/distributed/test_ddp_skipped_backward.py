"""A step where one rank skipped its backward (a caught exception) still publishes the same
keys on every rank (the reduced ones with the same values), and nothing hangs (2 CPU processes, gloo; the worker is
tests/workers/ddp_skipped_backward.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.distributed import free_port
from tests.helpers.paths import WORKERS

SCRIPT = WORKERS / "ddp_skipped_backward.py"


def test_a_rank_that_skipped_its_backward_publishes_the_same_keys_as_the_others(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), port, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert sorted(r0) == sorted(r1) == ["0", "1", "2", "3"]
    for step in r0:
        assert sorted(r0[step]) == sorted(r1[step]), step
        # the forward statistics and the counts are reduced over the ranks: equal; without DDP each rank's
        # gradients are its own (DDP would average them, and hang on a skipped backward itself)
        reduced = [k for k in r0[step] if k.startswith(("headwatch/logits/", "headwatch/tokens/"))]
        assert reduced and all(r0[step][k] == r1[step][k] for k in reduced), step
    assert any(k.startswith("headwatch/grad/") for k in r0["2"]) or not any(k.startswith("headwatch/grad/") for k in r0["1"])
    assert any(k.startswith("headwatch/logits/") for k in r0["2"])  # rank 0's forward is still measured
