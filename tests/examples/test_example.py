"""The main job, examples/train_tiny_lm.py, at small settings: real text, real tokenizer, every monitor."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import train_tiny_lm  # noqa: E402

SMALL = ["--max-corpus-mb", "0.2", "--vocab-size", "512", "--log-every-n-steps", "2", "--no-progress-bar"]


@pytest.mark.parametrize("tie", [True, False])
def test_small_run_learns_and_reports(tmp_path, tie, capsys):
    flag = "--tie-weights" if tie else "--no-tie-weights"
    s = train_tiny_lm.main([*SMALL, flag, "--max-steps", "20", "--val-check-interval", "10", "--collision-every", "10",
                            "--logdir", str(tmp_path), "--print-every-s", "0"])
    out = capsys.readouterr().out
    phases = [line.split("]")[0] + "]" for line in out.splitlines() if line.startswith("[")]
    firsts = [p for i, p in enumerate(phases) if p not in phases[:i]]
    assert firsts == ["[corpus]", "[tokenizer]", "[model]", "[validation]", "[training]", "[summary]"]
    assert "[tokenizer] training a byte-level BPE tokenizer (512 tokens)" in out
    # without the progress bar, a training line per print interval (here: every step), step and loss
    steps = [int(m) for m in re.findall(r"^\[training\] step (\d+)/20  loss \d+\.\d+ nats  \d+ s$", out, re.M)]
    assert steps == list(range(1, 21))
    assert re.findall(r"^\[validation\] step (\d+): val loss", out, re.M) == ["0", "10", "20"]
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
    assert s["seed"] == 0 and 1 <= s["val_files"] < s["corpus_files"]
    # the self-check compares headwatch's target NLL with the train_loss the module logs (compare_loss):
    # the same figure of the same logits, so the gap is float32 rounding and no check fails
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(s["log_dir"], size_guidance={"scalars": 0})
    events.Reload()
    gaps = [e.value for e in events.Scalars("headwatch/check/nll_gap")]
    nll = {e.step: e.value for e in events.Scalars("headwatch/logits/target_nll")}
    loss = {e.step: e.value for e in events.Scalars("train_loss")}
    assert len(gaps) == 10 and max(abs(g) for g in gaps) < 1e-4
    assert all(abs(nll[k] - loss[k]) < 1e-4 for k in nll)  # against the logged loss itself
    assert {e.value for e in events.Scalars("headwatch/check/mismatch")} == {0.0}


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
    assert s["val_files"] == 2  # 5% of 40 equal-sized files, held out whole


def test_validation_holds_out_a_seeded_random_sample_of_files():
    docs = [f"document {i} " * (10 + i) for i in range(60)]
    train, val = train_tiny_lm.split_documents(docs, 0.1, seed=0)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)  # a partition into whole files
    size = sum(len(d) for d in docs)
    held = sum(len(d) for d in val)
    assert held >= 0.1 * size and held - max(len(d) for d in val) < 0.1 * size  # stops once the fraction is reached
    assert train_tiny_lm.split_documents(docs, 0.1, seed=0) == (train, val)  # the seed decides
    assert train_tiny_lm.split_documents(docs, 0.1, seed=1)[1] != val
    assert val != docs[-len(val):]  # not the corpus tail
    assert [docs.index(d) for d in val] == sorted(docs.index(d) for d in val)  # corpus order kept
    assert train_tiny_lm.split_documents(["a", "b"], 0.99, seed=3)[0]  # one file always trains
    with pytest.raises(ValueError, match="at least 2 documents, got 1"):
        train_tiny_lm.split_documents(["only"], 0.1, seed=0)


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        train_tiny_lm.main(["--vocab-size", "10"])
    assert "--vocab-size must be >= 257" in capsys.readouterr().err
