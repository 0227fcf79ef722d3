"""DeepSpeed ZeRO stages 1, 2 and 3 on 2 CPU processes (gloo, fp32; ``tests/workers/deepspeed_plain.py``): the plain-loop
``headwatch.Headwatch`` publishes every key a one-process run without DeepSpeed publishes, with its values
(relative 1e-5), although ``param.grad`` is None at every stage and ZeRO-3 leaves the matrices empty outside
the forward; a gradient read after ``engine.step()`` is refused once with the fix, on every process alike.

The DeepSpeed runs are skipped where ``deepspeed`` is not installed (it is not in the ``test`` extra: see
the README, "Sharded models"); the test that headwatch never imports it without ZeRO Parameters always runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from headwatch.distributed.zero import full_gradient, full_weight, gathered, zero_stage
from tests.helpers.distributed import read_measured, unexpected
from tests.helpers.paths import WORKERS

SCRIPT = WORKERS / "deepspeed_plain.py"
REASON = "deepspeed is not installed (optional: pip install deepspeed; DS_ACCELERATOR=cpu runs it on CPU)"


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


SCENARIOS = ("1", "2", "3", "3-after", "2-late", "3-late")
"""Every run of the worker's (stage, then ``-after`` or ``-late``): one launch of its 2 processes for all of them."""


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """Both DeepSpeed launches at once, as each waits much of its time on imports and on its peer process: the
    plain-loop worker's 2 processes with every scenario of :data:`SCENARIOS`, and the Hugging Face Trainer's
    ZeRO-3 run, whose one-process twin without DeepSpeed runs in this process meanwhile. Where each wrote its
    results, and each launch's exit status and output."""
    pytest.importorskip("deepspeed", reason=REASON)
    from tests.workers.hf_ddp import main

    out = tmp_path_factory.mktemp("zero")
    (out / "plain").mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    hf = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
          str(WORKERS / "hf_deepspeed.py"), str(out / "hf"), "3"]  # fmt: skip
    cmds = {"plain": [sys.executable, str(SCRIPT), str(out / "plain"), _free_port(), *SCENARIOS], "hf": hf}
    procs = {k: subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k, c in cmds.items()}
    try:
        main(str(out / "single"))  # no DeepSpeed, the same global batches as the Hugging Face run
        said = {k: p.communicate(timeout=400)[0] for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    return {"out": out, "said": said, "codes": {k: p.returncode for k, p in procs.items()}}


@pytest.fixture(scope="module")
def zero_runs(launches) -> tuple[dict, dict]:
    """Each rank's results of every scenario of :data:`SCENARIOS` and of the one-process twin."""
    assert launches["codes"]["plain"] == 0, launches["said"]["plain"][-6000:]
    return tuple(read_measured(launches["out"] / "plain" / f"rank{r}.json") for r in (0, 1))  # type: ignore[return-value]


def _close(a: float, b: float, abs_tol: float = 1e-8) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=abs_tol)


def _gap_close(key: str, a: float, b: float) -> bool:
    """A ``check/*_gap`` is a difference of two float32 figures near 4 nats: its rounding is absolute (~1e-6)."""
    return _close(a, b, abs_tol=1e-5 if key.endswith("_gap") else 1e-8)


def _compare(rank0: dict, rank1: dict, run: str, tying: str) -> tuple[list[dict], list[dict]]:
    """The run's per-step values on both ranks (checked equal to each other) and the one-process values."""
    single = rank0[f"single/{tying}"]
    got0, got1 = rank0[run]["values"], rank1[run]["values"]
    assert rank0[run]["error"] is None and rank1[run]["error"] is None, (rank0[run]["error"], rank1[run]["error"])
    assert len(got0) == len(got1) == len(single) == 3
    for a, b in zip(got0, got1):
        assert set(a) == set(b) and all(_close(a[k], b[k]) for k in a), run  # every rank publishes the same
    return got0, single


def _assert_equal_to_one_process(rank0: dict, rank1: dict, run: str, tying: str) -> None:
    got, single = _compare(rank0, rank1, run, tying)
    assert unexpected(rank0[run]["warnings"]) == [], (run, rank0[run]["warnings"])
    # said once, on rank 0, with the cost
    assert len(rank0[run]["info"]) == 1 and "safe_get_full_grad" in rank0[run]["info"][0], rank0[run]["info"]
    assert rank1[run]["info"] == []
    for step, (expected, values) in enumerate(zip(single, got)):
        assert set(values) == set(expected), (run, step, set(values) ^ set(expected))
        wrong = {k: (expected[k], values[k]) for k in expected if not _close(expected[k], values[k])}
        assert not wrong, (run, step, wrong)
    keys = set(got[-1])
    flows = ("embedding", "head", "shared") if tying == "tied" else ("embedding", "head")
    matrices = ("shared",) if tying == "tied" else ("embedding", "head")
    assert {f"headwatch/grad/{f}_row_density" for f in flows} <= keys
    assert {f"headwatch/update/{m}_row_norm_p50" for m in matrices} <= keys
    assert ("headwatch/grad/tied_flow_cosine_mean" in keys) == (tying == "tied")
    assert {"headwatch/collision/rare_rate_head", "headwatch/logits/entropy", "headwatch/tokens/seen_fraction"} <= keys
    assert 0 < got[-1]["headwatch/grad/head_row_density"] <= 1  # a measured gradient, not an empty one


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_1_2_3_equal_one_process(zero_runs, stage):
    rank0, rank1 = zero_runs
    for tying in ("tied", "untied"):
        run = f"zero{stage}/{tying}"
        # what ZeRO did to the head: stage 3 leaves an empty placeholder outside the forward
        expected_seen = {"shape": [0], "ds_id": True, "hp_mapping": False} if stage == 3 else {"shape": [63, 16], "ds_id": False, "hp_mapping": True}
        assert rank0[run]["seen"] == rank1[run]["seen"] == expected_seen, run
        _assert_equal_to_one_process(rank0, rank1, run, tying)


def test_zero3_headwatch_created_after_initialize(zero_runs):
    rank0, rank1 = zero_runs
    for tying in ("tied", "untied"):
        _assert_equal_to_one_process(rank0, rank1, f"zero3-after/{tying}", tying)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_read_after_engine_step_is_refused_once(zero_runs, stage):
    # stage 2 raised on some processes only (a hang or a crash), stage 3 gave the buffer's leftovers
    rank0, rank1 = zero_runs
    for tying in ("tied", "untied"):
        run = f"zero{stage}-late/{tying}"
        got, single = _compare(rank0, rank1, run, tying)
        warned = unexpected(rank0[run]["warnings"])
        assert len(warned) == 1 and "`engine.step()` already ran" in warned[0] and "before `engine.step()`" in warned[0], warned
        assert unexpected(rank1[run]["warnings"]) == []  # said on rank 0 only; rank 1 took the same path, silently
        for expected, values in zip(single, got):
            assert not any(k.startswith("headwatch/grad/") for k in values)  # skipped, on both ranks
            assert "headwatch/logits/entropy" in values
            assert all(_close(expected[k], values[k]) for k in values)


def test_without_zero_parameters_nothing_changes_and_deepspeed_is_not_imported():
    ds_before = "deepspeed" in sys.modules
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    weight = model[1].weight
    assert zero_stage(weight) == 0
    assert full_gradient(weight) is weight.grad  # .grad itself, no copy
    assert full_gradient(nn.Parameter(torch.ones(2), requires_grad=False)) is None
    assert full_weight(weight) is weight
    with gathered(model):
        assert model[1].weight is weight
    assert ("deepspeed" in sys.modules) == ds_before


def test_hugging_face_trainer_under_zero3_refuses_gradients_once_and_measures_the_rest(launches):
    """accelerate steps the DeepSpeed engine inside ``accelerator.backward``, before ``on_pre_optimizer_step``."""
    assert launches["codes"]["hf"] == 0, launches["said"]["hf"][-4000:]
    out = launches["out"]
    single = read_measured(out / "single" / "rank0.json")
    ranks = [read_measured(out / "hf" / f"rank{r}.json") for r in range(2)]
    assert ranks[0] == ranks[1] and sorted(ranks[0]) == sorted(single) == ["2", "4"]
    warned = unexpected(json.loads((out / "hf" / "warnings0.json").read_text()))
    assert len(warned) == 1 and "inside `accelerator.backward`" in warned[0], warned
    assert unexpected(json.loads((out / "hf" / "warnings1.json").read_text())) == []  # said on rank 0 only
    for step, values in ranks[0].items():
        missing = set(single[step]) - set(values)
        # the gradient statistics, and the self-check made from them, are refused under ZeRO-3
        # (the head's shapes, model/*, come with the gradient statistics)
        assert {k.split("/")[1] for k in missing - {"headwatch/check/vanished_gradient"}} == {"grad", "update", "freq", "model"}
        assert "headwatch/check/vanished_gradient" in missing
        assert {"headwatch/logits/entropy", "headwatch/collision/rare_rate_head", "headwatch/tokens/seen_fraction"} <= set(values)
        wrong = {k: (single[step][k], v) for k, v in values.items() if not _gap_close(k, single[step][k], v)}
        assert not wrong, (step, wrong)
