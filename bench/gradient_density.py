"""Cost of GradientDensityMonitor relative to a full training step, measured side by side.

A GPT-style model (d_model 512, vocabulary 32768, 2 blocks, AdamW, Zipf-distributed token
ids) trains on the CPU under Lightning, in one process:

- ``baseline``: no headwatch callback; each step is timed from ``on_train_batch_start`` to
  ``on_train_batch_end`` (forward, backward, optimizer step), median over the timed steps;
- ``monitored``: GradientDensityMonitor with the Trainer's log_every_n_steps=1, so every step is a logging
  step (gradient statistics per row and per frequency bucket, the tied split when tied,
  update density with its weight copies, frequency gravity, token counts and buckets).
  Every hook of the monitor and of its TokenFrequency tracker is wrapped with a timer:
  the cost of one logging step is the median of the summed hook time per step;
- ``non-logging``: the same with log_every_n_steps=1000: the hook time of a step that
  does not log (token counting only).

Ratios are hook time / median baseline step. Tied and untied models, and two batch sizes
(tokens per step), because the statistics cost a fixed time per logging step (they scale
with vocab_size * d_model, not with the batch) while a training step scales with the batch.

Run: ``python bench/gradient_density.py [--steps 8]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from headwatch import GradientDensityMonitor, TokenFrequency


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class BenchLM(pl.LightningModule):
    def __init__(self, vocab_size: int, d_model: int, layers: int, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, 8) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        x = self.embed_tokens(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)


HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def timed(callback: pl.Callback, per_step: dict[int, float], trainer_ref: list) -> None:
    """Wrap the callback's per-step hooks with timers that add into ``per_step[global_step_at_start]``."""
    for name in HOOKS:
        original = getattr(callback, name)

        def wrapper(*args, _original=original, **kwargs):
            step = trainer_ref[0].global_step if trainer_ref else -1
            t0 = time.perf_counter()
            result = _original(*args, **kwargs)
            per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - t0
            return result

        setattr(callback, name, wrapper)


def run(
    args: argparse.Namespace, batch: int, tied: bool, monitor: GradientDensityMonitor | None, every: int = 1
) -> tuple[list[float], list[float]]:
    """Median-ready lists: step times, and the monitor's hook time per step (empty without a monitor)."""
    g = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)  # Zipf-like token ids
    n = (args.steps + args.warmup) * batch
    ids = torch.multinomial(weights, n * args.seq, replacement=True, generator=g).view(n, args.seq)
    data = DataLoader(TensorDataset(ids), batch_size=batch)
    torch.manual_seed(0)
    model = BenchLM(args.vocab, args.d_model, args.layers, tied)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    per_step: dict[int, float] = {}
    trainer_ref: list = []
    if monitor is not None:
        tracker = TokenFrequency()
        timed(monitor, per_step, trainer_ref)
        timed(tracker, per_step, trainer_ref)
        callbacks = [tracker, monitor, timer]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps + args.warmup,
        logger=pl.loggers.CSVLogger("/tmp/headwatch_bench", name="gradient_density"),
        log_every_n_steps=every,  # the monitor and the tracker follow the Trainer's schedule
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer_ref.append(trainer)
    trainer.fit(model, data)
    hooks = [per_step[s] for s in sorted(per_step)][args.warmup :]
    return timer.times[args.warmup :], hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16], help="sequences per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"V={args.vocab}, d_model={args.d_model}, {args.layers} blocks, sequences of {args.seq} tokens, "
          f"{args.steps} timed steps per configuration")
    print(f"{'model':8s} {'tokens/step':>11s} {'train step':>11s} {'logging step':>13s} {'ratio':>7s} "
          f"{'non-logging step':>17s} {'ratio':>9s}")
    for tied in (False, True):
        for batch in args.batches:
            steps, _ = run(args, batch, tied, None)
            _, hooks = run(args, batch, tied, GradientDensityMonitor(figure_every_n_steps=0), every=1)
            _, idle = run(args, batch, tied, GradientDensityMonitor(figure_every_n_steps=0), every=1000)
            base, cost, quiet = statistics.median(steps), statistics.median(hooks), statistics.median(idle)
            print(f"{'tied' if tied else 'untied':8s} {batch * args.seq:11d} {base * 1e3:9.1f}ms {cost * 1e3:11.1f}ms "
                  f"{100 * cost / base:6.1f}% {quiet * 1e3:15.3f}ms {100 * quiet / base:8.3f}%")
    print("ratio = hook time of the monitor and its TokenFrequency / median training step without them "
          "(target: a logging step <= 5%)")


if __name__ == "__main__":
    main()
