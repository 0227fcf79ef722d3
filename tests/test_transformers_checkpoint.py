"""The Hugging Face front door's checkpoints: the monitors' state saved in ``checkpoint-<step>/`` and
restored on ``resume_from_checkpoint``; a resumed run ends with the counts of an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from headwatch.integrations.transformers import HeadwatchCallback
from tests.test_transformers import Rows, hf_args, one_batch, tiny_llama


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


def test_resume_without_state_warns(tmp_path):
    train(tmp_path, 2)
    (tmp_path / "checkpoint-2" / "headwatch_state.pt").unlink()
    with pytest.warns(UserWarning, match=r"resumes from .*checkpoint-2', which holds no headwatch_state.pt; the monitors' counts start afresh"):
        cb, _ = train(tmp_path, 4, str(tmp_path / "checkpoint-2"))
    assert counts(cb)[0].sum() == 2 * 4 * 10  # steps 3 and 4 only
