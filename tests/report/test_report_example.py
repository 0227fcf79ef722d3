"""The example job as the report reads it: its run time said once, its seed written where the report finds it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import train_tiny_lm  # noqa: E402

from headwatch.report import main  # noqa: E402

RUN_TIME_CLAIM = re.compile(r"about [\d.]+ min(?:ute)?s?")


def texts() -> dict[str, str]:
    """Where the example's run time is told: its docstring, its --help, the README, the Lightning guide."""
    return {
        "docstring": train_tiny_lm.__doc__,
        "--help": " ".join(train_tiny_lm.build_parser().format_help().split()),  # argparse wraps lines
        "README.md": (ROOT / "README.md").read_text(encoding="utf-8"),
        "docs/getting-started/lightning.md": (ROOT / "docs" / "getting-started" / "lightning.md").read_text(encoding="utf-8"),
    }


def test_the_run_time_is_one_constant_everywhere():
    figure = RUN_TIME_CLAIM.match(train_tiny_lm.RUN_TIME).group(0)
    for where, text in texts().items():
        flat = " ".join(text.split())
        assert train_tiny_lm.RUN_TIME in flat, where
        assert set(RUN_TIME_CLAIM.findall(flat)) == {figure}, where  # no other "about N minutes" for a run


def test_the_example_writes_its_seed_where_the_report_pairs_by_it(tmp_path, capsys):
    small = ["--max-corpus-mb", "0.2", "--vocab-size", "512", "--max-steps", "4", "--val-check-interval", "4",
             "--log-every-n-steps", "2", "--collision-every", "4", "--no-progress-bar", "--seed", "3",
             "--logdir", str(tmp_path / "runs")]
    for flag in ("--tie-weights", "--no-tie-weights"):
        train_tiny_lm.main([*small, flag])
    hparams = (tmp_path / "runs" / "tied" / "version_0" / "hparams.yaml").read_text()
    assert re.search(r"^seed: 3$", hparams, re.M)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s: v["seeds"] for s, v in data["sides"].items()} == {"tied/version_0": [3], "untied/version_0": [3]}
    cost = next(r for r in data["headlines"] if r["key"] == "untying_cost")["comparisons"]["untied/version_0"]["cost"]
    vocab = cost["vocab_size"]
    assert vocab % 64 == 0 and cost["d_model"] == 128 and cost["parameters"] == vocab * 128
    assert data["one_run_a_side"] is True
    assert all(c.get("verdict") is None for r in data["headlines"] for c in r["comparisons"].values())
    assert main(["report", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "One run a side cannot separate the setting from the seed" in out
    shown = float(re.search(r"^validation loss, nats +[\d.]+ +[\d.]+ +([-+][\d.]+)", out, re.M).group(1))
    assert shown == pytest.approx(data["headlines"][0]["comparisons"]["untied/version_0"]["difference"], abs=1e-3)
