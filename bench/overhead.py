"""What watching costs a training run, on each front door at its defaults, priced and checked.

Per front door (plain loop, Hugging Face ``Trainer``, Lightning), at the door's
defaults (the plain loop logs every 50 steps, the Hugging Face ``TrainingArguments.logging_steps`` default of
500, Lightning's ``log_every_n_steps`` of 50; ``overhead_budget=0.01`` and its probe cadence as headwatch
decides it; figures at their default), for two shapes of a ``LlamaForCausalLM`` built from a config (untied,
AdamW, CPU):

- ``logits``: V 32000, d_model 256, 2 layers, batch 8 x 128 (the worst case: the head and the logits are about
  80% of a step's arithmetic);
- ``quarter``: V 8000, d_model 512, 4 layers, batch 4 x 128: the head is about a quarter of the arithmetic
  (as in Llama 3.2 1B, where it is 21%); the printed header gives the share computed from the shapes.

**Pricing.** A bare run (no headwatch) and a watched run of the door (logging every ``--price-every`` steps, 2: to
collect many logging steps, and a window whose one quiet step's extra, the noisiest figure on a shared machine,
weighs once in the bench's side of the window comparison; everything else at the defaults) train in one process, in two threads that take
turns of one step (set-up and teardown untimed), so the two never compete for the cores and a shared machine's
drift cancels. Each watched step is divided by the bare step nearest in time, and headwatch says which steps
were logging and which probe steps (``Overhead.begin``). From the medians of those ratios (quiet, logging,
probe; the quiet ones of the real run below pooled with the pricing run's) and headwatch's own probe decisions (:class:`headwatch.core.overhead.Overhead` fed with the priced
costs), a ``--run-steps`` (2000) run at the door's default is priced: the whole run over the same steps bare, and
a 95% upper bound for it (bootstrap: the ratios of each kind resampled, 2000 times, one-sided).

**Checked by one real run.** A bare and a watched run of ``--real-steps`` (at most 300) at the door's defaults,
in turns of one step as above, timed whole (the end of training, with its end probe, included): the measured
ratio beside the priced one for the same number of steps. headwatch's own accounting (``overhead/fraction``,
``fraction_run``) is compared with the bench's. A window is the steps from the end of one logging step's work to
the end of the next one's (``--price-every`` steps, its publishing included): headwatch's seconds of a pricing-run
window without a probe (median over windows) against the bench's extra seconds of the same steps,
``(every - 1) x quiet extra + logging extra``, each extra the median of watched - bare over its paired steps (the
quiet ones of the pricing and the real run together). Over the real run, headwatch's seconds (every window, the end
of training and closing included) over the watched run's time against the bench's extra over the same: each
logging and probe step's own watched - bare, the end of training's, and the quiet steps at their median extra (a
quiet step's extra is far below the noise of one pair: summed, 50 pairs' noise would be the figure; the sum of
every pair is printed beside it). Both sides in the seconds of ``--clock``: with ``--clock cpu`` headwatch's own
clock reads the process's CPU seconds too. ``--aa`` adds an A/A run per door (the real run's length, neither slot
watched): the median step difference between the two slots, the bench's own bias, is taken off every step's extra.

**Pass** (printed per criterion): a logging step <= 1.12x bare; quiet steps <= 1.005x; the priced whole run
<= 1.01x with its 95% upper bound <= 1.02x; headwatch's seconds of a window within 20% of the bench's;
``fraction_run`` within 0.5 points of the bench's. The load average, torch's thread count and the share of the
CPU used by other processes while measuring (``/proc/stat``) are printed: on a busy machine the timings do
not mean much.

``--quick``: the ``logits`` shape, 16 pricing steps (logging every 2), real runs of 50 steps: a smoke run.
About 25 minutes on 2 quiet cores with the defaults (from the step times: 30 + 60 steps a door and shape, bare
and watched, and 3 probes). ``--json PATH`` writes every step time.

Run: ``python bench/overhead.py [--quick] [--doors loop hf lightning] [--shapes logits quarter]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
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
from logit_stats import _system_busy_seconds, other_cpu_share

DOORS = {"loop": "plain loop", "hf": "Hugging Face", "lightning": "Lightning"}
DEFAULT_LOG_EVERY = {"loop": 50, "hf": 500, "lightning": 50}
"""Each door's logging interval when nobody sets one: ``Headwatch(log_every_n_steps=50)``,
``TrainingArguments.logging_steps`` (500), ``lightning.Trainer(log_every_n_steps=50)``."""
BUDGET = 0.01
CPU_CLOCK = time.process_time
"""The CPU seconds of ``--clock cpu``; ``--clock thread``: ``time.thread_time`` (torch at one thread)."""
"""``overhead_budget``'s default on every door."""


# ----------------------------------------------------------------------------- turn-taking
class Baton:
    """Only the run named at ``schedule[pos]`` runs; the others wait for their turn."""

    def __init__(self, schedule: list[str]) -> None:
        self.schedule, self.pos = schedule, 0
        self.cond = threading.Condition()
        self.error: BaseException | None = None

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(
                lambda: self.error is not None or (self.pos < len(self.schedule) and self.schedule[self.pos] == name)
            )
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
    steps: int
    log_every: int
    baton: Baton
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """The same steps in CPU seconds (:data:`CPU_CLOCK`: the process's, one run works at a time; or the thread's)."""
    starts: list[float] = field(default_factory=list)
    """``time.perf_counter()`` at the start of each step (pairs bare and watched steps in time)."""
    end: float = 0.0
    """Seconds from the last step's end to the end of training (the door's end event: the end probe)."""
    flags: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    """headwatch's step -> (logging step, probe step), from ``Overhead.begin``."""
    published: list[dict[str, float]] = field(default_factory=list)
    """Each window headwatch completed (``Overhead.settle``): its seconds, wall time and published values."""
    wall: tuple[list[float], float] | None = None
    """The wall-clock step times and end when the figures are in CPU seconds (``--clock cpu``)."""
    overhead: Any = None
    """The watched run's ``Overhead`` (its ``run_seconds`` after training: headwatch's seconds over the run)."""
    error: BaseException | None = None
    aa: bool = False
    """An A/A run: the run in the watched slot trains bare too (the bench's own bias between the two slots)."""
    _i: int = 0
    _start: float = 0.0
    _cpu: float = 0.0
    cpu_end: float = 0.0

    @property
    def watching(self) -> bool:
        return self.watched and not self.aa

    @property
    def name(self) -> str:
        return f"{self.door} {'watched' if self.watched else 'bare'}"

    def boundary(self) -> None:
        """A step starts (or the last one ended): time the previous step, then hand over to the other run."""
        now = time.perf_counter()
        if 0 < self._i <= self.steps:
            self.times.append(now - self._start)
            self.cpu.append(CPU_CLOCK() - self._cpu)
        if self._i <= self.steps:
            self.baton.release(self.name)
            self.baton.wait(self.name)
        self._i += 1
        self._start, self._cpu = time.perf_counter(), CPU_CLOCK()
        if self._i <= self.steps:
            self.starts.append(self._start)

    def finished(self) -> None:
        """Training returned: the time since the last boundary (the end of training) is :attr:`end`."""
        self.end, self.cpu_end = time.perf_counter() - self._start, CPU_CLOCK() - self._cpu

    def kinds(self) -> list[str]:
        """``quiet``, ``logging`` or ``probe`` for each timed step (headwatch's steps in order)."""
        ordered = [self.flags[s] for s in sorted(self.flags)][: len(self.times)]
        return ["probe" if p else "logging" if lg else "quiet" for lg, p in ordered] + ["quiet"] * (
            len(self.times) - len(ordered)
        )


_RUNS: dict[str, Run] = {}
"""The watched run of each thread (by thread name): what headwatch's ``Overhead`` records into."""


def record_overhead() -> None:
    """Wrap ``Overhead.begin`` and ``Overhead.settle`` to record, for the calling thread's run, which steps log and
    probe and each window headwatch completes (its seconds and wall time, and the values it published at its
    logging step); the values themselves are untouched."""
    from headwatch.core.overhead import Overhead

    begin, settle = Overhead.begin, Overhead.settle

    def begin_recorded(self: Overhead, step: int, logging: bool, first: bool) -> None:
        begin(self, step, logging, first)
        run = _RUNS.get(threading.current_thread().name)
        if run is not None:
            run.flags[step] = (logging, self.probing)

    def settle_recorded(self: Overhead) -> None:
        closed = self.closed
        settle(self)
        run = _RUNS.get(threading.current_thread().name)
        if run is not None:
            run.overhead = self
            if self.closed > closed:
                fraction = next(v for k, v in self.last.items() if k.endswith("overhead/fraction"))
                run_fraction = next(v for k, v in self.last.items() if k.endswith("overhead/fraction_run"))
                run.published.append({"fraction": fraction, "fraction_run": run_fraction, "spent": self.window[0] + self.window[1],
                                      "wall": self.window[2], "probe": self.window[1], "at": len(run.times)})  # fmt: skip

    Overhead.begin, Overhead.settle = begin_recorded, settle_recorded  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- the model and data
@dataclass(frozen=True)
class Shapes:
    vocab: int
    d_model: int
    layers: int
    heads: int
    batch: int
    seq: int

    @property
    def d_ff(self) -> int:
        return 64 * -(-8 * self.d_model // 3 // 64)  # Llama's ~8/3 d_model, a multiple of 64

    def head_share(self) -> float:
        """The head's share of a step's matrix arithmetic (per token: head ``2 d V``; a layer ``8 d^2`` projections,
        ``6 d d_ff`` MLP, ``4 T d`` attention scores)."""
        d = self.d_model
        head = 2 * d * self.vocab
        layer = 8 * d * d + 6 * d * self.d_ff + 4 * self.seq * d
        return head / (head + self.layers * layer)

    def describe(self) -> str:
        return (f"LlamaForCausalLM V={self.vocab}, d_model={self.d_model}, {self.layers} layers, {self.heads} heads, "
                f"d_ff={self.d_ff}, untied; batch {self.batch} x {self.seq} tokens; AdamW lr 1e-4; "
                f"head {100 * self.head_share():.0f}% of the matrix arithmetic")  # fmt: skip


SHAPES = {"logits": Shapes(32000, 256, 2, 4, 8, 128), "quarter": Shapes(8000, 512, 4, 8, 4, 128)}


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


# ----------------------------------------------------------------------------- the doors, at their defaults
def train_loop(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    import headwatch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    writer = SummaryWriter(str(out))
    hw = headwatch.Headwatch(model, writer=writer, log_every_n_steps=run.log_every) if run.watching else None
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
    if hw is not None:
        hw.close()
    writer.close()
    run.finished()


def train_hf(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, out: Path) -> None:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from headwatch.integrations.transformers import HeadwatchCallback

    class Boundaries(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.boundary()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.boundary()

    every = {} if run.log_every == DEFAULT_LOG_EVERY["hf"] else {"logging_steps": run.log_every}
    args = TrainingArguments(
        output_dir=str(out), max_steps=ids.shape[0] // shapes.batch, per_device_train_batch_size=shapes.batch,
        learning_rate=1e-4, report_to=["tensorboard"], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, **every,
    )  # fmt: skip
    callbacks = [Boundaries()] + ([HeadwatchCallback()] if run.watching else [])
    trainer = Trainer(model=model, args=args, train_dataset=Rows(ids), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the logged dicts on stdout (disable_tqdm), in both runs alike
    trainer.train()
    run.finished()


def train_lightning(run: Run, model: Any, ids: torch.Tensor, shapes: Shapes, out: Path) -> None:
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

    watch = [headwatch.TokenFrequency(), headwatch.LogitStatsMonitor(), headwatch.GradientDensityMonitor(),
             headwatch.SynonymCollisionMonitor()] if run.watching else []  # fmt: skip
    trainer = pl.Trainer(
        default_root_dir=str(out), max_steps=ids.shape[0] // shapes.batch, log_every_n_steps=run.log_every,
        logger=TensorBoardLogger(str(out)), callbacks=[Boundaries(), *watch], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(Rows(ids), batch_size=shapes.batch))
    run.finished()


TRAIN: dict[str, Callable[..., None]] = {"loop": train_loop, "hf": train_hf, "lightning": train_lightning}


def interleaved(door: str, shapes: Shapes, steps: int, log_every: int, seed: int, aa: bool = False) -> tuple[Run, Run]:
    """A bare and a watched run of ``door``, ``steps`` steps each, in turns of one step (set-up and teardown in
    turns too, untimed, but for the end of training: :attr:`Run.end`). ``aa``: the watched slot trains bare too.
    Returns ``(bare, watched)``."""
    bare, watched = (Run(door, w, steps, log_every, Baton([]), aa=aa) for w in (False, True))
    schedule = [bare.name, watched.name]  # set-up
    for k in range(steps):
        schedule += [bare.name, watched.name] if k % 2 == 0 else [watched.name, bare.name]
    schedule += [bare.name, watched.name]  # the end of training and teardown
    baton = Baton(schedule)
    ids = token_ids(shapes, steps, seed)

    def main(run: Run, out: Path) -> None:
        try:
            baton.wait(run.name)
            model = build_model(shapes, seed)
            TRAIN[run.door](run, model, ids, shapes, out)
            baton.release(run.name)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            run.error = err
            baton.fail(err)

    with tempfile.TemporaryDirectory() as tmp:
        threads = []
        for run in (bare, watched):
            run.baton = baton
            threads.append(threading.Thread(target=main, args=(run, Path(tmp) / run.name.replace(" ", "_")), name=run.name))
        _RUNS[watched.name] = watched
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _RUNS.pop(watched.name, None)
    for run in (watched, bare):
        if run.error is not None and not isinstance(run.error, RuntimeError):
            raise RuntimeError(f"{run.name} failed") from run.error
    for run in (watched, bare):
        if run.error is not None:
            raise RuntimeError(f"{run.name} failed") from run.error
    return bare, watched


# ----------------------------------------------------------------------------- figures
def median_ci(values: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free 95% interval for it (order statistics ``n/2 -+ 0.98 sqrt(n)``)."""
    v = sorted(values)
    n = len(v)
    half = 0.98 * n**0.5
    return statistics.median(v), v[max(0, int(n / 2 - half))], v[min(n - 1, -int(-(n / 2 + half)) - 1)]


def paired(bare: Run, watched: Run, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """Each watched step with the bare step nearest in time: ``{kind: [(watched s, bare s), ...]}`` (the first
    ``warmup`` steps of each run left out, but for probe steps: the first logging step is one)."""
    out: dict[str, list[tuple[float, float]]] = {"quiet": [], "logging": [], "probe": []}
    bare_steps = [(s, t) for i, (s, t) in enumerate(zip(bare.starts, bare.times)) if i >= warmup]
    for i, (start, t, k) in enumerate(zip(watched.starts, watched.times, watched.kinds())):
        if i >= warmup or k == "probe":
            out[k].append((t, min(bare_steps, key=lambda st: abs(st[0] - start))[1]))
    return out


def probe_steps(steps: int, every: int, cost: dict[str, float], bare_s: float) -> set[int]:
    """The steps headwatch probes in a run of ``steps`` steps logging every ``every``, its decisions fed with the
    priced costs (``cost``: seconds over bare per kind): its own :class:`Overhead`, and the end of training."""
    from headwatch.core.overhead import Overhead

    over = Overhead(BUDGET, "bench")
    over.configure(every, [])
    probes: set[int] = set()
    for step in range(every - 1, steps, every):
        over.begin(step, True, False)  # as the orchestrator: the first logging step, the probe decision, the step count
        probing = over.probing
        if probing:
            probes.add(step)
        statistics_s = cost["logging"]
        probe_s = cost["probe"] - cost["logging"] if probing else 0.0
        wall = every * bare_s + statistics_s + probe_s
        over.decide(statistics_s, probe_s, wall, 1.0 if probing else 0.0, steps=over.steps_watched())
    if steps - 1 not in probes:
        probes.add(steps - 1)  # the end of training probes the last step (Orchestrator.end_run)
    return probes


def price(ratios: dict[str, float], steps: int, every: int, bare_s: float) -> float:
    """A ``steps``-step run at logging interval ``every`` over the same run bare, from per-kind step ratios. The end
    of training's probe, when the last step is not a logging step, is one probe's work over a quiet step."""
    cost = {k: (r - 1) * bare_s for k, r in ratios.items()}
    probes = probe_steps(steps, every, cost, bare_s)
    logging_steps = {s for s in range(every - 1, steps, every)}
    total = 0.0
    for k, n in (("probe", len(probes & logging_steps)), ("logging", len(logging_steps - probes))):
        total += n * ratios[k]
    total += (steps - len(logging_steps)) * ratios["quiet"]
    if steps - 1 not in logging_steps:
        total += ratios["probe"] - ratios["logging"]
    return total / steps


def bootstrap_upper(pairs: dict[str, list[tuple[float, float]]], steps: int, every: int, bare_s: float, seed: int) -> float:
    """One-sided 95% upper bound of :func:`price` (each kind's ratios resampled with replacement, 2000 times)."""
    rng = random.Random(seed)
    ratios = {k: [w / b for w, b in v] for k, v in pairs.items()}
    priced = []
    for _ in range(2000):
        draw = {k: statistics.median(rng.choices(v, k=len(v))) for k, v in ratios.items()}
        priced.append(price(draw, steps, every, bare_s))
    priced.sort()
    return priced[int(0.95 * len(priced))]


@dataclass
class Verdict:
    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)

    def check(self, what: str, value: str, target: str, ok: bool) -> None:
        self.rows.append((what, value, target, ok))
        print(f"    {'PASS' if ok else 'FAIL'}  {what:<58} {value:<34} target {target}")


def door_report(
    door: str, shape: str, price_runs: tuple[Run, Run], real_runs: tuple[Run, Run], args: Any, verdict: Verdict,
    aa_runs: tuple[Run, Run] | None = None,
) -> dict[str, Any]:
    bare, watched = price_runs
    pairs = paired(bare, watched, args.warmup)
    missing = [k for k, v in pairs.items() if not v]
    print(f"  {DOORS[door]} ({shape}): priced from a run logging every {watched.log_every}; "
          + ", ".join(f"{k} {len(v)}" for k, v in pairs.items()) + " paired steps (and the real run's quiet ones)")  # fmt: skip
    if missing:
        print(f"    no {', '.join(missing)} step: nothing priced (more --price-steps)")
        return {}
    bare_s = statistics.median(bare.times[args.warmup :])
    rb, rw = real_runs
    real_pairs = paired(rb, rw, args.warmup)
    # the quiet steps of the real run too: the same steps of the same door and shape, their pairs as adjacent in
    # time, which narrows the quiet median's interval (the price's largest term) for no more steps
    pairs = {**pairs, "quiet": pairs["quiet"] + real_pairs["quiet"]}
    med = {}
    for k, v in pairs.items():
        m, lo, hi = median_ci([w / b for w, b in v])
        med[k] = m
        print(
            f"    {k:<8} {m:.4f}x ({lo:.3f}-{hi:.3f}), bare {1e3 * bare_s:.0f} ms, watched {1e3 * statistics.median(w for w, _ in v):.0f} ms"
        )
    every = DEFAULT_LOG_EVERY[door]
    whole = price(med, args.run_steps, every, bare_s)
    upper = bootstrap_upper(pairs, args.run_steps, every, bare_s, args.seed)
    probes = sorted(probe_steps(args.run_steps, every, {k: (r - 1) * bare_s for k, r in med.items()}, bare_s))
    print(f"    {args.run_steps} steps logging every {every}: probes at steps {probes}")
    verdict.check(f"{door}/{shape}: logging step", f"{med['logging']:.4f}x", "<= 1.12x", med["logging"] <= 1.12)
    verdict.check(f"{door}/{shape}: quiet steps", f"{med['quiet']:.4f}x", "<= 1.005x", med["quiet"] <= 1.005)
    verdict.check(f"{door}/{shape}: whole run ({args.run_steps} steps), priced", f"{whole:.4f}x", "<= 1.01x", whole <= 1.01)
    verdict.check(f"{door}/{shape}: whole run, 95% upper bound", f"{upper:.4f}x", "<= 1.02x", upper <= 1.02)
    # headwatch's own seconds of a window (the steps from the end of one logging step's work to the end of the
    # next one's; the pricing run's windows that held no probe) against the bench's extra seconds of the same steps:
    # (every - 1) quiet steps and one logging step, each extra the median of watched - bare over its paired steps
    # (the quiet steps of the pricing and the real run together: a quiet step's extra is small against the noise).
    # In the seconds of --clock: headwatch's clock reads them too (main)
    # With --aa, the bench's own bias between the two slots (an A/A run's median step difference) is taken off every
    # step's extra.
    bias = statistics.median(w - b for w, b in paired(*aa_runs, args.warmup)["quiet"]) if aa_runs else 0.0
    if aa_runs:
        print(f"    A/A run of {args.real_steps} steps: the watched slot {1e3 * bias:+.1f} ms a step (median), taken off every step")
    quiet = statistics.median(w - b for w, b in pairs["quiet"]) - bias  # the pricing and the real run's
    logging_extra = statistics.median(w - b for w, b in pairs["logging"]) - bias
    own = [p["spent"] for p in watched.published if p["probe"] == 0]
    bench = (watched.log_every - 1) * quiet + logging_extra
    if own:
        mine = statistics.median(own)
        print(f"    a window of {watched.log_every} steps: headwatch {1e3 * mine:.0f} ms (median of {len(own)} windows); bench "
              f"{watched.log_every - 1} x {1e3 * quiet:.1f} ms quiet ({len(pairs['quiet'])} "
              f"pairs) + {1e3 * logging_extra:.0f} ms logging ({len(pairs['logging'])} pairs)")  # fmt: skip
        verdict.check(f"{door}/{shape}: headwatch's seconds of a logging window vs bench", f"{1e3 * mine:.0f} ms vs {1e3 * bench:.0f} ms",
                      "within 20%", abs(mine - bench) <= 0.2 * abs(bench))  # fmt: skip
    # the real run at the door's default
    wall_w, wall_b = sum(rw.times) + rw.end, sum(rb.times) + rb.end
    measured = wall_w / wall_b
    priced_real = price(med, args.real_steps, every, bare_s)
    kinds = rw.kinds()
    print(f"    real run, {args.real_steps} steps at the default: {kinds.count('logging')} logging, {kinds.count('probe')} probe "
          f"steps, end {rw.end:.1f} s (bare {rb.end:.1f} s); measured {measured:.4f}x, priced {priced_real:.4f}x")  # fmt: skip
    result = {
        "ratios": med,
        "bare_s": bare_s,
        "whole": whole,
        "upper": upper,
        "measured_real": measured,
        "priced_real": priced_real,
    }
    if rw.overhead is not None:
        # headwatch's wall time also holds the bare run's turns (the runs alternate): its fraction_run is read as
        # its own seconds over the run (run_seconds: every window, the end of training and closing included) over
        # the watched run's time, both in the seconds of --clock
        # the bench's extra: each logging or probe step's own watched - bare (step i of one run against step i of
        # the other, adjacent in time), the end of training's, and for the quiet steps, whose extra is far below the
        # noise of one pair, their median (summed, the pairs' noise would be the figure)
        own_w, own_b = sum(rw.times) + rw.end, sum(rb.times) + rb.end
        hw_run = rw.overhead.run_seconds[0] / own_w
        diffs = [(k, w - b - bias) for k, w, b in zip(rw.kinds(), rw.times, rb.times)]
        extra_run = sum(d for k, d in diffs if k != "quiet") + quiet * sum(k == "quiet" for k, _ in diffs) + rw.end - rb.end
        bench_run = extra_run / own_w
        print(f"    real run: headwatch's seconds {rw.overhead.run_seconds[0]:.2f} s, the bench's extra {extra_run:.2f} s "
              f"(every pair summed: {own_w - own_b:.2f} s) of {own_w:.1f} s watched")  # fmt: skip
        verdict.check(f"{door}/{shape}: fraction_run vs bench (real run)", f"{100 * hw_run:.2f}% vs {100 * bench_run:.2f}%",
                      "within 0.5 points", abs(hw_run - bench_run) <= 0.005)  # fmt: skip
        result.update(fraction_run=hw_run, published_fraction_run=rw.published[-1]["fraction_run"] if rw.published else None, bench_fraction_run=bench_run,
                      bench_extra_all_pairs=own_w - own_b)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doors", nargs="+", choices=list(DOORS), default=list(DOORS))
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--price-steps", type=int, default=40, help="steps of each pricing run (default 40)")
    parser.add_argument("--price-every", type=int, default=2, help="logging interval of the pricing runs (default 2)")
    parser.add_argument("--real-steps", type=int, default=60, help="steps of each real run, at most 300 (default 60)")
    parser.add_argument("--run-steps", type=int, default=2000, help="the run priced (default 2000 steps)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--quick", action="store_true", help="the logits shape, 16 pricing steps logging every 2, real runs of 50: a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "cpu", "thread"), default="wall",
                        help="time steps, and headwatch's own clock, in wall seconds (default), in the process's CPU seconds, or in the "
                             "run's thread's CPU seconds with torch at one thread (both less moved by other jobs)")  # fmt: skip
    parser.add_argument("--aa", action="store_true",
                        help="also an A/A run per door (neither slot watched): the slots' own bias is taken off every step's extra")
    parser.add_argument("--json", type=Path, help="also write every step time (seconds) and the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.price_steps, args.price_every, args.real_steps = ["logits"], 16, 2, 50
    if not 0 < args.real_steps <= 300:
        parser.error(f"--real-steps must be in 1..300, got {args.real_steps}")

    warnings.filterwarnings("ignore")
    import lightning
    import lightning.pytorch
    import transformers

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("lightning")]:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("headwatch").setLevel(logging.ERROR)  # the over-budget notes of the pricing runs
    transformers.logging.set_verbosity_error()
    import headwatch

    record_overhead()
    if args.clock != "wall":  # headwatch's own clock counts the same seconds as the bench (one run works at a time)
        import types

        from headwatch.core import overhead

        global CPU_CLOCK
        if args.clock == "thread":  # all of a step's work on its run's thread: torch at one thread
            CPU_CLOCK = time.thread_time
            torch.set_num_threads(1)
        overhead.time = types.SimpleNamespace(perf_counter=CPU_CLOCK)  # type: ignore[assignment]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (os.cpu_count: {os.cpu_count()}), "
          f"{platform.machine()}; python {platform.python_version()}, transformers {transformers.__version__}, "
          f"lightning {lightning.__version__}, headwatch {headwatch.__version__}")  # fmt: skip
    for s in args.shapes:
        print(f"shape {s}: {SHAPES[s].describe()}")
    print(f"doors at their defaults (logging every {', '.join(f'{DOORS[d]} {DEFAULT_LOG_EVERY[d]}' for d in args.doors)}; "
          f"overhead_budget {BUDGET}); pricing runs {args.price_steps} steps logging every {args.price_every}, real runs "
          f"{args.real_steps} steps; priced run {args.run_steps} steps; steps timed in {args.clock} seconds")  # fmt: skip
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    busy0, own0, wall0 = _system_busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    verdict, results, times = Verdict(), {}, {}
    for shape in args.shapes:
        for door in args.doors:
            pricing = interleaved(door, SHAPES[shape], args.price_steps, args.price_every, args.seed)
            real = interleaved(door, SHAPES[shape], args.real_steps, DEFAULT_LOG_EVERY[door], args.seed)
            aa = interleaved(door, SHAPES[shape], args.real_steps, DEFAULT_LOG_EVERY[door], args.seed, aa=True) if args.aa else None
            times[f"{door}/{shape}"] = {f"{kind} {r.name}": {"wall": r.times, "cpu": r.cpu, "end": r.end, "cpu_end": r.cpu_end,
                                                             "kinds": r.kinds(), "published": r.published}
                                        for kind, runs in (("pricing", pricing), ("real", real)) for r in runs}  # fmt: skip
            if args.clock != "wall":  # the figures from CPU seconds; the pairing stays in wall time
                for r in (*pricing, *real, *(aa or ())):
                    r.wall = (r.times, r.end)
                    r.times, r.end = r.cpu, r.cpu_end
            results[f"{door}/{shape}"] = door_report(door, shape, pricing, real, args, verdict, aa)
            print(f"    (load {os.getloadavg()[0]:.2f}, {time.perf_counter() - wall0:.0f} s so far)", flush=True)
            if args.json is not None:  # after every door: a run cut short keeps what it measured
                args.json.write_text(json.dumps({"results": results, "times": times, "criteria": verdict.rows}, indent=1))
    contention = other_cpu_share(busy0, own0, wall0)
    print()
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU used by other processes while "
          f"measuring: {contention}; {time.perf_counter() - wall0:.0f} s")  # fmt: skip
    failed = [r for r in verdict.rows if not r[3]]
    print(f"{len(verdict.rows) - len(failed)} of {len(verdict.rows)} criteria pass")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "times": times, "criteria": verdict.rows}, indent=1))


if __name__ == "__main__":
    main()
