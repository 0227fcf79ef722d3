"""The TensorBoard dashboard layout: written at fit start, kept in dashboards/, live points."""

from __future__ import annotations

import json
import re

import lightning.pytorch as pl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

from headwatch import GradientDensityMonitor, LogitStatsMonitor
from headwatch.tensorboard.layout import build_layout, main
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer
from tests.helpers.paths import ROOT

DASHBOARDS = ROOT / "dashboards"


def test_file_and_code_agree():
    assert json.loads((DASHBOARDS / "headwatch.json").read_text()) == build_layout()


def _layout_from_events(logdir: str) -> layout_pb2.Layout:
    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)
    return layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])


def test_layout_written_once_at_fit_start_and_matches_logged_tags(tmp_path):
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(), GradientDensityMonitor()], max_steps=4, val_check_interval=4)
    trainer.fit(TinyCausalLM(), loader(), loader(n=16, seed=1))
    layout = _layout_from_events(trainer.logger.log_dir)
    (category,) = layout.category
    assert category.title == "headwatch"
    titles = [chart.title for chart in category.chart]
    assert titles == list(build_layout()["headwatch"])
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # every chart of the first five finds at least one logged tag
    for chart in category.chart[:5]:
        patterns = list(chart.multiline.tag) or [chart.margin.series[0].value]
        assert any(re.search(p, t) for p in patterns for t in tags), chart.title


def test_points_are_on_disk_during_training(tmp_path):
    """A point is readable by TensorBoard while the run goes on (TensorBoardLogger alone waits 120 s)."""
    seen: list[int] = []

    class ReadBack(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            acc = EventAccumulator(trainer.logger.log_dir)
            acc.Reload()
            if "headwatch/logits/entropy" in acc.Tags()["scalars"]:
                seen.extend(e.step for e in acc.Scalars("headwatch/logits/entropy"))

    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False), ReadBack()], max_steps=2, log_every_n_steps=1)
    trainer.fit(TinyCausalLM(), loader())
    assert 0 in seen  # step 0's point was on disk before step 1 began


def test_write_layout_command(tmp_path, capsys):
    assert main(["--write", str(tmp_path)]) == 0
    layout = _layout_from_events(str(tmp_path))
    assert layout.category[0].title == "headwatch"
    capsys.readouterr()
    assert main(["--json", "--prefix", "hw"]) == 0
    assert json.loads(capsys.readouterr().out) == build_layout("hw")


def test_histogram_keeps_every_finite_value_and_warns_on_the_rest(tmp_path):
    import pytest
    import torch

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from headwatch.tensorboard import write_histogram

    writer = SummaryWriter(tmp_path)
    values = torch.tensor([2.198e21, 6.005e20, 1e40, float("nan"), float("inf")], dtype=torch.float64)  # 1e40: inf in float32
    with pytest.warns(UserWarning, match="'h' left out non-finite values"):
        write_histogram([writer], "h", values, step=3)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    (event,) = acc.Histograms("h")
    assert event.step == 3 and event.histogram_value.num == 3 and event.histogram_value.max == 1e40
