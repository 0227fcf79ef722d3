"""Figures written to TensorBoard's IMAGES tab, and the optional-matplotlib policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import GradientDensityMonitor, HeadwatchError, LogitStatsMonitor, SynonymCollisionMonitor
from headwatch.core import figures
from tests.helpers import TinyCausalLM, loader
from tests.test_monitor import make_trainer


def test_norm_vs_rank_plots_the_right_points():
    counts = torch.tensor([5, 10, 0, 1, 7])
    valid = torch.tensor([True, True, True, True, False])
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    fig = figures.norm_vs_frequency_rank(counts, valid, {"head": norms}, "t")
    offsets = np.asarray(fig.axes[0].lines[0].get_xydata())
    # token 1 (count 10) has rank 1, token 0 rank 2, token 3 rank 3; token 2 unseen and token 4 invalid are left out
    assert sorted(map(tuple, np.asarray(offsets).tolist())) == [(1.0, 2.0), (2.0, 1.0), (3.0, 4.0)]
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"


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
