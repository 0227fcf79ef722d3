"""The ``rare_nll_rise`` alert rule: the rare-target NLL rising while the overall target
NLL falls. Every expected firing step is worked out by hand in the comments from the series and the
rule's definition (``CollapseRules`` docstring), not by running the engine."""

from __future__ import annotations

import math

import pytest

from headwatch import HeadwatchError
from headwatch.alerts import RULES, AlertEngine, CollapseRules
from headwatch.alerts.events import FIRED, RESOLVED

RARE, NLL = "headwatch/logits/rare/target_nll", "headwatch/logits/target_nll"


def events(rules: CollapseRules, rare: list[float], nll: list[float], start: int = 0) -> list[tuple[int, str, str]]:
    out = []
    for k, (r, n) in enumerate(zip(rare, nll), start):
        out += [(e.step, e.kind, e.severity) for e in rules.observe_train(k, {RARE: r, NLL: n}) if e.rule == "rare_nll_rise"]
    return out


RARE_SERIES = [3.0, 3.2, 3.4, 3.8, 4.0, 4.0, 4.6, 4.7, 4.8, math.nan, 5.6]
NLL_SERIES = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.6, 1.4, 1.5, 1.3, 1.2]


def test_fires_when_rare_rises_while_overall_falls():
    rules = CollapseRules(rare_nll_rise=0.5, rare_window=2, alpha=1.0, margin=0.1)  # re-arms at a rise <= 0.45
    # k=2: rise 3.4 - 3.0 = 0.4 <= 0.5.  k=3: 3.8 - 3.2 = 0.6 > 0.5 and 1.7 < 1.9 -> fires at 3.
    # k=4: 4.0 - 3.4 = 0.6, open.  k=5: 4.0 - 3.8 = 0.2 <= 0.45 -> resolved at 5.
    # k=6: 4.6 - 4.0 = 0.6 but 1.6 is not < 1.6 (overall not falling) -> nothing.
    # k=7: 4.7 - 4.0 = 0.7 and 1.4 < 1.5 -> fires at 7.  k=8: 4.8 - 4.6 = 0.2 -> resolved at 8.
    # k=9: NaN rare NLL, skipped (the window holds k = 7, 8 and then 10).
    # k=10: 5.6 - 4.7 = 0.9 and 1.2 < 1.4 -> fires at 10.
    assert events(rules, RARE_SERIES, NLL_SERIES) == [
        (3, FIRED, "critical"), (5, RESOLVED, "critical"), (7, FIRED, "critical"), (8, RESOLVED, "critical"),
        (10, FIRED, "critical"),
    ]  # fmt: skip


def test_smoothed_and_severities():
    rules = CollapseRules(rare_nll_rise=(0.3, 0.6), rare_window=1, alpha=0.5, margin=0.0)
    # R~ = 3, 4, 4.5, 4.75 (alpha 0.5 on 3, 5, 5, 5); L~ = 2, 1.9, 1.75, 1.575 (on 2, 1.8, 1.6, 1.4): falls.
    # rises over 1: k=1 1.0 (> 0.3 and > 0.6: both fire), k=2 0.5 (critical re-arms: 0.5 <= 0.6; warning open),
    # k=3 0.25 (<= 0.3: warning re-arms). Unsmoothed, the rise at k=2 would be 0 and the warning would re-arm there.
    assert events(rules, [3, 5, 5, 5], [2, 1.8, 1.6, 1.4]) == [
        (1, FIRED, "warning"), (1, FIRED, "critical"), (2, RESOLVED, "critical"), (3, RESOLVED, "warning"),
    ]  # fmt: skip


def test_off_by_default_declared_and_resumable():
    assert "rare_nll_rise" in RULES
    assert events(CollapseRules(entropy_floor=0.1), RARE_SERIES, NLL_SERIES) == []
    whole = CollapseRules(rare_nll_rise=0.5, rare_window=2, alpha=1.0, margin=0.1)
    first = CollapseRules(rare_nll_rise=0.5, rare_window=2, alpha=1.0, margin=0.1)
    events(first, RARE_SERIES[:6], NLL_SERIES[:6])
    resumed = CollapseRules(rare_nll_rise=0.5, rare_window=2, alpha=1.0, margin=0.1)
    resumed.load_state_dict(first.state_dict())
    assert events(resumed, RARE_SERIES[6:], NLL_SERIES[6:], start=6) == events(whole, RARE_SERIES, NLL_SERIES)[2:]


def test_engine_alert_shows_both_nlls():
    engine = AlertEngine(CollapseRules(rare_nll_rise=0.5, rare_window=2, alpha=1.0), actions=[])
    alerts = [a for k in range(4) for a in engine.observe_train(k, {RARE: RARE_SERIES[k], NLL: NLL_SERIES[k]})]
    (alert,) = alerts
    assert alert.step == 3 and alert.rule == "rare_nll_rise" and (alert.metrics[RARE], alert.metrics[NLL]) == (3.8, 1.7)
    assert "rare-target NLL (smoothed) rose by more than 0.5 nats over 2 logged values" in alert.message


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rare_nll_rise=-0.1), r"`rare_nll_rise` must be None or rises > 0 \(nats\), got -0.1"),
        (dict(rare_nll_rise=(0.6, 0.3)), r"`rare_nll_rise`: the warning threshold must be <= the critical one"),
        (dict(rare_nll_rise=0.5, rare_window=0), r"`rare_window` must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        CollapseRules(**kwargs)
