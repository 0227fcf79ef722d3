"""examples/hf_trainer.py at tiny sizes: a Llama fine-tuned by the Hugging Face Trainer, every monitor attached."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import hf_trainer  # noqa: E402


def test_hf_trainer_example_smoke(tmp_path, tie=True):  # untied: tests/integrations/transformers/test_transformers.py
    s = hf_trainer.main(["--max-corpus-mb", "0.1", "--vocab-size", "300", "--block-size", "32", "--d-model", "32",
                         "--layers", "1", "--batch-size", "8", "--max-steps", "6", "--logging-steps", "2",
                         "--tie-weights" if tie else "--no-tie-weights", "--output-dir", str(tmp_path)])  # fmt: skip
    assert s["steps"] == 6 and s["logged_steps"] == [2, 4, 6]
    assert s["tie_weights"] is tie and s["grad/tied"] == float(tie)
    assert 0 < s["logits/entropy"] <= math.log(s["vocab_size"])
    assert s["logits/kl_to_uniform"] == pytest.approx(math.log(s["vocab_size"]) - s["logits/entropy"], abs=1e-4)
    assert 0 < s["grad/embedding_row_density"] < 1 and s["grad/head_row_density"] == 1.0
    assert ("grad/tied_flow_cosine_mean" in s) == tie
    assert s["collision/rare_count"] > 0 and 0 <= s["collision/rare_rate_head"] <= 1
    assert s["val/logits/positions"] > 0 and math.isfinite(s["final_eval_loss"])
    assert list(Path(tmp_path).rglob("events.out.tfevents.*"))
