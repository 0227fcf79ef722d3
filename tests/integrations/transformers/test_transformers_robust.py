"""The Hugging Face front door when one monitor fails at a logging step: the others still publish."""

from __future__ import annotations

import pytest
from transformers import Trainer

from headwatch.core import LogitStats
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama


def test_one_failing_monitor_does_not_lose_the_others_values(tmp_path):
    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"])
    logits = next(m for m in cb.monitors if isinstance(m, LogitStats))

    def boom():
        raise RuntimeError("boom in compute")

    logits.compute = boom
    trainer = Trainer(model=tiny_llama(tie=True), args=hf_args(tmp_path), train_dataset=Rows(one_batch()), callbacks=[cb])
    with pytest.warns(UserWarning, match="LogitStats failed while computing the statistics .*boom in compute"):
        trainer.train()
    # was: the first failure skipped every later monitor's compute: no value of the step was published
    rows = Rows(one_batch())
    assert cb.latest["headwatch/tokens/total"] == sum(len(rows[i]["input_ids"]) for i in range(len(rows)))
    assert "headwatch/grad/embedding_row_density" in cb.latest
    assert not any(k.startswith("headwatch/logits/") for k in cb.latest)
    logged = [r for r in trainer.state.log_history if "headwatch/tokens/total" in r]
    assert len(logged) == 1 and "headwatch/grad/embedding_row_density" in logged[0]
