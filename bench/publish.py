"""What publishing one logging step costs on each front door, side by side.

The same publication (``--scalars`` values, default 150 as a logging step of the default monitors, and a
``Media`` with ``--histograms`` row-norm histograms of ``--rows`` values, default 3 of 32000) goes through
each door's own sink, in one process, into real TensorBoard event files in a temporary directory:

- plain loop: ``headwatch.tensorboard.WriterSink`` over a ``SummaryWriter`` (what ``headwatch.Headwatch`` uses);
- Hugging Face: ``TrainerSink`` of a ``HeadwatchCallback`` attached to a ``transformers.Trainer``
  (``report_to=["tensorboard"]``; a tiny model, never trained): ``Trainer.log`` with its ``TensorBoardCallback``
  and console printers, media to the Trainer's writer;
- Lightning: ``LightningSink`` of a ``lightning.pytorch.Trainer`` with headwatch's ``TensorBoardLogger``
  (never fitted): ``log_metrics`` of every logger, ``trainer.callback_metrics``, media, one flush.

**Method.** ``--rounds`` rounds (default 40, the first 3 left out); each round publishes once through every
door, in an order that rotates from round to round, at a new step. Per door: the median time of one
publication and its ratio to the plain loop's median (target: at most 1.0x, the Trainers' publishing no
dearer than the plain loop's), and the median of the per-round ratios (each round's HF or Lightning time over
the same round's loop time: a shared machine's drift cancels). The load average and the CPU used by other
processes are printed.

Run: ``python bench/publish.py [--rounds 40] [--scalars 150] [--histograms 3] [--rows 32000]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logit_stats import _system_busy_seconds, other_cpu_share


def publication(scalars: int, histograms: int, rows: int) -> tuple[dict[str, float], Any]:
    from headwatch.core.monitor import Media

    g = torch.Generator().manual_seed(0)
    numbers = {f"headwatch/bench/value_{i:03d}": float(v) for i, v in enumerate(torch.rand(scalars, generator=g))}
    media = Media(histograms={f"headwatch/bench/histogram_{i}": torch.rand(rows, generator=g) for i in range(histograms)})
    return numbers, media


def loop_sink(root: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    from headwatch import tensorboard as tb

    return tb.WriterSink([SummaryWriter(str(root / "loop"))])


def hf_sink(root: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from headwatch.integrations.transformers import attach

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    args = TrainingArguments(output_dir=str(root / "hf"), report_to=["tensorboard"],
                             use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(config), args=args)
    callback = attach(trainer)
    return callback.run.sinks[0]


def lightning_sink(root: Path) -> Any:
    import lightning.pytorch as pl

    from headwatch.integrations.lightning.door import LightningSink
    from headwatch.integrations.lightning.logger import TensorBoardLogger

    trainer = pl.Trainer(logger=TensorBoardLogger(str(root / "lightning")), accelerator="cpu", enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    return LightningSink(SimpleNamespace(trainer=trainer, published={}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--scalars", type=int, default=150)
    parser.add_argument("--histograms", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in [n for n in logging.root.manager.loggerDict if n.startswith(("lightning", "transformers"))]:
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    numbers, media = publication(args.scalars, args.histograms, args.rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.scalars} scalars and {args.histograms} "
          f"histograms of {args.rows} values per publication; {args.rounds} rounds (first {args.warmup} left out)")  # fmt: skip
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sinks = {"plain loop": loop_sink(root), "Hugging Face": hf_sink(root), "Lightning": lightning_sink(root)}
        times: dict[str, list[float]] = {name: [] for name in sinks}
        busy0, own0, wall0 = _system_busy_seconds(), sum(os.times()[:2]), time.perf_counter()
        names = list(sinks)
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                sinks[name].publish(numbers, [media], step=r, val=False)
                times[name].append(time.perf_counter() - start)
        contention = other_cpu_share(busy0, own0, wall0)
    kept = {name: t[args.warmup :] for name, t in times.items()}
    base = statistics.median(kept["plain loop"])
    print()
    print(f"{'door':14s} {'median ms':>10s} {'vs loop (medians)':>18s} {'vs loop (per round)':>20s}")
    for name, t in kept.items():
        per_round = statistics.median(a / b for a, b in zip(t, kept["plain loop"]))
        print(f"{name:14s} {statistics.median(t) * 1e3:10.2f} {statistics.median(t) / base:17.3f}x {per_round:19.3f}x")
    print()
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU used by other processes while "
          f"measuring: {contention}")  # fmt: skip
    print("target: the Trainers' publishing no dearer than the plain loop's (<= 1.0x)")


if __name__ == "__main__":
    main()
