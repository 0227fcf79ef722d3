"""Under FSDP2 (``fully_shard``, 2 CPU processes, gloo; 4 for an int below the world size), a fused loss (the hidden-state path: the model returns no
logits and never calls its head) is measured through every door, for each ``reshard_after_forward`` of the root and
of the decoder layer, given as bools and as ints: each published figure equals one process's on the same global
batches, and the logits statistics equal float64 ones of the hidden states the loss scored, at forward time
(docs/supported.md). The Trainers are handed a model already sharded (accelerate runs FSDP on accelerators only)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.helpers.distributed import read_measured
from tests.helpers.paths import WORKERS

pytest.importorskip("trl")

SCRIPT = WORKERS / "fsdp_doors.py"
ATOL = 2e-5  # the trainer matrix's: float32 statistics against float64 ones (measured below 2e-7)


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list]:
    """The one-process runs of every door, the 2-process runs of every setting and the 4-process run, started together."""
    out = tmp_path_factory.mktemp("fsdp_doors")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), mode, str(out), _free_port()], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for mode in ("single", "sharded", "sharded4")
    ]
    for proc in procs:
        text, _ = proc.communicate(timeout=540)
        assert proc.returncode == 0, text[-4000:]
    names = ["single_rank0", "sharded_rank0", "sharded_rank1"] + [f"sharded4_rank{r}" for r in range(4)]
    return {name: read_measured(out / f"{name}.json") for name in names}


def _same(key: str, a: float, b: float) -> bool:
    """Equal to 1e-5 relative; the self-check's gaps (differences of two ~5-nat float32 means: rounding ~5e-7) to 1e-5."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if key.startswith("headwatch/check/") and key.endswith("_gap"):
        return abs(a - b) <= 1e-5
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-8)


SETTINGS = [("hf_trainer", True, True), ("hf_trainer", False, False), ("hf_trainer", 2, 1), ("hf_trainer", False, True),
            ("sft_trainer", True, True), ("sft_trainer", False, False), ("sft_trainer", 2, 1), ("sft_trainer", False, True),
            ("lightning", True, True), ("lightning", False, False), ("lightning", 2, 1), ("lightning", False, True),
            ("loop", 2, 1)]  # fmt: skip


@pytest.mark.parametrize(("door", "root", "layer"), SETTINGS)
def test_fused_loss_under_fsdp2_through_each_door_equals_one_process(runs, door, root, layer):
    single = next(r for r in runs["single_rank0"] if r["door"] == door)
    index = SETTINGS.index((door, root, layer))
    got0, got1 = runs["sharded_rank0"][index], runs["sharded_rank1"][index]
    assert (got0["door"], got0["root"], got0["layer"]) == (door, root, layer)
    assert len(single["values"]) == len(got0["values"]) == len(got1["values"]) == 2
    if door != "lightning":  # the root's post-forward mesh: both processes (True, or the int 2) or none (False)
        assert got0["held"] == ([2] if root else None)
    for step, (expected, a, b) in enumerate(zip(single["values"], got0["values"], got1["values"], strict=True)):
        assert set(a) == set(b) == set(expected), (step, set(a) ^ set(expected))
        assert "headwatch/grad/shared_row_density" in a and "headwatch/logits/entropy" in a
        wrong = {k: (expected[k], a[k], b[k]) for k in expected if not (_same(k, expected[k], a[k]) and _same(k, expected[k], b[k]))}
        assert not wrong, (step, wrong)
        reference = single["reference"][step]  # float64, from the hidden states and the weight the loss used
        assert a["headwatch/logits/positions"] == reference["positions"]
        for key, col in (("entropy", "entropy"), ("kl_to_uniform", "kl_to_uniform"), ("max_prob", "max_prob"), ("target_nll", "nll")):
            assert a[f"headwatch/logits/{key}"] == pytest.approx(reference[col], abs=ATOL), key
    # what headwatch said: the same as on one process (the hidden-state path's note; rank 0 says it), no failure
    assert got0["warnings"] == single["warnings"] and set(got1["warnings"]) <= set(got0["warnings"]), (got0["warnings"], single["warnings"])
    assert not any("FAILED" in w or "failed" in w or "no gradient" in w or "sharded" in w for w in got0["warnings"])


@pytest.mark.parametrize("door", ["hf_trainer", "sft_trainer", "lightning", "loop"])
def test_an_int_below_the_world_size_reshards_to_a_smaller_group_and_equals_one_process(runs, door):
    """``reshard_after_forward=2`` on 4 processes (root and layer): after the forward each Parameter is held by groups
    of 2 (FSDP2's post-forward mesh), not by all 4; 4 rows a step."""
    single = next(r for r in runs["single_rank0"] if r["door"] == f"{door}4")
    ranks = [next(r for r in runs[f"sharded4_rank{rank}"] if r["door"] == f"{door}4") for rank in range(4)]
    assert [(r["root"], r["layer"]) for r in ranks] == [(2, 2)] * 4
    if door != "lightning":  # sharded in configure_model there
        assert ranks[0]["held"] == [2, 2]  # after the forward: 2 groups of 2 processes, each holding every row
    assert len(single["values"]) == 2 and all(len(r["values"]) == 2 for r in ranks)
    for step, expected in enumerate(single["values"]):
        got = [r["values"][step] for r in ranks]
        assert all(set(g) == set(expected) for g in got), [set(g) ^ set(expected) for g in got]
        assert "headwatch/grad/shared_row_density" in expected and "headwatch/logits/entropy" in expected
        wrong = {k: [expected[k]] + [g[k] for g in got] for k in expected if not all(_same(k, expected[k], g[k]) for g in got)}
        assert not wrong, (step, wrong)
        reference = single["reference"][step]
        assert got[0]["headwatch/logits/positions"] == reference["positions"]
        assert got[0]["headwatch/logits/entropy"] == pytest.approx(reference["entropy"], abs=ATOL)
        assert got[0]["headwatch/logits/target_nll"] == pytest.approx(reference["nll"], abs=ATOL)
    assert ranks[0]["warnings"] == single["warnings"] and all(set(r["warnings"]) <= set(single["warnings"]) for r in ranks)
