"""Under FSDP2 (Lightning's ``ModelParallelStrategy``, 2 CPU processes, gloo) every monitor publishes the values
a single process publishes on the same global batches, tied and untied, and no process holds a work buffer
of the whole ``(V, d_model)`` matrix: per-row statistics are computed on each process's rows and combined."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.distributed import read_measured
from tests.helpers.paths import WORKERS

SCRIPT = WORKERS / "fsdp_monitors.py"
LOOPS = WORKERS / "fsdp_loops.py"
LOOP_WORKERS = ("fsdp_ops", "fsdp_plain", "fsdp_drift", "fsdp1_plain")  # fsdp1_plain last: it patches classes
LOOP_OUTPUTS = ("ops.txt", "plain.json", "drift_rank0.json", "drift_rank1.json", "fsdp1_plain.json", "fsdp1_plain_r1.json")


def _free_ports(n: int) -> list[str]:
    """``n`` distinct free ports (held open together while chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [str(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, tuple]:
    """Started together: the one-process Lightning run and the two-process runs under FSDP2 and FSDP1
    (tests/workers/fsdp_monitors.py), and the plain-loop workers in one launch (tests/workers/fsdp_loops.py).
    Each launch's exit status, output and folder, by name."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    lightning, loops = tmp_path_factory.mktemp("lightning_fsdp"), tmp_path_factory.mktemp("loops_fsdp")
    commands = {mode: ([str(SCRIPT), mode, str(lightning)], lightning) for mode in ("fsdp", "fsdp1", "single")}
    commands["loops"] = ([str(LOOPS), ",".join(LOOP_WORKERS), str(loops), ",".join(_free_ports(len(LOOP_WORKERS)))], loops)
    procs = {}
    for name, (args, out) in commands.items():
        with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
            procs[name] = subprocess.Popen([sys.executable, *args], env=env, stdout=stdout, stderr=stderr, text=True)
    result = {}
    try:
        for name, proc in procs.items():
            proc.wait(timeout=600)
            out = commands[name][1]
            result[name] = (proc.returncode, (out / f"{name}.out").read_text(), (out / f"{name}.err").read_text(), out)
    finally:
        for proc in procs.values():
            proc.kill()
    return result


@pytest.fixture(scope="module")
def lightning_runs(launches) -> dict[str, dict]:
    """The one-process run and the two-process runs under FSDP2 and FSDP1."""
    for mode in ("fsdp", "fsdp1", "single"):
        returncode, stdout, stderr, out = launches[mode]
        assert returncode == 0, (stdout + stderr)[-4000:]
    names = ("single_rank0", "fsdp_rank0", "fsdp_rank1", "fsdp1_rank0", "fsdp1_rank1")
    return {name: read_measured(out / f"{name}.json") for name in names}


@pytest.fixture(scope="module")
def loops(launches):
    """The plain-loop workers' folder, once every worker finished."""
    returncode, stdout, stderr, out = launches["loops"]
    ok = all((out / name).exists() for name in LOOP_OUTPUTS) and (out / "ops.txt").read_text() == "ok"  # after the checks
    # gloo now and then aborts a worker at interpreter exit ("terminate called without an active exception"), after
    # every worker's checks and the barrier that follows them: that exit is not a failed comparison
    aborted_at_exit = ok and "terminate called without an active exception" in stderr and "AssertionError" not in stderr
    assert returncode == 0 or aborted_at_exit, stdout[-3000:] + stderr[-3000:]
    return out


def _assert_equal_steps(single: dict, rank0: dict, rank1: dict, tying: str) -> None:
    steps = single[tying]["steps"]
    assert sorted(steps) == sorted(rank0[tying]["steps"]) == sorted(rank1[tying]["steps"]) == ["0", "1", "2", "3"]
    for step, expected in steps.items():
        got0, got1 = rank0[tying]["steps"][step], rank1[tying]["steps"][step]
        assert set(got0) == set(got1) == set(expected), (tying, step, set(got0) ^ set(expected))
        wrong = {k: (expected[k], got0[k], got1[k]) for k in expected if not (_close(expected[k], got0[k]) and _close(expected[k], got1[k]))}
        assert not wrong, (tying, step, wrong)


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-8)


def _same(key: str, a: float, b: float) -> bool:
    """:func:`_close`, but the self-check's gaps (differences of two ~4-nat float32 means: rounding ~5e-7) to 1e-5."""
    if key.startswith("headwatch/check/") and key.endswith("_gap"):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5
    return _close(a, b)


def test_every_monitor_under_fsdp2_equals_one_process(lightning_runs):
    single, rank0, rank1 = (lightning_runs[k] for k in ("single_rank0", "fsdp_rank0", "fsdp_rank1"))
    for tying in ("tied", "untied"):
        # the run was sharded: DTensor weight and gradient, 63 rows split 32 + 31, work buffers of local rows only
        assert rank0[tying]["seen"] == {"weight": "DTensor", "grad": "DTensor", "local_rows": 32, "buffers": [[32, 16]]}
        assert rank1[tying]["seen"] == {"weight": "DTensor", "grad": "DTensor", "local_rows": 31, "buffers": [[31, 16]]}
        assert single[tying]["seen"]["buffers"] == [[63, 16]]
        _assert_equal_steps(single, rank0, rank1, tying)
        steps = single[tying]["steps"]
        keys = set(steps["3"])
        flows = ("embedding", "head", "shared") if tying == "tied" else ("embedding", "head")
        for flow in flows:
            assert {f"headwatch/grad/{flow}_row_density", f"headwatch/grad/rare/{flow}_row_norm_p95"} <= keys
        matrices = ("shared",) if tying == "tied" else ("embedding", "head")
        assert {f"headwatch/update/{m}_row_norm_p50" for m in matrices} <= keys
        assert {f"headwatch/freq/{m}_norm_spearman" for m in matrices} <= keys
        assert ("headwatch/grad/tied_flow_cosine_mean" in keys) == (tying == "tied")
        assert {"headwatch/collision/rare_rate_head", "headwatch/collision/synonym_pair_rate_head", "headwatch/tokens/seen_fraction"} <= keys
        assert "headwatch/logits/entropy" in keys
        # the sharded neighbour search found collisions to compare (not only NaN or zero)
        assert 0 < steps["3"]["headwatch/collision/drift/raw_rate_head"] <= 1  # the raw (drift) rate, headwatch 0.1's headline


def test_plain_loop_attached_before_fully_shard_equals_one_process(loops):
    result = read_measured(loops / "plain.json")
    for tying, runs in result.items():
        for step, (expected, got) in enumerate(zip(runs["single"], runs["sharded"])):
            assert set(got) == set(expected), (tying, step, set(got) ^ set(expected))
            wrong = {k: (expected[k], got[k]) for k in expected if not _close(expected[k], got[k])}
            assert not wrong, (tying, step, wrong)
        # was: the Parameters resolved before fully_shard had no .grad: "the head has no gradient", 1 grad key
        assert sum(k.startswith("headwatch/grad/") for k in runs["sharded"][-1]) > 70, tying


def test_sharded_functions_equal_one_process_functions_on_a_dtensor(loops):
    # nearest neighbours (no query, tied cosines across shards, NaN, zero and invalid rows), row statistics,
    # zero rows, gathered rows, synonym pairs and the compact lookup flow (padding, two micro-batches)
    assert (loops / "ops.txt").read_text() == "ok"  # written after both ranks' checks


def test_every_monitor_under_lightning_fsdp1_equals_one_process(lightning_runs):
    # Lightning's FSDPStrategy (FSDP1, use_orig_params=True): outside forward the head weight is this process's
    # part of a flat 1-D vector (tied: 1008 values split 504 + 504; untied: the head lies wholly on rank 1),
    # so every matrix measurement runs inside summon_full_params of the root unit. Was: HeadwatchError at
    # on_fit_start ("the output head ... has no 2-D `weight`").
    single, rank0, rank1 = (lightning_runs[k] for k in ("single_rank0", "fsdp1_rank0", "fsdp1_rank1"))
    assert rank0["tied"]["seen"]["local_shape"] == rank1["tied"]["seen"]["local_shape"] == [504]
    assert (rank0["untied"]["seen"]["local_shape"], rank1["untied"]["seen"]["local_shape"]) == ([0], [1008])
    for tying in ("tied", "untied"):
        _assert_equal_steps(single, rank0, rank1, tying)
        keys = set(single[tying]["steps"]["3"])
        matrices = ("shared",) if tying == "tied" else ("embedding", "head")
        assert {f"headwatch/update/{m}_row_norm_p50" for m in matrices} <= keys
        assert ("headwatch/grad/tied_flow_cosine_mean" in keys) == (tying == "tied")
        assert {"headwatch/grad/head_row_density", "headwatch/collision/rare_rate_head", "headwatch/logits/entropy"} <= keys


@pytest.fixture(scope="module")
def plain1_run(loops) -> tuple[dict, dict]:
    """tests/workers/fsdp1_plain.py's output: rank 0's runs and rank 1's values of the ``fail-rank1`` run."""
    return read_measured(loops / "fsdp1_plain.json"), read_measured(loops / "fsdp1_plain_r1.json")


def test_plain_loop_under_fsdp1_equals_one_process(plain1_run):
    # headwatch.Headwatch created on a FullyShardedDataParallel root (mix: its own unit), tied and untied:
    # use_orig_params=True gives every value of one process; use_orig_params=False (no per-parameter
    # gradient in FSDP1) gives the weight and logit values, skips the gradient ones and says why, once
    result = plain1_run[0]
    assert result["tied-orig"]["seen"]["head_weight_shape"] == [504]  # flat: not a (V, d_model) matrix
    # the model's own names in messages; was "head `_fsdp_wrapped_module.lm_head` and embedding ..."
    assert result["untied-orig"]["seen"]["tying"].startswith("head `lm_head` and embedding `embed_tokens`"), result["untied-orig"]["seen"]
    for name in ("tied-orig", "tied-flat", "untied-orig", "untied-flat"):
        run = result[name]
        flat = name.endswith("flat")
        for step, (expected, got) in enumerate(zip(run["single"], run["sharded"])):
            missing = set(expected) - set(got)
            assert not set(got) - set(expected), (name, step)
            gradient_keys = ("headwatch/grad/", "headwatch/update/", "headwatch/freq/", "headwatch/model/", "headwatch/check/vanished_gradient")
            assert all(k.startswith(gradient_keys) for k in missing), (name, missing)
            assert bool(missing) == flat, (name, step, len(missing))
            wrong = {k: (expected[k], got[k]) for k in got if not _same(k, expected[k], got[k])}
            assert not wrong, (name, step, wrong)
        assert {"headwatch/logits/entropy", "headwatch/tokens/seen_fraction"} <= set(run["sharded"][-1])  # collision: the Lightning test
        said = [w for w in run["warnings"] if "use_orig_params=False" in w]
        assert len(said) == (1 if flat else 0), (name, run["warnings"])
        if not flat:
            assert sum(k.startswith("headwatch/grad/") for k in run["sharded"][-1]) > 70, name
def _relative(expected: float, got: float) -> float:
    if math.isnan(expected) or math.isnan(got):
        return 0.0 if math.isnan(expected) and math.isnan(got) else math.inf
    return abs(got - expected) / max(abs(expected), 1e-12)


def _table_numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| (-?\d\.\d{4}) (?=\|)", text)]


def test_drift_corrected_collision_on_local_rows_equals_one_process(loops):
    """Was: the sharded path gathered the whole (V, d_model) matrix on every process before the correction."""
    ranks = [read_measured(loops / f"drift_rank{r}.json") for r in (0, 1)]
    V, d = 1001, 32
    for path in ("exact", "randomized"):
        single = ranks[0][path]["single"]
        # the path under test ran (2 matrices: head and embedding), on one process and on both shards
        assert all(run["calls"][path] == 2 and sum(run["calls"].values()) == 2 for run in (single, *(r[path]["sharded"] for r in ranks)))
        # the recorder sees the one-process (V, d_model) tensors; the shards hold none
        assert [V, d] in single["full"] and single["most_rows"] == V
        for r, rank in enumerate(ranks):
            got = rank[path]["sharded"]
            assert got["full"] == [], (path, r, got["full"])
            assert got["most_rows"] < V, (path, r, got["most_rows"])  # the local rows plus the gathered queries
            assert set(got["scalars"]) == set(single["scalars"])
            wrong = {k: (v, got["scalars"][k]) for k, v in single["scalars"].items() if _relative(v, got["scalars"][k]) > 1e-5}
            assert not wrong, (path, r, wrong)
            for name, pairs in single["pairs"].items():
                assert [p[:2] for p in got["pairs"][name]] == [p[:2] for p in pairs]
                assert all(abs(a[2] - b[2]) < 1e-5 for a, b in zip(got["pairs"][name], pairs))
            assert got["tables"].keys() == single["tables"].keys()
            for key, text in single["tables"].items():  # cosines, drift removed and raw (the pair's rows gathered)
                ours, theirs = _table_numbers(got["tables"][key]), _table_numbers(text)
                assert len(ours) == len(theirs) > 0 and all(abs(a - b) <= 1.5e-4 for a, b in zip(ours, theirs)), key
        s = single["scalars"]
        for m in ("head", "embedding"):
            # planted: drift makes every raw rare cosine pass tau; corrected, only the 50 planted pairs collide
            assert s[f"headwatch/collision/drift/raw_rate_{m}"] == 1.0
            assert 0.05 < s[f"headwatch/collision/rare_rate_{m}"] < 0.4
            assert s[f"headwatch/collision/synonym_pair_rate_{m}"] == 1 / 3  # 310 ~ 420 only
            assert s[f"headwatch/collision/synonym_partner_rank_{m}"] > 10  # the median pair is an independent one
            assert s[f"headwatch/collision/untrained_count_{m}"] == 1.0



def test_plain_loop_under_fsdp1_hostile_uses(plain1_run):
    result, rank1 = plain1_run
    tied = result["tied-orig"]["single"]  # the one-process twin
    # 1. Headwatch created on the model, then FullyShardedDataParallel wrapped it (README: create it after):
    # training goes on, the token and logit values are those of one process, and the matrix statistics are
    # skipped with the cause and the fix said once. Was: "expected matrix of shape [vocab_size, d_model], got (504,)"
    run = result["before-wrap"]
    for expected, got in zip(tied, run["sharded"]):
        forward = {k for k in expected if k.startswith(("headwatch/logits/", "headwatch/tokens/"))}
        captured = {k for k in expected if k.startswith(("headwatch/debug/", "headwatch/check/"))}  # the self-check
        assert forward <= set(got) <= forward | captured, set(got) ^ forward
        assert all(_same(k, expected[k], got[k]) for k in got), {k: (expected[k], got[k]) for k in got if not _same(k, expected[k], got[k])}
    said = [w for w in run["warnings"] if "wrapped the model after headwatch attached" in w]
    # once per monitor that reads the matrices and measured (the collision probe runs on the first logging step)
    assert {w.split(" failed while ")[0] for w in said} == {"GradientDensity", "SynonymCollision"}, "\n\n".join(said)
    assert all("create headwatch.Headwatch on the wrapped model" in w for w in said)
    # 2. untied, the head a unit of its own, 2 micro-batches per step (the first under no_sync): one process's values
    run = result["accum-headunit"]
    for expected, got in zip(run["single"], run["sharded"]):
        assert set(got) == set(expected)
        assert all(_same(k, expected[k], got[k]) for k in got), {k: (expected[k], got[k]) for k in got if not _same(k, expected[k], got[k])}
    # a tiny tied LlamaForCausalLM, decoder layers as units, headwatch's defaults: one process's values
    run = result["llama-tied"]
    for expected, got in zip(run["single"], run["sharded"]):
        assert set(got) == set(expected)
        assert all(_same(k, expected[k], got[k]) for k in got), {k: (expected[k], got[k]) for k in got if not _same(k, expected[k], got[k])}
    assert {"headwatch/grad/tied_flow_cosine_mean", "headwatch/update/shared_row_norm_p50"} <= set(run["sharded"][-1])
    # 3. measurements failing on rank 1 only (local math, after their collectives): no hang, both ranks publish
    # the same keys, rank 0 says once per monitor that another process failed, and what is published is exact.
    # Was: rank 0 published the gradient values rank 1 dropped, and said nothing.
    run = result["fail-rank1"]
    matrices = ("headwatch/grad/", "headwatch/freq/", "headwatch/update/", "headwatch/model/", "headwatch/check/vanished_gradient")  # GradientDensity's
    # LogitStats' values, and the self-check's that derive from them (what was captured, the gaps)
    dropped = {0: ("headwatch/logits/", "headwatch/debug/", "headwatch/check/"), 1: matrices, 2: matrices}
    for step, (expected, got, got1) in enumerate(zip(tied, run["sharded"], rank1["fail-rank1"])):
        assert set(got) == set(got1) == {k for k in expected if not k.startswith(dropped[step])}, step
        assert all(_same(k, expected[k], got[k]) and _same(k, got[k], got1[k]) for k in got), step
    said = [w for w in run["warnings"] if "failed on another process" in w]
    assert len(said) == 2 and {w.split(" failed while ")[0] for w in said} == {"LogitStats", "GradientDensity"}, run["warnings"]
