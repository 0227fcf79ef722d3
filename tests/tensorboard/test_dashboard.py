"""The CUSTOM SCALARS layout: its declarations (:mod:`headwatch.tensorboard.charts`), the file kept in ``dashboards/``,
and the layout each run gets, read back from its event files with TensorBoard's own ``EventAccumulator``.

The independent reference for "which charts a run has" is the run's own scalar tags, matched with the
``re.match`` TensorBoard's custom-scalars plugin applies to a Multiline regex (and tag equality for a
Margin chart), not the tracker's bookkeeping.
"""

from __future__ import annotations

import json
import re

import lightning.pytorch as pl
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata
from torch.utils.tensorboard import SummaryWriter

from headwatch import GradientDensityMonitor, LogitStatsMonitor, names
from headwatch.tensorboard.charts import CATEGORIES, CHARTS, chart_tag
from headwatch.tensorboard import flush, write_layout, write_scalars
from headwatch.tensorboard.layout import build_layout, drawn_order, main
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer
from tests.helpers.paths import ROOT

DASHBOARDS = ROOT / "dashboards"
CONCRETE = {f"headwatch/{n}" for m in names.METRICS if m.kind == "scalar" for n in names.expand(m)}
VITAL_ORDER = [
    "logits/entropy",  # with its p05-p95 band
    "check/nll_gap",  # target NLL against the trainer's loss
    "grad/embedding_row_density",
    "grad/head_row_density",
    "collision/rare_rate_head",  # beyond drift
]


def _acc(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _layouts(logdir) -> list[layout_pb2.Layout]:
    acc = _acc(logdir)
    if metadata.CONFIG_SUMMARY_TAG not in acc.Tags()["tensors"]:
        return []
    return [layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in acc.Tensors(metadata.CONFIG_SUMMARY_TAG)]


def _drawn(chart: layout_pb2.Chart, tags) -> list[str]:
    """The tags of ``tags`` the chart draws, as TensorBoard's custom-scalars plugin selects them."""
    if chart.HasField("margin"):
        return [t for t in tags if t == chart.margin.series[0].value]
    return [t for t in tags for regex in chart.multiline.tag if re.match(regex, t)]


# ---------------------------------------------------------------- declarations and the file
def test_file_and_code_agree():
    assert json.loads((DASHBOARDS / "headwatch.json").read_text(encoding="utf-8")) == build_layout()


def test_first_category_is_the_vital_signs_in_order_open_and_the_others_closed():
    layout = build_layout()
    titles = [c["title"] for c in layout["category"]]
    assert titles == [f"headwatch: {c.title}" for c in CATEGORIES]
    assert [c.get("closed", False) for c in layout["category"]] == [False] + [True] * (len(CATEGORIES) - 1)
    vital = drawn_order(layout["category"][0]["chart"])  # as the page draws them
    # all margin charts (TensorBoard draws a category's margin charts after its Multiline ones: these keep their order)
    assert all(list(c) == ["title", "margin"] for c in vital)
    bands = [c["margin"]["series"][0] for c in vital]
    assert [b["value"].removeprefix("headwatch/") for b in bands[: len(VITAL_ORDER)]] == VITAL_ORDER
    assert bands[0] == {"value": "headwatch/logits/entropy", "lower": "headwatch/logits/entropy_p05",
                        "upper": "headwatch/logits/entropy_p95"}
    assert all(b["value"] == b["lower"] == b["upper"] for b in bands[1:])  # one unsmoothed line each
    # then one chart per alert marker, critical then warning, and nothing else
    markers = {f"headwatch/alerts/{r}" for r in names.ALERT_RULES} | {f"headwatch/alerts/{r}_warning" for r in names.ALERT_RULES}
    assert {b["value"] for b in bands[len(VITAL_ORDER):]} == markers and len(bands) == len(VITAL_ORDER) + len(markers)


def test_each_category_declares_its_multiline_charts_first():
    """TensorBoard 2.21 draws a category's margin charts (and Lines) after its Multiline charts, whatever the
    layout's order: declaring them in that order makes the page show the declared order."""
    for category in CATEGORIES:
        kinds = [c.kind == "Multiline" for c in CHARTS if c.category == category.key]
        assert kinds == sorted(kinds, reverse=True), category.title


def test_every_chart_draws_one_series_a_run_or_one_band_of_declared_names():
    assert len({c.title for c in CHARTS}) == len(CHARTS)
    for chart in CHARTS:
        if chart.kind == "Margin":
            assert len(chart.series) == 3 and {f"headwatch/{s}" for s in chart.series} <= CONCRETE, chart.title
            continue
        if chart.kind == "Line":
            assert len(chart.series) == 1 and f"headwatch/{chart.series[0]}" in CONCRETE, chart.title
            continue
        assert chart.kind == "Multiline" and len(chart.series) == 1, chart.title
        (series,) = chart.series
        if series.startswith("^"):  # the trainer's own loss: one tag a run (Lightning's or the HF Trainer's)
            assert [t for t in ("train_loss", "train/loss", "val_loss", "eval/loss") if re.match(series, t)], chart.title
            continue
        regex = chart_tag(series, chart.kind)
        assert [t for t in CONCRETE if re.match(regex, t)] == [f"headwatch/{series}"], chart.title
        if series.startswith(("val/", "collision/val/")):  # several validation dataloaders: one series each
            assert re.match(regex, f"headwatch/{series}/dataloader_idx_1")
        assert not re.match(regex, f"headwatch/{series}/dataloader_idx_1") or "val/" in series
        assert not re.match(regex, f"train/headwatch/{series}")


def test_layout_of_another_prefix_reads_its_tags_on_a_page_of_its_name():
    layout = build_layout("train/headwatch", category="headwatch")
    assert layout["category"][0]["title"] == "headwatch: vital signs"
    tags = [c["multiline"]["tag"][0] for cat in layout["category"] for c in cat["chart"] if "multiline" in c]
    tags += [v for cat in layout["category"] for c in cat["chart"] if "margin" in c for v in c["margin"]["series"][0].values()]
    assert all(t.startswith(("train/headwatch/", "^")) for t in tags)


# ---------------------------------------------------------------- the layout a run gets
def test_a_lightning_run_gets_the_charts_of_its_tags_vital_signs_first(tmp_path):
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(compare_loss="train_loss"), GradientDensityMonitor()],
                           max_steps=4, val_check_interval=4)  # fmt: skip
    trainer.fit(TinyCausalLM(), loader(), loader(n=16, seed=1))
    logdir = trainer.logger.log_dir
    layout = _layouts(logdir)[-1]  # TensorBoard reads the last one
    tags = _acc(logdir).Tags()["scalars"]
    full = layout_pb2.Layout()
    from google.protobuf import json_format

    json_format.ParseDict(build_layout(), full)
    expected = [(c.title, [ch.title for ch in drawn_order(list(c.chart)) if _drawn(ch, tags)]) for c in full.category]
    assert [(c.title, [ch.title for ch in drawn_order(list(c.chart))]) for c in layout.category] == [e for e in expected if e[1]]
    assert [c.closed for c in layout.category] == [False] + [True] * (len(layout.category) - 1)
    vital = [ch.title for ch in drawn_order(list(layout.category[0].chart))]  # as the page draws them
    assert vital == [c.title for c in CHARTS if c.category == "vital" and not c.series[0].startswith("alerts/")
                     and c.series[0] != "collision/rare_rate_head"]  # no collision monitor, no alert here
    # the self-check's counters that never move in a healthy run sit under debug/ (off the SCALARS tab's first page)
    debug = {t for t in tags if t.startswith("headwatch/debug/")}
    assert debug == {f"headwatch/debug/capture/{n}" for n in ("forwards", "positions", "labelled_positions", "generation_forwards",
                                                              "no_grad_forwards")} | {
        f"headwatch/debug/check/reference_{n}" for n in ("nll", "positions", "forwards")}  # fmt: skip
    assert not [t for t in tags if t.startswith(("headwatch/capture/", "headwatch/check/reference_"))]
    assert all(names.declaration(t) is not None for t in debug)
    every = [ch for c in layout.category for ch in c.chart]
    assert not [ch.title for ch in every if ch.title.startswith(("RL:", "alert", "synonym"))]
    for chart in every:  # one series of this run a chart (or one band), and every chart has it
        assert len(_drawn(chart, tags)) == 1, chart.title


def test_rl_synonym_and_alert_charts_join_when_their_first_tag_is_written(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    write_layout([writer])
    write_scalars([writer], {"headwatch/logits/entropy": 3.0, "headwatch/logits/entropy_p05": 1.0,
                             "headwatch/logits/entropy_p95": 5.0}, step=0)  # fmt: skip
    flush([writer])
    write_scalars([writer], {"headwatch/logits/entropy": 2.9}, step=1)
    flush([writer])  # nothing new: no new layout
    first = _layouts(tmp_path)
    assert len(first) == 1 and [c.title for c in first[0].category] == ["headwatch: vital signs"]
    write_scalars([writer], {"headwatch/rl/temperature": 0.7, "headwatch/rl/sampled_nll": 1.2,
                             "headwatch/collision/synonym_partner_rank_head": 3.0}, step=2)  # fmt: skip
    writer.add_scalar("headwatch/alerts/entropy_drop_warning", 1.0, global_step=2)  # as the alert engine writes it
    flush([writer])
    writer.close()
    layouts = _layouts(tmp_path)
    assert len(layouts) == 2
    last = {c.title: [ch.title for ch in drawn_order(list(c.chart))] for c in layouts[-1].category}
    assert last == {
        "headwatch: vital signs": ["entropy, train: mean and p05-p95 band (nats)",
                                   "alert warning: entropy_drop (1 at each warning step)"],
        "headwatch: collision": ["synonym partner rank, head (median; 1 = nearest)"],
        "headwatch: RL fine-tuning": ["RL: sampled tokens' NLL at the sampling temperature (nats)"],
    }  # fmt: skip
    assert _acc(tmp_path).Tensors(metadata.CONFIG_SUMMARY_TAG)[-1].step == 2  # at the step of the tags that made it


def test_a_writer_without_the_guard_gets_every_chart_once_as_a_dict():
    class StandIn:  # tensorboardX-like: add_custom_scalars(dict) and flush
        def __init__(self):
            self.layouts = []

        def add_custom_scalars(self, layout):
            self.layouts.append(layout)

        def flush(self):
            pass

    writer = StandIn()
    write_layout([writer])
    write_layout([writer])
    (layout,) = writer.layouts
    assert list(layout) == [f"headwatch: {c.title}" for c in CATEGORIES]
    assert sum(len(v) for v in layout.values()) == len(CHARTS)
    assert layout["headwatch: vital signs"][CHARTS[0].title] == ["Margin", [f"headwatch/{s}" for s in CHARTS[0].series]]


def test_the_chart_table_of_the_docs_covers_every_chart_once():
    """``docs/dashboard.md``'s table (written by ``docs/make_pictures.py`` from its runs) has a row for every
    chart a run of the example has and names every other chart once, as declared."""
    text = (DASHBOARDS.parent / "docs" / "dashboard.md").read_text(encoding="utf-8")
    start, end = text.index("<!-- chart table: generated"), text.index("<!-- end of chart table -->")
    table = text[start:end]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ") and "**" not in line]
    absent = table.split("Not in these runs (no tag, so no chart): ", 1)[1].strip().rstrip(".").split(" · ")
    assert rows[0] == "chart" and sorted(rows[1:] + absent) == sorted(c.title for c in CHARTS)
    assert rows[1:6] == [c.title for c in CHARTS[:5]]  # the vital signs first, in order


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
    run = tmp_path / "run"
    writer = SummaryWriter(str(run))
    writer.add_scalar("headwatch/grad/head_row_density", 1.0, 0)
    writer.add_scalar("val_loss", 5.0, 0)
    writer.close()
    assert main(["--write", str(run)]) == 0
    assert "(2 charts)" in capsys.readouterr().out
    (layout,) = _layouts(run)
    assert [(c.title, [ch.title for ch in drawn_order(list(c.chart))]) for c in layout.category] == [
        ("headwatch: vital signs", ["gradient row density: head, scoring flow (fraction of rows)"]),
        ("headwatch: loss and calibration", ["the trainer's loss, validation (nats)"]),
    ]
    assert main(["--write", str(tmp_path / "all"), "--all"]) == 0
    (layout,) = _layouts(tmp_path / "all")
    assert sum(len(c.chart) for c in layout.category) == len(CHARTS)
    capsys.readouterr()
    assert main(["--json", "--prefix", "hw"]) == 0
    assert json.loads(capsys.readouterr().out) == build_layout("hw")


def test_histogram_keeps_every_finite_value_and_warns_on_the_rest(tmp_path):
    import torch

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
