"""Reduce once: the collectives headwatch makes on one logging step, counted exactly, on 2 CPU processes (gloo) under
DDP, FSDP2 and DeepSpeed ZeRO-3 (``tests/workers/collectives_worker.py``: the plain-loop door with its four monitors, tied and
untied, logging steps 1 and 3, the collision measured at step 3).

Every sum of a logging step (the logit statistics, the calibration, the target buckets' entropy, the synonym
confusion, the token counts, the self-check's, a row-sharded tied matrix's flow sums, the failure flags) travels in
ONE ``all_reduce`` per dtype, and the per-position values of the quantiles in one ``all_gather``; every other
collective comes from a place ``docs/distributed.md`` lists with its reason. Steps that do not log make none.

Before (measured on the same runs, with each monitor reducing on its own and torchmetrics syncing each state with a
barrier and two gathers), per logging step without / with the collision: DDP 59 / 60 tied, 56 / 57 untied; FSDP2
89 / 148 tied, 74 / 191 untied; ZeRO-3 64 / 66 tied, 66 / 69 untied.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.paths import WORKERS

SCRIPT = WORKERS / "collectives_worker.py"
LOGGING, QUIET = (1, 3), (0, 2)
"""Steps that log (3: the collision too) and steps that do not."""

EXPECTED = {
    "ddp/tied": (7, 7),
    "ddp/untied": (6, 6),
    "fsdp2/tied": (25, 47),
    "fsdp2/untied": (18, 62),
    "zero3/tied": (10, 11),
    "zero3/untied": (12, 14),
}
"""Headwatch's collectives on logging step 1 (no collision) and step 3 (with it)."""

ONE_STEP = {
    ("snapshot", "allreduce", "int64"): 1,  # the token counts, summed when the logging step starts
    ("_agree", "allreduce", "int64"): 1,  # the gradient decisions every process must take alike
    ("compute_due", "allreduce", "float64"): 1,  # the step's float64 sums
    ("compute_due", "allreduce", "int64"): 2,  # the step's int64 sums (with the failure flags), the agreement after
    ("compute_due", "allgather", "float32"): 1,  # every position's entropy and top-1 probability (quantiles)
}
"""DDP, untied: the whole list (site: the headwatch function that asked). Tied adds the lookup flow's average."""

LISTED = {
    "frequency.snapshot", "gradients._agree", "gradients._captured", "monitor.compute_due",  # every engine
    "zero.full_gradient", "zero.full_weight",  # DeepSpeed ZeRO-3 gathers the matrices
    "sharded.rows", "sharded.gather_by_rows", "sharded.gather_rows", "sharded.nearest_neighbours_sharded",  # FSDP2 rows
    "sharded_drift.pairable_rows_sharded", "sharded_drift.principal_directions_sharded", "drift.principal_directions_of",
    "drift._exact_directions", "sharded_drift.corrected_collision_rows", "sharded_drift.synonym_statistics_rows",
}  # fmt: skip
"""Where the collectives that do not ride with the sums come from (docs/distributed.md, "Collectives of a logging step")."""


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _run(tmp_path: Path, *engines: str) -> tuple[dict, dict]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), _free_port(), *engines], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tuple(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))  # type: ignore[return-value]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_run(rank0: dict, rank1: dict, run: str) -> None:
    steps0, steps1 = rank0[run], rank1[run]
    assert len(steps0) == len(steps1) == 4
    for step, (a, b) in enumerate(zip(steps0, steps1)):
        # both processes run the same collectives in the same order (gloo needs it; a mismatch hangs NCCL)
        assert [(c["op"], c["dtype"], c["numel"]) for c in a["collectives"]] == [(c["op"], c["dtype"], c["numel"]) for c in b["collectives"]], (run, step)
        # the same keys; the same values but headwatch's own timings (overhead/: each process's, docs/definitions.md)
        shared = [k for k in a["values"] if "/overhead/" not in k]
        assert a["values"].keys() == b["values"].keys() and all(_same(a["values"][k], b["values"][k]) for k in shared), (run, step)
    for step in QUIET:
        assert steps0[step]["collectives"] == [] and steps0[step]["values"] == {}, (run, step)
    for step, expected in zip(LOGGING, EXPECTED[run]):
        mine = steps0[step]["collectives"]
        assert len(mine) == expected, (run, step, Counter((c["site"], c["op"], c["dtype"]) for c in mine))
        sums = [c for c in mine if c["packed"] and c["op"] == "allreduce"]
        assert sorted(c["dtype"] for c in sums) == ["float64", "int64"], (run, step, sums)  # one all_reduce per dtype
        assert [c["dtype"] for c in mine if c["packed"] and c["op"] != "allreduce"] == ["float32"], (run, step)  # the values
        assert {c["site"] for c in mine if not c["packed"]} <= LISTED, (run, step)
        assert "headwatch/logits/entropy_p50" in steps0[step]["values"] and "headwatch/grad/head_row_density" in steps0[step]["values"]
    assert "headwatch/collision/rare_rate_head" in steps0[3]["values"]


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> tuple[dict, dict]:
    """Every engine's runs, ZeRO-3's where DeepSpeed is installed: one launch of the worker's 2 processes for all."""
    return _run(tmp_path_factory.mktemp("collectives"), "ddp", "ddp-fail", "fsdp2", *(("zero3",) if HAS_DEEPSPEED else ()))


def test_one_all_reduce_per_dtype_on_ddp_and_fsdp2(engine_runs):
    rank0, rank1 = engine_runs
    for run in ("ddp/tied", "ddp/untied", "fsdp2/tied", "fsdp2/untied"):
        _check_run(rank0, rank1, run)
    for step in LOGGING:
        untied = Counter((c["site"].split(".")[1], c["op"], c["dtype"]) for c in rank0["ddp/untied"][step]["collectives"])
        assert untied == ONE_STEP, untied
        tied = Counter((c["site"].split(".")[1], c["op"], c["dtype"]) for c in rank0["ddp/tied"][step]["collectives"])
        assert tied - untied == Counter({("_captured", "allreduce", "float32"): 1})  # the tied lookup flow, averaged as .grad


def test_a_monitor_failing_on_one_process_runs_the_same_collectives_and_is_dropped_everywhere(engine_runs):
    """Rank 1's logit sums fail at step 1, before the step's first collective (its zeros and its failure flag ride
    with the sums: no process waits, the logit statistics are dropped on both); its gradient statistics fail at step 3
    after the sums were reduced (dropped on both by the agreement after computing). Was: the first hung."""
    rank0, rank1 = engine_runs
    failing, plain = rank0["ddp-fail/untied"], rank0["ddp/untied"]
    for step, (a, b) in enumerate(zip(failing, rank1["ddp-fail/untied"])):
        ops = [(c["op"], c["dtype"], c["numel"]) for c in a["collectives"]]
        assert ops == [(c["op"], c["dtype"], c["numel"]) for c in b["collectives"]], step
        assert len(ops) == len(plain[step]["collectives"]), step  # the same collectives as without the failures
        assert a["values"].keys() == b["values"].keys(), step
    dropped = {1: ("headwatch/logits/", "headwatch/debug/capture/", "headwatch/debug/check/", "headwatch/check/"), 3: ("headwatch/grad/", "headwatch/update/", "headwatch/freq/", "headwatch/model/",
                                                                                      "headwatch/check/vanished")}
    for step, prefixes in dropped.items():
        got, full = failing[step]["values"], plain[step]["values"]
        assert set(got) == {k for k in full if not k.startswith(prefixes)}, step
        # what is published is what the run without failures gives (but headwatch's own timings, overhead/)
        assert all(_same(got[k], full[k]) for k in got if "/overhead/" not in k), step


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (optional: pip install deepspeed; DS_ACCELERATOR=cpu runs it on CPU)")
def test_one_all_reduce_per_dtype_on_deepspeed_zero3(engine_runs):
    rank0, rank1 = engine_runs
    for run in ("zero3/tied", "zero3/untied"):
        _check_run(rank0, rank1, run)
