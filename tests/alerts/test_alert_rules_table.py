"""CollapseRules against an independent reference: closed-form smoothing over the whole series.

The reference below never runs the rules. It keeps the observations each rule may use (finite,
at or after ``warmup_steps``), computes the smoothed series in closed form with exact fractions,
``S_k = (1 - a)^k x_0 + sum_{j=1..k} a (1 - a)^(k-j) x_j``, reads the window ``S_{k-N}`` by index in
the full list, and turns each observation into (condition, recovered) exactly as the
``CollapseRules`` docstring defines them; a small episode machine (fires after ``for_steps``
consecutive conditions, re-arms on ``recovered``) gives the expected events. Values are multiples of
1/4 and ``alpha`` is 1/2 or 1, so every smoothed value is exact in float64 and the implementation's
recursion must agree bit for bit, and so must every comparison.

Also: argument errors not covered elsewhere, threshold forms, descriptions, warm-up and the
validation fallback, worked by hand.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwatch import HeadwatchError
from headwatch.alerts import CollapseRules
from headwatch.alerts.events import FIRED, RESOLVED, AlertEvent
from headwatch.alerts.rules import TRAIN_RULES, parse_threshold

E, K = "headwatch/logits/entropy", "headwatch/logits/kl_to_uniform"
RARE, NLL = "headwatch/logits/rare/target_nll", "headwatch/logits/target_nll"
VAL_E = "headwatch/val/logits/entropy"

THRESHOLDS = dict(
    entropy_floor=(3.0, 2.0),  # warning floor above the critical one
    entropy_ceiling=(6.0, 7.0),
    kl_ceiling=(1.5, 2.5),
    entropy_drop=(0.2, 0.4),
    rare_nll_rise=(0.25, 0.75),
)


# --------------------------------------------------------------------------- the reference


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


def ema_exact(xs: list[float], alpha: float) -> list[float]:
    """The smoothed series in closed form, with exact fractions (no recursion)."""
    a = Fraction(alpha)
    out = []
    for k in range(len(xs)):
        s = (1 - a) ** k * Fraction(xs[0]) + sum(a * (1 - a) ** (k - j) * Fraction(xs[j]) for j in range(1, k + 1))
        out.append(float(s))
    return out


def episode_machine(evaluations: list[tuple[int, bool, bool]], for_steps: int) -> list[tuple[int, str]]:
    """(step, kind) from (step, condition, recovered) per evaluated observation."""
    is_open, pending, out = False, 0, []
    for step, condition, recovered in evaluations:
        if is_open:
            if recovered:
                is_open = False
                out.append((step, RESOLVED))
            continue
        pending = pending + 1 if condition else 0
        if pending >= for_steps:
            is_open, pending = True, 0
            out.append((step, FIRED))
    return out


def reference_train(series: list[dict], cfg: dict) -> dict[str, list[tuple[int, str]]]:
    """Expected events of every (rule, severity) key, from the docstring's definitions."""
    warm, m, n, alpha = cfg["warmup_steps"], cfg["margin"], cfg["for_steps"], cfg["alpha"]
    out: dict[str, list[tuple[int, str]]] = {}

    def add(rule, severity, evaluations):
        out[f"{rule}/{severity}"] = episode_machine(evaluations, n)

    h = [(s, obs[E]) for s, obs in enumerate(series) if s >= warm and finite(obs.get(E))]
    kl = [(s, obs[K]) for s, obs in enumerate(series) if s >= warm and finite(obs.get(K))]
    both = [(s, obs[RARE], obs[NLL]) for s, obs in enumerate(series)
            if s >= warm and finite(obs.get(RARE)) and finite(obs.get(NLL))]
    for severity, t in zip(("warning", "critical"), THRESHOLDS["entropy_floor"]):
        add("entropy_floor", severity, [(s, v < t, v >= t + m * abs(t)) for s, v in h])
    for severity, t in zip(("warning", "critical"), THRESHOLDS["entropy_ceiling"]):
        add("entropy_ceiling", severity, [(s, v > t, v <= t - m * abs(t)) for s, v in h])
    for severity, t in zip(("warning", "critical"), THRESHOLDS["kl_ceiling"]):
        add("kl_ceiling", severity, [(s, v > t, v <= t - m * abs(t)) for s, v in kl])
    smoothed = ema_exact([v for _, v in h], alpha) if h else []
    w = cfg["window"]
    drops = []
    for k in range(w, len(h)):
        old, new = smoothed[k - w], smoothed[k]
        drops.append((h[k][0], (old - new) / old if old > 0 else 0.0))
    for severity, r in zip(("warning", "critical"), THRESHOLDS["entropy_drop"]):
        add("entropy_drop", severity, [(s, d >= r, d < r * (1 - m)) for s, d in drops])
    rare_s = ema_exact([r for _, r, _ in both], alpha) if both else []
    nll_s = ema_exact([x for _, _, x in both], alpha) if both else []
    rw = cfg["rare_window"]
    rises = [(both[k][0], rare_s[k] - rare_s[k - rw], nll_s[k] < nll_s[k - rw]) for k in range(rw, len(both))]
    for severity, t in zip(("warning", "critical"), THRESHOLDS["rare_nll_rise"]):
        add("rare_nll_rise", severity,
            [(s, rise > t and falling, rise <= t - m * abs(t) or not falling) for s, rise, falling in rises])
    return out


def by_key(events: list[AlertEvent]) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    for e in events:
        out.setdefault(e.key, []).append((e.step, e.kind))
    return out


def run(rules: CollapseRules, series: list[dict], start: int = 0) -> list[AlertEvent]:
    return [e for step, obs in enumerate(series, start) for e in rules.observe_train(step, obs)]


# --------------------------------------------------------------------------- strategies

GRID = st.integers(1, 36).map(lambda k: k / 4)  # 0.25 .. 9.0, exact in binary
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
VALUE = st.one_of(GRID, GRID, GRID, st.none(), NONFINITE)
OBS = st.fixed_dictionaries({E: VALUE, K: VALUE, RARE: VALUE, NLL: VALUE})
CONFIG = st.fixed_dictionaries({
    "alpha": st.sampled_from([0.5, 1.0]),
    "margin": st.sampled_from([0.0, 0.1, 0.25]),
    "for_steps": st.integers(1, 3),
    "window": st.integers(1, 3),
    "rare_window": st.integers(1, 3),
    "warmup_steps": st.integers(0, 3),
})


def make(cfg: dict) -> CollapseRules:
    return CollapseRules(**THRESHOLDS, **cfg)


def without_none(obs: dict) -> dict:
    return {k: v for k, v in obs.items() if v is not None}


@settings(max_examples=150, deadline=None)
@given(st.lists(OBS, max_size=24), CONFIG)
def test_train_rules_match_the_closed_form_reference(series, cfg):
    rules = make(cfg)
    got = by_key(run(rules, [without_none(o) for o in series]))
    expected = reference_train(series, cfg)
    for key in rules.episodes():
        assert got.get(key, []) == expected[key], key


@settings(max_examples=100, deadline=None)
@given(st.lists(OBS, max_size=24), CONFIG)
def test_episode_invariants(series, cfg):
    """Per episode: events alternate fired/resolved from fired; the state agrees with the events."""
    rules = make(cfg)
    got = by_key(run(rules, series))
    for key, state in rules.states.items():
        kinds = [kind for _, kind in got.get(key, [])]
        assert kinds == [(FIRED, RESOLVED)[i % 2] for i in range(len(kinds))], key
        assert state.fired == kinds.count(FIRED)
        assert state.open == (bool(kinds) and kinds[-1] == FIRED)
        assert 0 <= state.pending < cfg["for_steps"] and (state.pending == 0 or not state.open)


@settings(max_examples=100, deadline=None)
@given(st.lists(OBS, max_size=24), CONFIG, st.data())
def test_a_json_checkpoint_anywhere_changes_nothing(series, cfg, data):
    """Stop after any observation, save through strict JSON, resume in a new object: the same events."""
    cut = data.draw(st.integers(0, len(series)))
    whole = run(make(cfg), series)
    first = make(cfg)
    before = run(first, series[:cut])
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # strict JSON: no NaN/inf in the state
    resumed = make(cfg)
    resumed.load_state_dict(state)
    after = run(resumed, series[cut:], start=cut)
    assert before + after == whole
    assert resumed.state_dict() == make_and_run_state(cfg, series)


def make_and_run_state(cfg, series):
    rules = make(cfg)
    run(rules, series)
    return rules.state_dict()


@settings(max_examples=100, deadline=None)
@given(st.lists(OBS, max_size=20), CONFIG)
def test_a_non_finite_value_is_skipped_like_an_absent_one(series, cfg):
    """NaN, +inf and -inf never enter the smoothed entropy, the windows or the episodes."""
    dirty = make(cfg)
    clean = make(cfg)
    assert run(dirty, series) == run(clean, [{k: v for k, v in o.items() if finite(v)} for o in series])
    assert dirty.state_dict() == clean.state_dict()
    assert dirty.smoothed is None or math.isfinite(dirty.smoothed)


def test_one_infinite_entropy_does_not_switch_the_drop_rule_off():
    # found by the property above: +inf entered the smoothed entropy, S stayed inf (or NaN with
    # alpha = 1: 0 * inf) for ever and entropy_drop could never fire again.
    rules = CollapseRules(entropy_drop=0.5, window=2, alpha=1.0)
    series = [4.0, 4.0, math.inf, 4.0, 4.0, 1.0, 1.0]
    # inf at step 2 skipped: the kept values 4, 4, 4, 4, 1 (steps 0, 1, 3, 4, 5); at step 5 the drop
    # over 2 kept values is (4 - 1) / 4 = 0.75 >= 0.5: fires at 5
    assert [(e.step, e.kind) for e in run(rules, [{E: h} for h in series])] == [(5, FIRED)]
    assert rules.smoothed == 1.0 and list(rules.history) == [4.0, 1.0, 1.0]


# --------------------------------------------------------------------------- validation


def reference_val(obs: list[tuple[float | None, float | None]], patience, delta, min_drop, for_steps):
    kept = [(v, loss, ent) for v, (loss, ent) in enumerate(obs) if finite(loss) and finite(ent)]
    evaluations = []
    for k in range(patience, len(kept)):
        first_loss, first_ent = kept[k - patience][1], kept[k - patience][2]
        improvement = first_loss - min(loss for _, loss, _ in kept[k - patience + 1 : k + 1])
        falling = (first_ent - kept[k][2]) / first_ent if first_ent > 0 else 0.0
        holds = improvement < delta and falling >= min_drop
        evaluations.append((kept[k][0], holds, not holds))
    return episode_machine(evaluations, for_steps)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.one_of(GRID, st.none(), NONFINITE), st.one_of(GRID, GRID, st.none())), max_size=20),
    st.integers(1, 3), st.sampled_from([0.0, 0.25, 1.0]), st.sampled_from([0.0, 0.1]), st.integers(1, 2),
)
def test_val_stall_matches_the_reference(obs, patience, delta, min_drop, for_steps):
    rules = CollapseRules(patience=patience, delta=delta, min_entropy_drop=min_drop, for_steps=for_steps)
    got = []
    for v, (loss, ent) in enumerate(obs):
        got += [(e.step, e.kind) for e in rules.observe_val(v, without_none({"val_loss": loss, VAL_E: ent}))]
    assert got == reference_val(obs, patience, delta, min_drop, for_steps)


def test_val_stall_falls_back_on_the_smoothed_training_entropy():
    rules = CollapseRules(patience=1, delta=0.1, min_entropy_drop=0.1, alpha=1.0)
    assert rules.observe_val(0, {"val_loss": 3.0}) == []  # no entropy at all yet: not even recorded
    assert list(rules.val_history) == []
    rules.observe_train(0, {E: 5.0})
    assert rules.observe_val(0, {"val_loss": 3.0}) == []  # (3.0, S = 5.0) recorded
    rules.observe_train(1, {E: 4.0})
    # improvement 3.0 - 2.95 = 0.05 < 0.1 while S fell (5 - 4) / 5 = 20% >= 10%: fires
    assert rules.observe_val(1, {"val_loss": 2.95}) == [AlertEvent(FIRED, "val_stall", "critical", 1)]


def test_val_observations_ignored_before_warmup_and_without_patience():
    rules = CollapseRules(patience=1, warmup_steps=5, entropy_floor=1.0)
    for v in range(5):
        assert rules.observe_val(v, {"val_loss": 3.0, VAL_E: 5.0 - v}) == []
    assert list(rules.val_history) == []
    off = CollapseRules(entropy_floor=1.0)  # patience None: val_stall is off
    assert off.observe_val(9, {"val_loss": 3.0, VAL_E: 1.0}) == [] and list(off.val_history) == []
    assert ("val_stall", "critical") not in off.enabled()


# --------------------------------------------------------------------------- hand-worked cases


def test_warmup_observations_do_not_seed_the_smoothing():
    rules = CollapseRules(entropy_drop=0.5, window=1, alpha=0.5, warmup_steps=2)
    run(rules, [{E: 100.0}, {E: 100.0}, {E: 4.0}, {E: 2.0}])
    # S starts at step 2: S = 4, then 0.5 * 2 + 0.5 * 4 = 3; the 100s never count
    assert rules.smoothed == 3.0 and list(rules.history) == [4.0, 3.0]


def test_ceiling_severities_each_with_their_own_rearm_band():
    # warning 3.0 (re-arms at <= 3.0 - 0.3 = 2.7), critical 3.5 (re-arms at <= 3.5 - 0.35 = 3.15), margin 0.1
    rules = CollapseRules(entropy_ceiling=(3.0, 3.5), margin=0.1)
    got = run(rules, [{E: h} for h in [2.0, 3.2, 3.6, 3.4, 3.2, 3.1, 2.8, 2.6, 3.01]])
    # 1: 3.2 > 3 warning; 2: 3.6 > 3.5 critical; 3: 3.4, 4: 3.2 > 3.15 both stay open; 5: 3.1 <= 3.15
    # re-arms the critical; 6: 2.8 > 2.7 warning still open; 7: 2.6 re-arms it; 8: 3.01 > 3 warning again
    assert [(e.step, e.kind, e.severity) for e in got] == [
        (1, FIRED, "warning"), (2, FIRED, "critical"), (5, RESOLVED, "critical"), (7, RESOLVED, "warning"),
        (8, FIRED, "warning"),
    ]  # fmt: skip


def test_kl_ceiling_with_warmup_and_for_steps():
    rules = CollapseRules(kl_ceiling=5.0, for_steps=2, warmup_steps=3, margin=0.0)
    # steps 0-2 ignored; 3: 6 > 5 (1 of 2); 4: 4 restarts; 5, 6: two in a row -> fires at 6; 7 open
    got = run(rules, [{K: k} for k in [9.0, 9.0, 9.0, 6.0, 4.0, 6.0, 6.0, 6.0]])
    assert [(e.step, e.kind) for e in got] == [(6, FIRED)]
    assert rules.episode("kl_ceiling").open and rules.episode("kl_ceiling").pending == 0


def test_drop_is_measured_against_a_non_positive_old_value_as_no_drop():
    rules = CollapseRules(entropy_drop=0.1, window=1, alpha=1.0)
    # entropy 0 then 0: old S = 0, the drop is defined as 0 (no division by zero), never fires
    assert run(rules, [{E: 0.0}, {E: 0.0}, {E: 0.0}]) == []


def test_rare_rule_needs_both_values_at_one_observation():
    rules = CollapseRules(rare_nll_rise=0.5, rare_window=1, alpha=1.0)
    # the overall NLL missing at step 1: nothing recorded; 0 -> 2: rise 1.0 > 0.5 and 3 -> 2.5 falls
    got = run(rules, [{RARE: 2.0, NLL: 3.0}, {RARE: 9.0}, {RARE: 3.0, NLL: 2.5}])
    assert [(e.step, e.kind) for e in got] == [(2, FIRED)]
    assert list(rules.nll_history) == [(2.0, 3.0), (3.0, 2.5)]


def test_force_fire_opens_once_and_counts_once():
    rules = CollapseRules(entropy_floor=1.0)
    rules.force_fire("entropy_floor")
    rules.force_fire("entropy_floor")  # already open: not counted twice
    assert rules.episode("entropy_floor").fired == 1 and rules.episode("entropy_floor").open
    assert run(rules, [{E: 0.5}]) == []  # open: no second firing
    assert [e.kind for e in run(rules, [{E: 1.5}, {E: 0.5}], start=1)] == [RESOLVED, FIRED]


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("value", "expected"), [
    (None, {}),
    (1, {"critical": 1.0}),
    (2.5, {"critical": 2.5}),
    ((2, 1), {"warning": 2.0, "critical": 1.0}),
    ({"warning": 2}, {"warning": 2.0}),
    ({"warning": 3, "critical": None}, {"warning": 3.0}),
    ((None, 4.0), {"critical": 4.0}),
])
def test_threshold_forms(value, expected):
    assert parse_threshold("entropy_floor", value) == expected


@pytest.mark.parametrize("value", [True, "1", (1.0, 2.0, 3.0), {"severe": 1.0}, {"warning": math.inf}, {}, (None, None), [2.0, 1.0]])
def test_bad_threshold_forms_name_the_argument(value):
    with pytest.raises(HeadwatchError, match=r"`kl_ceiling` must be None, a finite number \(critical\)"):
        parse_threshold("kl_ceiling", value)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(margin=1.0), r"`margin` \(`rearm_margin`\) must be a number in \[0, 1\), got 1.0"),
    (dict(margin=-0.1), r"`rearm_margin`"),
    (dict(delta=-0.5), r"`delta` \(`val_delta`\) must be a finite number >= 0, got -0.5"),
    (dict(delta=math.nan), r"`val_delta`"),
    (dict(min_entropy_drop=-0.01), r"`min_entropy_drop` \(`val_min_entropy_drop`\) must be a finite number >= 0"),
    (dict(min_entropy_drop=math.inf), r"`val_min_entropy_drop`"),
    (dict(patience=0), r"`patience` must be None or an int >= 1, got 0"),
    (dict(patience=True), r"`patience` must be None or an int >= 1, got True"),
    (dict(patience=2.0), r"`patience`"),
    (dict(alpha=0.0), r"`alpha` \(`smoothing`\) must be a number in \(0, 1\]"),
    (dict(alpha=1.5), r"`smoothing`"),
    (dict(warmup_steps=-1), r"`warmup_steps` must be an int >= 0, got -1"),
    (dict(for_steps=True), r"`for_steps` must be an int >= 1, got True"),
    (dict(window=1.0), r"`window` must be an int >= 1"),
    (dict(entropy_drop=0.0), r"`entropy_drop` must be None or fractions in \(0, 1\)"),
    (dict(entropy_drop=(0.5, 0.3)), r"`entropy_drop`: the warning threshold must be <= the critical one"),
    (dict(entropy_ceiling=(5.0, 4.0)), r"`entropy_ceiling`: the warning threshold must be <="),
])
def test_bad_rule_arguments_name_the_argument(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        CollapseRules(**{"entropy_floor": 1.0, **kwargs})


def test_enabled_pairs_in_a_fixed_order():
    rules = CollapseRules(entropy_drop=0.3, kl_ceiling=(1.0, 2.0), entropy_floor={"warning": 2.0}, patience=3)
    # the rules in TRAIN_RULES order, warning before critical, then val_stall
    assert TRAIN_RULES == ("entropy_floor", "entropy_ceiling", "kl_ceiling", "entropy_drop", "rare_nll_rise")
    assert rules.enabled("train") == [("entropy_floor", "warning"), ("kl_ceiling", "warning"),
                                      ("kl_ceiling", "critical"), ("entropy_drop", "critical")]
    assert rules.enabled("val") == [("val_stall", "critical")]
    assert rules.enabled() == rules.enabled("train") + [("val_stall", "critical")]
    assert rules.episodes() == ["entropy_floor/warning", "kl_ceiling/warning", "kl_ceiling/critical",
                                "entropy_drop/critical", "val_stall/critical"]
    assert sorted(rules.states) == sorted(rules.episodes())


def test_descriptions_name_the_threshold_of_each_severity():
    rules = CollapseRules(entropy_floor=(2.0, 1.0), entropy_ceiling=5.5, kl_ceiling=3.0, entropy_drop=0.25,
                          window=7, rare_nll_rise=0.4, rare_window=3, patience=2, delta=0.01)
    assert rules.describe("entropy_floor", "warning") == "entropy fell below 2.0 nats"
    assert rules.describe("entropy_floor") == "entropy fell below 1.0 nats"
    assert rules.describe("entropy_ceiling") == "entropy rose above 5.5 nats (predictions going flat)"
    assert rules.describe("kl_ceiling") == "kl_to_uniform rose above 3.0 nats"
    assert rules.describe("entropy_drop") == "smoothed entropy dropped by >= 25% over 7 logged values"
    assert rules.describe("rare_nll_rise").startswith("rare-target NLL (smoothed) rose by more than 0.4 nats over 3")
    assert rules.describe("val_stall") == ("entropy falling while val_loss (dataloader 0) improved by < 0.01 "
                                           "over 2 validations")


def test_a_version_1_state_loads_as_critical_and_unknown_episodes_are_ignored():
    rules = CollapseRules(entropy_floor=(2.0, 1.0), kl_ceiling=4.0)
    rules.load_state_dict({
        "smoothed": 1.5, "history": [1.7, 1.5],
        "states": {"entropy_floor": {"open": True, "fired": 3}, "kl_ceiling/warning": {"open": True}, "gone": {}},
    })  # fmt: skip
    assert rules.episode("entropy_floor", "critical").open and rules.episode("entropy_floor", "critical").fired == 3
    assert not rules.episode("entropy_floor", "warning").open
    assert "kl_ceiling/warning" not in rules.states and "gone" not in rules.states  # not enabled here
    assert rules.smoothed == 1.5 and list(rules.nll_history) == [] and list(rules.val_history) == []
