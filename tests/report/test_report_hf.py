"""``headwatch report`` on Hugging Face Trainer runs: tags under ``train/headwatch/``, ``train/loss``, ``eval/loss``.

The event files are written by hand with the Trainer's TensorBoard layout (the callback puts
``train/`` before every training key and ``eval/`` before every evaluation key) next to a run
with the Lightning layout; the numbers are checked against the values written (float32, as
TensorBoard stores them).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from headwatch.report import main, strip_trainer_namespace

STEPS = list(range(0, 200, 10))


def entropy(t: int, c: float) -> float:
    return c - 0.01 * t


def write(path, series: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for tag, points in series.items():
        for step, value in points:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


def hf_series(c: float, k: float) -> dict[str, list[tuple[int, float]]]:
    return {
        "train/headwatch/logits/entropy": [(t, entropy(t, c)) for t in STEPS],
        "train/headwatch/alerts/entropy_floor": [(150, 1.0)],
        "train/loss": [(t, 5.0 - 0.005 * t) for t in STEPS],
        "eval/loss": [(t, 6.0 - k * t) for t in STEPS if t % 50 == 0],
        "train/learning_rate": [(t, 1e-3) for t in STEPS],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "runs"
    write(root / "hf", hf_series(6.0, 0.01))
    write(root / "lightning", {"headwatch/logits/entropy": [(t, entropy(t, 5.0)) for t in STEPS], "val_loss": [(0, 4.0)]})
    return root


def test_strip_trainer_namespace_only_without_prefix_tags():
    hf = {"train/headwatch/logits/entropy": [(0, 1.0)], "train/loss": [(0, 2.0)], "eval/headwatch/x": [(0, 3.0)]}
    assert strip_trainer_namespace(hf) == {"headwatch/logits/entropy": [(0, 1.0)], "train/loss": [(0, 2.0)], "eval/headwatch/x": [(0, 3.0)]}
    mixed = {"headwatch/logits/entropy": [(0, 1.0)], "train/headwatch/logits/entropy": [(0, 9.0)]}
    assert strip_trainer_namespace(mixed) == mixed  # a run that has <prefix>/ tags is read as written
    assert strip_trainer_namespace({"train/hw/a": [(0, 1.0)]}, prefix="hw") == {"hw/a": [(0, 1.0)]}


def test_report_reads_hf_layout_without_prefix(runs, capsys):
    assert main(["report", str(runs), "--json", "--match", "."]) == 0
    data = json.loads(capsys.readouterr().out)["metrics"]
    hf, pl = data["hf"], data["lightning"]
    want = np.float32(entropy(STEPS[-1], 6.0)).item()
    assert hf["headwatch/logits/entropy"]["final"] == want
    assert hf["headwatch/logits/entropy"]["steps"] == len(STEPS)
    assert pl["headwatch/logits/entropy"]["final"] == np.float32(entropy(STEPS[-1], 5.0)).item()
    assert hf["train/loss"]["final"] == np.float32(5.0 - 0.005 * STEPS[-1]).item()
    assert hf["eval/loss"]["final"] == np.float32(6.0 - 0.01 * 150).item()
    assert not any(tag.startswith("train/headwatch/") for tag in hf)
    assert "train/learning_rate" not in hf  # not a headwatch or context tag


def test_report_text_groups_hf_tags(runs, capsys):
    assert main(["report", str(runs / "hf"), "--match", "."]) == 0
    out = capsys.readouterr().out
    assert "No headwatch metrics matched" not in out
    assert "[logits]" in out and "[loss]" in out and "[alerts]" in out
    assert "train/headwatch" not in out
    assert "1× (last at step 150)" in next(line for line in out.splitlines() if "alerts/entropy_floor" in line)


def test_groups_default_loss_tag_falls_back_to_eval_loss(tmp_path, capsys):
    slopes = {"a_1": 0.010, "a_2": 0.012, "b_1": 0.020, "b_2": 0.024}
    for name, k in slopes.items():
        write(tmp_path / name, hf_series(6.0 + k, k))
    assert main(["report", "--group", f"a={tmp_path}/a_*", f"b={tmp_path}/b_*", "--json", "--all"]) == 0
    data = json.loads(capsys.readouterr().out)["metrics"]
    assert data["loss_tag"] == "eval/loss"
    target = max(6.0 - k * 150 for k in slopes.values())  # the lowest eval/loss every run reaches
    assert data["loss_target"] == pytest.approx(target, rel=1e-6)
    for name, k in slopes.items():  # eval/loss(s) = 6 - k s, crossed at (6 - L*) / k
        assert data["loss_steps"][name] == pytest.approx((6.0 - target) / k, rel=1e-5)
    assert "headwatch/logits/entropy" in {r["tag"] for r in data["at_loss"]}
