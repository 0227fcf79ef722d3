"""What watching costs a training step, on each front door, side by side.

One tiny causal LM (a Hugging Face ``LlamaForCausalLM`` built from a config: V 32000, d_model 256, 2 layers,
untied, batch 8 x 128 tokens, AdamW; see ``--help``) trains on the CPU through each of headwatch's three
front doors, bare (no headwatch) and watched (headwatch with its default monitors), in one process:

- plain loop: ``headwatch.Headwatch(model, writer=SummaryWriter(...))`` with ``step_start`` /
  ``before_optimizer_step`` / ``after_optimizer_step`` / ``step_end``; bare: the same loop without it;
- Hugging Face: ``transformers.Trainer`` (``report_to=["tensorboard"]``) with
  ``HeadwatchCallback()``; bare: the same Trainer without it;
- Lightning: ``lightning.pytorch.Trainer`` with a ``TensorBoardLogger`` and the callbacks
  ``TokenFrequency, LogitStatsMonitor, GradientDensityMonitor, SynonymCollisionMonitor``; bare: none.

Every door logs every ``--log-every`` steps (10: the plain loop's default; the Trainers are set to it,
their own defaults being 500 and 50); collision measures every 10 logging intervals and figures are
drawn then too (their defaults). The model logs its loss on the same steps in the Trainers, bare or not.

**Method.** The six trainings (3 doors x bare/watched) run in six threads that take turns: one thread
runs at a time, for one turn of ``--block`` steps (default 1), then hands over. Every round has a watched
turn of each door, and every other round (``--steps / --bare-steps``) a bare turn of that door too, just
before or after it (alternately); set-up and teardown take turns as well and are not timed, so no two
runs ever compete for the cores. A step is timed from one step boundary to the next, as seen from outside
headwatch: the start of an iteration (loop), ``on_step_begin`` (Hugging Face, a callback before
headwatch's), ``on_train_batch_start`` (Lightning, a callback before headwatch's); so a step includes the
door's logging after the optimizer step. The watched runs time ``--steps`` steps (default 100: one
collision step), the bare runs ``--bare-steps`` (default 50: their steps are all alike but for the
Trainers' own loss logging), then each run takes one more untimed step and ends. The first ``--warmup``
steps of each run are left out. About 6 minutes on 2 quiet cores (0.8 s a step).

**Figures** (per door). Each watched step is divided by the bare step of the same door nearest in time
(a few seconds apart: the speed of a shared machine drifts by +-20% over tens of seconds, which pairing
cancels and global medians do not; pairing single steps gave a 95% interval 4x narrower than pairing
10-step turns). Per kind of step: ``quiet`` (no logging), ``logging`` (headwatch measures; not collision),
``collision`` (the logging step where collision, and the figures, also run): the median of those ratios
and a distribution-free 95% interval for it; the whole run at the default cadence, the medians weighted
by the count of each kind in one collision interval (90, 9, 1 per 100 steps); and the measured whole run,
the watched steps' total time over their paired bare steps'. The bare step paired with a logging step
includes the Trainers' own loss logging only when it falls on a logging step (a scalar and a flush:
milliseconds). Targets: quiet <= 1.01x, logging <= 1.15x, whole run <= 1.01x, on 2 quiet CPU
cores. The load average, torch's thread count, and the share of the CPU used by other processes while
measuring (from ``/proc/stat``) are printed: on a busy machine the timings do not mean much.

``--contended``: ``--spinners`` (default 1) other processes run ``while True: pass`` during the whole
measurement (started and killed by the script, as ``bench/logit_stats.py --contended`` does).
``--quick``: 20 watched and 10 bare steps (about 1.5 minutes), a smoke run (no collision step: the whole-run ratio then
leaves collision out). ``--json PATH`` writes every step time.

Run: ``python bench/overhead.py [--quick] [--contended] [--steps 100] [--doors loop hf lightning]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logit_stats import _system_busy_seconds, other_cpu_share  # noqa: E402  (the load measurement, one copy)

DOORS = {"loop": "plain loop", "hf": "Hugging Face", "lightning": "Lightning"}


# ----------------------------------------------------------------------------- turn-taking
class Baton:
    """Only the run named at ``schedule[pos]`` runs; the others wait for their turn."""

    def __init__(self, schedule: list[str]) -> None:
        self.schedule, self.pos = schedule, 0
        self.last_door = ""
        """Progress is printed (stderr) when this door's watched run ends a turn."""
        self.cond = threading.Condition()
        self.error: BaseException | None = None

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or (self.pos < len(self.schedule) and self.schedule[self.pos] == name))
            if self.error is not None:
                raise RuntimeError(f"{name}: stopped, another run failed") from self.error

    def release(self, name: str) -> None:
        with self.cond:
            if self.schedule[self.pos] != name:
                raise RuntimeError(f"{name} released a turn that was {self.schedule[self.pos]}'s")
            self.pos += 1
            self.cond.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = self.error or err
            self.cond.notify_all()


@dataclass
class Run:
    """One training (a door, bare or watched) and the times of its steps."""

    door: str
    watched: bool
    timed: int
    """Steps timed; the run trains ``timed + 1`` steps."""
    block: int
    """Steps per turn."""
    baton: Baton
    figures: bool = True
    """Watched: headwatch's figures at their default (``"auto"``); False: none."""
    times: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    """``time.perf_counter()`` at the start of each timed step (pairs bare and watched steps in time)."""
    error: BaseException | None = None
    _i: int = 0
    _start: float = 0.0

    @property
    def name(self) -> str:
        return f"{DOORS[self.door]} {'watched' if self.watched else 'bare'}"

    def boundary(self) -> None:
        """A step starts (or the training ends): time the previous step; hand over at block ends."""
        now = time.perf_counter()
        i = self._i
        if 0 < i <= self.timed:
            self.times.append(now - self._start)
        if i == 0 or (i % self.block == 0 and i <= self.timed):  # end of set-up, of a block, of the timed steps
            if i % 10 == 0 and i and self.watched and self.door == self.baton.last_door:
                print(f"  {self.name}: {i} of {self.timed} steps, median {statistics.median(self.times):.2f} s", file=sys.stderr)
            self.baton.release(self.name)
            self.baton.wait(self.name)
        self._i += 1
        self._start = time.perf_counter()
        if i < self.timed:
            self.starts.append(self._start)


# ----------------------------------------------------------------------------- the model and data
@dataclass(frozen=True)
class Shapes:
    vocab: int
    d_model: int
    layers: int
    heads: int
    batch: int
    seq: int

    def describe(self) -> str:
        return (f"LlamaForCausalLM V={self.vocab}, d_model={self.d_model}, {self.layers} layers, {self.heads} heads, "
                f"d_ff={self.d_ff}, untied; batch {self.batch} x {self.seq} tokens; AdamW lr 1e-4")  # fmt: skip

    @property
    def d_ff(self) -> int:
        return 64 * math.ceil(8 * self.d_model / 3 / 64)  # Llama's ~8/3 d_model, a multiple of 64


def build_model(shapes: Shapes, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shapes.vocab, hidden_size=shapes.d_model, intermediate_size=shapes.d_ff, num_hidden_layers=shapes.layers,
        num_attention_heads=shapes.heads, num_key_value_heads=shapes.heads, max_position_embeddings=shapes.seq,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def token_ids(shapes: Shapes, steps: int, seed: int) -> torch.Tensor:
    """``(steps * batch, seq)`` ids drawn from a Zipf distribution (s = 1) over the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, shapes.vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, steps * shapes.batch * shapes.seq, replacement=True, generator=g).view(-1, shapes.seq)


class Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ----------------------------------------------------------------------------- the doors
def train_loop(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, log_every: int, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    import headwatch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    writer = SummaryWriter(str(out))
    figures = "auto" if run.figures else 0
    hw = headwatch.Headwatch(model, writer=writer, log_every_n_steps=log_every, figure_every_n_steps=figures) if run.watched else None
    for step, rows in enumerate(ids.split(shapes.batch)):
        run.boundary()
        batch = {"input_ids": rows, "labels": rows}
        if hw is not None:
            hw.step_start(batch, step)
        model(**batch).loss.backward()
        if hw is not None:
            hw.before_optimizer_step()
        optimizer.step()
        if hw is not None:
            hw.after_optimizer_step()
        optimizer.zero_grad()
        if hw is not None:
            hw.step_end()
    run.boundary()
    writer.close()


def train_hf(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, log_every: int, out: Path) -> None:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from headwatch.integrations.transformers import HeadwatchCallback

    class Boundaries(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.boundary()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.boundary()

    args = TrainingArguments(
        output_dir=str(out), max_steps=ids.shape[0] // shapes.batch, logging_steps=log_every, per_device_train_batch_size=shapes.batch,
        learning_rate=1e-4, report_to=["tensorboard"], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [Boundaries()] + ([HeadwatchCallback(figure_every_n_steps="auto" if run.figures else 0)] if run.watched else [])
    trainer = Trainer(model=model, args=args, train_dataset=Rows(ids), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the logged dicts on stdout (disable_tqdm), in both runs alike
    trainer.train()


def train_lightning(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, log_every: int, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    import headwatch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Boundaries(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            run.boundary()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            run.boundary()

    every = "auto" if run.figures else 0
    watch = [headwatch.TokenFrequency(), headwatch.LogitStatsMonitor(figure_every_n_steps=every),
             headwatch.GradientDensityMonitor(figure_every_n_steps=every),
             headwatch.SynonymCollisionMonitor(figures="auto" if run.figures else False)] if run.watched else []  # fmt: skip
    trainer = pl.Trainer(
        default_root_dir=str(out), max_steps=ids.shape[0] // shapes.batch, log_every_n_steps=log_every,
        logger=TensorBoardLogger(str(out)), callbacks=[Boundaries(), *watch], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(Rows(ids), batch_size=shapes.batch))


TRAIN: dict[str, Callable[..., None]] = {"loop": train_loop, "hf": train_hf, "lightning": train_lightning}


# ----------------------------------------------------------------------------- measuring


def measure(
    doors: list[str], shapes: Shapes, steps: int, bare_steps: int, block: int, log_every: int, seed: int, figures: bool = True
) -> list[Run]:
    """Train the bare and watched runs of ``doors`` in turns of ``block`` steps; returns the runs with their
    step times. Every round has a watched turn per door; every ``steps // bare_steps``-th round a bare turn
    too, before or after it (alternately)."""
    rounds, every = steps // block, steps // bare_steps
    runs = {}
    for door in doors:
        for watched in (False, True):
            r = Run(door, watched, steps if watched else bare_steps, block, Baton([]), figures)
            runs[r.name] = r
    schedule = list(runs)  # set-up turns
    for k in range(rounds):
        for door in doors:
            pair = [f"{DOORS[door]} bare", f"{DOORS[door]} watched"]
            if k % every:
                schedule.append(pair[1])
            else:
                schedule += pair if (k // every) % 2 == 0 else pair[::-1]
    schedule += list(runs)  # one more step and the teardown
    baton = Baton(schedule)
    baton.last_door = doors[-1]
    ids = token_ids(shapes, steps + 1, seed)

    def main(run: Run, out: Path) -> None:
        try:
            baton.wait(run.name)
            model = build_model(shapes, seed)
            TRAIN[run.door](run, model, ids[: (run.timed + 1) * shapes.batch], shapes, log_every, out)
            baton.release(run.name)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            run.error = err
            baton.fail(err)

    with tempfile.TemporaryDirectory() as tmp:
        threads = []
        for run in runs.values():
            run.baton = baton
            threads.append(threading.Thread(target=main, args=(run, Path(tmp) / run.name.replace(" ", "_")), name=run.name))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    failed = [r for r in runs.values() if r.error is not None and not isinstance(r.error, RuntimeError)]
    failed = failed or [r for r in runs.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"{failed[0].name} failed") from failed[0].error
    return list(runs.values())


DEFAULT_LOG_EVERY = {"loop": 10, "hf": 500, "lightning": 50}
"""Each door's logging interval when nobody sets one: ``Headwatch(log_every_n_steps=10)``, ``TrainingArguments.logging_steps``
(500), ``lightning.Trainer(log_every_n_steps=50)``; collision every 10 of them."""


def kind(step: int, log_every: int) -> str:
    if (step + 1) % (10 * log_every) == 0:
        return "collision"
    return "logging" if (step + 1) % log_every == 0 else "quiet"


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free 95% interval for it (order statistics ``n/2 -+ 0.98 sqrt(n)``)."""
    v = sorted(values)
    n = len(v)
    half = 0.98 * math.sqrt(n)
    return statistics.median(v), v[max(0, math.floor(n / 2 - half))], v[min(n - 1, math.ceil(n / 2 + half) - 1)]


def paired(bare: Run, watched: Run, log_every: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """Each watched step with the bare step of the same door nearest in time: ``{kind: [(watched s, bare s), ...]}``."""
    out: dict[str, list[tuple[float, float]]] = {"quiet": [], "logging": [], "collision": []}
    bare_steps = [(s, t) for i, (s, t) in enumerate(zip(bare.starts, bare.times)) if i >= warmup]
    for i, (start, t) in enumerate(zip(watched.starts, watched.times)):
        if i >= warmup:
            _, b = min(bare_steps, key=lambda st: abs(st[0] - start))
            out[kind(i, log_every)].append((t, b))
    return out


def report(runs: list[Run], doors: list[str], log_every: int, warmup: int) -> None:
    cycle = 10 * log_every
    counts = {"quiet": cycle - 10, "logging": 9, "collision": 1}  # per collision interval, at log_every 10
    targets = {"quiet": "<= 1.01x", "logging": "<= 1.15x", "collision": "", "whole run": "<= 1.01x"}
    print(f"{'door':<13} {'step':<28} {'n':>3} {'bare ms':>8} {'watched ms':>10} {'ratio':>7}  {'95% interval':<13}  target")
    for door in doors:
        bare = next(r for r in runs if r.door == door and not r.watched)
        watched = next(r for r in runs if r.door == door and r.watched)
        pairs = paired(bare, watched, log_every, warmup)
        name, used = DOORS[door], {}
        for k in counts:
            if not pairs[k]:
                print(f"{name:<13} {k:<28} {0:>3}  (not reached: needs --steps >= {cycle})")
                name = ""
                continue
            med, lo, hi = median_ci([w / b for w, b in pairs[k]])
            used[k] = med
            interval = f"{lo:.3f}-{hi:.3f}" if len(pairs[k]) > 1 else ""
            print(f"{name:<13} {k:<28} {len(pairs[k]):>3} {1e3 * statistics.median(b for _, b in pairs[k]):>8.0f} "
                  f"{1e3 * statistics.median(w for w, _ in pairs[k]):>10.0f} {med:>6.3f}x  {interval:<13}  {targets[k]}")  # fmt: skip
            name = ""
        n = {k: counts[k] for k in used}
        whole = sum(n[k] * used[k] for k in used) / sum(n.values())
        label = f"whole run ({'/'.join(str(n[k]) for k in used)} per {sum(n.values())})"
        print(f"{'':<13} {label:<28} {'':>3} {'':>8} {'':>10} {whole:>6.3f}x  {'':<13}  {targets['whole run']}")
        if len(used) == 3:  # the same medians at the cadence the door has when nobody sets it
            own = DEFAULT_LOG_EVERY[door]
            n = {"quiet": 10 * own - 10, "logging": 9, "collision": 1}
            whole = sum(n[k] * used[k] for k in used) / sum(n.values())
            label = f"whole run, logging every {own}"
            print(f"{'':<13} {label:<28} {'':>3} {'':>8} {'':>10} {whole:>6.3f}x  {'':<13}  (the door's default)")
        everything = [p for k in pairs for p in pairs[k]]
        measured = sum(w for w, _ in everything) / sum(b for _, b in everything)
        print(f"{'':<13} {'measured (sum of the pairs)':<28} {len(everything):>3} {'':>8} {'':>10} {measured:>6.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doors", nargs="+", choices=list(DOORS), default=list(DOORS))
    parser.add_argument("--steps", type=int, default=100, help="timed steps of each watched run (default 100: one collision step)")
    parser.add_argument("--bare-steps", type=int, default=50, help="timed steps of each bare run (default 50)")
    parser.add_argument("--block", type=int, default=1, help="steps per turn (default 1: finest pairing)")
    parser.add_argument("--log-every", type=int, default=10, help="logging interval of every door (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--quick", action="store_true", help="20 watched steps: a smoke run (no collision step)")
    parser.add_argument("--contended", action="store_true", help="run --spinners busy processes during the measurement")
    parser.add_argument("--spinners", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-figures", action="store_true", help="watched runs draw no figures (default: theirs, 'auto')")
    parser.add_argument("--json", type=Path, help="also write every run's step times (seconds) to this file")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.bare_steps = 20, 10
    if args.steps % args.block or args.bare_steps % args.block or args.steps % args.bare_steps or args.bare_steps <= args.warmup:
        parser.error("--steps and --bare-steps must be multiples of --block, --steps a multiple of --bare-steps, and "
                     f"--bare-steps above --warmup; got {args.steps}, {args.bare_steps}, {args.block}, {args.warmup}")  # fmt: skip
    bare_steps = args.bare_steps

    warnings.filterwarnings("ignore")
    import lightning
    import lightning.pytorch
    import transformers

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("lightning")]:
        logging.getLogger(name).setLevel(logging.ERROR)  # set-up lines and "`Trainer.fit` stopped", six times

    transformers.logging.set_verbosity_error()
    import headwatch

    shapes = Shapes(args.vocab, args.d_model, args.layers, args.heads, args.batch, args.seq)
    params = sum(p.numel() for p in build_model(shapes, args.seed).parameters())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (os.cpu_count: {os.cpu_count()}), "
          f"{platform.machine()}; python {platform.python_version()}, transformers {transformers.__version__}, "
          f"lightning {lightning.__version__}, headwatch {headwatch.__version__}")  # fmt: skip
    print(f"model: {shapes.describe()}; {params / 1e6:.1f}M parameters")
    print(f"cadence: every door logs every {args.log_every} steps, collision and figures every {10 * args.log_every}; "
          f"{args.steps} timed steps per watched run, {bare_steps} per bare run, in turns of {args.block} "
          f"(a bare turn every {args.steps // bare_steps} watched turns); first {args.warmup} steps left out; "
          f"figures {'none' if args.no_figures else 'at their default'}")  # fmt: skip
    print(f"load average before: {load}")

    procs = []
    if args.contended:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
        time.sleep(0.5)  # let the spinners get scheduled
        print(f"contended: {args.spinners} other process(es) running `while True: pass` during the measurement")
    busy0, own0, wall0 = _system_busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    try:
        runs = measure(args.doors, shapes, args.steps, bare_steps, args.block, args.log_every, args.seed, not args.no_figures)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    contention = other_cpu_share(busy0, own0, wall0)
    wall = time.perf_counter() - wall0
    if args.json is not None:
        args.json.write_text(json.dumps({r.name: r.times for r in runs}, indent=1))
    print()
    report(runs, args.doors, args.log_every, args.warmup)
    print()
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU used by other processes while "
          f"measuring: {contention}; {wall:.0f} s")  # fmt: skip
    print("ratio: median of (watched step / the bare step of the same door nearest in time), with its 95% interval;\n"
          "whole run: those medians weighted by the count of each kind of step in one collision interval;\n"
          "measured: the watched steps' total time over their paired bare steps' (collision included when reached).")


if __name__ == "__main__":
    main()
