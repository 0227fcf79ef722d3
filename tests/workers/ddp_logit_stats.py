"""Run by tests/distributed/test_ddp.py: log headwatch metrics on N CPU processes (gloo) and dump them.

usage: python tests/workers/ddp_logit_stats.py OUT_DIR DEVICES GLOBAL_BATCH
The model is tied, so the gradient split (lookup / scoring) is reduced across processes too.
Each rank writes OUT_DIR/rank{r}.json: {"train": {step: {metric: value}}, "val": {...}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency  # noqa: E402
from tests.helpers import TinyCausalLM, loader, shutdown_distributed  # noqa: E402

GRAD_KEYS = (
    "grad/embedding_row_density",
    "grad/head_row_density",
    "grad/shared_row_density",
    "grad/tied_flow_rows",
    "grad/tail/embedding_row_density",
    "grad/unseen/embedding_row_density",
    "tokens/total",
    "tokens/seen_fraction",
    "tokens/rare_count",
)
KEYS = ("entropy", "kl_to_uniform", "kl_from_uniform", "entropy_p05", "entropy_p50", "entropy_p95",
        "max_prob", "target_nll", "target_argmax_rate", "positions",
        # calibration by target frequency: bin and bucket sums reduced across processes
        "ece", "overconfidence", "rare/ece", "rare/overconfidence", "rare/target_nll", "rare/positions",
        "top1/target_nll", "top10/target_argmax_rate", "tail/max_prob", "unseen/positions")


class Recorder(pl.Callback):
    def __init__(self):
        self.train: dict[int, dict[str, float]] = {}
        self.val: dict[int, dict[str, float]] = {}

    def _grab(self, trainer, group):
        values = {k: float(trainer.callback_metrics[f"headwatch/{group}/{k}"]) for k in KEYS}
        values.update({k: float(trainer.callback_metrics[f"headwatch/{k}"]) for k in GRAD_KEYS})
        tracker = next(c for c in trainer.callbacks if isinstance(c, TokenFrequency))
        values["counts"] = tracker.snapshot(trainer).counts.tolist()
        return values

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train[trainer.global_step - 1] = self._grab(trainer, "logits")

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            # LogitStatsMonitor (earlier in the list) logged through pl_module.log this epoch
            self.val[trainer.global_step] = {k: float(v) for k, v in trainer.callback_metrics.items() if "val/logits" in k}


def main() -> None:
    out, devices, global_batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model = TinyCausalLM(lr=0.0, tie_weights=True)  # fixed weights: every step sees the same model on 1 or N processes
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=3,
        log_every_n_steps=1,
        val_check_interval=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        default_root_dir=out,  # a checkpoint is saved at the end: TokenFrequency.state_dict sums across ranks
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TokenFrequency(), LogitStatsMonitor(), GradientDensityMonitor(), recorder],
        use_distributed_sampler=False,  # Lightning's sampler would shuffle the training set
    )
    per_rank = global_batch // devices

    def data(n: int, seed: int) -> DataLoader:
        # rank r takes samples r, r + N, r + 2N, ...: the N ranks' batch k together are the single
        # process's batch k of size N * per_rank
        dataset = loader(n=n, seed=seed).dataset
        sampler = DistributedSampler(dataset, num_replicas=devices, rank=trainer.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=per_rank, sampler=sampler)

    trainer.fit(model, data(48, 0), data(32, 1))
    out.mkdir(parents=True, exist_ok=True)
    ckpt = trainer.checkpoint_callback.best_model_path
    trainer.strategy.barrier()
    import torch

    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    counts = next(v["counts"] for k, v in saved.items() if k.startswith("TokenFrequency")).tolist()
    result = {"train": recorder.train, "val": recorder.val, "saved_counts": counts}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    shutdown_distributed()
