"""Run by tests/integrations/test_sigterm_resume.py: train a tiny model through one door with a checkpoint every 2 steps and
an alert; ``kill`` sends this process SIGTERM at the start of step 5 (after the checkpoint of step 4). At the
end (a run that was not killed) the headwatch state is written to ``OUT/final.pt``.

usage: python tests/workers/sigterm_worker.py DOOR OUT (kill | whole | resume)
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from headwatch.alerts import CollapseRules  # noqa: E402
from tests.helpers import TinyCausalLM, ids_loader, watched_step  # noqa: E402

STEPS, KILL_AT, V = 8, 5, 64
E = "headwatch/logits/entropy"


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (4, 8), generator=g) for _ in range(STEPS)]


def plain_loop(out: Path, mode: str) -> dict:
    from headwatch import Headwatch
    from headwatch.alerts import AlertEngine

    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    hw = Headwatch(model, monitors=["tokens", "logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=0)
    alert = AlertEngine(CollapseRules(entropy_floor=9.0, entropy_drop=0.001, window=2), [], warn=lambda m: None)
    start = 0
    if mode == "resume":
        ckpt = torch.load(out / "step-4.pt", weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        hw.load_state_dict(ckpt["headwatch"])
        alert.load_state_dict(ckpt["alert"])
        start = 4
    data = batches()
    for step in range(start, STEPS):
        if mode == "kill" and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        ids = data[step]
        values = watched_step(hw, model, optimizer, ids, step)
        alert.observe_train(step, values)
        if (step + 1) % 2 == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "headwatch": hw.state_dict(),
                        "alert": alert.state_dict()}, out / f"step-{step + 1}.pt")  # fmt: skip
    return {"headwatch": hw.state_dict(), "alert": alert.state_dict()}


def lightning(out: Path, mode: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from headwatch import LogitStatsMonitor, SharpnessCollapseAlert, TokenFrequency

    class Kill(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if mode == "kill" and trainer.global_step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL if os.environ.get("HW_SIGKILL") else signal.SIGTERM)

    pl.seed_everything(0, verbose=False)
    tokens, logits = TokenFrequency(), LogitStatsMonitor(figure_every_n_steps=0, log_every_n_steps=1, validation=False)
    alert = SharpnessCollapseAlert(entropy_floor=9.0, entropy_drop=0.001, window=2, log_every_n_steps=1)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        default_root_dir=out, accelerator="cpu", devices=1, max_steps=STEPS, log_every_n_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[tokens, logits, alert, checkpoint, Kill()],
    )  # fmt: skip
    ckpt = str(out / "ckpt" / "epoch=0-step=4.ckpt") if mode == "resume" else None
    # every batch the same 4 rows: Lightning restarts a non-stateful epoch from its first batch on a mid-epoch
    # resume, so the batches after the resume are those of the uninterrupted run only if all batches are alike
    rows = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(0)).repeat(STEPS, 1)
    trainer.fit(TinyCausalLM(vocab_size=V, d_model=16, lr=0.5), ids_loader(rows, 4), ckpt_path=ckpt)
    return {"tokens": tokens._core().state_dict(), "logits": logits._core().state_dict(), "alert": alert.state_dict()}


def main() -> None:
    door, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    final = {"plain": plain_loop, "lightning": lightning}[door](out, mode)
    torch.save(final, out / f"final-{mode}.pt")
    print("finished", flush=True)


if __name__ == "__main__":
    main()
