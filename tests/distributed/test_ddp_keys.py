"""Every rank publishes the same headwatch keys with the same values on the same steps, so Lightning's
ModelCheckpoint and EarlyStopping may watch any headwatch metric on 2 processes without hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import WORKERS
from tests.workers.ddp_keys import MONITORS

SCRIPT = WORKERS / "ddp_keys.py"


def test_same_keys_and_values_on_every_rank_and_checkpoint_on_a_collision_key(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    # was: rank 0 published 11 collision keys more than rank 1; ModelCheckpoint deadlocked at step 2
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert sorted(r0["steps"]) == sorted(r1["steps"]) == ["0", "1", "2", "3"]
    for step in r0["steps"]:
        a, b = r0["steps"][step], r1["steps"][step]
        for monitor, prefix in MONITORS.items():
            keys = {k for k in a if k.startswith(prefix)}
            assert keys == {k for k in b if k.startswith(prefix)}, (step, monitor)
            assert keys or (monitor == "collision" and step == "0"), (step, monitor)  # collision: every 2 steps
        assert a.keys() == b.keys(), step
        measured = [k for k in a if "/overhead/" not in k]  # overhead/: each process's own timings (docs/definitions.md)
        assert all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in measured), step  # NaN == NaN
    assert "headwatch/collision/rare_rate_head" in r0["steps"]["1"]
    assert r0["saved"] == r1["saved"] and len(r0["saved"]) == 2  # steps 2 and 4
    # the logit statistics failed on rank 1 only at step 2: dropped on both ranks (was: rank 0 published its
    # values, rank 1 did not, and the ranks' callback_metrics differed from step 2 on)
    assert [r0["published"][s] for s in ("1", "2", "3")] == [r1["published"][s] for s in ("1", "2", "3")] == [[1], [1], [3]]

