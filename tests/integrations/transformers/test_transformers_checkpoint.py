"""The Hugging Face front door's checkpoints: the monitors' state saved in ``checkpoint-<step>/`` and
restored on ``resume_from_checkpoint``; a resumed run ends with the counts of an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, alert_run, hf_args, one_batch, tiny_llama
from tests.helpers.paths import ROOT


def train(out, max_steps: int, resume: str | bool | None = None) -> tuple[HeadwatchCallback, Trainer]:
    cb = HeadwatchCallback(monitors=["tokens", "logits"])
    args = hf_args(out, max_steps=max_steps, logging_steps=1, save_strategy="steps", save_steps=2, learning_rate=1e-3)
    batch = one_batch()
    batch["input_ids"][:, 1] = torch.arange(40, 44)  # rows differ: counts depend on which rows were seen
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(batch, 3), callbacks=[cb])
    trainer.train(resume_from_checkpoint=resume)
    return cb, trainer


def counts(cb: HeadwatchCallback) -> tuple[torch.Tensor, float, int]:
    tokens, logits = cb.monitors[0].state_dict(), [m for m in cb.monitors if m.name == "logits"][0]
    return tokens["counts"], logits.totals["positions"], logits.logged_steps


@pytest.mark.parametrize("resume", ["path", True])
def test_resumed_counts_equal_uninterrupted(tmp_path, resume):
    whole, _ = train(tmp_path / "whole", 4)
    first, _ = train(tmp_path / "cut", 2)
    saved = torch.load(tmp_path / "cut" / "checkpoint-2" / "headwatch_state.pt", weights_only=True)
    assert saved["monitors"][0]["counts"].sum() == 2 * 4 * 10  # 2 steps of 4 rows of 10 tokens
    resumed, trainer = train(tmp_path / "cut", 4, str(tmp_path / "cut" / "checkpoint-2") if resume == "path" else True)
    assert trainer.state.global_step == 4
    c_whole, c_resumed = counts(whole), counts(resumed)
    assert torch.equal(c_resumed[0], c_whole[0]) and c_whole[0].sum() == 4 * 4 * 10
    assert c_resumed[1:] == c_whole[1:] == (4 * 4 * 9, 4)  # positions (shifted labels), logging steps
    assert resumed.latest["headwatch/tokens/total"] == whole.latest["headwatch/tokens/total"] == 160
    assert (tmp_path / "cut" / "checkpoint-4" / "headwatch_state.pt").is_file()
    # the end-of-training summary covers the whole run: its first entropy is the uninterrupted run's first
    assert resumed.summary.first["headwatch/logits/entropy"] == whole.summary.first["headwatch/logits/entropy"]
    assert "since step 1" in resumed.summary.text


def test_resume_without_state_warns(tmp_path):
    train(tmp_path, 2)
    (tmp_path / "checkpoint-2" / "headwatch_state.pt").unlink()
    with pytest.warns(UserWarning, match=r"resumes from .*checkpoint-2', which holds no headwatch_state.pt; the monitors' counts start afresh"):
        cb, _ = train(tmp_path, 4, str(tmp_path / "checkpoint-2"))
    assert counts(cb)[0].sum() == 2 * 4 * 10  # steps 3 and 4 only


# --------------------------------------------------------------------------- a real interruption

KILLED_RUN = """
import os, signal, sys
import torch
from transformers import Trainer, TrainerCallback
sys.path.insert(0, {root!r})
from tests.helpers.hf import alert_run

class Interrupt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == {kill_at}:  # in the middle of training, after checkpoint-{saved}
            os.kill(os.getpid(), signal.SIGTERM)

alert_run({out!r}, 8, extra=[Interrupt()])
print("not interrupted")
"""


def untimed(state: dict) -> dict:
    """An alert state without the alerts' wall-clock times."""
    return {**state, "alerts": [{k: v for k, v in a.items() if k != "time"} for a in state["alerts"]]}


def test_a_run_killed_by_sigterm_resumes_the_exact_state_of_its_checkpoint(tmp_path):
    """The monitors' counts and the alert's state (smoothing, episodes, alerts) after a resume from the checkpoint
    of step 4 of a run killed by SIGTERM at step 5 equal an uninterrupted run's, at the checkpoint and at the end."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    whole, _ = alert_run(tmp_path / "whole", 8)
    root = str(ROOT)
    code = KILLED_RUN.format(root=root, out=str(tmp_path / "cut"), kill_at=5, saved=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "not interrupted" not in done.stdout
    checkpoint = tmp_path / "cut" / "checkpoint-4"
    assert not (tmp_path / "cut" / "checkpoint-6").exists()
    at_4 = torch.load(checkpoint / "headwatch_state.pt", weights_only=True)
    whole_at_4 = torch.load(tmp_path / "whole" / "checkpoint-4" / "headwatch_state.pt", weights_only=True)
    assert untimed(at_4["alert"]) == untimed(whole_at_4["alert"]) and at_4["alert"]["alerts"], "the alert state of the checkpoint's step"
    assert torch.equal(at_4["monitors"][0]["counts"], whole_at_4["monitors"][0]["counts"])
    resumed, trainer = alert_run(tmp_path / "cut", 8, str(checkpoint))
    assert trainer.state.global_step == 8
    assert untimed(resumed.alert.state_dict()) == untimed(whole.alert.state_dict())
    assert [(a.step, a.rule) for a in resumed.alert.alerts] == [(a.step, a.rule) for a in whole.alert.alerts]
    assert torch.equal(counts(resumed)[0], counts(whole)[0]) and counts(resumed)[1:] == counts(whole)[1:]
