"""The overhead budget against bad input: budgets of every numeric type, the notes said once whatever the timings,
and budgets that differ between two processes (gloo)."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

import headwatch
from headwatch.core.monitor import FailurePolicy
from headwatch.core.overhead import Overhead, check_budget
from headwatch.errors import HeadwatchError
from tests.helpers.forked import fork_gloo_workers
from tests.helpers.loop import Tiny, train_step, trained_loop


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), np.float16(0.25)])
def test_a_budget_of_any_real_type_is_that_fraction(value):
    """numpy's float32 is a float in (0, 1) as much as its float64 is: both the same budget, a Python float."""
    assert check_budget(value) == pytest.approx(0.25) and type(check_budget(value)) is float
    assert headwatch.Headwatch(Tiny(), overhead_budget=value, summary=False).run.cost.budget == pytest.approx(0.25)


@pytest.mark.parametrize(
    "bad", [float("inf"), -float("inf"), np.float32("nan"), np.float64(2.0), torch.tensor(0.01), np.bool_(True)]
)
def test_a_budget_outside_the_range_or_not_a_number_is_refused_naming_it(bad):
    with pytest.raises(HeadwatchError, match=r"`overhead_budget` must be None or a float in \(0, 1\)"):
        headwatch.Headwatch(Tiny(), overhead_budget=bad, summary=False)


def test_the_statistics_over_budget_note_is_said_once_as_its_share_changes(caplog):
    """The note that the logging statistics alone exceed the budget holds the share of the window it read; a later
    window with another share is the same condition, not a new note."""
    cost = Overhead(0.01, "headwatch")
    cost.configure(2, [], FailurePolicy())
    with caplog.at_level(logging.INFO, logger="headwatch"):
        for statistics in (0.5, 0.7, 0.9):  # seconds of statistics a window of 2 steps of 1 s: 25%, 35%, 45%
            cost.decide(statistics, 0.0, 2.0, 0.0)
    said = [r.getMessage() for r in caplog.records if "logging statistics alone" in r.getMessage()]
    assert len(said) == 1 and "25.0%" in said[0], said


@pytest.fixture(scope="module")
def saved():
    """The loop door's state after 6 steps (logging every 2) and its model."""
    hw, model = trained_loop(6, every=2)
    return hw.state_dict(), model


DAMAGED = {
    "not a dict": "garbage",
    "a key missing": {"multiple": 8, "first": 1},
    "a key more": {"multiple": 8, "probe_seconds": 0.1, "first": 1, "interval": 16},
    "negative seconds": {"multiple": 8, "probe_seconds": -1.0, "first": 1},
    "NaN seconds": {"multiple": 8, "probe_seconds": float("nan"), "first": 1},
    "seconds beyond a day": {"multiple": 8, "probe_seconds": 1e300, "first": 1},
    "seconds a tensor": {"multiple": 8, "probe_seconds": torch.tensor(0.1), "first": 1},
    "a huge interval": {"multiple": 2**40, "probe_seconds": 0.1, "first": 1},
    "an interval not a power of two": {"multiple": 6, "probe_seconds": 0.1, "first": 1},
    "an interval a string": {"multiple": "8", "probe_seconds": 0.1, "first": 1},
    "a negative first step": {"multiple": 8, "probe_seconds": 0.1, "first": -1},
    "run seconds over the wall": {"multiple": 8, "probe_seconds": 0.1, "first": 1, "run": [2.0, 1.0, 0.5]},
    "run seconds NaN": {"multiple": 8, "probe_seconds": 0.1, "first": 1, "run": [0.1, float("nan"), 0.0]},
    "run seconds two": {"multiple": 8, "probe_seconds": 0.1, "first": 1, "run": [0.1, 1.0]},
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_overhead_state_is_refused_once_and_the_rest_of_the_state_loads(saved, damage):
    """The overhead part refused with one warning naming it (the schedule starts again), every monitor's part
    restored as saved, and the next steps run."""
    state, model = saved
    resumed = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed.load_state_dict({**state, "overhead": DAMAGED[damage]})
        fresh = {"multiple": 8, "probe_seconds": 0.0, "first": None, "run": [0.0] * 3, "ends": 0}
        assert resumed.run.cost.state_dict() == fresh
        torch.testing.assert_close(resumed.run.state_dict()["monitors"], state["monitors"], rtol=0, atol=0)
        for s in range(6, 8):
            values = train_step(resumed, model, s)
    assert "headwatch/overhead/probe_interval" in values
    assert len([w for w in said if "`overhead` must be a dict" in str(w.message)]) == 1, [str(w.message) for w in said]


def test_a_resumed_run_publishes_the_checkpoints_probe_cost_until_it_probes_again(saved):
    """A resumed run's logging steps before its next probe publish the probe cost of the checkpoint, never 0 s."""
    state, model = saved
    resumed = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    resumed.load_state_dict(state)
    assert not resumed.run.cost.is_probe_step(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = [train_step(resumed, model, s) for s in range(6, 8)][-1]
    assert "headwatch/overhead/probe_interval" in values and not any("/collision/" in k for k in values)
    assert values["headwatch/overhead/probe_seconds"] == state["overhead"]["probe_seconds"] > 0


class Figures:
    """A sink that keeps the steps whose publication held figures."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def publish(self, numbers, media, step, val) -> None:
        if not val and any(m.figures for m in media):
            self.steps.append(step)


def test_a_figure_cadence_of_the_users_over_the_budget_is_kept_with_one_note_naming_it(caplog):
    """Figures at the user's cadence are drawn off the probe steps too, timed with the logging statistics: the note
    that these exceed the budget names that cadence, once, and the figures keep it."""
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(
        model, log_every_n_steps=2, figure_every_n_steps=2, overhead_budget=1e-9, summary=False, monitors=["logits"]
    )
    sink = Figures()
    hw.run.sinks.append(sink)
    with warnings.catch_warnings(record=True) as said, caplog.at_level(logging.INFO, logger="headwatch"):
        warnings.simplefilter("always")
        for s in range(8):  # the note waits for three windows over the budget
            train_step(hw, model, s)
    assert sink.steps == [1, 3, 5, 7]  # the user's cadence wins
    notes = [str(w.message) for w in said] + [r.getMessage() for r in caplog.records]
    said = [n for n in notes if "figure_every_n_steps=2" in n]
    assert len(said) == 1 and "every 2 steps (figure_every_n_steps=2)" in said[0] and "kept as set" in said[0], notes


GLOO = r"""
import datetime, json, os, sys, time, warnings
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from tests.helpers.loop import Tiny, train_step
from headwatch import Headwatch
from headwatch.errors import HeadwatchError
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT))
torch.manual_seed(0)
model = Tiny()
"""
"""The start of a gloo worker (``fork_gloo_workers``' arguments: rank, port, repository, output folder): the process
group (``TIMEOUT`` seconds) and the tiny model, seeded."""

DIFFERENT_BUDGETS = GLOO.replace("TIMEOUT", "20") + r"""
# alone, rank 0 would probe every logging interval (its steps are slow, its budget large), rank 1 at the longest
budget = 0.9 if rank == 0 else 1e-9
hw = Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False, overhead_budget=budget)
clock, take = hw.run.cost.clock, hw.run.cost.clock.take
clock.take = lambda: {**take(), "statistics": 0.0, "publish": 0.0}  # only the probes cost: a decision of the budgets
steps, keys = [], []
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for s in range(16):
        time.sleep(0.05 if rank == 0 else 0.1)  # rank 1 slower too: its windows' wall time differs
        values = train_step(hw, model, s)
        if any("/collision/" in k for k in values):
            steps.append(s)
        if values:
            keys.append(sorted(values))
    hw.close()
notes = [str(w.message) for w in said if "overhead_budget differs" in str(w.message)]
out = {"steps": steps, "keys": keys, "notes": notes, "budget": hw.run.cost.agreed}
json.dump(out, open(sys.argv[4] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_budgets_that_differ_between_processes_are_replaced_by_their_mean_on_every_process(tmp_path):
    """Each process passes its own ``overhead_budget`` and rank 1's steps are slower: the budgets ride with the
    logging step's sums, every process decides from their mean (the same probe steps and keys, no collective
    mismatch) and rank 0 says so once."""
    r0, r1 = fork_gloo_workers(DIFFERENT_BUDGETS, tmp_path, 39300, timeout=120)
    assert r0["steps"] == r1["steps"] and r0["keys"] == r1["keys"] and len(r0["keys"]) == 8
    assert r0["budget"] == r1["budget"] == pytest.approx((0.9 + 1e-9) / 2)
    assert len(r0["notes"]) == 1 and "0.45" in r0["notes"][0] and r1["notes"] == [], r0["notes"]


BUDGET_ON_ONE_PROCESS = GLOO.replace("TIMEOUT", "5") + r"""
refused = None
try:  # the refusal comes at construction (the start-up gather of the configuration), before any step
    hw = Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False,
                   overhead_budget=0.01 if rank == 0 else None)
    for s in range(4):
        train_step(hw, model, s)
    hw.close()
except HeadwatchError as err:
    refused = str(err)
json.dump({"refused": refused}, open(sys.argv[4] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_a_budget_on_one_process_only_is_refused_at_start_on_every_process_naming_both_values(tmp_path):
    """A budget on one process and None on another would probe on one only, so the first logging step's sums would
    differ in layout (gloo aborts): the start-up gather of the configuration refuses it on every process, with an
    error naming both values and the fix, before any step."""
    r0, r1 = fork_gloo_workers(BUDGET_ON_ONE_PROCESS, tmp_path, 39500, timeout=60)
    for r in (r0, r1):
        assert "overhead_budget is set on some processes and None on others" in (r["refused"] or ""), r
        assert "by rank: 0.01, None" in r["refused"] and "Pass the same overhead_budget" in r["refused"], r
    assert "rank 0: 0.01" in r0["refused"] and "rank 1: None" in r1["refused"]
