"""The trainer-free alert engine: for_steps, severities, entropy ceiling, state, actions, no torch import.

Every expected firing step below is worked out by hand in the comments from the series and the
rule's definition, not by running the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwatch import HeadwatchError
from headwatch.alerts import Alert, AlertEngine, CollapseRules, SummaryWriterSink, WebhookSender, standard_actions
from headwatch.alerts.events import FIRED, RESOLVED

E, K = "headwatch/logits/entropy", "headwatch/logits/kl_to_uniform"


def events(rules: CollapseRules, series: list[float], name: str = E) -> list[tuple[int, str, str, str]]:
    """(step, kind, rule, severity) of every event, feeding ``series[step]`` under ``name``."""
    out = []
    for step, value in enumerate(series):
        out += [(e.step, e.kind, e.rule, e.severity) for e in rules.observe_train(step, {name: value})]
    return out


def test_for_steps_needs_consecutive_observations():
    rules = CollapseRules(entropy_floor=2.0, entropy_drop=None, for_steps=3, margin=0.05)  # re-arms at H >= 2.1
    series = [3.0, 1.9, 1.8, 2.5, 1.9, 1.8, 1.7, 1.6, 2.0, 2.2, 1.0, 1.0, 1.0]
    # below 2: steps 1, 2 (count 1, 2); step 3 (2.5) restarts the count; steps 4, 5, 6 -> fires at 6.
    # open at 7 (1.6) and 8 (2.0 < 2.1, not recovered); 9 (2.2 >= 2.1) resolves; 10, 11, 12 -> fires at 12.
    assert events(rules, series) == [
        (6, FIRED, "entropy_floor", "critical"),
        (9, RESOLVED, "entropy_floor", "critical"),
        (12, FIRED, "entropy_floor", "critical"),
    ]
    assert rules.episode("entropy_floor").fired == 2


def test_for_steps_skips_nan_and_absent_values_without_restarting():
    rules = CollapseRules(entropy_floor=2.0, entropy_drop=None, for_steps=2)
    # below at 0; NaN at 1 and absent at 2 are skipped (neither count nor restart); below at 3 -> count 2: fires at 3
    out = []
    for step, metrics in enumerate([{E: 1.0}, {E: float("nan")}, {K: 3.0}, {E: 1.5}]):
        out += [(e.step, e.kind) for e in rules.observe_train(step, metrics)]
    assert out == [(3, FIRED)]


def test_two_severities_have_their_own_episodes_and_hysteresis():
    # warning floor 2.0 (re-arms at >= 2.2), critical floor 1.0 (re-arms at >= 1.1), margin 0.1
    rules = CollapseRules(entropy_floor=(2.0, 1.0), entropy_drop=None, margin=0.1)
    series = [3.0, 1.9, 1.5, 0.9, 0.95, 1.05, 1.2, 2.1, 2.3, 0.5]
    # 1: 1.9 < 2 warning fires; 3: 0.9 < 1 critical fires; 5: 1.05 < 1.1 critical still open;
    # 6: 1.2 >= 1.1 critical resolves; 7: 2.1 < 2.2 warning still open; 8: 2.3 resolves the warning;
    # 9: 0.5 fires both (warning listed first)
    assert events(rules, series) == [
        (1, FIRED, "entropy_floor", "warning"),
        (3, FIRED, "entropy_floor", "critical"),
        (6, RESOLVED, "entropy_floor", "critical"),
        (8, RESOLVED, "entropy_floor", "warning"),
        (9, FIRED, "entropy_floor", "warning"),
        (9, FIRED, "entropy_floor", "critical"),
    ]


def test_severities_with_for_steps_on_a_ceiling():
    # kl warning 4.0 (re-arms <= 3.8), critical 6.0 (re-arms <= 5.7), each must hold 2 observations
    rules = CollapseRules(kl_ceiling={"warning": 4.0, "critical": 6.0}, entropy_drop=None, for_steps=2)
    # > 4: steps 1, 2 -> warning at 2; > 6: steps 3, 4 -> critical at 4; 3.5 at 5 resolves both
    assert events(rules, [3.0, 4.5, 5.0, 6.5, 7.0, 3.5], name=K) == [
        (2, FIRED, "kl_ceiling", "warning"),
        (4, FIRED, "kl_ceiling", "critical"),
        (5, RESOLVED, "kl_ceiling", "warning"),
        (5, RESOLVED, "kl_ceiling", "critical"),
    ]


def test_entropy_ceiling_fires_when_predictions_go_flat():
    # like kl_ceiling: fires when H > 4.0, re-arms when H <= 4.0 - 0.05 * 4.0 = 3.8
    rules = CollapseRules(entropy_ceiling=4.0, entropy_drop=None)
    # 1: 4.1 fires; 2: open; 3: 3.9 > 3.8 still open; 4: 3.7 resolves; 5: 4.05 fires again
    assert events(rules, [3.0, 4.1, 4.2, 3.9, 3.7, 4.05]) == [
        (1, FIRED, "entropy_ceiling", "critical"),
        (4, RESOLVED, "entropy_ceiling", "critical"),
        (5, FIRED, "entropy_ceiling", "critical"),
    ]


def test_entropy_drop_with_severities():
    # no smoothing, window 1: drop_k = (H_{k-1} - H_k) / H_{k-1}; warning r=0.2, critical r=0.5
    rules = CollapseRules(entropy_drop=(0.2, 0.5), window=1, alpha=1.0, margin=0.0)
    # 1: 4 -> 3 drop 0.25: warning fires; 2: 3 -> 1.2 drop 0.6: critical fires (warning open);
    # 3: 1.2 -> 1.2 drop 0: both resolve
    assert events(rules, [4.0, 3.0, 1.2, 1.2]) == [
        (1, FIRED, "entropy_drop", "warning"),
        (2, FIRED, "entropy_drop", "critical"),
        (3, RESOLVED, "entropy_drop", "warning"),
        (3, RESOLVED, "entropy_drop", "critical"),
    ]


def test_val_stall_watches_one_dataloader():
    rules = CollapseRules(entropy_drop=None, patience=1, delta=0.05, val_dataloader_idx=1)
    ent = "headwatch/val/logits/entropy"
    assert rules.observe_val(0, {"val_loss": 3.0, ent: 5.0}, dataloader_idx=0) == []
    # dataloader 0 would stall (3.0 -> 3.0) but only dataloader 1 is watched: no history from 0 at all
    assert rules.observe_val(1, {"val_loss": 3.0, ent: 4.0}, dataloader_idx=0) == []
    assert list(rules.val_history) == []
    rules.observe_val(0, {"val_loss": 3.0, ent: 5.0}, dataloader_idx=1)
    fired = rules.observe_val(1, {"val_loss": 2.99, ent: 4.0}, dataloader_idx=1)  # improved 0.01 < 0.05, entropy -20%
    assert [(e.kind, e.rule, e.step) for e in fired] == [(FIRED, "val_stall", 1)]


def test_pending_and_open_state_round_trip_and_old_states_load():
    rules = CollapseRules(entropy_floor=(2.0, 1.0), entropy_drop=None, for_steps=3)
    events(rules, [1.5, 1.5])  # warning pending 2 of 3
    copy = CollapseRules(entropy_floor=(2.0, 1.0), entropy_drop=None, for_steps=3)
    copy.load_state_dict(json.loads(json.dumps(rules.state_dict())))
    assert copy.state_dict() == rules.state_dict()
    assert [(e.step, e.severity) for e in copy.observe_train(2, {E: 1.5})] == [(2, "warning")]  # the third in a row
    old = CollapseRules(entropy_floor=1.0, entropy_drop=None)  # a 0.1 checkpoint: episodes keyed by rule
    old.load_state_dict({"smoothed": 0.5, "history": [0.5], "val_history": [], "states": {"entropy_floor": {"open": True, "fired": 1}}})
    assert old.episode("entropy_floor").open and old.episode("entropy_floor").fired == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(entropy_floor=(1.0, 2.0)), "warning threshold must be >="),  # a warning floor below the critical one
        (dict(kl_ceiling=(6.0, 4.0)), "warning threshold must be <="),
        (dict(entropy_floor={"severe": 1.0}), "entropy_floor"),
        (dict(entropy_ceiling="4"), "entropy_ceiling"),
        (dict(entropy_drop=(0.2, 1.5)), "entropy_drop"),
        (dict(for_steps=0), "for_steps"),
        (dict(val_dataloader_idx=-1), "val_dataloader_idx"),
    ],
)
def test_bad_rule_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        CollapseRules(**kwargs)


def test_engine_runs_actions_by_severity_and_on_every_process_decision(tmp_path):
    seen, stopped = [], []
    actions = standard_actions(warn=lambda m: None, jsonl_path=tmp_path / "a.jsonl", callables=[seen.append],
                               stop=stopped.append)
    calls: list[int] = []  # the engine asks once per (rule, severity) in order: warning, then critical

    def reduce_bool(fired: bool) -> bool:  # "another process" fires the critical floor at step 3
        calls.append(step)
        return fired or (step == 3 and calls.count(3) == 2)

    engine = AlertEngine(CollapseRules(entropy_floor=(2.0, 1.0), entropy_drop=None), actions, reduce_bool=reduce_bool)
    for step, h in enumerate([3.0, 1.5, 1.5, 1.5, 0.5]):
        engine.observe_train(step, {E: h})
    assert calls == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # every step, every pair: the same collectives everywhere
    # warning at 1 (1.5 < 2); critical at 3 from the other process, none at 4 although 0.5 < 1 here:
    # the episode opened at 3 was kept in step
    assert [(a.step, a.severity) for a in engine.alerts] == [(1, "warning"), (3, "critical")]
    assert seen == engine.alerts and [a.step for a in stopped] == [3]  # stop acts on critical only
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [(r["step"], r["severity"]) for r in lines] == [(1, "warning"), (3, "critical")]
    assert "warning" in engine.alerts[0].message and lines[1]["metrics"][E] == 1.5


def test_engine_main_process_only_actions_and_failures(tmp_path):
    def broken(alert):
        raise RuntimeError("pager is down")

    warned = []
    engine = AlertEngine(
        CollapseRules(entropy_floor=1.0, entropy_drop=None),
        standard_actions(warn=warned.append, jsonl_path=tmp_path / "a.jsonl", callables=[broken]),
        main_process=False, warn=warned.append,
    )
    engine.observe_train(0, {E: 0.5})
    assert not (tmp_path / "a.jsonl").exists() and engine.action_failures == 1  # JSONL and console: rank zero only
    assert len(warned) == 1 and "pager is down" in warned[0]
    strict = AlertEngine(CollapseRules(entropy_floor=1.0, entropy_drop=None), [broken], strict=True)
    with pytest.raises(HeadwatchError, match="pager is down"):
        strict.observe_train(0, {E: 0.5})


def test_summary_writer_sink_writes_markers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    engine = AlertEngine(CollapseRules(entropy_floor=(2.0, 1.0), entropy_drop=None),
                         standard_actions(warn=lambda m: None, sink=SummaryWriterSink(writer)))
    for step, h in enumerate([3.0, 1.5, 0.5]):
        engine.observe_train(step, {E: h})
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("headwatch/alerts/entropy_floor_warning")] == [(1, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("headwatch/alerts/entropy_floor")] == [(2, 1.0)]


def test_webhook_sender_posts_without_lightning():
    received = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sender = WebhookSender(f"http://127.0.0.1:{server.server_port}/x?token=SECRET", timeout=1.0, retries=0)
        sender(Alert("t", 7, 0, "entropy_ceiling", {E: 4.1}, "m", severity="warning"))
        sender.close()
    finally:
        server.shutdown()
    assert [(r["step"], r["severity"], r["rule"]) for r in received] == [(7, "warning", "entropy_ceiling")]
    assert "SECRET" not in sender.redacted


def test_engine_imports_neither_torch_nor_lightning():
    code = (
        "import sys; import headwatch.alerts as a; a.AlertEngine(a.CollapseRules(entropy_floor=1.0));"
        "bad = [m for m in ('torch', 'lightning', 'lightning.pytorch') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_entropy_ceiling_above_log_v_is_warned_once():
    warned = []
    engine = AlertEngine(CollapseRules(entropy_ceiling=(4.0, 4.5)), [], warn=warned.append)
    for step in range(3):  # V = 64: log V = H + KL = 4.159 nats; 4.5 can never be exceeded, 4.0 can
        engine.observe_train(step, {E: 3.0, K: 1.1589})
    assert len(warned) == 1 and "{'critical': 4.5}" in warned[0] and "4.159" in warned[0]


def runs_reference(below: list[bool], n: int) -> tuple[list[int], list[int]]:
    """Fired and resolved steps for a floor with margin 0, from the maximal runs of ``below``:
    a run of length >= n fires at its start + n - 1 and resolves at the step after it (if any)."""
    fired, resolved, start = [], [], None
    for i, b in enumerate(below + [False]):
        if b and start is None:
            start = i
        elif not b and start is not None:
            if i - start >= n:
                fired.append(start + n - 1)
                if i < len(below):
                    resolved.append(i)
            start = None
    return fired, resolved


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.5, 1.5, 2.5]), max_size=30), st.integers(1, 4))
def test_for_steps_matches_a_run_length_reference(series, n):
    rules = CollapseRules(entropy_floor=2.0, entropy_drop=None, for_steps=n, margin=0.0)
    got = events(rules, series)
    fired, resolved = runs_reference([v < 2.0 for v in series], n)
    assert [s for s, kind, _, _ in got if kind == FIRED] == fired
    assert [s for s, kind, _, _ in got if kind == RESOLVED] == resolved


def test_marker_names():
    from headwatch.alerts import marker_name

    assert marker_name("entropy_floor") == "entropy_floor"  # 0.1's tag for a critical alert
    assert marker_name("entropy_floor", "warning") == "entropy_floor_warning"
