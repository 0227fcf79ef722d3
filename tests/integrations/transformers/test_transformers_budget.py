"""The overhead budget on the Hugging Face door: ``logging_steps`` is kept, the cost published on every logging
step, and a logging interval whose statistics alone exceed the budget said once, with the interval that fits."""

from __future__ import annotations

import warnings

import pytest
from transformers import Trainer

from headwatch import HeadwatchError
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

KEYS = {f"headwatch/overhead/{k}" for k in ("fraction", "fraction_run", "probe_fraction_run", "probe_interval", "probe_seconds")}


def _train(tmp_path, **kw):
    cb = HeadwatchCallback(figure_every_n_steps=None, summary=False, **kw)
    args = hf_args(tmp_path, max_steps=5, logging_first_step=False)
    trainer = Trainer(model=tiny_llama(tie=False), args=args, train_dataset=Rows(one_batch(), 5), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, cb, [str(w.message) for w in caught]


def test_logging_steps_kept_cost_published_and_said_once_with_the_fix(tmp_path):
    trainer, _, said = _train(tmp_path, overhead_budget=1e-7)  # no logging interval fits: said, with one
    logged = [r for r in trainer.state.log_history if "headwatch/logits/entropy" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]  # logging_steps=1, kept
    assert all(KEYS <= set(r) for r in logged)
    assert {r["headwatch/overhead/probe_interval"] for r in logged[1:]} == {1024.0}  # the longest
    notes = [m for m in said if "logging statistics alone" in m]
    assert len(notes) == 1, said
    assert "raise logging_steps to" in notes[0] and "overhead_budget=None" in notes[0]
    fits = int(notes[0].split("raise logging_steps to ")[1].split()[0])
    assert fits > 1 and fits & (fits - 1) == 0  # a power of two times logging_steps=1
    collision = [r["step"] for r in trainer.state.log_history if "headwatch/collision/rare_rate_head" in r]
    assert collision[0] == 1  # the first logging step probes, whatever the budget


def test_no_budget_no_cost_keys_no_note(tmp_path):
    trainer, _, said = _train(tmp_path, overhead_budget=None)
    assert not [r for r in trainer.state.log_history if KEYS & set(r)]
    assert not [m for m in said if "logging statistics alone" in m]


def test_bad_budget_raises():
    with pytest.raises(HeadwatchError, match="overhead_budget"):
        HeadwatchCallback(overhead_budget=2)


def test_end_of_training_publishes_no_window_without_a_training_step(tmp_path):
    # `overhead/fraction` is the share of the window a logging step closes. The run ends on a logging step, so the
    # end of training's probe closes a "window" with no training step in it: published (at the logging step's
    # step) its fraction is about 1, a point near 100% on the cost chart of every such run. The end of training
    # may add to `fraction_run` (docs/definitions.md), not publish a `fraction` of its own.
    cb = HeadwatchCallback(figure_every_n_steps=None, summary=False)
    args = hf_args(tmp_path, max_steps=4, logging_steps=2, logging_first_step=False)
    trainer = Trainer(model=tiny_llama(tie=False), args=args, train_dataset=Rows(one_batch(), 4), callbacks=[cb])
    trainer.train()
    history = trainer.state.log_history
    logging = [r["step"] for r in history if "headwatch/logits/entropy" in r]
    fraction = [(r["step"], r["headwatch/overhead/fraction"]) for r in history if "headwatch/overhead/fraction" in r]
    assert logging == [2, 4]
    assert [step for step, _ in fraction] == logging, fraction
