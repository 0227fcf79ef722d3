"""Where ``headwatch report`` reads each headline and how it says so: runs of different lengths, a last probe that is
not the end of training, the entropy fall over each run's own second half, the training NLL named for what it is."""

from __future__ import annotations

import numpy as np
import pytest

from headwatch.report import RunData, verdicts
from headwatch.report.answer import render_answer

P = "headwatch/"
NLL, VAL, ENT, COLL = P + "logits/target_nll", P + "val/logits/target_nll", P + "logits/entropy", P + "collision/rare_rate_head"


def row(data, key):
    return next(r for r in data["headlines"] if r["key"] == key)


def entropy(s):
    return 7.0 - 0.001 * s * s  # curved: a fall read over the wrong range differs


def test_a_run_that_ended_before_the_other_started_is_not_called_unrecorded():
    short = RunData({NLL: [(0, 6.0), (1, 5.9)]})
    long = RunData({NLL: [(s, 5.0) for s in range(4, 60, 5)]})
    data = verdicts({"short": {"short": short}, "long": {"long": long}})
    why = row(data, "validation_loss")["comparisons"]["long"]["why"]
    assert why == "long first logged at step 4, after short ended (step 1)"
    assert "not recorded" not in render_answer(data)
    never = verdicts({"a": {"a": RunData({NLL: [(0, 6.0)]})}, "b": {"b": RunData({ENT: [(0, 6.0)]})}})
    assert row(never, "validation_loss")["comparisons"]["b"]["why"] == "not recorded by b"  # truly never logged


def test_the_end_of_training_probe_is_only_the_probe_at_the_runs_last_step():
    logits = {NLL: [(s, 5.0) for s in range(60)]}
    early = verdicts({"run": {"run": RunData({**logits, COLL: [(s, 0.25) for s in (9, 19, 29, 39, 49)]})}})
    anchor = row(early, "collision")["anchor"]
    assert anchor == {"rule": "the last probe", "step": 49, "of": [59.0]}
    assert "collision beyond drift: the last probe (step 49 of 59)" in render_answer(early)
    assert "end-of-training" not in render_answer(early)
    at_end = verdicts({"run": {"run": RunData({**logits, COLL: [(s, 0.25) for s in (29, 59)]})}})
    assert row(at_end, "collision")["anchor"] == {"rule": "the end-of-training probe", "step": 59}
    two = verdicts({
        "a": {"a": RunData({NLL: [(s, 5.0) for s in range(31)], COLL: [(29, 0.25)]})},
        "b": {"b": RunData({**logits, COLL: [(29, 0.5), (59, 0.5)]})},
    })  # fmt: skip
    assert "the last probe every run has (step 29; the runs end at steps 30, 59)" in render_answer(two)


def test_the_entropy_fall_is_each_runs_own_second_half():
    whole = RunData({ENT: [(s, entropy(s)) for s in range(31)]})  # a 30-step run
    resumed = RunData({ENT: [(s, entropy(s)) for s in range(15, 31)]})  # logged from step 15
    data = verdicts({"whole": {"whole": whole}, "resumed": {"resumed": resumed}})
    r = row(data, "entropy_fall")
    steps = np.arange(0, 31, dtype=np.float64)
    def ref(lo, hi):  # float64: the curve interpolated at the run's midpoint minus its value at its last step
        return float(np.interp(lo, steps, entropy(steps)) - entropy(np.float64(hi)))
    assert r["values"]["whole"]["whole"] == pytest.approx(ref(15.0, 30.0), rel=1e-12)  # from step 15, not 22.5
    assert r["values"]["resumed"]["resumed"] == pytest.approx(ref(22.5, 30.0), rel=1e-12)
    assert r["anchor"]["ranges"] == {"whole": [15.0, 30.0], "resumed": [22.5, 30.0]}
    assert "from the midpoint of each run's logged steps to its last (whole 15 to 30, resumed 22.5 to 30)" in render_answer(data)
    alone = verdicts({"whole": {"whole": whole}})
    assert "entropy fall, 2nd half: from step 15 to 30" in render_answer(alone)


def test_the_training_nll_is_not_called_validation_loss():
    train_only = verdicts({"run": {"run": RunData({NLL: [(0, 6.0), (10, 5.0)]})}})
    r = row(train_only, "validation_loss")
    assert r["question"] == "target NLL" and r["where"] == "train"
    text = render_answer(train_only)
    assert "target NLL (train), nats" in text and "validation loss" not in text
    with_val = verdicts({"run": {"run": RunData({NLL: [(0, 6.0), (10, 5.0)], VAL: [(10, 5.5)]})}})
    assert row(with_val, "validation_loss")["question"] == "validation loss"


def test_runs_that_share_no_logged_step_are_not_read_at_a_step_every_run_logged():
    short = RunData({NLL: [(0, 6.0), (1, 5.9)]})
    long = RunData({NLL: [(s, 5.0) for s in range(4, 60, 5)]})
    data = verdicts({"short": {"short": short}, "long": {"long": long}})
    anchor = row(data, "validation_loss")["anchor"]
    assert anchor["step"] == 1 and "share no logged step" in anchor["rule"]
    text = render_answer(data)
    assert "the last step every run logged" not in text and "the runs share no logged step" in text
    overlapping = verdicts({"short": {"short": RunData({NLL: [(0, 6.0), (9, 5.9)]})}, "long": {"long": long}})
    assert row(overlapping, "validation_loss")["anchor"]["rule"] == "the last step every run logged"
