"""One host-device sync and one writer flush per logging step, none on other steps, on every front door
(issue 18, acceptance point 4).

Each door (the plain loop ``headwatch.Headwatch``, the Hugging Face ``HeadwatchCallback``, the Lightning
callbacks) trains a tiny Llama for :data:`STEPS` steps at its default cadence with ``log_every_n_steps``
:data:`EVERY` (collision every ``10 * EVERY`` = 20 steps: the last step; figures at their default), and
for every training step the test counts:

- **syncs caused by headwatch**: operations that make the host wait for the device on a GPU. On the CPU
  there is no device, so :class:`SyncCounter` (a ``torch.overrides.TorchFunctionMode``) counts the
  operations that would, of three kinds:

  - ``"to host"``: a tensor's value read on the host (``item``, ``tolist``, ``numpy``, ``__bool__``,
    ``__float__``, ``__int__``, ``__index__``, ``__format__``, ``equal``, ``cpu()``, ``.to("cpu")`` ...);
  - ``"data-dependent shape"``: an output whose size is read from the values (``nonzero``,
    ``masked_select``, boolean-mask indexing, ``unique``, ``bincount`` ...);
  - ``"to device"``: Python data or a host tensor copied to the device (``torch.tensor(x, device=...)``,
    ``host.to(t.device)``: a synchronous copy under CUDA).

  Tensors that exist before counting starts (the model, the batches) stand for device tensors. Host
  tensors are followed: a ``.cpu()`` result (a copy, as on a GPU), a tensor made without ``device=``,
  and whatever is computed from such tensors only; reading them is not counted, moving them to the
  device is. An operation is caused by headwatch when the innermost frame outside torch, numpy,
  tensorboard and the standard library is a file under ``src/headwatch/``.
- **flushes caused by headwatch**: calls of ``SummaryWriter.flush`` (or of its ``FileWriter.flush``
  directly) with a headwatch frame anywhere on the stack (``Trainer.log`` flushing the Hugging Face
  writer for headwatch counts; the Trainer's or Lightning's own flush for the loss does not, and is
  shown beside as "flushes not by headwatch").

Two tests per door: values read on the host only (``"to host"``: the orchestration's one transfer), and
every kind (what a GPU waits for: the math of the monitors too). Steps are delimited from outside
headwatch: around each iteration (loop), from one ``on_step_begin`` to the next (Hugging Face, a
``TrainerCallback`` placed before headwatch's; the last step runs to ``on_train_end``), from one
``on_train_batch_start`` to the next (Lightning, a callback placed first; the last step runs to
``on_train_end``): a step's counts include the door's logging and epoch-end work after the optimizer
step. :func:`test_counter_sees_every_kind` checks the instrument itself on known operations. On a GPU,
``bench/gpu_check.py`` counts the real syncs with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import headwatch
from headwatch.core import Monitor
from headwatch.integrations.lightning import MonitorCallback

HEADWATCH_SRC = str(Path(headwatch.__file__).resolve().parent) + os.sep
"""Operations attributed to headwatch come from files under this folder."""

V, B, T = 64, 4, 12
EVERY = 2
"""``log_every_n_steps`` of every door (logging steps 1, 3, 5, ...; 0-based)."""
STEPS = 20
"""Steps per run: collision's default schedule (10 logging intervals) measures at the last one."""

# ----------------------------------------------------------------------------------- the instrument
_LIBRARIES = tuple(str(Path(os.path.dirname(m.__file__)).resolve()) + os.sep for m in (torch, np))
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
try:
    import tensorboard as _tb

    _LIBRARIES += (str(Path(_tb.__file__).resolve().parent) + os.sep,)
except ImportError:  # pragma: no cover - torch.utils.tensorboard needs it
    pass
_OWN = str(Path(__file__).resolve())

_TO_HOST = {
    "item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__", "__complex__",
    "__format__", "__repr__", "__str__", "__contains__", "equal", "allclose", "is_nonzero", "cpu",
}  # fmt: skip
"""Tensor -> host value (on a GPU: a device-to-host copy the host waits for)."""
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
"""Output size read from the values (on a GPU: a device-to-host copy of a count)."""
_FACTORIES_FROM_DATA = {"tensor", "as_tensor", "asarray"}
_HOST = "_one_sync_test_on_host"
"""Attribute set on tensors that live on the host in a GPU run."""


@dataclass
class Event:
    kind: str
    """``"to host"``, ``"data-dependent shape"``, ``"to device"``, ``"flush"``, ``"other flush"``."""
    op: str
    where: str
    """``file:line`` of the frame it is attributed to, then of its callers in the same tree (``a:1 < b:2``;
    relative to ``src/headwatch/`` for headwatch)."""

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


@functools.lru_cache(maxsize=None)
def _plumbing(filename: str) -> bool:
    """torch, numpy, tensorboard, the standard library (not its site-packages), generated code."""
    if filename.startswith("<"):  # <frozen ...>, <string> (dataclass-generated methods)
        return True
    path = os.path.realpath(filename)
    if path.startswith(_LIBRARIES):
        return True
    return path.startswith(_STDLIB) and "site-packages" not in path and "dist-packages" not in path


def _where(frame: FrameType, root: str, depth: int = 3) -> str:
    """``file:line`` of ``frame`` and of up to ``depth - 1`` of its callers under ``root``, innermost first."""
    places = []
    while frame is not None and len(places) < depth:
        name = frame.f_code.co_filename
        if name.startswith(root) or not places:
            shown = name.removeprefix(root) if name.startswith(root) and root.endswith(os.sep) else os.path.basename(name)
            places.append(f"{shown}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(places)


def _on_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _HOST, False)


def _mark(tensors: list[Any]) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _HOST, True)
            except Exception:  # noqa: BLE001 - a tensor subclass that refuses attributes stays "device"
                pass


def _device_arg(args: tuple, kwargs: dict) -> Any:
    """The device a ``Tensor.to`` call asks for (a str, a torch.device, a tensor's), or None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):
            return a
    return None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs`` values, and inside lists and tuples of them (one level:
    what torch operations take)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += [x for x in a if isinstance(x, torch.Tensor)]
    return found


def _bool_index(index: Any) -> bool:
    return any(i.dtype == torch.bool and i.dim() > 0 for i in _tensors((index,), {}))


class SyncCounter(TorchFunctionMode):
    """Counts the operations of code under ``root`` that would make the host wait for a GPU (see the module docstring).

    ``events``: every counted operation in order; :meth:`boundary` records where a step starts.
    """

    def __init__(self, root: str = HEADWATCH_SRC) -> None:
        super().__init__()
        self.root = root
        self.events: list[Event] = []
        self.bounds: list[int] = []
        self._flushing = threading.local()

    def boundary(self) -> None:
        self.bounds.append(len(self.events))

    def steps(self) -> list[list[Event]]:
        """Events of each step (between consecutive boundaries)."""
        return [self.events[a:b] for a, b in zip(self.bounds, self.bounds[1:])]

    def _caller(self, frame: FrameType | None) -> FrameType | None:
        """The innermost frame that is not torch, numpy, tensorboard, the standard library or this counter."""
        while frame is not None and (_plumbing(frame.f_code.co_filename) or frame.f_code in _COUNTER_CODES):
            frame = frame.f_back
        return frame

    def _record(self, kind: str, op: str, frame: FrameType | None) -> None:
        caller = self._caller(frame)
        if caller is not None and caller.f_code.co_filename.startswith(self.root):
            self.events.append(Event(kind, op, _where(caller, self.root)))

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        frame = sys._getframe(1)
        name = getattr(func, "__name__", "")
        leaves = _tensors(args, kwargs)
        host = bool(leaves) and all(_on_host(t) for t in leaves)
        kind = None
        if name == "to":
            target = _device_arg(args, kwargs)
            if (isinstance(target, str) and target.startswith("cpu")) or _on_host(target):
                kind = None if host else "to host"
                name = f"to({target!r})" if isinstance(target, str) else "to(host tensor)"
            elif isinstance(target, (torch.device, torch.Tensor)) and _on_host(args[0]):
                kind = "to device"
        elif name in _TO_HOST:
            kind = None if host else "to host"
        elif name == "copy_" and _on_host(args[0]) and not _on_host(args[1]):
            kind = "to host"
        elif not host and (
            name in _DATA_DEPENDENT
            or (name == "where" and len(args) + len(kwargs) == 1)
            or (name in ("__getitem__", "__setitem__", "index_put_", "index_put") and _bool_index(args[1]))
            or (name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
                and kwargs.get("output_size") is None)
            or (name == "histc" and _histc_auto_range(args, kwargs))
            or (name == "one_hot" and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0)
        ):  # fmt: skip
            kind = "data-dependent shape"
        elif name in _FACTORIES_FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            device = kwargs.get("device")
            if device is not None and not (isinstance(device, str) and device.startswith("cpu")):
                kind = "to device"
        elif name in _FACTORIES_FROM_DATA and args and _on_host(args[0]) and isinstance(kwargs.get("device"), torch.device):
            kind = "to device"
        if kind is not None:
            self._record(kind, name, frame)

        out = func(*args, **kwargs)

        outs = _tensors((out,), {})
        if kind == "to host":
            if out is args[0]:  # the CPU returns the same tensor; a GPU returns a host copy
                out = out.clone()
                outs = [out]
            _mark(outs)
        elif kind == "to device":
            if out is args[0]:
                out = out.clone()  # the device copy, not the host tensor
        elif host or (not leaves and kwargs.get("device") is None and name not in ("__get__", "__set__")):
            _mark(outs)  # computed from host tensors only, or made without device= (the host by default)
        return out


def _histc_auto_range(args: tuple, kwargs: dict) -> bool:
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return lo == hi  # min == max: the range is read from the data


_COUNTER_CODES = {SyncCounter.__torch_function__.__code__, SyncCounter._record.__code__}


@contextmanager
def counting(root: str = HEADWATCH_SRC) -> Iterator[SyncCounter]:
    """A :class:`SyncCounter` that also records ``SummaryWriter`` flushes (``"flush"``: a frame under
    ``root`` on the stack; ``"other flush"``: none)."""
    counter = SyncCounter(root)
    summary_flush, file_flush = SummaryWriter.flush, FileWriter.flush

    def record_flush(what: str) -> None:
        frame: FrameType | None = sys._getframe(2)
        inner = None
        while frame is not None:
            name = frame.f_code.co_filename
            # headwatch.tensorboard.guard stands in for the writer's FileWriter, and headwatch.tensorboard.batched_scalars
            # (with the Hugging Face door's on_log around the TensorBoardCallback) for its add_scalar and flush: a flush
            # through them is their caller's
            stand_in = name.endswith(os.path.join("tensorboard", "guard.py")) or any(
                s in frame.f_code.co_qualname for s in ("_batched.<locals>", "batch_scalars_of.<locals>")
            )
            if inner is None and name.startswith(root) and not stand_in:
                inner = frame
            frame = frame.f_back
        if inner is not None:
            counter.events.append(Event("flush", what, _where(inner, root)))
        else:
            counter.events.append(Event("other flush", what, "-"))

    def summary(self: SummaryWriter) -> None:
        record_flush("SummaryWriter.flush")
        counter._flushing.depth = getattr(counter._flushing, "depth", 0) + 1
        try:
            summary_flush(self)
        finally:
            counter._flushing.depth -= 1

    def file(self: FileWriter) -> None:
        if not getattr(counter._flushing, "depth", 0):
            record_flush("FileWriter.flush")
        file_flush(self)

    SummaryWriter.flush, FileWriter.flush = summary, file  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        SummaryWriter.flush, FileWriter.flush = summary_flush, file_flush  # type: ignore[method-assign]


SYNCS = ("to host", "data-dependent shape", "to device")
"""Every kind of operation that waits for the device on a GPU."""
READS = ("to host",)
"""Values read on the host only (``item``, ``tolist``, ``__bool__``, ``cpu()`` ...)."""


def summarize(counter: SyncCounter, kinds: tuple[str, ...], only: Callable[[int], bool] = lambda s: True) -> tuple[bool, str]:
    """Whether every logging step has exactly one operation of ``kinds`` and one flush, and every other step
    none (among the steps ``only`` keeps); a table of what each step had (the counted operations and their
    places where a step is wrong)."""
    lines, ok = [], True
    for step, events in enumerate(counter.steps()):
        if not only(step):
            continue
        logging = (step + 1) % EVERY == 0
        want = int(logging)
        syncs = [e for e in events if e.kind in kinds]
        flushes = [e for e in events if e.kind == "flush"]
        others = sum(e.kind == "other flush" for e in events)
        good = len(syncs) == want and len(flushes) == want
        ok &= good
        lines.append(
            f"step {step:2d} {'logging' if logging else 'quiet  '}: {len(syncs)} syncs, {len(flushes)} flushes"
            f" (and {others} flushes not by headwatch){'' if good else f'   <- expected {want} and {want}'}"
        )
        if not good:
            seen: dict[str, int] = {}
            for e in syncs + flushes:
                key = f"{e.kind}: {e}"
                seen[key] = seen.get(key, 0) + 1
            lines += [f"    {n} x {key}" for key, n in seen.items()]
    return ok, "\n".join(lines)


def check(
    counter: SyncCounter, door: str, kinds: tuple[str, ...], steps: int = STEPS, only: Callable[[int], bool] = lambda s: True
) -> None:
    assert len(counter.steps()) == steps, f"{door}: {len(counter.steps())} steps delimited, expected {steps}"
    ok, table = summarize(counter, kinds, only)
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
COLLISION_STEP = STEPS - 1


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
    """The collision measurement's step (also the figures' step: 10 logging intervals) makes exactly 1 sync of
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
