"""The Hugging Face front door's console: headline values printed, every value reported (TensorBoard,
``log_history``)."""

from __future__ import annotations

import ast

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer

from headwatch import HeadwatchError
from headwatch.integrations.transformers import HeadwatchCallback
from headwatch.names import CONSOLE_KEYS, declaration
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama


def printed_records(text: str) -> list[dict]:
    """The dicts the Trainer's printers wrote, one a line."""
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{")]


def run(tmp_path, capsys, disable_tqdm: bool, **kw) -> tuple[list[dict], Trainer, HeadwatchCallback]:
    cb = HeadwatchCallback(monitors=["tokens", "logits"], **kw)
    args = hf_args(tmp_path, max_steps=2, logging_steps=1, report_to="tensorboard", disable_tqdm=disable_tqdm)
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), 2), callbacks=[cb])
    capsys.readouterr()
    trainer.train()
    return printed_records(capsys.readouterr().out), trainer, cb


@pytest.mark.parametrize("disable_tqdm", [True, False])  # PrinterCallback, ProgressCallback
def test_console_shows_headline_keys_reporting_gets_all(tmp_path, capsys, disable_tqdm):
    printed, trainer, cb = run(tmp_path, capsys, disable_tqdm)
    ours = [r for r in printed if any(k.startswith("headwatch/") for k in r)]
    shown = {"headwatch/" + k for k in CONSOLE_KEYS} & set(cb.latest)
    assert shown == {"headwatch/logits/entropy", "headwatch/logits/target_nll", "headwatch/logits/rare/target_nll",
                     "headwatch/tokens/seen_fraction"}  # fmt: skip  (the monitors run here)
    assert len(ours) == 2 and all(set(r) == shown | {"epoch"} for r in ours)
    assert any("loss" in r for r in printed)  # the Trainer's own records are untouched
    logged = [r for r in trainer.state.log_history if "headwatch/logits/entropy" in r]
    assert len(logged) == 2 and all(set(cb.latest) <= set(r) for r in logged) and len(cb.latest) > 4 * len(shown)
    (logdir,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    tags = set(EventAccumulator(str(logdir)).Reload().Tags()["scalars"])
    assert {"train/" + k for k in cb.latest} <= tags  # e.g. train/headwatch/logits/kl_to_uniform
    assert not any(type(c).__name__ == "_ConsoleView" for c in trainer.callback_handler.callbacks)  # restored


def test_console_keys_all_and_chosen(tmp_path, capsys):
    printed, _, cb = run(tmp_path / "all", capsys, True, console_keys="all")
    assert [set(r) - {"epoch"} for r in printed if "headwatch/logits/entropy" in r] == [set(cb.latest)] * 2
    printed, _, _ = run(tmp_path / "one", capsys, True, console_keys=["logits/max_prob"])
    assert [set(r) for r in printed if any(k.startswith("headwatch/") for k in r)] == [{"headwatch/logits/max_prob", "epoch"}] * 2
    printed, _, _ = run(tmp_path / "none", capsys, True, console_keys=())
    assert not any(k.startswith("headwatch/") for r in printed for k in r)


def test_console_keys_are_declared_and_checked():
    assert all(declaration("headwatch/" + k) is not None for k in CONSOLE_KEYS)
    with pytest.raises(HeadwatchError, match=r"`console_keys` must be None, 'all' or a sequence of metric names, got 'some'"):
        HeadwatchCallback(console_keys="some")
    with pytest.raises(HeadwatchError, match=r"`console_keys` must be .* got \[1\]"):
        HeadwatchCallback(console_keys=[1])
