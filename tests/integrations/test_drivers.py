"""One driver per door: Lightning's ``HeadwatchDriver`` in ``trainer.callbacks``, every door's sinks, its end of
training (the end-of-training summary against the values the trainer holds), ``alert=`` on every door and the
webhook of ``HEADWATCH_WEBHOOK_URL`` through each, and no module-global state in the doors."""

from __future__ import annotations

import ast
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

import headwatch
from headwatch import GradientDensityMonitor, HeadwatchError, LogitStatsMonitor, TokenFrequency
from headwatch.alerts import CollapseRules
from headwatch.integrations.lightning import HeadwatchDriver
from tests.helpers import TinyCausalLM, loader, watched_step
from tests.helpers.lightning_runs import make_trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "headwatch"


def drivers(trainer) -> list[HeadwatchDriver]:
    return [cb for cb in trainer.callbacks if isinstance(cb, HeadwatchDriver)]


def test_lightning_has_one_driver_just_before_the_first_headwatch_callback(tmp_path, capsys):
    from lightning.pytorch.callbacks import LearningRateMonitor

    first, second = LogitStatsMonitor(validation=False, figure_every_n_steps=0), GradientDensityMonitor(figure_every_n_steps=0)
    lr = LearningRateMonitor()
    trainer = make_trainer(tmp_path, [lr, first, second], max_steps=4, log_every_n_steps=2)
    trainer.fit(TinyCausalLM(), loader(n=64, batch_size=8, pad=False))
    (driver,) = drivers(trainer)
    callbacks = list(trainer.callbacks)
    assert callbacks.index(driver) == callbacks.index(first) - 1 and callbacks.index(lr) < callbacks.index(driver)
    cores = driver.run.monitors
    assert first in cores and second in cores and any(isinstance(m, TokenFrequency) for m in cores)  # added, shared
    assert driver.run.every == 2 and driver.published["headwatch/logits/entropy"] == 3
    # the end of training: the summary, its figures the last values the trainer holds
    out = capsys.readouterr().out
    assert "headwatch: training ended at step 3" in out and driver.summary.text in out
    held = trainer.callback_metrics
    assert driver.summary.figures["entropy_last"] == pytest.approx(float(held["headwatch/logits/entropy"]), rel=1e-6)
    assert driver.summary.figures["head_row_density"] == pytest.approx(float(held["headwatch/grad/head_row_density"]))


def test_lightning_driver_passed_explicitly_is_used_and_two_trainers_have_their_own(tmp_path, capsys):
    mine = HeadwatchDriver(summary=False)
    monitor = LogitStatsMonitor(validation=False, figure_every_n_steps=0)
    trainer = make_trainer(tmp_path / "a", [monitor, mine], max_steps=2, log_every_n_steps=1)
    trainer.fit(TinyCausalLM(), loader(n=32, batch_size=8, pad=False))
    assert drivers(trainer) == [mine] and monitor in mine.run.monitors
    assert "training ended" not in capsys.readouterr().out  # summary=False
    other = make_trainer(tmp_path / "b", [monitor], max_steps=2, log_every_n_steps=1)
    other.fit(TinyCausalLM(), loader(n=32, batch_size=8, pad=False))
    (theirs,) = drivers(other)
    assert theirs is not mine and theirs.run is not mine.run and monitor in theirs.run.monitors
    with pytest.raises(HeadwatchError, match="summary"):
        HeadwatchDriver(summary="yes")


def test_doors_hold_no_module_level_registry():
    """No door keeps state in a module: a registry is an empty mutable container (or a weak one) bound at module level."""
    found = []
    for path in sorted((SRC / "integrations").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(value, "keys", getattr(value, "elts", None))
            call = isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) in (
                "dict", "list", "set", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict")
            if empty or call:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, found


def tiny_loop(tmp_path: Path, alert, steps: int = 4, **kw):
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=64, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = SummaryWriter(str(tmp_path / "run"))
    seen = []
    with headwatch.Headwatch(model, writer=writer, log_every_n_steps=1, figure_every_n_steps=0, alert=alert, **kw) as hw:
        for step in range(steps):
            ids = torch.randint(0, 64, (4, 8))
            values = watched_step(hw, model, optimizer, ids, step)
            seen.append((step, values.get("headwatch/logits/entropy"), hw.should_stop))
            if hw.should_stop:
                break
    writer.close()
    hw.model = model
    return hw, seen


def test_plain_loop_alert_and_its_end_of_training(tmp_path, capsys):
    # the entropy of a fresh model is about log 64 = 4.16 nats: below a floor of 100 from the first logging step
    hw, seen = tiny_loop(tmp_path, CollapseRules(entropy_floor=100.0, entropy_drop=None))
    assert [s for s, _, stop in seen] == [0] and seen[0][2]  # critical: should_stop at once, the loop stopped
    (alert,) = hw.alert.alerts
    assert alert.rule == "entropy_floor" and alert.step == 0
    assert alert.metrics["headwatch/logits/entropy"] == pytest.approx(seen[0][1])
    records = [json.loads(line) for line in (tmp_path / "run" / "headwatch_alerts.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["step"]) for r in records] == [("entropy_floor", 0)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("headwatch/alerts/entropy_floor")] == [(0, 1.0)]
    out = capsys.readouterr().out
    assert "headwatch: training ended at step 0" in out and "1 fired: entropy_floor (critical) at 0" in out
    assert hw.run.ended and not any(m._forward_hooks or m._forward_pre_hooks for m in hw.model.modules())  # closed


def test_plain_loop_refuses_a_bad_alert():
    with pytest.raises(HeadwatchError, match="alert"):
        headwatch.Headwatch(TinyCausalLM(), alert="entropy_floor=1")


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver(monkeypatch):
    _Receiver.received = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HEADWATCH_WEBHOOK_URL", f"http://127.0.0.1:{server.server_port}/hook")
    yield _Receiver.received
    server.shutdown()


def test_plain_loop_posts_to_the_webhook_of_the_environment(tmp_path, receiver):
    hw, _ = tiny_loop(tmp_path, CollapseRules(entropy_floor=100.0, entropy_drop=None))
    assert [(r["rule"], r["step"]) for r in receiver] == [("entropy_floor", 0)]  # delivered by the end of the run
    assert hw.alert.action_failures == 0


def test_hugging_face_door_posts_to_the_webhook_of_the_environment(tmp_path, receiver):
    from transformers import Trainer

    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

    cb = HeadwatchCallback(alert=CollapseRules(entropy_floor=100.0, entropy_drop=None), figure_every_n_steps=0)
    trainer = Trainer(model=tiny_llama(False), args=hf_args(tmp_path, max_steps=2), train_dataset=Rows(one_batch(), 2), callbacks=[cb])
    trainer.train()
    assert [(r["rule"], r["step"]) for r in receiver] == [(a.rule, a.step) for a in cb.alert.alerts] == [("entropy_floor", 1)]
    assert cb.summary.text is not None and "1 fired" in cb.summary.text
    assert math.isclose(cb.summary.figures["entropy_last"], cb.latest["headwatch/logits/entropy"])


def test_lightning_values_are_in_callback_metrics_the_training_ones_not_in_logged_metrics(tmp_path):
    """What the Lightning guide says ("The values in your code")."""
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(figure_every_n_steps=0)], max_steps=4, log_every_n_steps=2,
                           val_check_interval=4)  # fmt: skip
    trainer.fit(TinyCausalLM(), loader(n=64, batch_size=8, pad=False), loader(n=16, batch_size=8, pad=False))
    (driver,) = drivers(trainer)
    held, logged = trainer.callback_metrics, trainer.logged_metrics
    assert float(held["headwatch/logits/entropy"]) == pytest.approx(driver.run.latest["headwatch/logits/entropy"], rel=1e-6)
    assert "headwatch/logits/entropy" not in logged  # written to the loggers by headwatch itself
    assert "headwatch/val/logits/entropy" in held and "headwatch/val/logits/entropy" in logged  # through self.log
