"""The LightningCLI presets in callbacks/ attach headwatch to any LightningCLI script."""

from __future__ import annotations


import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import LogitStatsMonitor
from tests.helpers.paths import ROOT
from tests.workers import cli_app

PRESETS = ROOT / "callbacks"


@pytest.mark.parametrize("preset", sorted(p.name for p in PRESETS.glob("*.yaml")))
def test_preset_attaches_and_logs(preset, tmp_path):
    cli = cli_app.main(
        [
            "fit",
            "--config",
            str(PRESETS / preset),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=4",
            "--trainer.log_every_n_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.accelerator=cpu",
        ]
    )
    monitors = [c for c in cli.trainer.callbacks if isinstance(c, LogitStatsMonitor)]
    assert len(monitors) == 1
    assert cli.trainer.global_step == 4
    logdir = cli.trainer.logger.log_dir
    acc = EventAccumulator(logdir)
    acc.Reload()
    entropy = acc.Scalars("headwatch/logits/entropy")
    assert [e.step for e in entropy] == [1, 3]
    assert all(0 < e.value <= 4.16 for e in entropy)  # within [0, log 64]
    assert "headwatch/val/logits/kl_to_uniform" in acc.Tags()["scalars"]
