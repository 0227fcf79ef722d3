"""Run by tests/distributed/test_ddp_keys.py: every monitor on 2 CPU processes (gloo), with ModelCheckpoint and
EarlyStopping watching headwatch keys, the logit statistics failing on rank 1 only at step 2; each
rank dumps the headwatch keys and values it published.

usage: python tests/workers/ddp_keys.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402

import torch  # noqa: E402

from headwatch import GradientDensityMonitor, LogitStatsMonitor, SynonymCollisionMonitor, TokenFrequency  # noqa: E402
from headwatch.integrations.lightning import HeadwatchDriver  # noqa: E402
from tests.helpers import TinyCausalLM, loader, shutdown_distributed  # noqa: E402

MONITORS = {"logits": "headwatch/logits/", "grad": "headwatch/grad/", "tokens": "headwatch/tokens/", "collision": "headwatch/collision/"}


class FailsOnRank1(LogitStatsMonitor):
    """Its statistics fail on rank 1 only, at step 2 (the third logging step), after their collectives
    (a failure before one leaves the other rank waiting in it: the README's known limit)."""

    calls = 0

    def compute(self):
        self.calls += 1
        out = super().compute()
        if self.calls == 3 and torch.distributed.get_rank() == 1:
            raise RuntimeError("injected on rank 1")
        return out


class Recorder(pl.Callback):
    """Per step: the headwatch keys (by monitor) and values each rank holds after the batch, and the
    step each logits key was last published at."""

    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}
        self.published: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        self.steps[step] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/")}
        (driver,) = [cb for cb in trainer.callbacks if isinstance(cb, HeadwatchDriver)]
        last = driver.published
        self.published[step] = sorted({v for k, v in last.items() if k.startswith("headwatch/logits/")})


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    recorder = Recorder()
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", monitor="headwatch/collision/rare_rate_head", every_n_train_steps=2, save_top_k=-1
    )
    stopping = EarlyStopping(monitor="headwatch/logits/entropy", patience=100, check_on_train_epoch_end=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        log_every_n_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            TokenFrequency(),
            FailsOnRank1(figure_every_n_steps=0),
            GradientDensityMonitor(figure_every_n_steps=0),
            SynonymCollisionMonitor(every_n_steps=2, figures=False),
            checkpoint,
            stopping,
            recorder,
        ],
    )
    trainer.fit(TinyCausalLM(tie_weights=True), loader(n=32, batch_size=4))
    saved = sorted(p.name for p in (out / "ckpt").glob("*.ckpt"))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"steps": recorder.steps, "saved": saved, "published": recorder.published}))


if __name__ == "__main__":
    main()
    shutdown_distributed()
