"""``headwatch.tensorboard``: what each writer function puts in a real event file, read back with
TensorBoard's own ``EventAccumulator`` (scalars, histograms, text, images, the Custom Scalars layout).

Expected numbers come from the values written (float32 as TensorBoard stores scalars) and from
NumPy over the finite values; the layout is read back through TensorBoard's ``layout_pb2`` proto and compared
with the declarations of :mod:`headwatch.tensorboard.charts`, not with ``build_layout``'s own output.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from headwatch.tensorboard import charts
from headwatch.core.monitor import Media
from headwatch.tensorboard import flush, write_histogram, write_layout, write_media, write_scalars, write_text
from tests.helpers.events import layouts, reload
from headwatch.tensorboard.layout import drawn_order


def test_scalars_go_to_every_writer_and_flush_makes_them_readable(tmp_path):
    writers = [SummaryWriter(str(tmp_path / "a")), SummaryWriter(str(tmp_path / "b"))]
    write_scalars(writers, {"x": 0.1, "y": 3.0}, step=5)
    write_scalars(writers, {"x": 0.2}, step=6)
    flush(writers)  # readable now, before close
    for name in ("a", "b"):
        acc = reload(tmp_path / name)
        assert [(e.step, e.value) for e in acc.Scalars("x")] == [(5, float(np.float32(0.1))), (6, float(np.float32(0.2)))]
        assert [(e.step, e.value) for e in acc.Scalars("y")] == [(5, 3.0)]
    for w in writers:
        w.close()


def test_a_step_of_scalars_is_one_event_read_as_add_scalar_writes_them(tmp_path):
    """torch's writer gets one event per step (one summary value per tag); TensorBoard reads the same
    scalars, steps and float32 values as from one ``add_scalar`` per tag, in another directory."""
    from tensorboard.backend.event_processing import event_file_loader

    values = {f"headwatch/m{i}": (i - 3) * 0.37 for i in range(7)} | {"nan": float("nan"), "inf": float("inf")}
    ours, theirs = SummaryWriter(str(tmp_path / "ours")), SummaryWriter(str(tmp_path / "theirs"))
    for step in (3, 4):
        write_scalars([ours], values, step)
        for tag, value in values.items():
            theirs.add_scalar(tag, value, global_step=step)
    ours.close()
    theirs.close()
    a, b = reload(tmp_path / "ours"), reload(tmp_path / "theirs")
    assert sorted(a.Tags()["scalars"]) == sorted(b.Tags()["scalars"]) == sorted(values)
    for tag in values:
        got = [(e.step, e.value) for e in a.Scalars(tag)]
        want = [(e.step, e.value) for e in b.Scalars(tag)]
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True), tag
    (path,) = (tmp_path / "ours").iterdir()
    events = [e for e in event_file_loader.EventFileLoader(str(path)).Load() if e.HasField("summary")]
    assert [(e.step, len(e.summary.value)) for e in events] == [(3, len(values)), (4, len(values))]
    write_scalars([ours], {}, 5)  # nothing to write: no empty event


def test_batched_scalars_flush_inside_writes_them_and_the_writer_is_its_own_after_an_error(tmp_path):
    from headwatch.tensorboard import batched_scalars

    writer = SummaryWriter(str(tmp_path))
    with batched_scalars([writer]):
        writer.add_scalar("a", 1.5, 7)
        writer.flush()  # as the Trainer's TensorBoardCallback ends each on_log: what was collected is on disk
        assert [(e.step, e.value) for e in reload(tmp_path).Scalars("a")] == [(7, 1.5)]
    with pytest.raises(RuntimeError, match="boom"):
        with batched_scalars([writer]):
            writer.add_scalar("b", 2.5, 8)
            raise RuntimeError("boom")
    assert "add_scalar" not in vars(writer) and "flush" not in vars(writer)  # the class's methods again
    writer.add_scalar("b", 3.5, 9)
    writer.flush()
    assert [(e.step, e.value) for e in reload(tmp_path).Scalars("b")] == [(8, 2.5), (9, 3.5)]  # kept, then the next


def test_histogram_of_the_finite_values(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    values = torch.tensor([[0.5, -1.25, float("nan")], [3.0, float("-inf"), 2.0]], dtype=torch.float16)
    with pytest.warns(UserWarning, match="histogram 'grad/h' left out non-finite values"):
        write_histogram([writer], "grad/h", values, step=2)
    writer.close()
    (event,) = reload(tmp_path).Histograms("grad/h")
    finite = np.array([0.5, -1.25, 3.0, 2.0])
    h = event.histogram_value
    assert event.step == 2 and h.num == 4 and (h.min, h.max) == (-1.25, 3.0)
    assert h.sum == pytest.approx(finite.sum()) and h.sum_squares == pytest.approx((finite**2).sum())
    assert sum(h.bucket) == 4


def test_histogram_beyond_1e20_uses_automatic_bins(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    values = torch.tensor([1.0, 2.0, 5e20, 1e22], dtype=torch.float64)  # past TensorBoard's last default bucket
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all finite: no warning
        write_histogram([writer], "h", values, step=0)
    writer.close()
    (event,) = reload(tmp_path).Histograms("h")
    assert event.histogram_value.num == 4 and event.histogram_value.max == 1e22 and sum(event.histogram_value.bucket) == 4


def test_nothing_finite_writes_no_histogram(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    with pytest.warns(UserWarning, match="'h' left out non-finite values"):
        write_histogram([writer], "h", torch.tensor([float("nan"), float("inf")]), step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_histogram([writer], "empty", torch.empty(0), step=0)  # nothing at all: no warning either
    writer.add_scalar("marker", 1.0, 0)
    writer.close()
    assert reload(tmp_path).Tags()["histograms"] == []


def test_media_texts_figures_and_optional_histograms(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    assert matplotlib is not None
    fig = Figure(figsize=(2.0, 1.5), dpi=50)
    fig.subplots().plot([0, 1], [1, 0])
    media = Media(histograms={"h": torch.arange(4.0)}, texts={"t": "**tied** by storage"}, figures={"f": fig})
    writer = SummaryWriter(str(tmp_path))
    write_media([writer], media, step=3, histograms=False)
    assert fig.axes == []  # cleared once written
    write_media([], Media(figures={"g": fig}), step=4)  # no writer (not rank zero): nothing happens
    writer.close()
    acc = reload(tmp_path)
    assert acc.Tags()["histograms"] == []  # histograms=False
    (text,) = acc.Tensors("t/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (3, "**tied** by storage")
    (image,) = acc.Images("f")
    assert (image.step, image.width, image.height) == (3, 100, 75)  # 2 x 1.5 inches at 50 dpi


def test_text_to_several_writers(tmp_path):
    writers = [SummaryWriter(str(tmp_path / k)) for k in ("a", "b")]
    write_text(writers, "headwatch/grad/tying", "untied", step=0)
    for w in writers:
        w.close()
    for k in ("a", "b"):
        (event,) = reload(tmp_path / k).Tensors("headwatch/grad/tying/text_summary")
        assert event.tensor_proto.string_val[0] == b"untied"


def test_layout_holds_the_charts_whose_tags_the_writer_wrote_under_its_category(tmp_path):
    first, second = SummaryWriter(str(tmp_path / "a")), SummaryWriter(str(tmp_path / "b"))
    write_layout([first], prefix="train/headwatch", category="headwatch")
    write_layout([first, second], prefix="train/headwatch", category="headwatch")  # the first already tracks it
    flush([first])
    assert layouts(tmp_path / "a") == []  # no chart has a tag yet: no layout
    write_scalars([first, second], {"train/headwatch/logits/entropy": 5.0, "train/headwatch/logits/entropy_p05": 1.0,
                                    "train/headwatch/logits/entropy_p95": 6.0, "train/headwatch/grad/head_row_density": 1.0,
                                    "headwatch/grad/embedding_row_density": 0.2}, step=3)  # another prefix: no chart
    flush([first, second])
    first.close()
    second.close()
    for path in (tmp_path / "a", tmp_path / "b"):
        (layout,) = layouts(path)  # written once, at the flush after the first tags
        titles = [(c.title, c.closed, [ch.title for ch in drawn_order(list(c.chart))]) for c in layout.category]
        assert titles == [("headwatch: vital signs", False, [charts.CHARTS[0].title, charts.CHARTS[3].title])]
        band, density = drawn_order(list(layout.category[0].chart))  # as TensorBoard draws them
        assert [(s.value, s.lower, s.upper) for s in band.margin.series] == [
            ("train/headwatch/logits/entropy", "train/headwatch/logits/entropy_p05", "train/headwatch/logits/entropy_p95")]
        (line,) = density.margin.series  # a Line: a band of no width, drawn unsmoothed
        assert line.value == line.lower == line.upper == "train/headwatch/grad/head_row_density"


def test_layout_module_needs_json_or_write(capsys):
    from headwatch.tensorboard.layout import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and "one of the arguments --json --write is required" in capsys.readouterr().err

