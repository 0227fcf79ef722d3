"""Keep a TensorBoard ``SummaryWriter`` writing through storage faults, and count what they cost.

torch's ``SummaryWriter`` writes its events through TensorBoard's ``EventFileWriter``, whose background
thread dies at the first failed write (a full disk, a directory remounted read-only): from then on every
``add_*`` and ``flush`` raises that error again, and nothing more is written for the rest of the run,
even after the fault clears. A log directory deleted during the run is worse: writes go on, into a file
that no longer has a name, and are lost without an error.

:func:`guard` (called by every headwatch write, :mod:`headwatch.tensorboard.writer`) replaces the
writer's ``FileWriter`` by a :class:`GuardedFileWriter`, which:

- never raises out of ``add_event``, ``flush`` or ``close``: training goes on, and the values keep going
  to the caller and to the trainer's other loggers;
- keeps every event added since the last successful flush; when a write or a flush fails, or the event
  file has disappeared, those events and every later one are kept in memory (up to
  ``max_pending_bytes``, default 64 MiB of serialized events; beyond that the oldest are dropped and
  counted);
- on a later ``flush`` (headwatch flushes once per logging step), at most every ``retry_seconds``
  (default 30 s), opens a new event file in the same directory (creating it again if it was deleted),
  writes the kept events in their order, then the two counters below as scalars at the step of the
  last event, so the dashboard shows the fault;
- warns once when writing stops (the cause, the directory, what happens next) and once when it
  resumes (how many events were delayed and lost).

Counters (cumulative over the run, also in :func:`storage_status`):

- ``headwatch/storage/delayed_events``: events that could not be written when they were added and
  were written once writing worked again;
- ``headwatch/storage/lost_events``: events never written (dropped beyond ``max_pending_bytes``, or
  still kept when the writer was closed).

A log directory that cannot be written when the ``SummaryWriter`` is made: torch's raises in its
constructor; ``headwatch.tensorboard.SummaryWriter`` (:mod:`headwatch.tensorboard.summary_writer`, through
:func:`open_guarded`) starts with a guarded writer that has no file yet, and opens it when the fault clears.

Events that were written just before a failure may be written again after it (the same step and value
twice: TensorBoard shows one point). Writers other than ``torch.utils.tensorboard.SummaryWriter`` (for
example ``tensorboardX``) are left as they are.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import deque
from typing import Any

from headwatch.errors import check_int, check_optional, check_protocol, check_range

DEFAULT_MAX_PENDING_BYTES = 64 * 2**20
"""Serialized events kept in memory while the log directory cannot be written."""
DEFAULT_RETRY_SECONDS = 30.0
"""Shortest time between two attempts to open a new event file."""
STORAGE_TAGS = ("headwatch/storage/delayed_events", "headwatch/storage/lost_events")

MAX_PENDING_LIMIT = 2**40
"""The largest ``max_pending_bytes`` taken (1 TiB: beyond it the memory runs out first)."""
MAX_RETRY_SECONDS = 86_400.0
"""The largest ``retry_seconds`` taken (a day)."""


def check_guard_options(max_pending_bytes: Any, retry_seconds: Any) -> tuple[int | None, float | None]:
    """``max_pending_bytes`` None or an int in ``[0, 2**40]`` and ``retry_seconds`` None or a number in ``[0, 86400]``,
    else HeadwatchError naming the argument (0.3 passed them to ``int()``/``float()``: a bare ValueError, or NaN)."""
    return (
        check_optional(check_int, "max_pending_bytes", max_pending_bytes, minimum=0, maximum=MAX_PENDING_LIMIT),
        check_optional(check_range, "retry_seconds", retry_seconds, 0, MAX_RETRY_SECONDS),
    )


class GuardedFileWriter:
    """A ``torch.utils.tensorboard.writer.FileWriter`` stand-in that survives storage faults (module docstring).

    Args:
        inner: the writer's current ``FileWriter`` (its event file and settings are kept).
        max_pending_bytes: serialized events kept while writing fails (None: the default, 64 MiB).
        retry_seconds: shortest time between two attempts to open a new event file (None: the default, 30 s).

    Raises:
        HeadwatchError: ``inner`` not a FileWriter, an option out of range (:func:`check_guard_options`).
    """

    def __init__(self, inner: Any, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 retry_seconds: float = DEFAULT_RETRY_SECONDS) -> None:  # fmt: skip
        check_protocol("inner", inner, ["get_logdir"], "a torch FileWriter (get_logdir, add_event, flush)")
        check_guard_options(max_pending_bytes, retry_seconds)
        self.inner = inner
        self.logdir = str(inner.get_logdir())
        self.max_pending_bytes = DEFAULT_MAX_PENDING_BYTES if max_pending_bytes is None else int(max_pending_bytes)
        self.retry_seconds = DEFAULT_RETRY_SECONDS if retry_seconds is None else float(retry_seconds)
        self.pending: deque[Any] = deque()  # events since the last good flush, or since the fault
        self.pending_bytes = 0
        self.broken: BaseException | None = None
        self.next_try = 0.0
        self.delayed = self.lost = 0
        self.last_step = 0
        self.warned = False
        self.file_args: tuple[Any, ...] = ()  # the SummaryWriter's max_queue, flush_secs, filename_suffix, for new files
        self.observers: list[Any] = []
        self.tags: set[str] = set()
        """Every summary tag added through this writer (an observer added late starts from them)."""
        """Objects told of every event added (``observe(event)``) and of every flush, before it
        (``before_flush(self)``, which may add events): :class:`headwatch.tensorboard.layout.LayoutWriter`."""

    # ---------------------------------------------------------------- FileWriter's interface
    def get_logdir(self) -> str:
        return self.logdir

    def add_event(self, event: Any, step: int | None = None, walltime: float | None = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
            self.last_step = int(step)
        self._keep(event)
        if event.HasField("summary"):
            self.tags.update(v.tag for v in event.summary.value)
        for observer in self.observers:
            _tell(observer.observe, event)
        if self.broken is None:
            try:
                self.inner.event_writer.add_event(event)
            except Exception as err:  # noqa: BLE001 - a storage fault never stops training
                self._fail(err)

    def add_summary(self, summary: Any, global_step: int | None = None, walltime: float | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.add_event(Event(summary=summary), global_step, walltime)

    def add_graph(self, *args: Any, **kwargs: Any) -> None:
        type(self.inner).add_graph(self, *args, **kwargs)  # builds events, then self.add_event

    def add_onnx_graph(self, *args: Any, **kwargs: Any) -> None:
        type(self.inner).add_onnx_graph(self, *args, **kwargs)

    def flush(self) -> None:
        for observer in self.observers:
            _tell(observer.before_flush, self)
        if self.broken is None:
            try:
                self.inner.flush()
                if not os.path.exists(self.file_name):
                    raise FileNotFoundError(f"the event file {self.file_name} was deleted (its directory removed?)")
            except Exception as err:  # noqa: BLE001
                self._fail(err)
            else:
                self.pending.clear()
                self.pending_bytes = 0
                return
        self._retry()

    def close(self) -> None:
        for observer in self.observers:
            _tell(observer.before_flush, self)
        if self.broken is None and self.file_name and not os.path.exists(self.file_name):
            self._fail(FileNotFoundError(f"the event file {self.file_name} was deleted (its directory removed?)"))
        if self.broken is not None:
            self._retry(now=math.inf)  # a last try, whatever the retry interval
        if self.broken is None:
            try:
                self.inner.close()
                return
            except Exception as err:  # noqa: BLE001
                self._fail(err)
        self.lost += len(self.pending)  # still kept at the end: never written
        if self.pending:
            warnings.warn(
                f"headwatch: {len(self.pending)} TensorBoard events could not be written to {self.logdir} before the "
                f"writer closed ({self.broken}); they are lost.", UserWarning, stacklevel=2,
            )  # fmt: skip
        self.pending.clear()
        self.pending_bytes = 0

    def reopen(self) -> None:
        self.inner.reopen()

    # ---------------------------------------------------------------- the fault
    @property
    def file_name(self) -> str:
        return str(getattr(self.inner.event_writer, "_file_name", ""))

    def _keep(self, event: Any) -> None:
        self.pending.append(event)
        self.pending_bytes += event.ByteSize()
        while self.pending_bytes > self.max_pending_bytes and len(self.pending) > 1:
            dropped = self.pending.popleft()
            self.pending_bytes -= dropped.ByteSize()
            if self.broken is not None:  # while writing works, the oldest were handed to the file already
                self.lost += 1

    def _fail(self, err: BaseException) -> None:
        self.broken = err
        self.next_try = time.monotonic() + self.retry_seconds
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"headwatch: TensorBoard events cannot be written to {self.logdir} ({type(err).__name__}: {err}). "
                "Training goes on and the values still reach the caller and the trainer's other loggers; the events "
                f"are kept in memory (up to {self.max_pending_bytes / 2**20:.0f} MiB) and written, with the counts "
                f"{STORAGE_TAGS[0]} and {STORAGE_TAGS[1]}, as soon as a new event file can be opened there (tried at "
                f"most every {self.retry_seconds:g} s). (warned once)",
                UserWarning,
                stacklevel=3,
            )

    def _retry(self, now: float | None = None) -> bool:
        """Open a new event file and write the kept events; False while the fault lasts."""
        if self.broken is None or (now if now is not None else time.monotonic()) < self.next_try:
            return False
        from torch.utils.tensorboard.writer import FileWriter

        old, new = self.inner, None
        before = _event_files(self.logdir)
        try:
            _probe(self.logdir, self.pending_bytes + 4096)  # no writer thread (that dies loudly) while the fault lasts
            new = FileWriter(self.logdir, *self.file_args)  # makedirs + a new file + its header event, flushed: raises while the fault lasts
            events = list(self.pending)
            for event in events:
                new.event_writer.add_event(event)
            new.flush()
        except Exception as err:  # noqa: BLE001
            self._discard(new, remove=True)  # what it holds is still kept here
            for name in _event_files(self.logdir) - before:  # a file the failed attempt made
                try:
                    os.remove(os.path.join(self.logdir, name))
                except OSError:
                    pass
            self.next_try = time.monotonic() + self.retry_seconds
            self.broken = err
            return False
        self._discard(old)
        self.inner, self.broken = new, None
        delayed = len(events)
        self.delayed += delayed
        self.pending.clear()
        self.pending_bytes = 0
        self._write_counts()
        warnings.warn(
            f"headwatch: TensorBoard events are written to {self.logdir} again ({self.file_name}); {delayed} delayed "
            f"events were written, {self.lost} lost so far (published as {STORAGE_TAGS[0]} and {STORAGE_TAGS[1]}).",
            UserWarning,
            stacklevel=3,
        )
        self.warned = False  # a later fault warns again
        return True

    def _write_counts(self) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from torch.utils.tensorboard.summary import scalar

        for tag, value in zip(STORAGE_TAGS, (self.delayed, self.lost)):
            self.add_event(Event(summary=scalar(tag, float(value))), self.last_step)
        self.flush()

    @staticmethod
    def _discard(writer: Any, remove: bool = False) -> None:
        """Close a dead or half-made writer without raising; its event file is removed when ``remove`` or empty."""
        if writer is None:
            return
        name = str(getattr(writer.event_writer, "_file_name", ""))
        try:
            writer.event_writer._async_writer._closed = True  # noqa: SLF001 - its thread is dead: do not flush again
            writer.event_writer._general_file_writer.close()  # noqa: SLF001
        except Exception:  # noqa: BLE001
            pass
        try:
            if name and (remove or os.path.getsize(name) == 0):
                os.remove(name)
        except OSError:
            pass


def _tell(method: Any, arg: Any) -> None:
    """Call an observer's method; its failure is warned about (once per message) and never stops the writing."""
    try:
        method(arg)
    except Exception as err:  # noqa: BLE001 - an observer never stops the events
        warnings.warn(f"headwatch: {method.__qualname__} failed ({type(err).__name__}: {err}); the events are written",
                      UserWarning, stacklevel=3)  # fmt: skip


def _probe(logdir: str, size: int) -> None:
    """Raise ``OSError`` unless ``size`` bytes (at most 1 MiB) can be written and synced in ``logdir`` (made if missing).

    A remote ``logdir`` (``scheme://...``, written through TensorBoard's file systems) is not probed."""
    if "://" in logdir:
        return
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, f".headwatch_probe.{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * min(size, 2**20))
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def _event_files(logdir: str) -> set[str]:
    try:
        return {n for n in os.listdir(logdir) if n.startswith("events.out.tfevents.")}
    except OSError:
        return set()


def torch_writer_class() -> type:
    """``torch.utils.tensorboard.SummaryWriter``, the writers headwatch guards and batches (``type(None)`` without
    tensorboard installed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # pragma: no cover - tensorboard not installed
        return type(None)
    return SummaryWriter


def guard(writer: Any, **kwargs: Any) -> Any:
    """Make ``writer`` (a ``torch.utils.tensorboard.SummaryWriter``) survive storage faults; returns it.

    Idempotent and cheap (an attribute check once guarded). Other writers are returned unchanged.
    ``kwargs``: :class:`GuardedFileWriter`'s ``max_pending_bytes`` and ``retry_seconds``.
    """
    if not isinstance(writer, torch_writer_class()):
        return writer
    current = writer.file_writer
    if isinstance(current, GuardedFileWriter):
        return writer
    try:
        current = writer._get_file_writer()  # noqa: SLF001 - opens the file if the writer was closed
    except Exception as err:  # noqa: BLE001 - cannot even open: guard a writer that starts broken
        return _start_broken(writer, err, kwargs)
    guarded = GuardedFileWriter(current, **kwargs)
    _install(writer, guarded)
    return writer


def _install(writer: Any, guarded: GuardedFileWriter) -> None:
    previous = getattr(writer, "headwatch_storage", None)  # the writer was closed and opened again: same counts
    if isinstance(previous, GuardedFileWriter):
        guarded.delayed, guarded.lost = previous.delayed, previous.lost
        guarded.max_pending_bytes, guarded.retry_seconds = previous.max_pending_bytes, previous.retry_seconds
        guarded.observers, guarded.tags = previous.observers, previous.tags
    writer.file_writer, writer.all_writers = guarded, {guarded.get_logdir(): guarded}
    if all(hasattr(writer, a) for a in ("max_queue", "flush_secs", "filename_suffix")):
        guarded.file_args = (writer.max_queue, writer.flush_secs, writer.filename_suffix)
    writer.headwatch_storage = guarded  # kept after `writer.close()` (which drops file_writer) for storage_status


def _start_broken(writer: Any, err: BaseException, kwargs: dict[str, Any]) -> Any:
    class _Unopened:
        event_writer = None

        def get_logdir(self) -> str:
            return str(writer.log_dir)

    guarded = GuardedFileWriter(_Unopened(), **kwargs)
    guarded._fail(err)  # noqa: SLF001 - same module
    guarded.next_try = 0.0
    _install(writer, guarded)
    return writer


def open_guarded(writer: Any, open_file: Any, **kwargs: Any) -> GuardedFileWriter:
    """Open ``writer``'s event file with ``open_file()`` (which returns a torch ``FileWriter``) and guard it; when
    the log directory cannot be written (probed first, so that no torch writer thread starts and dies), install
    a :class:`GuardedFileWriter` that starts broken: it keeps the events and opens the file at a later flush.

    Returns the guarded writer, installed as ``writer.file_writer``. Never raises for the storage.
    ``kwargs``: :class:`GuardedFileWriter`'s ``max_pending_bytes`` and ``retry_seconds``.
    """
    try:
        _probe(str(writer.log_dir), 4096)
        current = open_file()
    except Exception as err:  # noqa: BLE001 - the storage never stops training
        writer.file_writer = writer.all_writers = None
        _start_broken(writer, err, kwargs)
        return writer.file_writer
    _install(writer, GuardedFileWriter(current, **kwargs))
    return writer.file_writer


def storage_status(writer: Any) -> dict[str, Any]:
    """``{"writing": bool, "delayed_events": int, "lost_events": int, "pending_events": int, "error": str | None}``
    of a guarded writer (an unguarded one: writing, zeros)."""
    g = getattr(writer, "headwatch_storage", None)
    if not isinstance(g, GuardedFileWriter):
        return {"writing": True, "delayed_events": 0, "lost_events": 0, "pending_events": 0, "error": None}
    return {"writing": g.broken is None, "delayed_events": g.delayed, "lost_events": g.lost,
            "pending_events": len(g.pending), "error": None if g.broken is None else f"{type(g.broken).__name__}: {g.broken}"}  # fmt: skip
