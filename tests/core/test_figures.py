"""Figures written to TensorBoard's IMAGES tab, and the optional-matplotlib policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import GradientDensityMonitor, HeadwatchError, LogitStatsMonitor, SynonymCollisionMonitor
from headwatch.core import figures
from tests.helpers import TinyCausalLM, loader
from tests.helpers.lightning_runs import make_trainer


def test_norm_vs_rank_plots_the_right_points():
    counts = torch.tensor([5, 10, 0, 1, 7])
    valid = torch.tensor([True, True, True, True, False])
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    fig = figures.norm_vs_frequency_rank(counts, valid, {"head": norms}, "t")
    offsets = np.asarray(fig.axes[0].lines[0].get_xydata())
    # token 1 (count 10) has rank 1, token 0 rank 2, token 3 rank 3; token 2 unseen and token 4 invalid are left out
    assert sorted(map(tuple, np.asarray(offsets).tolist())) == [(1.0, 2.0), (2.0, 1.0), (3.0, 4.0)]
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"


LONG = "gradient row norm vs token frequency, tied: lookup and scoring flows of the one matrix, rare vs frequent tokens"


@pytest.mark.parametrize("make", [
    lambda: figures.norm_vs_frequency_rank(torch.tensor([3, 1]), torch.tensor([True, True]), {"head": torch.ones(2)}, LONG),
    lambda: figures.nn_similarity_by_bucket({"rare": torch.tensor([0.1, 0.5])}, 0.9, LONG),
    lambda: figures.entropy_over_run([0, 10], [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])], 7.62),
])  # fmt: skip
def test_a_long_title_fits_inside_the_image(make):
    fig = make()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = fig.axes[0].title.get_window_extent(canvas.get_renderer())
    width, height = fig.bbox.width, fig.bbox.height
    assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, (box, width, height)
    assert fig.axes[0].title.get_text().replace("\n", " ").startswith(("gradient", "distribution"))


def test_entropy_heat_map_colours_the_runs_range_on_a_log_scale():
    from matplotlib.colors import LogNorm

    counts = [torch.tensor([0.0, 0.0, 0.0, 40.0]), torch.tensor([1.0, 30.0, 9.0, 0.0]), torch.tensor([0.0, 2.0, 36.0, 2.0])]
    fig = figures.entropy_over_run([9, 19, 29], counts, 4.0)
    (image,) = fig.axes[0].images
    fractions = np.stack([c.numpy() / c.numpy().sum() for c in counts], axis=1)  # (bins, steps), each column sums to 1
    assert isinstance(image.norm, LogNorm)
    assert image.norm.vmin == pytest.approx(fractions[fractions > 0].min())  # 1/40: the rarest bin the run filled
    assert image.norm.vmax == pytest.approx(fractions.max())  # 1: the first step, every position in one bin
    shown = image.get_array()
    np.testing.assert_allclose(shown.filled(0.0), fractions)
    assert shown.mask.tolist() == (fractions == 0).tolist()  # empty bins: masked, drawn in the "bad" colour
    assert image.cmap.get_bad().tolist() == [1.0, 1.0, 1.0, 1.0]  # white


def test_entropy_histogram_matches_numpy():
    values = torch.tensor([0.0, 0.1, 0.5, 1.2, 2.0, float("nan")])
    got = figures.entropy_histogram(values, 2.0, bins=4)
    want, _ = np.histogram([0.0, 0.1, 0.5, 1.2, 2.0], bins=4, range=(0, 2.0))
    assert got.tolist() == want.tolist()
    fig = figures.entropy_over_run([1, 3], [got, got * 2], 2.0)
    assert fig.axes[0].get_ylabel() == "entropy (nats)"


def test_all_figures_reach_tensorboard(tmp_path):
    monitors = [
        LogitStatsMonitor(figure_every_n_steps=2),
        GradientDensityMonitor(figure_every_n_steps=2),
        SynonymCollisionMonitor(every_n_steps=2, figures=True),
    ]
    trainer = make_trainer(tmp_path, monitors, max_steps=4, log_every_n_steps=1)
    trainer.fit(TinyCausalLM(), loader())
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    images = acc.Tags()["images"]
    for tag in (
        "headwatch/logits/entropy_over_run",
        "headwatch/grad/row_norm_vs_frequency",
        "headwatch/collision/nn_similarity_head",
        "headwatch/collision/nn_similarity_embedding",
    ):
        assert tag in images, tag
    steps = [e.step for e in acc.Images("headwatch/logits/entropy_over_run")]
    assert steps == [1, 3]
    first = acc.Images("headwatch/grad/row_norm_vs_frequency")[0]
    assert first.width == 640 and first.height == 420 and first.encoded_image_string[:4] == b"\x89PNG"


def test_missing_matplotlib_has_an_install_hint(monkeypatch):
    monkeypatch.setattr(figures, "matplotlib_available", lambda: False)
    with pytest.raises(HeadwatchError, match=r'pip install "headwatch\[figures\]"'):
        LogitStatsMonitor(figure_every_n_steps=5)
    with pytest.raises(HeadwatchError, match="matplotlib"):
        SynonymCollisionMonitor(figures=True)
    assert figures.resolve_figure_interval("auto", 50) == 0  # auto: silently off
    with pytest.raises(HeadwatchError, match="figure_every_n_steps"):
        LogitStatsMonitor(figure_every_n_steps="often")


def test_norm_vs_rank_without_a_positive_norm_draws_a_note():
    """A zero gradient (GRPO whose groups all got equal rewards): no point to plot; log axes could not be drawn
    (matplotlib: "Data cannot be log-scaled"), so the axes stay linear with a note, and the figure renders."""
    import io

    counts, valid = torch.tensor([5, 10, 0, 1]), torch.ones(4, dtype=torch.bool)
    fig = figures.norm_vs_frequency_rank(counts, valid, {"head": torch.zeros(4), "embedding": torch.zeros(4)}, "t")
    fig.savefig(io.BytesIO(), format="png")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.texts] == ["no seen row with a norm above 0 at this step"]


def _zero_gradient_run(tmp_path, **callback_kw):
    """A Hugging Face Trainer whose loss is multiplied by 0 (every gradient is zero), figures on every logging
    step, TensorBoard, and an entropy floor above log V (it fires at every logging step)."""
    import warnings

    from transformers import Trainer

    from headwatch.alerts import CollapseRules
    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

    class ZeroLoss(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            return super().compute_loss(model, inputs, *args, **kwargs) * 0.0

    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], alert=CollapseRules(entropy_floor=5.0),
                           figure_every_n_steps=1, overhead_budget=None, **callback_kw)  # fmt: skip
    # (no budget: the histograms of every logging step, not of the probe steps only)
    args = hf_args(tmp_path, max_steps=2, logging_first_step=False, report_to="tensorboard", per_device_train_batch_size=2)
    trainer = ZeroLoss(model=tiny_llama(tie=False), args=args, train_dataset=Rows(one_batch(), 2), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    published = sorted(r["step"] for r in trainer.state.log_history if "headwatch/logits/entropy" in r)
    alerts = (tmp_path / "headwatch_alerts.jsonl").read_text().splitlines()
    (logdir,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "histograms": 0}).Reload()
    return [str(w.message) for w in caught], published, alerts, acc


def test_a_zero_gradient_step_keeps_its_values_figures_and_alert(tmp_path):
    """Before: the norm figure raised while drawn, the door lost the whole step (values and alert) with one
    warning, and the later steps silently."""
    messages, published, alerts, acc = _zero_gradient_run(tmp_path)
    assert not [m for m in messages if "could not publish" in m], messages
    assert published == [1, 2] and len(alerts) == 1  # fired once (it stays active), at step 1
    assert [e.step for e in acc.Images("train/headwatch/grad/row_norm_vs_frequency")] == [1, 2]


def test_media_that_cannot_be_written_lose_neither_the_values_nor_the_alert(tmp_path, monkeypatch):
    from headwatch.tensorboard import writer

    def broken(*args, **kwargs):
        raise RuntimeError("no figure today")

    monkeypatch.setattr(writer, "write_figure", broken)
    messages, published, alerts, acc = _zero_gradient_run(tmp_path)
    (warned,) = [m for m in messages if "could not publish" in m]  # once
    assert "TrainerSink" in warned and "no figure today" in warned
    assert published == [1, 2] and len(alerts) == 1
    assert [e.step for e in acc.Histograms("train/headwatch/grad/head_row_norm_histogram")] == [1, 2]  # the other media
    assert "train/headwatch/grad/row_norm_vs_frequency" not in acc.Tags()["images"]
