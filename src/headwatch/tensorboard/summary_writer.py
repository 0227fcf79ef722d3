"""A ``SummaryWriter`` whose log directory may be unwritable from the start.

torch's ``SummaryWriter`` opens its event file in its constructor and raises there when the log directory
cannot be written (``OSError`` EROFS on a read-only file system, ENOSPC on a full one, EACCES): the run
stops before its first step. :class:`SummaryWriter` (``headwatch.tensorboard.SummaryWriter``) is torch's,
with that first open guarded: it starts without a file, keeps its events in memory and opens the file at a
later ``flush`` once the fault clears, exactly as for a fault in the middle of the run
(:class:`headwatch.tensorboard.guard.GuardedFileWriter`).
"""

from __future__ import annotations

from typing import Any

from torch.utils.tensorboard import SummaryWriter as TorchSummaryWriter

from headwatch.tensorboard.guard import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_RETRY_SECONDS,
    GuardedFileWriter,
    check_guard_options,
    open_guarded,
)

__all__ = ["SummaryWriter", "guarded_writer_class"]


class SummaryWriter(TorchSummaryWriter):
    """``torch.utils.tensorboard.SummaryWriter`` that never raises for its storage, from its constructor on.

    When the event file cannot be made (a read-only or full file system, a directory that cannot be
    created), it starts without one: one warning names the directory and the error, the events are kept in
    memory, and the file is opened at a later ``flush`` once the fault clears (the first flush tries at
    once, later ones at most every ``retry_seconds``). The kept events are then written in order, followed
    by ``headwatch/storage/delayed_events`` and ``headwatch/storage/lost_events`` (cumulative counts);
    one warning says writing resumed. Faults in the middle of the run are handled the same way
    (:mod:`headwatch.tensorboard.guard`); ``headwatch.tensorboard.storage_status(writer)`` gives the counts.

    Args:
        *args, **kwargs: those of ``torch.utils.tensorboard.SummaryWriter`` (``log_dir``, ``purge_step``,
            ``max_queue``, ``flush_secs``, ``filename_suffix``...).
        max_pending_bytes: serialized events kept in memory while the log directory cannot be written
            (default 64 MiB); beyond it the oldest are dropped and counted lost.
        retry_seconds: shortest time in seconds between two attempts to open an event file (default:
            ``DEFAULT_RETRY_SECONDS``, 30 s).

    Raises:
        Nothing for the storage; HeadwatchError for ``max_pending_bytes`` or ``retry_seconds`` out of range
        (:func:`~headwatch.tensorboard.guard.check_guard_options`); torch's errors for its other arguments.
    """

    def __init__(self, *args: Any, max_pending_bytes: int | None = None, retry_seconds: float | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        check_guard_options(max_pending_bytes, retry_seconds)
        self.headwatch_guard_kwargs = {
            "max_pending_bytes": DEFAULT_MAX_PENDING_BYTES if max_pending_bytes is None else int(max_pending_bytes),
            "retry_seconds": DEFAULT_RETRY_SECONDS if retry_seconds is None else float(retry_seconds),
        }
        super().__init__(*args, **kwargs)  # calls _get_file_writer, which never raises for the storage

    def _get_file_writer(self) -> Any:
        """The guarded ``FileWriter``; made (or made again after ``close``) when there is none."""
        if isinstance(self.file_writer, GuardedFileWriter) and self.all_writers is not None:
            return self.file_writer
        guarded = open_guarded(self, super()._get_file_writer, **self.headwatch_guard_kwargs)
        if guarded.broken is not None and self.purge_step is not None:  # what torch's writer puts first in a new file
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            guarded.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
            guarded.add_event(Event(step=self.purge_step, session_log=SessionLog(status=SessionLog.START)))
            self.purge_step = None
        return guarded


def guarded_writer_class(cls: Any) -> Any:
    """:class:`SummaryWriter` when ``cls`` is ``torch.utils.tensorboard.SummaryWriter``; any other class
    (``tensorboardX``'s, a user's own subclass) unchanged."""
    return SummaryWriter if cls is TorchSummaryWriter else cls
