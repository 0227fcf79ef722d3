"""The overhead budget of a run resumed from checkpoints: each segment ends with an end-of-training probe, which the
probe schedule of the later segments reserves for (``Overhead.segment_ends``)."""

from __future__ import annotations

import warnings

import pytest

import headwatch
from headwatch.core.overhead import Overhead
from tests.helpers.loop import trained_loop


def _segmented_run_cost(steps: int, segment: int, count_ends: bool) -> tuple[float, int]:
    """headwatch's share of a run of ``steps`` steps of 0.1 s logging every 10 (statistics 1 ms a logging step, a
    probe 0.3 s) resumed from its checkpoint every ``segment`` steps: each segment a new :class:`Overhead` loaded with
    the last one's state, driven as the orchestrator does, and ending with its end-of-training probe (unless its
    last step probed). ``count_ends`` False: the former rule, blind to the earlier segments' end probes. Returns the
    share and the first and periodic probes paid."""
    state, spent, probes = None, 0.0, 0
    for start in range(0, steps, segment):
        cost = Overhead(0.01, "headwatch")
        cost.configure(10, [])
        cost.load_state_dict(state)
        cost.segment_ends = cost.segment_ends if count_ends else 0
        probing = False
        for step in range(start + 9, min(start + segment, steps), 10):
            cost.begin(step, True, False)
            probing = cost.probing
            spent, probes = spent + 0.001 + 0.3 * probing, probes + probing
            cost.decide(0.001, 0.3 * probing, 1.0 + 0.001 + 0.3 * probing, float(probing), steps=cost.steps_watched())
        spent += 0.3 * (not probing)  # the segment's end of training
        state = cost.state_dict()
    return spent / (steps * 0.1 + spent), probes


@pytest.mark.parametrize("steps", [20_000, 100_000])
def test_a_run_resumed_every_500_steps_stays_within_the_budget_its_segments_end_probes_included(steps):
    """Each 500-step segment pays an end probe (0.3 s of a 50 s segment: 0.6%): the former reserve (the first and one
    end probe) let the periodic probes take their usual share as well, 1.11% (20,000 steps) and 1.13% (100,000) of a
    1% budget; counting the earlier segments' end probes keeps the whole run within it (0.86%, 0.91%), the periodic
    probes still running. An uninterrupted run of the same length is within it too."""
    former, _ = _segmented_run_cost(steps, 500, count_ends=False)
    share, probes = _segmented_run_cost(steps, 500, count_ends=True)
    assert former > 0.0105, former
    assert 0.008 < share <= 0.01, share
    assert probes > steps // 10_000, probes  # the periodic probes, beyond the first (the segments' ends not counted)
    assert _segmented_run_cost(steps, steps, count_ends=True)[0] <= 0.01


def test_each_resume_counts_one_end_probe_more_and_old_checkpoints_count_none():
    """The count rides with the checkpoint: a resumed run's state says one end probe more than the state it loaded;
    a state from before the count (no ``ends``) loads as a run with no earlier segment's end, plus the one that saved
    it; a negative or non-integer count is refused like any damaged overhead state."""
    first, model = trained_loop(4, every=2)
    state = first.state_dict()
    assert state["overhead"]["ends"] == 0
    resumed = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    resumed.load_state_dict(state)
    assert resumed.run.cost.segment_ends == 1 and resumed.state_dict()["overhead"]["ends"] == 1
    again = headwatch.Headwatch(model, log_every_n_steps=2, figure_every_n_steps=None, summary=False)
    again.load_state_dict(resumed.state_dict())
    assert again.run.cost.segment_ends == 2
    older = {k: v for k, v in state["overhead"].items() if k != "ends"}
    assert Overhead(0.01, "headwatch").load_state_dict(older) is None
    for bad in (-1, 1.0, True, "1"):
        cost = Overhead(0.01, "headwatch")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "`ends`: a count >= 0" in (cost.load_state_dict({**state["overhead"], "ends": bad}) or "")
        assert cost.segment_ends == 0
