"""The Hugging Face front door under torchrun: 2 CPU processes (gloo) equal 1 on the same global batches."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np

from tests.helpers.distributed import read_measured
from tests.helpers.paths import WORKERS
from tests.workers.hf_ddp import T, main


def test_two_processes_equal_one_process(tmp_path):
    """torchrun, 2 CPU processes (gloo) with 2 rows each, against one process with the same 4 rows per step."""
    script = WORKERS / "hf_ddp.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:  # a free port (torchrun's --master_port=0 hangs with the static rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", str(script), str(tmp_path / "ddp")]
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            main(str(tmp_path / "single"))  # meanwhile, in this process
            proc.wait(timeout=240)  # loaded 2-core CI runners: imports alone take tens of seconds
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # torchrun passes SIGTERM on to its workers
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    single = read_measured(tmp_path / "single" / "rank0.json")
    ranks = [read_measured(tmp_path / "ddp" / f"rank{r}.json") for r in range(2)]
    assert ranks[0] == ranks[1], "every rank logs the same synchronised values"
    assert sorted(single) == sorted(ranks[0]) == ["2", "4"]
    for step, values in single.items():
        assert set(values) == set(ranks[0][step]), step
        for key, value in values.items():
            np.testing.assert_allclose(ranks[0][step][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{step} {key}")
    assert single["2"]["headwatch/tokens/total"] == 2 * 4 * T  # counts summed over both processes
    assert single["2"]["headwatch/logits/positions"] == 4 * (T - 1)  # the 4 rows of the logging step, both halves
    # the checkpoint at step 4: every rank took the (collective) state, one wrote it; the counts are the
    # whole run's over both processes, as the one-process run saved them
    import torch

    states = [torch.load(tmp_path / run / "checkpoint-4" / "headwatch_state.pt", weights_only=True) for run in ("single", "ddp")]
    assert torch.equal(states[0]["monitors"][0]["counts"], states[1]["monitors"][0]["counts"])
    assert int(states[1]["monitors"][0]["counts"].sum()) == 4 * 4 * T  # 4 steps x 4 rows x T tokens

