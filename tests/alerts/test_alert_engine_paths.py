"""AlertEngine paths the front doors rely on: argument checks, collectives on empty steps, an episode
opened on another process and resolved here, messages, the webhook's failure policy, and alerts that
``headwatch report`` reads back from a real event file and JSON Lines log.

Expected values are worked out by hand from the rules' definitions, or read back with TensorBoard's
own ``EventAccumulator`` and ``json``, never from the engine itself.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from headwatch import HeadwatchError
from headwatch.alerts import (
    Alert,
    AlertEngine,
    CollapseRules,
    ConsoleWarning,
    JsonlLog,
    OnCritical,
    SinkMarker,
    SummaryWriterSink,
    WebhookSender,
    standard_actions,
)
from headwatch.alerts.actions import action_name, runs_for
from headwatch.alerts.engine import check_alert_args, closest_names
from headwatch.alerts.events import AlertEvent

E, K = "headwatch/logits/entropy", "headwatch/logits/kl_to_uniform"
VAL_E = "headwatch/val/logits/entropy"


def alert(severity: str = "critical", step: int = 3) -> Alert:
    return Alert("2024-01-01T00:00:00+00:00", step, 0, "entropy_floor", {E: 0.5}, "m", severity=severity)


# --------------------------------------------------------------------------- argument checks


def test_closest_names_lists_what_was_logged():
    logged = ["headwatch/logits/entropy", "val_loss", "epoch"]
    assert closest_names("headwatch/logits/entropyy", logged) == "the closest logged names are 'headwatch/logits/entropy'"
    assert closest_names("zzz", []) == "no logged name is close (logged: none)"
    far = [f"m{i:02d}" for i in range(12, 0, -1)]
    # nothing close: the first 10 logged names, sorted
    assert closest_names("headwatch/val/logits/entropy", far) == (
        "no logged name is close (logged: " + ", ".join(repr(f"m{i:02d}") for i in range(1, 11)) + ")"
    )


@pytest.mark.parametrize(("rules", "actions", "critical", "match"), [
    (CollapseRules, [], False, "every rule is off"),
    (lambda: CollapseRules(entropy_floor={"warning": 1.0}), [], True, "every rule is warning-only"),
    (lambda: CollapseRules(entropy_floor=1.0), [print, "not callable"], False, "`actions` must be"),
])
def test_check_alert_args(rules, actions, critical, match):
    with pytest.raises(HeadwatchError, match=match):
        check_alert_args(rules(), actions, critical)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: CollapseRules(entropy_floor=1.0, entropy_metric=""), r"`entropy_metric` must be a non-empty string, got ''"),
    (lambda: CollapseRules(entropy_floor=1.0, kl_metric=None), r"`kl_metric` must be a .*string, got None"),
    (lambda: CollapseRules(patience=2, val_metric=3), r"`val_metric` must be a .*string, got 3"),
])
def test_metric_names_are_checked_by_the_rules_themselves(build, match):
    """Since the checks moved into the core, a bad metric name is refused when the rules are built."""
    with pytest.raises(HeadwatchError, match=match):
        build()


def test_check_alert_args_accepts_a_critical_rule_for_stop_and_checkpoint():
    check_alert_args(CollapseRules(entropy_floor=(2.0, 1.0)), [print], critical_actions=True)  # no error
    check_alert_args(CollapseRules(patience=1), [], critical_actions=True)  # val_stall is critical


def test_engine_constructor_checks():
    with pytest.raises(HeadwatchError, match=r"`rules` must be a CollapseRules, got \{'entropy_floor': 1.0\}"):
        AlertEngine({"entropy_floor": 1.0})
    with pytest.raises(HeadwatchError, match=r"`actions` must be a sequence of callables taking an Alert, got \[None\]"):
        AlertEngine(CollapseRules(entropy_floor=1.0), [None])


# --------------------------------------------------------------------------- decisions


def test_the_collective_runs_on_empty_steps_too():
    calls = []

    def reduce_bool(fired: bool) -> bool:
        calls.append(fired)
        return fired

    rules = CollapseRules(entropy_floor=(2.0, 1.0), patience=1)
    engine = AlertEngine(rules, [], reduce_bool=reduce_bool)
    assert engine.observe_train(0, {}) == [] and engine.observe_train(1, {E: None, K: None}) == []
    assert calls == [False] * 4  # 2 train pairs per step, although nothing was observed
    assert rules.smoothed is None and list(rules.history) == []
    assert engine.observe_val(1, {}) == [] and calls == [False] * 5  # 1 val pair


def test_an_episode_opened_elsewhere_is_resolved_and_refired_here():
    other_fires_at = {1}
    info = []
    step = 0
    engine = AlertEngine(CollapseRules(entropy_floor=1.0, margin=0.0), [],
                         reduce_bool=lambda fired: fired or step in other_fires_at, info=info.append)
    raised = []
    for step, h in enumerate([3.0, 3.0, 0.5, 3.0, 0.5]):
        raised += [(a.step, a.rule) for a in engine.observe_train(step, {E: h})]
    # 1: another process fired: alert here too, episode opened; 2: 0.5 < 1 but open: nothing;
    # 3: 3.0 >= 1 resolves (an info line); 4: 0.5 < 1 fires from this process
    assert raised == [(1, "entropy_floor"), (4, "entropy_floor")]
    assert info == ["headwatch: entropy_floor (critical) resolved at step 3; it may fire again"]
    assert engine.rules.episode("entropy_floor").fired == 2


def test_val_stall_alert_shows_the_validation_values():
    engine = AlertEngine(CollapseRules(patience=1, delta=0.1, min_entropy_drop=0.1), [], name="MyAlert")
    assert engine.observe_val(0, {"val_loss": 3.0, VAL_E: 5.0}) == []
    (a,) = engine.observe_val(1, {"val_loss": 2.95, VAL_E: 4.0}, epoch=2)  # improved 0.05 < 0.1, entropy -20%
    assert (a.step, a.epoch, a.rule, a.severity) == (1, 2, "val_stall", "critical")
    assert a.metrics == {"val_loss": 2.95, VAL_E: 4.0, "smoothed_entropy": None}
    assert a.message == ("headwatch sharpness collapse alert (val_stall): entropy falling while val_loss (dataloader 0) "
                         "improved by < 0.1 over 1 validations (val_loss=2.95, headwatch/val/logits/entropy=4)")


def test_message_and_metrics_of_a_warning():
    engine = AlertEngine(CollapseRules(entropy_floor=(2.0, 1.0), alpha=0.5), [])
    engine.observe_train(0, {E: 3.0})
    (a,) = engine.observe_train(1, {E: 1.5, K: float("inf")})
    # the message skips nothing but None; the stored metrics are strict JSON (inf -> None)
    assert a.message == ("headwatch sharpness collapse alert (entropy_floor, warning): entropy fell below 2.0 nats "
                         "(headwatch/logits/entropy=1.5, headwatch/logits/kl_to_uniform=inf, smoothed_entropy=2.25)")
    assert a.metrics == {E: 1.5, K: None, "smoothed_entropy": 2.25}  # S = 0.5 * 1.5 + 0.5 * 3.0
    assert json.loads(a.to_json())["metrics"][K] is None


def test_event_key():
    assert AlertEvent("fired", "kl_ceiling", "warning", 4).key == "kl_ceiling/warning"


def test_engine_state_round_trips_through_json_and_does_not_refire():
    rules = dict(entropy_floor=(2.0, 1.0), for_steps=2)
    engine = AlertEngine(CollapseRules(**rules), [lambda a: 1 / 0], warn=lambda m: None)
    for step, h in enumerate([1.5, 1.5, 0.5]):
        engine.observe_train(step, {E: h})
    # warning after 2 values below 2 (step 1); critical pending 1 of 2 at step 2
    assert [(a.step, a.severity) for a in engine.alerts] == [(1, "warning")] and engine.action_failures == 1
    state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
    resumed = AlertEngine(CollapseRules(**rules), [])
    resumed.load_state_dict(state)
    assert resumed.alerts == engine.alerts and resumed.action_failures == 1
    (a,) = resumed.observe_train(3, {E: 0.5})  # the second value below 1 in a row: critical; warning stays open
    assert (a.step, a.severity) == (3, "critical")
    old = AlertEngine(CollapseRules(**rules), [])
    old.load_state_dict({})  # a state without keys (version 1 had fewer): defaults
    assert old.alerts == [] and old.action_failures == 0


# --------------------------------------------------------------------------- actions


def test_standard_actions_order_and_where_each_runs():
    sink_calls = []

    class Sink:
        def scalar(self, tag, value, step):
            sink_calls.append(("scalar", tag, value, step))

        def text(self, tag, text, step):
            sink_calls.append(("text", tag, text, step))

    actions = standard_actions(warn=print, sink=Sink(), prefix="hw", jsonl_path="x.jsonl", callables=[print],
                               webhook=WebhookSender("http://127.0.0.1:9/x"), save_checkpoint=print, stop=print)
    assert [type(a).__name__ for a in actions] == ["ConsoleWarning", "SinkMarker", "JsonlLog", "builtin_function_or_method",
                                                  "WebhookSender", "CheckpointOnCritical", "OnCritical"]
    assert [action_name(a) for a in actions[-2:]] == ["checkpoint", "stop"] and action_name(print) == "action print"
    warning, critical = alert("warning"), alert("critical")
    # (runs for a warning on rank 0, for a critical on rank 0, for a critical on another rank)
    expected = [(True, True, False), (True, True, True), (True, True, False), (True, True, True),
                (True, True, False), (False, True, True), (False, True, True)]
    assert [(runs_for(a, warning, True), runs_for(a, critical, True), runs_for(a, critical, False)) for a in actions] == expected
    actions[1](warning)
    assert sink_calls == [("scalar", "hw/alerts/entropy_floor_warning", 1.0, 3), ("text", "hw/alerts", "[warning] m", 3)]
    assert standard_actions()[0].__class__ is ConsoleWarning and len(standard_actions()) == 1


def test_jsonl_log_appends_strict_json_lines(tmp_path):
    path = tmp_path / "deep" / "dir" / "a.jsonl"
    log = JsonlLog(path)
    log(alert("warning", 1))
    log(Alert("t", 2, 0, "kl_ceiling", {K: None}, "m2"))  # the engine stores NaN/inf as None
    lines = path.read_text().splitlines()  # appended, one object a line, in order
    assert [(json.loads(x)["step"], json.loads(x)["severity"]) for x in lines] == [(1, "warning"), (2, "critical")]
    assert json.loads(lines[1])["metrics"] == {K: None}


def test_on_critical_runs_the_function_on_critical_alerts_only():
    got = []
    engine = AlertEngine(CollapseRules(entropy_floor=(2.0, 1.0)), [OnCritical("stop", got.append)], main_process=False)
    engine.observe_train(0, {E: 1.5})  # warning only
    engine.observe_train(1, {E: 0.5})  # critical: runs on every process
    assert [(a.step, a.severity) for a in got] == [(1, "critical")]


def test_alerts_package_names_an_unknown_attribute():
    import headwatch.alerts as alerts

    # the Lightning callback is the front door's (import it from headwatch): the package imports no door
    assert "SharpnessCollapseAlert" not in alerts.__all__
    for name in ("Nope", "SharpnessCollapseAlert"):
        with pytest.raises(AttributeError, match=f"module 'headwatch.alerts' has no attribute '{name}'"):
            getattr(alerts, name)


# --------------------------------------------------------------------------- the webhook's failure policy


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed: connection refused


def test_server_error_is_retried_then_reported_without_the_url():
    hits = []

    class Failing(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            hits.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["step"])
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    failures = []
    try:
        url = f"http://127.0.0.1:{server.server_port}/hooks/T0/SECRET?token=abc"
        sender = WebhookSender(url, timeout=1.0, retries=1, on_failure=lambda what, err: failures.append((what, str(err))))
        sender(alert(step=9))
        sender.close()
    finally:
        server.shutdown()
    assert hits == [9, 9]  # one attempt and one retry
    assert failures == [(f"webhook POST to http://127.0.0.1:{server.server_port}/...", "HTTPError: Internal Server Error")]
    assert sender._thread is None  # close let the thread go


def test_strict_engine_raises_a_failed_post_at_flush():
    url = f"http://127.0.0.1:{closed_port()}/x/SECRET"
    strict = AlertEngine(CollapseRules(entropy_floor=1.0), [], strict=True, warn=lambda m: None)
    sender = WebhookSender(url, timeout=0.5, retries=0, on_failure=strict.action_failed)
    strict.actions.append(sender)
    strict.observe_train(0, {E: 0.5})  # queued: the training thread does not wait
    with pytest.raises(HeadwatchError, match=r"the webhook POST to http://127\.0\.0\.1:\d+/\.\.\. failed") as info:
        strict.flush()
    assert "SECRET" not in str(info.value)
    warned = []
    lenient = AlertEngine(CollapseRules(entropy_floor=1.0), [], warn=warned.append)
    lenient.actions.append(WebhookSender(url, timeout=0.5, retries=0, on_failure=lenient.action_failed))
    lenient.observe_train(0, {E: 0.5})
    lenient.observe_train(1, {E: 1.5})
    lenient.observe_train(2, {E: 0.5})
    lenient.close()  # flushes: both posts failed, warned once, counted twice
    assert lenient.action_failures == 2 and len(warned) == 1 and "SECRET" not in warned[0]


# --------------------------------------------------------------------------- read back by the report


def test_alerts_written_by_the_engine_are_what_the_report_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from headwatch.report import collect_alerts, find_alerts_file, read_alerts_jsonl, read_run

    run_dir = tmp_path / "runs" / "a" / "version_0"
    writer = SummaryWriter(str(run_dir))
    actions = standard_actions(warn=lambda m: None, sink=SummaryWriterSink(writer),
                               jsonl_path=tmp_path / "runs" / "a" / "headwatch_alerts.jsonl")
    engine = AlertEngine(CollapseRules(entropy_floor=(2.0, 1.0), kl_ceiling=5.0, margin=0.0), actions)
    for step, (h, kl) in enumerate([(3.0, 1.0), (1.5, 1.0), (0.5, 6.0), (2.5, 1.0), (1.9, 1.0)]):
        writer.add_scalar(E, h, step)
        engine.observe_train(step, {E: h, K: kl})
    writer.close()
    # by hand: warning floor at 1 (1.5 < 2); critical floor and kl at 2; both floors resolve at 3
    # (2.5 >= 2); warning again at 4 (1.9 < 2)
    assert [(a.step, a.rule, a.severity) for a in engine.alerts] == [
        (1, "entropy_floor", "warning"), (2, "entropy_floor", "critical"), (2, "kl_ceiling", "critical"),
        (4, "entropy_floor", "warning"),
    ]  # fmt: skip
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("headwatch/alerts/entropy_floor_warning")] == [(1, 1.0), (4, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("headwatch/alerts/kl_ceiling")] == [(2, 1.0)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("headwatch/alerts/text_summary")]
    assert [s for s, _ in texts] == [1, 2, 2, 4] and texts[0][1].startswith("[warning] headwatch sharpness collapse")

    jsonl = find_alerts_file(run_dir, tmp_path / "runs")  # one level above the run directory
    assert jsonl == (tmp_path / "runs" / "a" / "headwatch_alerts.jsonl").resolve()
    records = collect_alerts(read_run(run_dir), read_alerts_jsonl(jsonl))
    assert [(r.step, r.rule, r.source) for r in records] == [
        (1, "entropy_floor_warning", "jsonl+tensorboard"), (2, "entropy_floor", "jsonl+tensorboard"),
        (2, "kl_ceiling", "jsonl+tensorboard"), (4, "entropy_floor_warning", "jsonl+tensorboard"),
    ]  # fmt: skip
    assert [r.message for r in records] == [a.message for a in engine.alerts]
