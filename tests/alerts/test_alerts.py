"""SharpnessCollapseAlert: exact firing steps on synthetic sequences, actions, a real collapse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from headwatch import Alert, HeadwatchError, LogitStatsMonitor, SharpnessCollapseAlert
from headwatch.alerts import CollapseRules, redact_url
from headwatch.alerts.events import FIRED
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer
from tests.helpers.paths import WORKERS


E, K = "headwatch/logits/entropy", "headwatch/logits/kl_to_uniform"
VAL_E = "headwatch/val/logits/entropy"


def fire_steps(rules: CollapseRules, entropies=None, kls=None) -> list[tuple[int, str]]:
    n = len(entropies or kls)
    out = []
    for step in range(n):
        metrics = {E: entropies[step] if entropies else None, K: kls[step] if kls else None}
        out += [(step, e.rule) for e in rules.observe_train(step, metrics) if e.kind == FIRED]
    return out


def test_floor_with_warmup_hysteresis_and_rearming():
    rules = CollapseRules(entropy_floor=2.0, entropy_drop=None, margin=0.05, warmup_steps=2)
    #          warm-up   ok   fire  open  <2.1 open  rearm fire
    values = [1.0, 1.5, 3.0, 1.9, 1.8, 2.05, 1.7, 2.2, 1.9]
    assert fire_steps(rules, values) == [(3, "entropy_floor"), (8, "entropy_floor")]
    assert rules.episode("entropy_floor").fired == 2 and rules.episode("entropy_floor").open


def test_kl_ceiling():
    rules = CollapseRules(kl_ceiling=5.0, entropy_drop=None, margin=0.1)
    kls = [1.0, 5.5, 6.0, 4.6, 5.2, 4.4, 5.01]  # re-arms at <= 4.5
    assert fire_steps(rules, kls=kls) == [(1, "kl_ceiling"), (6, "kl_ceiling")]


def test_relative_drop_is_smoothed_over_a_window():
    # no smoothing: the drop over 2 values reaches 50% at step 3
    rules = CollapseRules(entropy_drop=0.5, window=2, alpha=1.0, margin=0.1)
    assert fire_steps(rules, [4.0, 4.0, 4.0, 1.9, 1.9, 1.9, 1.9, 0.9]) == [(3, "entropy_drop"), (7, "entropy_drop")]
    # one noisy point does not fire with smoothing: S = 4, 4, 4, 3.1, 3.37, 3.56
    smoothed = CollapseRules(entropy_drop=0.5, window=2, alpha=0.3)
    assert fire_steps(smoothed, [4.0, 4.0, 4.0, 1.0, 4.0, 4.0]) == []
    assert smoothed.smoothed == pytest.approx(0.3 * 4 + 0.7 * (0.3 * 4 + 0.7 * (0.3 * 1 + 0.7 * 4)))
    # a sustained collapse does fire, a few values later
    # S = 4, 4, 4, 2.95, 2.215, 1.70: (S_1 - S_5) / S_1 = 0.575 over a window of 4
    assert fire_steps(CollapseRules(entropy_drop=0.5, window=4, alpha=0.3), [4.0] * 3 + [0.5] * 6) == [(5, "entropy_drop")]


def test_entropy_falling_while_validation_stalls():
    rules = CollapseRules(entropy_drop=None, patience=2, delta=0.05, min_entropy_drop=0.02)
    losses = [3.0, 2.5, 2.49, 2.495, 2.1, 2.09, 2.095]
    entropies = [5.0, 4.9, 4.5, 4.0, 4.0, 3.5, 3.0]
    fired = [
        v for v, (loss, ent) in enumerate(zip(losses, entropies))
        if any(e.kind == FIRED for e in rules.observe_val(v, {"val_loss": loss, VAL_E: ent}))
    ]
    # v=3: window (2.5, 2.49, 2.495) improved 0.01 < 0.05 while entropy fell 18%; v=4 improved: re-armed;
    # v=6: window (2.1, 2.09, 2.095) stalls again with entropy falling 25%
    assert fired == [3, 6]
    # entropy not falling: no alert however flat the loss
    flat = CollapseRules(entropy_drop=None, patience=2, delta=0.05)
    assert [v for v in range(5) if flat.observe_val(v, {"val_loss": 2.0, VAL_E: 4.0})] == []


def test_nan_values_are_skipped_and_state_round_trips():
    rules = CollapseRules(entropy_floor=1.0, entropy_drop=0.5, window=2)
    assert fire_steps(rules, [3.0, float("nan"), 0.5]) == [(2, "entropy_floor")]
    copy = CollapseRules(entropy_floor=1.0, entropy_drop=0.5, window=2)
    copy.load_state_dict(json.loads(json.dumps(rules.state_dict())))
    assert copy.state_dict() == rules.state_dict()
    assert copy.observe_train(3, {E: 0.4}) == []  # the open episode survives


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(entropy_drop=None), "every rule is off"),
        (dict(entropy_drop=1.5), "entropy_drop"),
        (dict(entropy_floor=float("nan")), "entropy_floor"),
        (dict(window=0), "window"),
        (dict(smoothing=0.0), "smoothing"),
        (dict(webhook_timeout=5), "webhook_timeout"),
        (dict(webhook_retries=10), "webhook_retries"),
        (dict(webhook_url="ftp://x/y"), "http"),
        (dict(actions=[3]), "actions"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        SharpnessCollapseAlert(**kwargs)


def test_redact_url_hides_path_query_and_token():
    assert redact_url("https://hooks.example.com:8443/services/T0/B0/SECRET?token=abc") == "https://hooks.example.com:8443/..."
    assert redact_url("https://host:SECRET/x") == "<an unparsable URL>"  # never raises, never echoes


@pytest.mark.parametrize("url", ["https://host:SECRET/hook", "https:/SECRET", "http://[x/SECRET"])
def test_bad_webhook_urls_are_refused_without_echoing_them(url):
    with pytest.raises(HeadwatchError) as info:
        SharpnessCollapseAlert(webhook_url=url)
    assert "SECRET" not in str(info.value)


def test_alert_json_is_strict_json():
    import math as _math

    alert = Alert("t", 1, 0, "entropy_floor", {"a": None, "b": 1.5}, "m")
    assert json.loads(alert.to_json())["metrics"] == {"a": None, "b": 1.5}
    with pytest.raises(ValueError):
        Alert("t", 1, 0, "r", {"a": _math.nan}, "m").to_json()  # NaN is mapped to None before it gets here


def _collapse_run(tmp_path, alert: SharpnessCollapseAlert, max_steps: int = 12, **kw):
    """A learning rate far too high: the logits blow up and the entropy collapses within a few steps."""
    torch.manual_seed(0)
    model = TinyCausalLM(lr=200.0)
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), alert], max_steps=max_steps, log_every_n_steps=1, **kw)
    trainer.fit(model, loader(n=96, batch_size=8, pad=False))
    return trainer


def test_induced_collapse_fires_and_writes_jsonl(tmp_path):
    seen: list[Alert] = []
    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, actions=[seen.append])
    with pytest.warns(UserWarning, match="sharpness collapse alert \\(entropy_floor\\)"):
        trainer = _collapse_run(tmp_path, alert)
    assert len(alert.alerts) == 1 and seen == alert.alerts
    lines = alert.jsonl_path.read_text().splitlines()
    assert alert.jsonl_path.parent == Path(trainer.logger.log_dir)
    record = json.loads(lines[0])
    assert set(record) == {"time", "step", "epoch", "rule", "metrics", "message", "severity"}
    assert record["severity"] == "critical"  # a plain threshold is critical
    assert record["rule"] == "entropy_floor" and record["metrics"]["headwatch/logits/entropy"] < 1.0
    assert trainer.callback_metrics["headwatch/alerts/entropy_floor"].item() == 1.0
    assert trainer.global_step == 12  # no stop asked


def test_stop_and_checkpoint_at_the_alert(tmp_path):
    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, stop_training=True, save_checkpoint=True)
    trainer = _collapse_run(tmp_path, alert, max_steps=50, enable_checkpointing=True)
    step = alert.alerts[0].step
    assert trainer.global_step == step + 1 < 50
    ckpt = Path(trainer.logger.log_dir) / f"headwatch_alert_step{step}.ckpt"
    assert ckpt.exists() and torch.load(ckpt, weights_only=False)["global_step"] == step + 1


def test_failing_action_does_not_stop_training_unless_strict(tmp_path):
    def broken(alert):
        raise RuntimeError("pager is down")

    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, actions=[broken])
    with pytest.warns(UserWarning, match="pager is down"):
        trainer = _collapse_run(tmp_path, alert)
    assert trainer.global_step == 12 and alert.action_failures == 1
    strict = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, actions=[broken], strict=True)
    with pytest.raises(HeadwatchError, match="pager is down"):
        _collapse_run(tmp_path / "strict", strict)


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"path": self.path, "json": json.loads(body), "type": self.headers["Content-Type"]})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhook_is_received(tmp_path):
    _Receiver.received = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/hook/SECRET?token=xyz"
        alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None, webhook_url=url)
        _collapse_run(tmp_path, alert)
    finally:
        server.shutdown()
    assert len(_Receiver.received) == 1
    got = _Receiver.received[0]
    assert got["path"] == "/hook/SECRET?token=xyz" and got["type"] == "application/json"
    assert got["json"]["rule"] == "entropy_floor" and got["json"]["step"] == alert.alerts[0].step
    assert alert.action_failures == 0


def test_webhook_from_environment_variable(monkeypatch):
    monkeypatch.setenv("HEADWATCH_WEBHOOK_URL", "https://example.invalid/hook")
    assert SharpnessCollapseAlert()._webhook_url == "https://example.invalid/hook"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["down", "hanging"])
def test_webhook_down_or_hanging_does_not_stop_training(tmp_path, mode, recwarn):
    listener = None
    if mode == "hanging":  # accepts connections, never answers
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
    else:
        port = _free_port()
    url = f"http://127.0.0.1:{port}/hook?token=SECRET"
    alert = SharpnessCollapseAlert(
        entropy_floor=1.0, entropy_drop=None, webhook_url=url, webhook_timeout=0.5, webhook_retries=1
    )
    try:
        trainer = _collapse_run(tmp_path, alert)
    finally:
        if listener is not None:
            listener.close()
    assert trainer.global_step == 12
    assert alert.action_failures == 1
    messages = [str(w.message) for w in recwarn.list]
    failure = [m for m in messages if "webhook POST" in m]
    assert failure and f"http://127.0.0.1:{port}/..." in failure[0]
    assert not any("SECRET" in m for m in messages)  # the URL's token is never printed


def test_state_survives_a_checkpoint_and_does_not_refire(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None)
    trainer = make_trainer(
        tmp_path, [LogitStatsMonitor(validation=False), alert, ckpt], max_steps=12, log_every_n_steps=1, enable_checkpointing=True
    )
    torch.manual_seed(0)
    trainer.fit(TinyCausalLM(lr=200.0), loader(n=96, batch_size=8, pad=False))
    assert len(alert.alerts) == 1 and alert.rules.episode("entropy_floor").open
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"][alert.state_key]
    assert saved["rules"]["states"]["entropy_floor/critical"]["open"] is True
    resumed = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None)
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), resumed], max_steps=16, log_every_n_steps=1)
    torch.manual_seed(0)
    trainer.fit(TinyCausalLM(lr=200.0), loader(n=96, batch_size=8, pad=False), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert len(resumed.alerts) == 1  # the history came back; the open episode did not fire again
    assert resumed.alerts[0].step == alert.alerts[0].step


@pytest.fixture(scope="module")
def ddp_alerts(tmp_path_factory) -> dict[str, list[dict]]:
    """tests/workers/ddp_alert.py's two modes, launched together (each mostly waits on its own start and gloo):
    each rank's result, by mode."""
    script = WORKERS / "ddp_alert.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    outs = {mode: tmp_path_factory.mktemp(f"ddp_alert_{mode}") for mode in ("rank0_metric", "rank1")}
    procs = {}
    for mode, out in outs.items():
        with open(out / "output.txt", "w") as sink:
            procs[mode] = subprocess.Popen([sys.executable, str(script), str(out), mode], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        for proc in procs.values():
            proc.wait(timeout=300)
    finally:
        for proc in procs.values():
            proc.kill()
    result = {}
    for mode, out in outs.items():
        assert procs[mode].returncode == 0, (out / "output.txt").read_text()[-6000:]
        result[mode] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return result


def test_ddp_metric_logged_on_rank_zero_only_neither_hangs_nor_splits(ddp_alerts):
    ranks = ddp_alerts["rank0_metric"]
    assert ranks[0]["fired_locally"] == [2]  # the first collision measurement, after step 2
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 3
    assert ranks[0]["alerts"] == ranks[1]["alerts"] == 1


def test_ddp_stop_decision_is_the_same_on_both_processes(ddp_alerts):
    ranks = ddp_alerts["rank1"]
    # only rank 1's rule fires, yet both processes stop at the same step
    assert ranks[0]["fired_locally"] == [] and ranks[1]["fired_locally"] != []
    assert ranks[0]["global_step"] == ranks[1]["global_step"] < 20
    assert ranks[0]["alerts"] == ranks[1]["alerts"] == 1


class _OneHotFrom(TinyCausalLM):
    """From step 3 the head's outputs are exactly one-hot: entropy is exactly 0.0 at every step."""

    def __init__(self):
        super().__init__()
        self.lm_head.register_forward_hook(self._collapse)  # runs before headwatch's hook

    def _collapse(self, module, args, logits):
        if self._trainer is None or self.global_step < 3:
            return logits
        onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float() * 1e4
        return logits + (onehot - logits).detach()


def test_exactly_repeated_values_are_still_evaluated(tmp_path):
    alert = SharpnessCollapseAlert(entropy_drop=0.5, window=2, smoothing=1.0)
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), alert], max_steps=8, log_every_n_steps=1)
    with pytest.warns(UserWarning, match="entropy_drop"):
        trainer.fit(_OneHotFrom(), loader(n=96, batch_size=8, pad=False))
    assert [a.step for a in alert.alerts] == [3]  # S_1 -> S_3 = 0: a 100% drop over 2 values


def test_alert_listed_before_its_monitor_evaluates_every_value_once(tmp_path):
    seen: list[int] = []

    class Counting(CollapseRules):
        def observe_train(self, step, metrics):
            seen.append(step)
            return super().observe_train(step, metrics)

    alert = SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=None)
    alert.rules = Counting(entropy_floor=1.0, entropy_drop=None)
    trainer = make_trainer(tmp_path, [alert, LogitStatsMonitor(validation=False)], max_steps=6, log_every_n_steps=2)
    trainer.fit(TinyCausalLM(), loader(n=96, batch_size=8, pad=False))
    assert seen == [1, 3, 5]  # the alert is a sink of the run: each value read at the step it was published
