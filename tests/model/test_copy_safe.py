"""A model headwatch watches can be deep-copied and pickled (EMA/SWA copies, ``torch.save(model)``): the copies carry
inert hooks, compute what the original computes, and never feed the monitor; the original keeps measuring."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from transformers import Trainer, TrainerCallback

from headwatch import Headwatch
from headwatch.alerts import CollapseRules
from headwatch.integrations.transformers import HeadwatchCallback
from headwatch.model.generation import _WatchedGenerate
from headwatch.model.hooks import CopySafeHook, InertHook
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama


def _copies(model):
    """A deep copy, a ``torch.save``/``torch.load`` round trip, an ``AveragedModel`` (EMA) of ``model``."""
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ema = torch.optim.swa_utils.AveragedModel(model).module
    return [copy.deepcopy(model), loaded, ema]


def _hooks(model):
    return [fn for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for fn in d.values()]


def _plain_run(make_copies: bool):
    model = tiny_llama(tie=False)
    batch = one_batch()
    alert = CollapseRules(entropy_floor=0.5)
    hw = Headwatch(model, monitors=["logits", "gradients", "tokens"], log_every_n_steps=1, alert=alert, summary=False)
    outs, copies = [], []
    for step in range(2):
        hw.step_start(batch, step)
        if make_copies:  # the copies' training forwards run inside the watched step, before the original's
            copies = _copies(model)
            for twin in copies:
                out = twin(**batch)
                out.loss.backward()
                outs.append(out.logits.detach())
        out = model(**batch)
        out.loss.backward()
        hw.before_optimizer_step()
        hw.after_optimizer_step()
        values = hw.step_end()
    own = out.logits.detach()
    hw.close()
    return values, own, outs, copies


def test_plain_loop_copies_are_inert_and_leave_the_values_alone():
    alone, own, _, _ = _plain_run(make_copies=False)
    values, own_again, outs, copies = _plain_run(make_copies=True)
    assert "headwatch/grad/head_row_density" in alone and "headwatch/logits/entropy" in alone
    assert values.keys() == alone.keys()
    for key, want in alone.items():
        if "/overhead/" in key:  # headwatch's own timings, not a measurement of the model
            continue
        got = values[key]
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6, abs=1e-9), key
    torch.testing.assert_close(own_again, own)
    for logits in outs[-3:]:  # the copies made at the last step hold the original's weights of that step
        torch.testing.assert_close(logits, own)
    for twin in copies:
        hooks = _hooks(twin)
        assert hooks and all(isinstance(fn, InertHook) for fn in hooks)
        assert not getattr(twin.loss_function, "__headwatch_loss__", False)
        assert not isinstance(twin.generate, _WatchedGenerate) and twin.generate.__self__ is twin


def test_attached_model_hooks_are_copy_safe_and_measure():
    model = tiny_llama(tie=False)
    hw = Headwatch(model, log_every_n_steps=1, summary=False)
    hw.step_start(one_batch(), 0)
    hooks = _hooks(model)
    assert hooks and all(isinstance(fn, CopySafeHook) for fn in hooks)
    pickle.loads(pickle.dumps(model))
    hw.close()
    assert not _hooks(model)


def test_hf_door_with_an_alert_copies_in_a_callback(tmp_path):
    seen: list[torch.Tensor] = []

    class EmaCopy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            for twin in _copies(model):
                with torch.no_grad():
                    seen.append((twin(**batch).logits, model(**batch).logits))

    def run(extra):
        cb = HeadwatchCallback(monitors=["tokens", "logits"], alert=CollapseRules(entropy_floor=0.5), console_keys=())
        trainer = Trainer(model=tiny_llama(tie=True), args=hf_args(tmp_path / str(len(extra)), max_steps=2, learning_rate=1e-2),
                          train_dataset=Rows(batch), callbacks=[cb, *extra])  # fmt: skip
        trainer.train()
        return trainer.state.log_history

    batch = one_batch()
    alone = run([])
    copied = run([EmaCopy()])
    assert len(seen) == 6
    for twin, own in seen:
        torch.testing.assert_close(twin, own)
    keys = [{k: v for k, v in row.items() if k.startswith("headwatch/")} for row in alone]
    again = [{k: v for k, v in row.items() if k.startswith("headwatch/")} for row in copied]
    assert any("headwatch/logits/entropy" in row for row in keys)
    assert [row.keys() for row in again] == [row.keys() for row in keys]
    for a, b in zip(keys, again, strict=True):
        for key, want in a.items():
            if "/overhead/" in key:  # headwatch's own timings, not a measurement of the model
                continue
            assert (math.isnan(b[key]) and math.isnan(want)) or b[key] == pytest.approx(want, rel=1e-6, abs=1e-9), key
