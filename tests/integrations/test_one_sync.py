"""One host-device sync and one writer flush per logging step, none on other steps, on every front door.

Each door (the plain loop ``headwatch.Headwatch``, the Hugging Face ``HeadwatchCallback``, the Lightning
callbacks) trains a tiny Llama for :data:`STEPS` steps at its default cadence with ``log_every_n_steps``
:data:`EVERY` under the default overhead budget (the collision probe and its figures at the first logging step, the
probe interval timed on the host: no sync), and
for every training step the test counts:

- **syncs caused by headwatch**: operations that would make the host wait for the device on a GPU (a value
  read on the host, an output whose size is read from the values, host data copied to the device);
- **flushes caused by headwatch**: calls of ``SummaryWriter.flush`` with a headwatch frame on the stack.

The instrument that counts them, :class:`tests.helpers.syncs.SyncCounter` (in ``tests/helpers/syncs.py``,
which says what it counts and how), is checked here on known operations first.

Two tests per door: values read on the host only (``"to host"``: the orchestration's one transfer), and
every kind (what a GPU waits for: the math of the monitors too). Steps are delimited from outside
headwatch: around each iteration (loop), from one ``on_step_begin`` to the next (Hugging Face, a
``TrainerCallback`` placed before headwatch's; the last step runs to ``on_train_end``), from one
``on_train_batch_start`` to the next (Lightning, a callback placed first; the last step runs to
``on_train_end``): a step's counts include the door's logging and epoch-end work after the optimizer
step. On a GPU,
``bench/gpu_check.py`` counts the real syncs with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import headwatch
from headwatch.core import Monitor
from headwatch.integrations.lightning import MonitorCallback
from tests.helpers.syncs import READS, SYNCS, SyncCounter, counting, summarize

V, B, T = 64, 4, 12
EVERY = 2
"""``log_every_n_steps`` of every door (logging steps 1, 3, 5, ...; 0-based)."""
STEPS = 20
"""Steps per run: the collision probe measures at the first logging step (every door's default overhead budget)."""

_OWN = str(Path(__file__).resolve())
"""This file: the counter's root when it checks itself."""


def check(
    counter: SyncCounter, door: str, kinds: tuple[str, ...], steps: int = STEPS, only: Callable[[int], bool] = lambda s: True
) -> None:
    assert len(counter.steps()) == steps, f"{door}: {len(counter.steps())} steps delimited, expected {steps}"
    ok, table = summarize(counter, kinds, EVERY, only)
    print(f"\n{door}, counting {' + '.join(kinds)}:\n{table}")
    if not ok:
        what = " + ".join(kinds)
        pytest.fail(f"{door}: a logging step must make exactly 1 sync ({what}) and 1 flush, other steps none; seen:\n{table}", pytrace=False)


# ----------------------------------------------------------------------------------- the instrument, checked
def _elsewhere() -> Callable[[torch.Tensor], float]:
    """A function whose code lives in another file (not the counter's root)."""
    return eval(compile("lambda t: t.item()", "elsewhere.py", "eval"))  # noqa: S307


def test_counter_sees_every_kind(tmp_path):
    """Each known operation counted once (and host-side reads not at all), attributed to the calling file only."""
    import math
    import statistics

    x = torch.tensor([1.5, -2.0, 3.0])  # made before counting: stands for a device tensor
    s, i, ids = torch.tensor(2.0), torch.tensor(1), torch.tensor([0, 2, 2])
    writer = SummaryWriter(str(tmp_path))
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("item", lambda: s.item(), 1),
        ("tolist", lambda: x.tolist(), 1),
        ("bool", lambda: 1 if s > 0 else 0, 1),
        ("float", lambda: float(s), 1),
        ("math.isfinite", lambda: math.isfinite(s), 1),
        ("int", lambda: int(i), 1),
        ("index", lambda: [0, 1, 2][i], 1),
        ("numpy", lambda: x.numpy(), 1),
        ("np.asarray", lambda: np.asarray(x), 1),
        ("format", lambda: f"{s:.3f}", 1),
        ("equal", lambda: torch.equal(x, x), 1),
        ("in", lambda: 3.0 in x, 1),
        ("cpu", lambda: x.cpu(), 1),
        ('to("cpu")', lambda: x.to("cpu"), 1),
        ("cpu then host reads", lambda: (x.cpu().numpy(), x.double().cpu().abs().max().item()), 2),
        ("one transfer of many scalars", lambda: torch.stack([s, x.sum(), x.amax()]).tolist(), 1),
        ("nonzero", lambda: x.nonzero(), 1),
        ("boolean mask read", lambda: x[x > 0], 1),
        ("boolean mask write", lambda: x.clone().__setitem__(x > 5, 0.0), 1),
        ("unique", lambda: torch.unique(ids), 1),
        ("bincount", lambda: torch.bincount(ids), 1),
        ("where(cond)", lambda: torch.where(x > 0), 1),
        ("repeat_interleave", lambda: x.repeat_interleave(ids), 1),
        ("one_hot without num_classes", lambda: F.one_hot(ids), 1),
        ("Python data to a device", lambda: torch.tensor(float("nan"), device=x.device), 1),
        ("host tensor to a device", lambda: torch.tensor([1.0, 2.0]).to(x.device), 1),
        ("made on the host, read", lambda: torch.tensor([1.0, 2.0]).sum().item() + torch.zeros(3).amax().item(), 0),
        ("device arithmetic", lambda: ((x * 2).sum(), x.to(torch.float64), torch.as_tensor(x, device=x.device)), 0),
        ("read in another file", lambda: _elsewhere()(s), 0),
        ("read inside torch, called from here", lambda: torch.testing.assert_close(x, x), 1),
        ("read inside the standard library, called from here", lambda: statistics.fmean([s]), 1),
    ]
    with counting(root=_OWN) as counter:
        seen = {}
        for label, fn, _ in cases:
            before = len(counter.events)
            fn()
            seen[label] = [e for e in counter.events[before:] if e.kind in SYNCS]
        before = len(counter.events)
        writer.add_scalar("a", 1.0, 0)
        writer.flush()
        flushes = counter.events[before:]
    writer.close()
    wrong = {label: [str(e) for e in seen[label]] for label, _, n in cases if len(seen[label]) != n}
    assert not wrong, f"counted differently than expected (expected counts in the table): {wrong}"
    assert [(e.kind, e.op) for e in flushes] == [("flush", "SummaryWriter.flush")]
    import linecache

    line = int(seen["item"][0].where.split(" < ")[0].rsplit(":", 1)[1])
    assert "s.item()" in linecache.getline(__file__, line), seen["item"][0].where


# ----------------------------------------------------------------------------------- the doors
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=T, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """``steps * B`` sequences of ``T`` ids drawn from a Zipf-like distribution (frequent and rare tokens)."""

    def __init__(self, steps: int) -> None:
        g = torch.Generator().manual_seed(1)
        weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
        self.ids = torch.multinomial(weights, steps * B * T, replacement=True, generator=g).view(steps * B, T)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    rows = Rows(steps)
    return [{k: torch.stack([rows[j][k] for j in range(s * B, (s + 1) * B)]) for k in rows[0]} for s in range(steps)]


def run_loop(tmp_path: Path, steps: int = STEPS, probes: bool = False, monitors: Callable[[], list] | None = None) -> SyncCounter:
    """``monitors``: makes the monitors inside the count (default: the door's own)."""
    model, data = tiny_llama(), batches(steps)
    writer = SummaryWriter(str(tmp_path / "loop"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with counting() as counter:
        monitors = [Probe("a"), Probe("b")] if probes else (monitors() if monitors is not None else None)
        hw = headwatch.Headwatch(model, monitors=monitors, writer=writer, log_every_n_steps=EVERY)
        for step, batch in enumerate(data):
            counter.boundary()
            hw.step_start(batch, step)
            model(**batch).loss.backward()
            hw.before_optimizer_step()
            optimizer.step()
            hw.after_optimizer_step()
            optimizer.zero_grad()
            hw.step_end()
        counter.boundary()
    writer.close()
    return counter


class Probe(Monitor):
    """A monitor whose measurement costs nothing: the mean token id of the logging step's batch (a device
    scalar) and a histogram of the ids; what a door does around it is the orchestration alone."""

    name = "probe"

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.ids: torch.Tensor | None = None

    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        if logging:
            self.ids = batch["input_ids"]

    def compute(self) -> dict[str, torch.Tensor]:
        assert self.ids is not None, "compute() on a step whose step_start was not told it logs"
        ids, self.ids = self.ids.double(), None
        self.media.histograms = {f"{self.prefix}/probe/{self.tag}/ids": ids.flatten()}
        return {f"{self.prefix}/probe/{self.tag}/mean_id": ids.mean()}


class LightningProbe(Probe, MonitorCallback):
    """:class:`Probe` as a Lightning callback, the way headwatch's Lightning monitors are built."""

    @property
    def state_key(self) -> str:
        return f"LightningProbe[{self.tag}]"


class HFSteps(TrainerCallback):
    """Step boundaries: each ``on_step_begin`` (before headwatch's callback), and ``on_train_end``."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counter.boundary()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counter.boundary()


def run_hf(tmp_path: Path, steps: int = STEPS, probes: bool = False) -> SyncCounter:
    from headwatch.integrations.transformers import HeadwatchCallback

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, logging_steps=EVERY, per_device_train_batch_size=B,
        learning_rate=1e-3, report_to=["tensorboard"], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = tiny_llama()
    with counting() as counter:
        callback = HeadwatchCallback(monitors=[Probe("a"), Probe("b")] if probes else None)
        trainer = Trainer(model=model, args=args, train_dataset=Rows(steps), callbacks=[HFSteps(counter), callback])
        trainer.train()
    return counter


class LitLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)  # Lightning's own logging (and flush) on its logging steps, as in a real run
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LightningSteps(pl.Callback):
    """Step boundaries: each ``on_train_batch_start`` (placed first, before headwatch's callbacks), and ``on_train_end``."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.counter.boundary()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counter.boundary()


def run_lightning(tmp_path: Path, steps: int = STEPS, probes: bool = False) -> SyncCounter:
    from lightning.pytorch.loggers import TensorBoardLogger

    data, module = torch.utils.data.DataLoader(Rows(steps), batch_size=B), LitLlama()
    with counting() as counter:
        if probes:
            watch: list[pl.Callback] = [LightningProbe("a"), LightningProbe("b")]
        else:
            watch = [headwatch.TokenFrequency(), headwatch.LogitStatsMonitor(), headwatch.GradientDensityMonitor(),
                     headwatch.SynonymCollisionMonitor()]  # fmt: skip
        trainer = pl.Trainer(
            default_root_dir=tmp_path, max_steps=steps, log_every_n_steps=EVERY, logger=TensorBoardLogger(str(tmp_path / "pl")),
            callbacks=[LightningSteps(counter), *watch], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            accelerator="cpu", devices=1,
        )  # fmt: skip
        trainer.fit(module, data)
    return counter


DOORS = {"plain loop": run_loop, "Hugging Face": run_hf, "Lightning": run_lightning}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SyncCounter]:
    """Each door's run, made once for both tests, on one torch thread (tiny matrices; steadier on a busy machine)."""
    runs: dict[str, SyncCounter] = {}

    def get(door: str) -> SyncCounter:
        if door not in runs:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                runs[door] = DOORS[door](tmp_path_factory.mktemp(door.replace(" ", "_")))
            finally:
                torch.set_num_threads(threads)
        return runs[door]

    return get


PROBE_STEPS = 6
# Before the orchestrator (36777ee) the doors' own work was 3 value reads (1 transfer, 2 histograms) and 3 flushes
# per logging step (plain loop, Hugging Face), 4 and 4 (Lightning: one transfer per callback).


@pytest.mark.parametrize("door", list(DOORS))
def test_orchestration_alone_one_sync_and_one_flush_per_logging_step(door, tmp_path):
    """Two monitors whose measurement reads nothing (:class:`Probe`): whatever is counted is the door's own
    (the transfer of the values, the histograms, the flushes). Every kind of sync counted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        counter = DOORS[door](tmp_path, steps=PROBE_STEPS, probes=True)
    finally:
        torch.set_num_threads(threads)
    check(counter, f"{door} (probes)", SYNCS, PROBE_STEPS)


# Before the orchestrator (36777ee), per logging step and at the collision step: 21 value reads and 4 flushes
# (plain loop, HF), 23 and 6 (Lightning); 91-93 syncs of every kind (245 at the collision step). After it, 1 and 1
# on every logging step but the collision measurement's, which still made 149 syncs of every kind (89 value reads:
# the rare-token selection, sampling and neighbour search read values; the figures of that step read their data).
# Now the collision step too: a fixed-size seeded sample, masked searches, the per-row results and the figures'
# data moved in the one transfer (``Media.host``), the table and figures made on the host in ``published``.
COLLISION_STEP = EVERY - 1
"""The first logging step: a probe step in every run under the overhead budget (the doors' default)."""


def _normal(step: int) -> bool:
    return step != COLLISION_STEP


@pytest.mark.parametrize("door", list(DOORS))
def test_one_value_read_and_one_flush_per_logging_step(door, measured):
    """Values read on the host (``item``, ``tolist``, ``bool()``, ``cpu()`` ...): exactly 1 on each logging step
    (the one transfer of the step's values), none on the others; the same for flushes caused by headwatch."""
    check(measured(door), door, READS, only=_normal)


@pytest.mark.parametrize("door", list(DOORS))
def test_one_sync_and_one_flush_per_logging_step(door, measured):
    """Everything that waits for a GPU (values read, shapes read from values, Python data copied to the device):
    exactly 1 on each logging step, none on the others; the same for flushes caused by headwatch."""
    check(measured(door), door, SYNCS, only=_normal)


@pytest.mark.parametrize("door", list(DOORS))
def test_one_sync_at_the_collision_step(door, measured):
    """The collision measurement's step (the first logging step, a probe step; its figures too) makes exactly 1 sync of
    every kind and 1 flush, like any logging step: the rare sample is a fixed-size seeded selection (random keys
    and ``topk``), the neighbour search and the drift correction mask rows instead of selecting them, and the
    per-row results (sample, cosines, top pairs' ids and counts) and the figures' data travel in the orchestrator's
    one transfer (``Media.host``); the top-pairs table, ``last_result`` and the figures are made on the host in
    ``published``. Was 149 syncs of every kind (89 value reads) before."""
    check(measured(door), door, SYNCS, only=lambda s: s == COLLISION_STEP)


SYNONYMS = [[3, 4], [10, 11, 12], [20, 63]]


def test_one_sync_per_logging_step_with_synonym_groups(tmp_path):
    """With synonym groups the collision step also computes the synonym pair rate and partner ranks (masked
    pairs, every row a competitor, the lower median from a sort), and every training step counts synonym
    confusion on the device: still 1 sync and 1 flush per logging step, the collision step included, none on
    the other steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        counter = run_loop(tmp_path, monitors=lambda: ["tokens", "logits", "gradients", headwatch.core.SynonymCollision(synonym_groups=SYNONYMS)])
    finally:
        torch.set_num_threads(threads)
    check(counter, "plain loop (synonym groups)", SYNCS)
