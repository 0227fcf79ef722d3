"""Prepared GPU check: bf16 tiny-Llama training with every headwatch monitor.

One script, under 5 minutes on one GPU. It prints:

1. the overhead of a step that does not log (monitors attached, logging interval longer
   than the run) against the same training without headwatch, and the number of host-device
   synchronisations counted with ``torch.cuda.set_sync_debug_mode("warn")`` on those steps,
   with and without headwatch (target: no extra sync, under 1% of step time);
2. the overhead of a logging step: (time with logging every ``--log-every`` steps - time
   without logging) / number of logging steps;
3. ``logit_statistics`` against ``torch.logsumexp`` on ``(8192, 128256)`` bf16 logits (time
   and peak extra memory from ``torch.cuda.max_memory_allocated``), and its values against a
   float64 recomputation, outside and inside ``torch.autocast``;
4. the peak extra memory of training with headwatch (peak allocated with minus without);
5. the entropy and target NLL headwatch logged at the last step against a float64
   recomputation from the logits the head produced at that step (a forward hook);
6. the overhead budget's clock (CUDA events, read at logging steps): the syncs on the logging run's other steps
   (target: none) and ``overhead/fraction_run`` against the share measured from the bare run.

Model: ``transformers.LlamaConfig`` (``--vocab`` 32000 or 128256, ``--d-model`` 512-1024),
``Trainer(precision="bf16-mixed")``, AdamW, random token ids. Monitors: ``LogitStatsMonitor``,
``GradientDensityMonitor`` (with its ``TokenFrequency``), ``SynonymCollisionMonitor``,
``SharpnessCollapseAlert``, with the public arguments they have today.

Run: ``python bench/gpu_check.py`` on a GPU machine; ``python bench/gpu_check.py --device cpu
--tiny`` is the CPU smoke test of everything but the sync count (tests/examples/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from headwatch import GradientDensityMonitor, LogitStatsMonitor, SharpnessCollapseAlert, SynonymCollisionMonitor
from headwatch.functional import logit_statistics

SYNC_WARNING = "synchroniz"  # torch's sync-debug warning: "called a synchronizing CUDA operation"


class LlamaModule(pl.LightningModule):
    def __init__(self, config, lr: float = 3e-4):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def dict_batches(ids: torch.Tensor, batch_size: int) -> DataLoader:
    """Batches as dicts with ``input_ids`` and ``labels``, the layout headwatch reads."""
    return DataLoader(TensorDataset(ids), batch_size=batch_size, collate_fn=_collate)


def _collate(items):
    ids = torch.stack([i[0] for i in items])
    return {"input_ids": ids, "labels": ids}


class DictModule(LlamaModule):
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


class StepClock(pl.Callback):
    """Per-step wall time (synchronised at the step's end only outside the timed span) and sync-warning counts."""

    def __init__(self, device: torch.device, caught: list):
        self.device, self.caught = device, caught
        self.times: list[float] = []
        self.syncs: list[int] = []
        self.last_logits: torch.Tensor | None = None
        self.last_labels: torch.Tensor | None = None
        self.keep = False

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync()
        self.n_warn = len(self.caught)
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        self.keep = trainer.global_step == trainer.max_steps - 1
        if self.keep:
            self.last_labels = batch["labels"]
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        self._sync()
        self.times.append(time.perf_counter() - self.t0)
        self.syncs.append(sum(SYNC_WARNING in str(w.message) for w in self.caught[self.n_warn :]))


def build_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.d_model // 64),
        num_key_value_heads=max(1, args.d_model // 128), max_position_embeddings=args.seq,
        tie_word_embeddings=args.tied,
    )


def monitors(log_every: int) -> list[pl.Callback]:
    return [
        LogitStatsMonitor(log_every_n_steps=log_every),
        GradientDensityMonitor(log_every_n_steps=log_every),
        SynonymCollisionMonitor(every_n_steps=log_every, on_epoch_end=False),
        SharpnessCollapseAlert(log_every_n_steps=log_every),
    ]


def train(args, device: torch.device, callbacks: list[pl.Callback], log_every: int) -> tuple[StepClock, float]:
    """Train ``--steps`` steps; returns the clock and the peak allocated bytes (CUDA; 0 on the CPU)."""
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.steps * args.batch, args.seq))
    module = DictModule(build_config(args))
    caught: list = []
    clock = StepClock(device, caught)

    def keep_logits(mod, inp, out):
        if clock.keep:  # the last step only: holding every step's logits would inflate the peak
            clock.last_logits = out.detach()

    module.model.lm_head.register_forward_hook(keep_logits)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision="bf16-mixed",
        max_steps=args.steps, log_every_n_steps=log_every, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp(prefix="headwatch-gpu-check-")),
        callbacks=[*callbacks, clock],
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        clock.caught = rec
        trainer.fit(module, dict_batches(ids, args.batch))
    clock.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return clock, peak


def float64_reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Mean entropy and target NLL (nats) over the positions with a next token, in float64."""
    x = logits[:, :-1].double()  # position t predicts labels[t + 1]
    logp = F.log_softmax(x, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    nll = -logp.gather(-1, labels[:, 1:].unsqueeze(-1).to(x.device)).squeeze(-1)
    return ent.mean().item(), nll.mean().item()


def logsumexp_comparison(device: torch.device, rows: int, vocab: int, repeats: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(rows, vocab, device=device, generator=g) * 3).bfloat16()

    def timed(fn) -> tuple[float, float]:
        fn()
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del out
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
        return statistics.median(times), peak

    lse_t, lse_m = timed(lambda: torch.logsumexp(x, -1))
    hw_t, hw_m = timed(lambda: logit_statistics(x))
    print(f"logit_statistics vs torch.logsumexp on ({rows}, {vocab}) bf16: {1e3 * hw_t:.2f} ms vs "
          f"{1e3 * lse_t:.2f} ms = {hw_t / lse_t:.2f}x; peak extra MiB {hw_m:.1f} vs {lse_m:.1f}")
    sub = x[:256]
    logp = F.log_softmax(sub.double(), dim=-1)
    want = -(logp.exp() * logp).sum(-1)
    for name, ctx in (("plain", torch.autocast(device.type, enabled=False)),
                      ("autocast bf16", torch.autocast(device.type, dtype=torch.bfloat16))):
        with ctx:
            got = logit_statistics(sub).entropy
        print(f"  entropy vs float64, 256 rows, {name}: max |diff| {(got.double() - want).abs().max().item():.2e} nats")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke test of the script")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--lse-rows", type=int, default=8192)
    args = p.parse_args()
    if args.tiny:
        args.vocab, args.d_model, args.layers, args.seq, args.batch = 512, 64, 1, 32, 2
        args.steps, args.log_every, args.lse_rows = 4, 2, 64
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; Llama V={args.vocab} d_model={args.d_model} layers={args.layers} batch={args.batch}x{args.seq}"
          + f" {'tied' if args.tied else 'untied'}, {args.steps} steps, bf16-mixed")

    base, base_peak = train(args, device, [], log_every=10**9)
    quiet, quiet_peak = train(args, device, monitors(10**9), log_every=10**9)
    logging, log_peak = train(args, device, monitors(args.log_every), log_every=args.log_every)
    skip = min(2, args.steps - 1)  # first steps: compilation, allocator warm-up, headwatch setup
    t_base = statistics.median(base.times[skip:])
    t_quiet = statistics.median(quiet.times[skip:])
    n_log = args.steps // args.log_every
    extra = (sum(logging.times[skip:]) - sum(base.times[skip:])) / max(1, n_log)
    print(f"training step without headwatch: {1e3 * t_base:.2f} ms (median)")
    print(f"non-logging step overhead: {1e3 * (t_quiet - t_base):+.2f} ms = {100 * (t_quiet / t_base - 1):+.2f}%")
    if device.type == "cuda":
        print(f"  host syncs per step on non-logging steps: without headwatch {sum(base.syncs[skip:])}, "
              f"with {sum(quiet.syncs[skip:])} over {args.steps - skip} steps")
    else:
        print("  host syncs: not counted on the CPU (torch.cuda.set_sync_debug_mode needs CUDA)")
    print(f"logging step overhead: {1e3 * extra:+.1f} ms per logging step ({n_log} logging steps, "
          f"{100 * extra / t_base:+.1f}% of a step)")
    if device.type == "cuda":
        print(f"peak allocated: without headwatch {base_peak / 2**20:.0f} MiB, with (not logging) "
              f"{quiet_peak / 2**20:.0f} MiB, with (logging) {log_peak / 2**20:.0f} MiB: "
              f"extra {(log_peak - base_peak) / 2**20:+.0f} MiB")
    # the overhead budget's clock (CUDA events on every step, read at logging steps): no sync on the other steps,
    # and its measured share of wall time against the bare run's (an independent reference)
    quiet_steps = [n for i, n in enumerate(logging.syncs) if i >= skip and (i + 1) % args.log_every != 0]
    if device.type == "cuda":
        print(f"  host syncs on the logging run's non-logging steps (overhead clock on): {sum(quiet_steps)} "
              f"over {len(quiet_steps)} steps")
    spent = logging.metrics.get("headwatch/overhead/fraction_run", math.nan)
    bare = 1 - sum(base.times[skip:]) / sum(logging.times[skip:])
    print(f"overhead budget: headwatch's measured share of wall time {spent:.2%} (published overhead/fraction_run), "
          f"against the bare run {bare:.2%}; probe interval "
          f"{logging.metrics.get('headwatch/overhead/probe_interval', math.nan):.0f} steps")
    ent, nll = float64_reference(logging.last_logits, logging.last_labels)
    got_ent = logging.metrics.get("headwatch/logits/entropy", math.nan)
    got_nll = logging.metrics.get("headwatch/logits/target_nll", math.nan)
    print(f"last logging step, headwatch vs float64 from the head's output: entropy {got_ent:.6f} vs {ent:.6f} "
          f"(|diff| {abs(got_ent - ent):.1e}), target_nll {got_nll:.6f} vs {nll:.6f} (|diff| {abs(got_nll - nll):.1e})")
    logsumexp_comparison(device, args.lse_rows, args.vocab, repeats=10 if not args.tiny else 2)


if __name__ == "__main__":
    main()
