"""The main job, examples/train_tiny_lm.py, at small settings: real text, real tokenizer, every monitor."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_tiny_lm  # noqa: E402

SMALL = ["--max-corpus-mb", "0.2", "--vocab-size", "512", "--log-every-n-steps", "2", "--no-progress-bar"]


@pytest.mark.parametrize("tie", [True, False])
def test_small_run_learns_and_reports(tmp_path, tie):
    flag = "--tie-weights" if tie else "--no-tie-weights"
    s = train_tiny_lm.main([*SMALL, flag, "--max-steps", "20", "--val-check-interval", "10", "--collision-every", "10",
                            "--logdir", str(tmp_path)])
    assert s["tie_weights"] is tie
    assert s["final_val_loss"] < s["initial_val_loss"] - 0.2  # it learns
    assert s["initial_val_loss"] == pytest.approx(math.log(s["vocab_size"]), abs=0.3)  # starts near uniform
    assert 0 < s["entropy"] <= math.log(s["vocab_size"])
    assert s["kl_to_uniform"] == pytest.approx(math.log(s["vocab_size"]) - s["entropy"], abs=1e-4)
    assert 0 < s["embedding_row_density"] < 1 and s["head_row_density"] == 1.0
    assert (s["tied_flow_cosine_mean"] is not None) == tie
    assert s["rare_count"] > 0 and 0 <= s["rare_rate_head"] <= 1
    assert s["params_saved_by_tying"] == s["vocab_size"] * s["d_model"]
    assert Path(s["tokenizer_path"]).exists()


def test_induced_collapse_fires_the_alert(tmp_path):
    s = train_tiny_lm.main([*SMALL, "--max-steps", "40", "--induce-collapse", "10", "--collapse-weight", "3",
                            "--alert-warmup-steps", "6", "--val-check-interval", "20", "--collision-every", "20",
                            "--logdir", str(tmp_path)])
    assert s["alerts"], "the collapse alert did not fire"
    assert s["alerts"][0]["step"] >= 10  # after the collapse began
    records = [json.loads(line) for line in Path(s["alerts_file"]).read_text().splitlines()]
    assert [r["step"] for r in records] == [a["step"] for a in s["alerts"]]
    assert records[0]["rule"] in ("entropy_drop", "entropy_floor")


def test_user_text_instead_of_the_standard_library(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the cat sat on the mat while the dog slept by the door and the bird sang in the tree".split()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(400)))
    s = train_tiny_lm.main(["--data", str(corpus), "--vocab-size", "300", "--max-steps", "6", "--block-size", "32",
                            "--val-check-interval", "6", "--log-every-n-steps", "2", "--no-progress-bar",
                            "--logdir", str(tmp_path / "runs")])
    assert s["corpus_files"] == 40 and s["final_val_loss"] < s["initial_val_loss"]


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        train_tiny_lm.main(["--vocab-size", "10"])
    assert "--vocab-size must be >= 257" in capsys.readouterr().err
