"""examples/untie_study.py at tiny sizes: three branches fork from one checkpoint, figures consistent."""

from __future__ import annotations

import json
import sys

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import untie_study  # noqa: E402


def test_three_branches_from_one_checkpoint(tmp_path, capsys):
    s = untie_study.main([
        "--pretrain-steps", "4", "--fork-steps", "2", "--max-corpus-mb", "0.05", "--vocab-size", "300",
        "--d-model", "16", "--n-head", "2", "--n-layer", "1", "--block-size", "32", "--head-warmup-steps", "2",
        "--val-check-interval", "2", "--collision-every", "2", "--log-every-n-steps", "1", "--logdir", str(tmp_path),
    ])
    b = s["branches"]
    assert list(b) == list(untie_study.BRANCHES)
    # the fork: the tied branch and the copy start from the same function, so the same validation loss, exactly;
    # and that is the loss the pre-training ended with
    assert b["tied"]["val_loss_at_fork"] == b["untied_copy"]["val_loss_at_fork"] == s["pretrain"]["val_loss_end"]
    assert b["untied_normal_warmup"]["val_loss_at_fork"] != b["tied"]["val_loss_at_fork"]  # a new head: new logits
    assert s["vocab_size"] % 64 == 0 and s["d_model"] == 16
    assert b["tied"]["params_added"] == 0 and b["untied_copy"]["params_added"] == s["vocab_size"] * 16
    assert s["pretrain"]["tied_flow_cosine_mean"] is not None and b["tied"]["rare_rate_embedding"] is None
    assert b["untied_copy"]["rare_rate_embedding"] is not None
    assert json.loads((tmp_path / "study.json").read_text())["seed"] == 0
    assert [h[0] for h in b["tied"]["val_history"]] == [0, 2]
    # each run in its own directory: headwatch report compares them
    from headwatch.report import main as report

    capsys.readouterr()
    assert report(["report", str(tmp_path), "--match", "entropy"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("pretrain", *untie_study.BRANCHES))

