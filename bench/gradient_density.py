"""Cost of GradientDensityMonitor relative to a full training step, measured side by side.

A GPT-style model (d_model 512, vocabulary 32768, 2 blocks, batch 4 x 128 tokens, AdamW)
trains on the CPU under Lightning in three configurations, each for the same number of
steps, in one process:

- ``baseline``: no headwatch callback;
- ``every step``: GradientDensityMonitor(log_every_n_steps=1), so every step is a logging
  step (gradient statistics, update density with its weight copies, token counts);
- ``every 50``: the default-like schedule, where almost every step is a non-logging step.

Each step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
backward, optimizer step, and every callback hook); the median over the timed steps is
reported, after warm-up steps. The cost of one logging step is
``median(every step) - median(baseline)``, printed as a fraction of the baseline step.

Run: ``python bench/gradient_density.py [--steps 12] [--tied/--no-tied]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from headwatch import GradientDensityMonitor


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


def run(callbacks: list[pl.Callback], args: argparse.Namespace, data: DataLoader, tied: bool) -> list[float]:
    torch.manual_seed(0)
    model = BenchLM(args.vocab, args.d_model, args.layers, tied)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps + args.warmup,
        logger=pl.loggers.CSVLogger("/tmp/headwatch_bench", name="gradient_density"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
    )
    trainer.fit(model, data)
    return timer.times[args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=False)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    # Zipf-like token ids, so frequency buckets and rare tokens are realistic
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)
    n = (args.steps + args.warmup) * args.batch
    ids = torch.multinomial(weights, n * args.seq, replacement=True, generator=g).view(n, args.seq)
    data = DataLoader(TensorDataset(ids), batch_size=args.batch)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; V={args.vocab}, d_model={args.d_model}, "
          f"{args.layers} blocks, batch {args.batch}x{args.seq}, {'tied' if args.tied else 'untied'}, "
          f"{args.steps} timed steps each")
    results = {
        "baseline (no callback)": run([], args, data, args.tied),
        "GradientDensityMonitor, every step logs": run([GradientDensityMonitor(log_every_n_steps=1)], args, data, args.tied),
        "GradientDensityMonitor, every 50 steps": run([GradientDensityMonitor(log_every_n_steps=50)], args, data, args.tied),
    }
    base = statistics.median(results["baseline (no callback)"])
    print(f"{'configuration':44s} {'median step':>12s} {'vs baseline':>12s}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:44s} {med * 1e3:10.1f}ms {med / base:11.3f}x")
    logging_cost = statistics.median(results["GradientDensityMonitor, every step logs"]) - base
    print(f"cost of one logging step's gradient statistics: {logging_cost * 1e3:.1f} ms = "
          f"{100 * logging_cost / base:.1f}% of a training step (target <= 5%)")


if __name__ == "__main__":
    main()
