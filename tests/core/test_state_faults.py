"""Damaged and hand-edited checkpoint states (docs/faults.md).

Every ``load_state_dict`` checks what it reads (presence, version, types, shapes, finiteness, signs): an
invalid part restarts that monitor from empty with one warning naming the part and the key, the resume goes
on, and nothing invalid is kept; ``strict=True`` raises :class:`headwatch.errors.StateError`. The
reference for "empty" is a monitor that never loaded anything; for "valid", a state that round-trips.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from headwatch import Headwatch
from headwatch.core import GradientDensity, LogitStats, SynonymCollision, TokenCounts
from headwatch.errors import StateError
from tests.helpers import TinyCausalLM

V = 64


def trained(strict: bool = False, steps: int = 4) -> Headwatch:
    """A plain-loop Headwatch over every monitor after ``steps`` logged steps (its state is non-trivial)."""
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hw = Headwatch(model, log_every_n_steps=1, figure_every_n_steps=0, strict=strict)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            ids = torch.randint(0, V, (4, 8))
            hw.step_start({"input_ids": ids, "labels": ids}, step)
            logits = model(ids)
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
            hw.before_optimizer_step()
            optimizer.step()
            hw.after_optimizer_step()
            optimizer.zero_grad()
            hw.step_end()
    return hw


def part(state: dict, cls: type) -> dict:
    return state["monitors"][state["names"].index(cls.__name__)]


def monitor(hw: Headwatch, cls: type):
    return next(m for m in hw.monitors if type(m) is cls)


# (monitor class, key, bad value, words the warning must hold)
CORRUPTIONS = [
    (TokenCounts, "counts", lambda c: c - 10**6, "counts >= 0"),
    (TokenCounts, "counts", lambda c: c.double(), "integer tensor"),
    (TokenCounts, "counts", lambda c: c[:-3], f"of {V} counts"),
    (TokenCounts, "counts", lambda c: c.reshape(1, -1), "1-D"),
    (TokenCounts, "counts", lambda c: c.tolist(), "integer tensor"),
    (TokenCounts, "out_of_range", lambda v: -1, "int >= 0"),
    (TokenCounts, "num_rows", lambda v: "64", "int >= 0"),
    (LogitStats, "total_positions", lambda v: math.nan, "finite number"),
    (LogitStats, "total_positions", lambda v: -5.0, ">= 0"),
    (LogitStats, "logged_steps", lambda v: 2.5, "int >= 0"),
    (LogitStats, "entropy_history", lambda h: [(0, [1.0, math.inf])], "pairs"),
    (LogitStats, "entropy_history", lambda h: "oops", "pairs"),
    (GradientDensity, "logged_steps", lambda v: -1, "int >= 0"),
    (GradientDensity, "failures", lambda v: None, "int >= 0"),
    (SynonymCollision, "last_step", lambda v: -7, "int >= -1"),
    (SynonymCollision, "version", lambda v: 99, "`version`"),
    (SynonymCollision, "panel", lambda v: 0, "int >= 1"),
    # crafted states: values that are not there (meta), a sparse layout, totals at the int64 limit
    (TokenCounts, "counts", lambda c: torch.empty_like(c, device="meta"), "not meta"),
    (TokenCounts, "counts", lambda c: c.to_sparse(), "not sparse"),
    (TokenCounts, "counts", lambda c: torch.full_like(c, 2**63 - 1), "total is at most 2**62"),
    (TokenCounts, "out_of_range", lambda v: 2**63 - 1, "at most 2**62"),
    (LogitStats, "total_positions", lambda v: float(2**63 - 1), "at most 2**62"),
    (LogitStats, "logged_steps", lambda v: 2**63 - 1, "at most 2**62"),
]


@pytest.mark.parametrize(("cls", "key", "corrupt", "words"), CORRUPTIONS, ids=[f"{c.__name__}.{k}-{i}" for i, (c, k, _, _) in enumerate(CORRUPTIONS)])
def test_an_invalid_part_restarts_that_monitor_from_empty_with_one_warning(cls, key, corrupt, words):
    state = trained().state_dict()
    damaged = part(state, cls)
    damaged[key] = corrupt(damaged.get(key))
    fresh = trained(steps=0)
    empty = monitor(fresh, cls).state_dict()  # what "from empty" means: a monitor that never measured
    resumed = trained(steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    said = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    assert len(said) == 1 and cls.__name__ in said[0] and f"`{key}`" in said[0] and words in said[0], said
    assert "restarts from empty" in said[0] and "resume goes on" in said[0]
    got = monitor(resumed, cls).state_dict()
    for k, v in empty.items():  # nothing of the damaged part was kept
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    for other in (TokenCounts, LogitStats, GradientDensity, SynonymCollision):  # the valid parts were restored
        if other is not cls:
            want, have = part(state, other), monitor(resumed, other).state_dict()
            for k, v in want.items():
                assert torch.equal(have[k], v) if isinstance(v, torch.Tensor) else have[k] == v, (other.__name__, k)


@pytest.mark.parametrize(("cls", "key", "corrupt", "words"), CORRUPTIONS[:3] + CORRUPTIONS[7:8] + CORRUPTIONS[16:])
def test_strict_raises_a_state_error_naming_the_part(cls, key, corrupt, words):
    state = trained().state_dict()
    damaged = part(state, cls)
    damaged[key] = corrupt(damaged.get(key))
    with pytest.raises(StateError, match=rf"{cls.__name__}: `{key}`"):
        trained(strict=True, steps=0).load_state_dict(state)


def test_a_valid_state_round_trips_and_resumes_the_counts():
    hw = trained()
    state = hw.state_dict()
    resumed = trained(steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid state says nothing
        resumed.load_state_dict(state)
    assert torch.equal(part(resumed.state_dict(), TokenCounts)["counts"], part(state, TokenCounts)["counts"])
    assert resumed.step_index == hw.step_index == 4


@pytest.mark.parametrize("state", [None, [], {"monitors": "x"}, {"step": -3, "monitors": []}, {"monitors": [{}, {}]}])
def test_a_malformed_whole_state_is_said_once_and_the_resume_goes_on(state):
    resumed = trained(steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)  # type: ignore[arg-type]
    said = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    assert said and all("cannot be restored" in m for m in said), said
    assert resumed.step_index == 0
    with pytest.raises(StateError):
        trained(strict=True, steps=0).load_state_dict(state)  # type: ignore[arg-type]


def test_a_state_without_names_loads_by_position():
    """A 0.2 checkpoint (no ``names``) loads part by part, in the monitors' order."""
    state = trained().state_dict()
    old = {"step": state["step"], "monitors": state["monitors"]}
    resumed = trained(steps=0)
    resumed.load_state_dict(old)
    assert torch.equal(part(resumed.state_dict(), TokenCounts)["counts"], part(state, TokenCounts)["counts"])


def test_a_truncated_checkpoint_file_leaves_the_monitors_empty_and_says_so(tmp_path):
    """The Hugging Face door reads ``headwatch_state.pt`` itself: a truncated file warns once and the resume goes on."""
    from types import SimpleNamespace

    from headwatch.integrations.hf_checkpoint import STATE_NAME, restore_state

    hw = trained()
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    path = folder / STATE_NAME
    torch.save(hw.state_dict(), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    resumed = trained(steps=0)
    callback = SimpleNamespace(run=resumed.run, load_state_dict=resumed.load_state_dict)
    args = SimpleNamespace(resume_from_checkpoint=str(folder), output_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore_state(callback, args, SimpleNamespace(global_step=4))
    said = [str(w.message) for w in caught if STATE_NAME in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert part(resumed.state_dict(), TokenCounts)["counts"].sum() == 0


# --------------------------------------------------------------------------- the alert's state

E = "headwatch/logits/entropy"


def engine(strict: bool = False, warned: list[str] | None = None):
    from headwatch.alerts import AlertEngine, CollapseRules

    return AlertEngine(CollapseRules(entropy_floor=1.0, entropy_drop=0.5), [], strict=strict,
                       warn=(warned.append if warned is not None else lambda m: None))  # fmt: skip


def alert_state() -> dict:
    e = engine()
    for step, h in enumerate([3.0, 2.8, 0.5, 0.4, 2.0]):
        e.observe_train(step, {E: h})
    return e.state_dict()


ALERT_CORRUPTIONS = [
    ("rules.smoothed", lambda s: s["rules"].__setitem__("smoothed", math.nan), "`smoothed`"),
    ("rules.history", lambda s: s["rules"].__setitem__("history", [1.0, "x"]), "`history`"),
    ("rules.episode", lambda s: s["rules"]["states"][next(iter(s["rules"]["states"]))].__setitem__("fired", -2), "`fired`"),
    ("alerts", lambda s: s.__setitem__("alerts", [{"step": "one"}]), "`alerts`"),
    ("action_failures", lambda s: s.__setitem__("action_failures", -1), "`action_failures`"),
    ("version", lambda s: s.__setitem__("version", 7), "`version`"),
]


@pytest.mark.parametrize(("where", "corrupt", "words"), ALERT_CORRUPTIONS, ids=[c[0] for c in ALERT_CORRUPTIONS])
def test_an_invalid_alert_state_restarts_the_alert_from_empty(where, corrupt, words):
    state = alert_state()
    assert state["alerts"] and state["rules"]["smoothed"] is not None  # a state worth restoring
    corrupt(state)
    warned: list[str] = []
    resumed = engine(warned=warned)
    resumed.load_state_dict(state)
    assert len(warned) == 1 and words in warned[0] and "restarts from empty" in warned[0], warned
    assert resumed.alerts == [] and resumed.action_failures == 0
    assert resumed.state_dict() == engine().state_dict()  # exactly the empty state
    with pytest.raises(StateError, match=words.replace("`", "`")):
        engine(strict=True).load_state_dict(state)


def test_a_valid_alert_state_round_trips():
    state = alert_state()
    resumed = engine()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
