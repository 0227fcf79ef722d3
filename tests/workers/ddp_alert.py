"""Run by tests/alerts/test_alerts.py: 2 CPU processes (gloo) where only rank 1's rule fires.

usage: python tests/workers/ddp_alert.py OUT_DIR [rank1|rank0_metric]
rank1: only rank 1's rule fires. rank0_metric: the alert watches a metric that only rank zero
logs (SynonymCollisionMonitor measures on rank zero), which must neither hang nor split the ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402

from headwatch import LogitStatsMonitor, SharpnessCollapseAlert, SynonymCollisionMonitor  # noqa: E402
from headwatch.alerts import AlertEvent, CollapseRules  # noqa: E402
from tests.helpers import TinyCausalLM, loader, shutdown_distributed  # noqa: E402


class RankRules(CollapseRules):
    """Fires the floor rule on rank 1 only, from step 3."""

    rank = 0
    fired_locally: list = []

    def observe_train(self, step, metrics):
        fired = super().observe_train(step, metrics)
        if self.rank == 1 and step >= 3 and not self.episode("entropy_floor").open:
            self.episode("entropy_floor").open = True
            fired = [AlertEvent("fired", "entropy_floor", "critical", step)]
        if fired:
            type(self).fired_locally.append(step)
        return fired


def main() -> None:
    out = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "rank1"
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    if mode == "rank0_metric":
        # rare_rate_head <= 1 < 2: fires at the first measurement, which exists on rank zero only
        alert = SharpnessCollapseAlert(
            entropy_metric="headwatch/collision/rare_rate_head", kl_metric="headwatch/collision/rare_count",
            entropy_floor=2.0, entropy_drop=None, stop_training=True, jsonl=False,
        )
        callbacks = [LogitStatsMonitor(validation=False), SynonymCollisionMonitor(every_n_steps=3), alert]
    else:
        alert = SharpnessCollapseAlert(entropy_floor=-1.0, entropy_drop=None, stop_training=True, jsonl=False)
        callbacks = [LogitStatsMonitor(validation=False), alert]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=20,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    if mode == "rank1":
        rules = RankRules(entropy_floor=-1.0, entropy_drop=None)
        rules.rank = trainer.global_rank
        alert.rules = rules
    trainer.fit(TinyCausalLM(), loader(n=320, batch_size=4))
    fired = RankRules.fired_locally if mode == "rank1" else [a.step for a in alert.alerts]
    result = {"global_step": trainer.global_step, "alerts": len(alert.alerts), "fired_locally": fired}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    shutdown_distributed()
