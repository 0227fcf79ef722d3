"""Lightning runs for the tests: a Trainer of a few steps, a logger that keeps every logged value by step."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger


def make_trainer(tmp_path: Path, callbacks, **kw) -> pl.Trainer:
    opts = dict(
        default_root_dir=tmp_path,
        max_steps=4,
        log_every_n_steps=2,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    opts.update(kw)
    return pl.Trainer(callbacks=callbacks, **opts)


class StepLogger(Logger):
    """Records the step of every metric Lightning (or headwatch) logs."""

    def __init__(self):
        super().__init__()
        self.steps: dict[str, list[int]] = defaultdict(list)
        self.values: dict[str, list[float]] = defaultdict(list)

    name = "steps"
    version = 0

    def log_metrics(self, metrics, step=None):
        for k, v in metrics.items():
            self.steps[k].append(step)
            self.values[k].append(float(v))

    def log_hyperparams(self, *args, **kwargs):
        pass
