"""The instrument of the one-sync tests (``tests/integrations/test_one_sync.py``): what headwatch makes the host
wait for, counted on the CPU.

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

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

import headwatch

HEADWATCH_SRC = str(Path(headwatch.__file__).resolve().parent) + os.sep
"""Operations attributed to headwatch come from files under this folder."""

_LIBRARIES = tuple(str(Path(os.path.dirname(m.__file__)).resolve()) + os.sep for m in (torch, np))
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
try:
    import tensorboard as _tb

    _LIBRARIES += (str(Path(_tb.__file__).resolve().parent) + os.sep,)
except ImportError:  # pragma: no cover - torch.utils.tensorboard needs it
    pass

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


def summarize(
    counter: SyncCounter, kinds: tuple[str, ...], every: int, only: Callable[[int], bool] = lambda s: True
) -> tuple[bool, str]:
    """Whether every logging step (``(step + 1) % every == 0``) has exactly one operation of ``kinds`` and one
    flush, and every other step none (among the steps ``only`` keeps); a table of what each step had (the counted
    operations and their places where a step is wrong)."""
    lines, ok = [], True
    for step, events in enumerate(counter.steps()):
        if not only(step):
            continue
        logging = (step + 1) % every == 0
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
