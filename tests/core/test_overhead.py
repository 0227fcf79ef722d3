"""The overhead budget (``headwatch.core.overhead``): the clock, the probe interval, the probe steps and the
``overhead/`` values on the plain-loop door, and the same probe steps on two processes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import headwatch
from headwatch.core import SynonymCollision
from headwatch.core.overhead import (
    FIRST_MULTIPLE,
    MAX_MULTIPLE,
    Overhead,
    OverheadClock,
    check_budget,
    probe_interval,
    steady_interval,
)
from headwatch.errors import HeadwatchError
from headwatch.report.summary import summary_lines
from tests.helpers.distributed import run_ranks
from tests.helpers.forked import fork_gloo_workers
from tests.helpers.loop import Tiny, train_step, trained_loop

KEYS = ("fraction", "fraction_run", "probe_fraction_run", "probe_interval", "probe_seconds")


class FakeTime:
    """``time.perf_counter`` under the test's control."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A sink that keeps every publication: ``(step, numbers)``."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, float]]] = []

    def publish(self, numbers, media, step, val) -> None:
        if not val:
            self.seen.append((step, dict(numbers)))

    def steps_with(self, part: str) -> list[int]:
        return [s for s, n in self.seen if any(part in k for k in n)]


def run_loop(steps: int, every: int = 2, close: bool = True, **kw):
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=every, figure_every_n_steps=None, summary=False, **kw)
    rec = Recorder()
    hw.run.sinks.append(rec)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for s in range(steps):
            train_step(hw, model, s)
        if close:
            hw.close()
    return hw, rec, [str(w.message) for w in said]


# ----------------------------------------------------------------------------------- the clock
def test_clock_nesting_counts_each_span_once(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr("headwatch.core.overhead.time.perf_counter", fake)
    clock = OverheadClock()
    with clock.kind("statistics"):
        fake.now = 1.0
        with clock.kind("probe"):
            fake.now = 3.0
            with clock.kind(None):  # inherits the kind around it
                fake.now = 3.5
        fake.now = 4.0
    with clock.kind(None):  # nothing around: statistics
        fake.now = 4.25
    with clock.kind("publish"):
        fake.now = 5.0
    clock.read()
    assert clock.take() == {"statistics": 1.75, "probe": 2.5, "figures": 0.0, "publish": 0.75}  # 1 + 0.5 + 0.25
    assert clock.take() == dict.fromkeys(("statistics", "probe", "figures", "publish"), 0.0)


# ----------------------------------------------------------------------------------- the interval
def _reference(statistics, probe, step_s, every, budget):
    """Brute force in float64: every power of two from 1 to MAX_MULTIPLE, the first within the budget."""
    for j in range(int(math.log2(MAX_MULTIPLE)) + 1):
        m = 2**j
        if statistics / every + probe / (m * every) <= budget * step_s:
            return m, True
    return MAX_MULTIPLE, False


@pytest.mark.parametrize(
    "statistics, probe, step_s, every, budget",
    [
        (0.001, 0.5, 0.1, 10, 0.01),  # needs 55.6 logging intervals: 64
        (0.0, 0.0, 0.1, 10, 0.01),  # free probes: every logging step
        (0.0, 0.02, 0.1, 50, 0.01),  # exactly at the budget with m = 4
        (0.02, 0.5, 0.1, 10, 0.01),  # the statistics alone are over: the longest, not fitting
        (1e-4, 30.0, 0.2, 50, 0.05),  # a probe of 30 s: 64
        (0.0, 1e6, 0.1, 1, 0.01),  # never fits
    ],
)
def test_probe_interval_is_the_smallest_power_of_two_within_the_budget(statistics, probe, step_s, every, budget):
    got = probe_interval(statistics, probe, step_s, every, budget)
    assert got == _reference(statistics, probe, step_s, every, budget)
    assert got[0] & (got[0] - 1) == 0  # a power of two


def _run_cost(steps: int, fixed_probes_paid: bool) -> float:
    """headwatch's share of a run of ``steps`` steps of 0.1 s logging every 10 (statistics 1 ms a logging step, a
    probe 0.5 s), its probe steps decided by :class:`Overhead` as the orchestrator drives it, the end probe included."""
    cost = Overhead(0.01, "headwatch")
    cost.configure(10, [])
    spent, probes = 0.0, 0
    for step in range(9, steps, 10):
        probing = cost.is_probe_step(step)
        cost.first = step if cost.first is None else cost.first
        probes += probing
        spent += 0.001 + 0.5 * probing
        cost.decide(0.001, 0.5 * probing, 1.0 + 0.001 + 0.5 * probing, float(probing), steps=step + 1 if fixed_probes_paid else None)
    spent += 0.5 if not probing else 0.0  # the end of training probes the last step
    return spent / (steps * 0.1 + spent)


def test_the_first_and_end_probes_are_paid_before_the_periodic_ones():
    """The first probe (spent) and the end of training's (to come) are amortised over the steps so far and taken off
    what the periodic probes may spend: early in a run they wait at the longest interval, and a run of 2000 steps that
    the periodic probes alone would put over the budget stays within it."""
    assert probe_interval(0.001, 0.5, 0.1, 10, 0.01, fixed=2 * 0.5 / 100) == (MAX_MULTIPLE, False)  # 100 steps in
    assert probe_interval(0.001, 0.5, 0.1, 10, 0.01, fixed=2 * 0.5 / 5000)[0] == 128  # not 64: 0.2 ms a step kept for them
    assert probe_interval(0.001, 0.5, 0.1, 10, 0.01)[0] == 64
    cost = Overhead(0.01, "headwatch")
    cost.configure(10, [])
    cost.decide(0.001, 0.5, 1.0, 1.0, steps=100)
    assert cost.multiple == MAX_MULTIPLE
    assert _run_cost(2000, fixed_probes_paid=False) > 0.0105  # the former schedule: the two fixed probes on top
    assert _run_cost(2000, fixed_probes_paid=True) <= 0.01
    assert _run_cost(100_000, fixed_probes_paid=True) <= 0.01


def test_the_fixed_probes_are_amortised_over_the_steps_this_run_has_watched():
    """A door that counts its steps from a late one without a checkpoint's state (watching starts mid-training) pays
    its first probe now: it is amortised over the steps watched since, not over the steps before; a resumed run's
    checkpoint says when its run began, and its earlier steps count."""
    window = [0.001, 0.5, 1.5, 1.0]  # statistics, the first probe (0.5 s), wall of 10 steps, a probe in it
    resumed = {"multiple": 8, "probe_seconds": 0.5, "first": 9}
    for start, state, want in [(0, None, MAX_MULTIPLE), (100_000, None, MAX_MULTIPLE), (100_000, resumed, 64)]:
        cost = Overhead(0.01, "headwatch")
        cost.configure(10, [])
        cost.load_state_dict(state)
        cost.begin(start + 9, True, False)
        assert cost.probing == (state is None)
        cost.after({}, window)
        assert cost.multiple == want, (start, state)


def test_interval_changes_rarely():
    assert steady_interval(8, 64) == 64  # over budget: up at once
    assert steady_interval(8, 4) == 8  # under, but not by a margin: unchanged
    assert steady_interval(8, 2) == 4  # a quarter fits: one halving
    assert steady_interval(1, 1) == 1


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "0.01", float("nan")])
def test_budget_is_checked(bad):
    with pytest.raises(HeadwatchError, match="overhead_budget"):
        check_budget(bad)
    with pytest.raises(HeadwatchError, match="overhead_budget"):
        headwatch.Headwatch(Tiny(), overhead_budget=bad)


def test_decision_reads_the_shared_window():
    """The interval follows the window's timings: a costly probe spaces the probes, a cheap one brings them back
    one halving at a time; the statistics alone over the budget say so once, with the interval that fits."""
    cost = Overhead(0.01, "headwatch")
    notes: list[str] = []

    class Say:
        def note_once(self, key, message):
            notes.append(message)

        info_once = notes.append

    cost.configure(10, [], Say())
    assert cost.multiple == FIRST_MULTIPLE
    cost.decide(0.0005, 0.5, 1.0, 1.0)  # 10 steps of 0.1 s, a probe of 0.5 s
    assert cost.multiple == _reference(0.0005, 0.5, 0.1, 10, 0.01)[0] == 64
    cost.decide(0.0005, 0.0, 1.0, 0.0)  # no probe in the window: the last probe's cost stands
    assert cost.multiple == 64
    cost.decide(0.0005, 0.001, 1.0, 1.0)  # a cheap probe: one halving per decision
    assert cost.multiple == 32
    cost.decide(0.005, 0.001, 1.0, 1.0)  # the statistics at half the budget
    assert cost.multiple == 16 and not notes
    cost.decide(0.02, 0.001, 1.0, 1.0)  # the statistics alone at twice the budget
    assert cost.multiple == MAX_MULTIPLE and not cost.fits
    assert not notes  # one window over: not said yet (one window on a busy machine can be several times another)
    cost.decide(0.03, 0.001, 1.0, 1.0)
    cost.decide(0.02, 0.001, 1.0, 1.0)  # three windows over: said, with the smallest share
    assert len(notes) == 1 and "take 2.0% of" in notes[0]
    assert len(notes) == 1 and "raise the logging interval to 20 or more" in notes[0], notes
    cost.decide(0.02, 0.001, 1.0, 1.0)
    assert len(notes) == 1  # once by its key, whatever the policy (here: a plain list)


# ----------------------------------------------------------------------------------- on a door
def test_overhead_values_on_every_logging_step_and_probes_at_first_and_end():
    _, rec, _ = run_loop(13, every=2)
    logging = [s for s in range(13) if (s + 1) % 2 == 0]
    overhead = rec.steps_with("/overhead/")
    assert overhead[: len(logging)] == logging  # every logging step
    for i, (_, numbers) in enumerate(rec.seen):
        if any("/overhead/" in k for k in numbers):
            # the end of training (the last) closes no window of training steps: no `fraction` of its own
            want = set(KEYS) - ({"fraction"} if i == len(rec.seen) - 1 else set())
            assert {k.rsplit("/", 1)[1] for k in numbers if "/overhead/" in k} == want
            interval = numbers["headwatch/overhead/probe_interval"]
            assert interval / 2 in {2.0**j for j in range(11)}  # a power of two of logging intervals
            assert 0 <= numbers.get("headwatch/overhead/fraction", 0) and 0 <= numbers["headwatch/overhead/fraction_run"]
    collision = rec.steps_with("/collision/")
    assert collision[0] == 1  # the first logging step
    assert collision[-1] == 12  # the end of training (step 12 is not a logging step)
    intervals = {s: n["headwatch/overhead/probe_interval"] for s, n in rec.seen if "headwatch/overhead/probe_interval" in n}
    for s in collision[1:-1]:  # the others on the probe grid of their time
        assert (s + 1) % intervals[s] == 0
    assert rec.seen[-1][1]["headwatch/overhead/probe_seconds"] > 0  # the end probe's cost, published


def test_end_probe_not_repeated_on_a_probe_step():
    _, rec, _ = run_loop(2, every=2)  # step 1: the first logging step, a probe, and the last
    assert rec.steps_with("/collision/") == [1]


def test_a_probe_steps_publishing_is_the_probes_cost():
    """A probe step's sinks (its figures and histograms written after its values were made) count in its own window
    as the probe's seconds, not as the next window's logging statistics; a window ends with its step's work."""
    import time

    class SlowOnProbes:
        def __init__(self):
            self.steps = []

        def publish(self, numbers, media, step, val):
            if any("/collision/" in k for k in numbers):
                time.sleep(0.3)  # a figure drawn and written
            self.steps.append(step)

    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    slow = SlowOnProbes()
    hw.run.sinks.append(slow)
    windows = []
    for s in range(4):  # step 1: the first logging step, a probe; step 3: a logging step
        train_step(hw, model, s)
        windows.append(list(hw.run.cost.window))
    assert slow.steps == [1, 3]
    statistics, probe, wall, probed = windows[1]  # the window of steps 0-1, ended with step 1's sinks
    assert probe >= 0.3 and probed == 1.0 and wall >= probe + statistics, windows
    statistics, probe, wall, probed = windows[3]  # the window of steps 2-3, closed at step 3
    assert probe == 0.0 and probed == 0.0 and statistics < 0.3 and wall < 0.3 + statistics, windows
    assert hw.run.cost.probe_seconds >= 0.3  # the decision at step 3 read step 1's window with its sinks


def test_explicit_cadence_wins_with_a_note():
    collision = SynonymCollision()
    collision.every_n_steps = 4
    _, rec, said = run_loop(17, every=2, monitors=["tokens", "logits", collision], overhead_budget=1e-9)
    assert rec.steps_with("/collision/") == [3, 7, 11, 15]  # its own, not the first step nor the end
    notes = [m for m in said if "collision measures every 4 steps as set" in m]
    assert len(notes) == 1, said


def test_no_budget_publishes_no_overhead_and_keeps_the_collision_cadence():
    _, rec, _ = run_loop(41, every=2, overhead_budget=None)
    assert rec.steps_with("/overhead/") == []
    assert rec.steps_with("/collision/") == [19, 39]  # every 10 logging intervals, nothing at the end


def test_histograms_on_probe_steps_only():
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    kept: list[int] = []
    probes: list[int] = []

    class Media:
        def publish(self, numbers, media, step, val):
            if any(m.histograms for m in media):
                kept.append(step)
            if any("/collision/" in k for k in numbers):
                probes.append(step)

    hw.run.sinks.append(Media())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(12):
            train_step(hw, model, s)
        hw.close()
    assert probes[0] == 1 and probes[-1] == 11
    # the probe steps of training (the end of training measures the probes alone, without histograms); without a
    # budget: every logging step (test_no_budget_keeps_histograms)
    assert kept == probes[:-1]


def test_no_budget_keeps_histograms():
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False, overhead_budget=None)
    kept: list[int] = []

    class Media:
        def publish(self, numbers, media, step, val):
            if any(m.histograms for m in media):
                kept.append(step)

    hw.run.sinks.append(Media())
    for s in range(6):
        train_step(hw, model, s)
    assert kept == [1, 3, 5]


def test_figures_on_probe_steps_only(tmp_path):
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = Tiny()
    writer = SummaryWriter(str(tmp_path))
    hw = headwatch.Headwatch(model, log_every_n_steps=2, writer=writer, summary=False)  # figures "auto"
    rec = Recorder()
    hw.run.sinks.append(rec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(12):
            train_step(hw, model, s)
        hw.close()
    writer.close()
    probes = rec.steps_with("/collision/")  # the probe steps, and the end of training (the probes alone)
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0}).Reload()
    for tag in ("headwatch/logits/entropy_over_run", "headwatch/grad/row_norm_vs_frequency"):
        assert [e.step for e in acc.Images(tag)] == probes[:-1], tag
    assert [e.step for e in acc.Images("headwatch/collision/nn_similarity_head")] == probes


def test_summary_says_the_cost_against_the_budget(capsys):
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(6):
            train_step(hw, model, s)
        hw.close()
    (line,) = [x for x in hw.summary.text.splitlines() if x.strip().startswith("overhead")]
    latest = hw.run.latest
    spent, interval = latest["headwatch/overhead/fraction_run"], latest["headwatch/overhead/probe_interval"]
    probes = latest["headwatch/overhead/probe_fraction_run"]
    head = (f"  overhead         {spent:.2%} of the wall time over the run (budget 1.00%), {100 * probes:.2f} points of it "
            "the probes (the first, the periodic, the end)")  # fmt: skip
    assert interval > 6  # early in a run the periodic probes wait at the longest interval
    assert line == f"{head}; no periodic probe (their interval, {interval:.0f} steps, is longer than the run)"
    assert line in capsys.readouterr().out
    later = [x for x in summary_lines(hw.summary, 10**6)[0] if x.strip().startswith("overhead")]
    assert later == [f"{head}; periodic probes every {interval:.0f} steps"]  # a run longer than the interval


def test_the_probes_share_of_the_run_holds_their_seconds(monkeypatch):
    """``overhead/probe_fraction_run`` against the seconds the probes were made to take: each collision measurement
    sleeps 50 ms (more than the tiny model's measurement takes), and the run's wall time is read around the loop."""
    import time

    measure, calls = SynonymCollision._measure_on_device, []

    def slow(self, *args, **kwargs):
        calls.append(1)
        time.sleep(0.05)
        return measure(self, *args, **kwargs)

    monkeypatch.setattr(SynonymCollision, "_measure_on_device", slow)
    start = time.perf_counter()
    hw, rec, _ = run_loop(9, every=2)
    wall = time.perf_counter() - start
    probes = len(rec.steps_with("/collision/"))
    assert probes >= 2 and len(calls) == probes  # the first logging step and the end of training
    share, spent = hw.run.cost.run_probe_seconds, hw.run.cost.run_seconds
    assert share >= 0.05 * probes and share <= spent[0] <= wall
    published = rec.seen[-1][1]
    assert published["headwatch/overhead/probe_fraction_run"] <= published["headwatch/overhead/fraction_run"]
    assert published["headwatch/overhead/probe_fraction_run"] * spent[1] >= 0.05 * (probes - 1)  # before the end's


def test_a_resumed_run_probes_on_the_steps_it_would_have():
    first, model = trained_loop(6, every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = first.state_dict()
        resumed = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
        resumed.load_state_dict(state)
        assert resumed.run.cost.state_dict() == {**first.run.cost.state_dict(), "ends": 1}  # the first segment's end
        assert resumed.run.cost.first == 1  # the run's first logging step was step 1: none forced at step 7
        assert resumed.run.cost.is_probe_step(7) == ((7 + 1) % (first.run.cost.multiple * 2) == 0)
        fresh = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
        assert fresh.run.cost.is_probe_step(7)  # without the state, the first logging step it sees probes
    bad = headwatch.Headwatch(Tiny(), summary=False)
    with pytest.warns(UserWarning, match="power-of-two `multiple`"):
        bad.load_state_dict({**state, "overhead": {"multiple": 3, "probe_seconds": 0.0, "first": 1}})
    assert bad.run.cost.multiple == FIRST_MULTIPLE


def test_a_resumed_run_goes_on_with_the_runs_cost_and_its_last_probe():
    """After a resume the run's fractions hold the seconds before the checkpoint (the first probe's among them) and
    `probe_seconds` is the saved probe's, not 0, until the next probe (none at step 7: the interval is 16 steps)."""
    import time

    first, model = trained_loop(6, every=2)
    saved_spent, saved_wall = first.run.cost.run_seconds
    saved_probe, last_probe = first.run.cost.run_probe_seconds, first.run.cost.probe_seconds
    assert saved_probe > 0 and last_probe > 0  # the first logging step (step 1) probed
    resumed = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the state loads whole, without a refusal
        resumed.load_state_dict(first.state_dict())
    start = time.perf_counter()
    for s in range(6, 8):
        values = train_step(resumed, model, s)
    after = time.perf_counter() - start
    assert not resumed.run.cost.is_probe_step(7)
    assert values["headwatch/overhead/probe_seconds"] == pytest.approx(last_probe, rel=1e-12)
    assert values["headwatch/overhead/probe_fraction_run"] >= saved_probe / (saved_wall + after)
    assert saved_wall < resumed.run.cost.run_seconds[1] <= saved_wall + after
    assert resumed.run.cost.run_seconds[0] > saved_spent


def test_loop_logs_every_50_steps_by_default():
    hw = headwatch.Headwatch(Tiny(), summary=False)
    assert hw.run.every == 50 and hw.run.cost.budget == 0.01


# ----------------------------------------------------------------------------------- two processes
def test_two_ranks_probe_on_the_same_steps_when_their_timings_differ():
    """Rank 1's clock reads 100 s of logging statistics per window, rank 0's none: alone, rank 0 would probe often
    and rank 1 at the longest interval; the window's timings ride with the step's sums, so both decide from the
    same means and probe on the same steps."""
    budget, every = 0.2, 2

    def rank_run(rank, reducer):
        torch.manual_seed(0)
        model = Tiny()
        hw = headwatch.Headwatch(
            model, log_every_n_steps=every, figure_every_n_steps=None, summary=False, reducer=reducer, overhead_budget=budget
        )
        clock, take = hw.run.cost.clock, hw.run.cost.clock.take
        clock.take = lambda: {**take(), "statistics": 100.0 if rank == 1 else 0.0, "publish": 0.0}
        rec = Recorder()
        hw.run.sinks.append(rec)
        own: list[int] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(16):
                train_step(hw, model, s)
                if (s + 1) % every == 0 and hw.run.cost.probe_seconds > 0:  # what this rank alone would decide
                    w = hw.run.cost.window
                    own.append(probe_interval(w[0], hw.run.cost.probe_seconds, w[2] / every, every, budget)[0])
            hw.close()
        intervals = [n.get("headwatch/overhead/probe_interval") for _, n in rec.seen]
        return rec.steps_with("/collision/"), intervals, own

    (steps0, intervals0, own0), (steps1, intervals1, own1) = run_ranks(2, rank_run)
    assert steps0 == steps1 and steps0[0] == 1 and steps0[-1] == 15
    assert intervals0 == intervals1
    assert max(own0) < MAX_MULTIPLE == min(own1)  # alone, they would have disagreed


GLOO_WORKER = r'''
import datetime, json, os, sys, warnings
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from tests.helpers.loop import Tiny, train_step
from headwatch import Headwatch
from headwatch.core.overhead import probe_interval
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
warnings.simplefilter("ignore")
torch.manual_seed(0)
model = Tiny()
hw = Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False, overhead_budget=0.2)
clock, take = hw.run.cost.clock, hw.run.cost.clock.take
clock.take = lambda: {**take(), "statistics": 100.0 if rank == 1 else 0.0, "publish": 0.0}  # rank 1's reads slow
steps, intervals, own = [], [], []
for s in range(16):
    values = train_step(hw, model, s)
    if any("/collision/" in k for k in values):
        steps.append(s)
    if values:
        intervals.append(values["headwatch/overhead/probe_interval"])
        if hw.run.cost.probe_seconds > 0:
            w = hw.run.cost.window
            own.append(probe_interval(w[0], hw.run.cost.probe_seconds, w[2] / 2, 2, 0.2)[0])
hw.close()
json.dump({"steps": steps, "intervals": intervals, "own": own}, open(sys.argv[4] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
'''


def test_two_gloo_processes_probe_on_the_same_steps_when_their_timings_differ(tmp_path):
    """The same on two processes (gloo, ``torch.distributed``'s reducer): rank 1's clock reads 100 s of statistics
    per window, rank 0's none; the probe steps and intervals agree, though each alone would have decided otherwise."""
    r0, r1 = fork_gloo_workers(GLOO_WORKER, tmp_path, 37500, timeout=240)
    assert r0["steps"] == r1["steps"] and r0["steps"][0] == 1
    assert r0["intervals"] == r1["intervals"] and len(r0["intervals"]) == 8
    assert max(r0["own"]) < MAX_MULTIPLE == min(r1["own"])


# ----------------------------------------------------------------------------------- what the clock covers
def test_the_clock_holds_the_time_spent_inside_headwatch(monkeypatch):
    """headwatch's seconds over a run (every window, the end of training and closing: ``run_seconds``) against an
    independent reference: ``time.perf_counter`` around each entry into headwatch's code that the run makes (the
    door's calls, the forward hooks it put on the model, the captures' backward hooks), outermost entries only. Work
    inside headwatch but outside every span of its clock would show as a gap; a few of its inner parts (the door's
    step bookkeeping, hook bodies, closing) take one second a call on the clock both read (``time.perf_counter`` plus
    a second per call, no sleep), so that one such call outside the clock's spans would be a gap of a second, against
    milliseconds of real work: exact whatever the machine's load."""
    import time

    from headwatch.core.orchestrator import Orchestrator
    from headwatch.core.self_check import SelfCheck
    from headwatch.model.capture import LogitsCapture
    from headwatch.model.flows import HeadFlowCapture, LookupFlowCapture
    from headwatch.model.hooks import CopySafeHook

    inside = {"depth": 0, "seconds": 0.0, "slowed": 0}

    def timed(fn):
        def entry(*args, **kwargs):
            inside["depth"] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside["depth"] -= 1
                if inside["depth"] == 0:
                    inside["seconds"] += time.perf_counter() - start

        return entry

    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + inside["slowed"])  # a second more per slowed call

    def slowed(fn):
        def part(*args, **kwargs):
            inside["slowed"] += 1
            return fn(*args, **kwargs)

        return part

    door = headwatch.Headwatch
    for cls, name in [(door, "step_start"), (door, "before_optimizer_step"), (door, "after_optimizer_step"), (door, "step_end"),
                      (door, "close"), (CopySafeHook, "__call__"), (LookupFlowCapture, "_add"), (HeadFlowCapture, "_add")]:  # fmt: skip
        monkeypatch.setattr(cls, name, timed(getattr(cls, name)))
    for cls, name in [(Orchestrator, "begin_step"), (Orchestrator, "end_step"), (Orchestrator, "close"), (SelfCheck, "_on_output"),
                      (LogitsCapture, "_on_head_input"), (LookupFlowCapture, "_on_forward")]:  # fmt: skip
        monkeypatch.setattr(cls, name, slowed(getattr(cls, name)))  # before attaching: the hooks hold these
    torch.manual_seed(0)
    model = Tiny()
    hw = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    inside["seconds"] = 0.0  # attaching is outside the run's windows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(5):  # logging steps 1 (a probe) and 3; step 4 quiet, then the end probe
            train_step(hw, model, s)
        hw.close()
    clock, reference = hw.run.cost.run_seconds[0], inside["seconds"]
    assert hw.run.cost.closed == 3 and inside["slowed"] >= 20
    assert reference >= inside["slowed"]  # every slowed call inside an entry into headwatch
    assert reference - 0.5 < clock <= reference, (clock, reference)  # no slowed call outside the clock's spans
