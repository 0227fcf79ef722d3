"""What happens at an alert, trainer-free (no torch, no Lightning): console, JSON Lines, a
scalar/text sink (TensorBoard), checkpoint, stop. The webhook is in :mod:`headwatch.alerts.webhook`.

An action is any callable taking an :class:`~headwatch.alerts.events.Alert`. Optional attributes
read by :class:`~headwatch.alerts.engine.AlertEngine`: ``name`` (for failure messages),
``main_process_only`` (default False: run on every process) and ``severities`` (default: all).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from headwatch.alerts.events import CRITICAL, SEVERITIES, Alert

JSONL_NAME = "headwatch_alerts.jsonl"


class AlertSink(Protocol):
    """Where markers and messages go (a TensorBoard writer, Lightning's loggers, ...)."""

    def scalar(self, tag: str, value: float, step: int) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...


class SummaryWriterSink:
    """:class:`AlertSink` over a ``torch.utils.tensorboard.SummaryWriter`` (or anything with
    ``add_scalar`` / ``add_text`` / ``flush``); flushed at once so that the marker shows live."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, global_step=step)
        self.writer.flush()


def marker_name(rule: str, severity: str = CRITICAL) -> str:
    """``<rule>`` for a critical alert, ``<rule>_warning`` for a warning: the marker's last tag component
    (a reader of ``headwatch_alerts.jsonl`` matches records to markers with it)."""
    return rule if severity == CRITICAL else f"{rule}_{severity}"


def marker_tag(prefix: str, alert: Alert) -> str:
    """``<prefix>/alerts/<marker_name(rule, severity)>``."""
    return f"{prefix}/alerts/{marker_name(alert.rule, alert.severity)}"


class SinkMarker:
    """Scalar marker ``marker_tag(prefix, alert)`` = 1 at the alert step and the message as text."""

    name = "TensorBoard marker"
    main_process_only = False  # the sink decides (Lightning's loggers write on rank zero)

    def __init__(self, sink: AlertSink, prefix: str = "headwatch") -> None:
        self.sink = sink
        self.prefix = prefix

    def __call__(self, alert: Alert) -> None:
        self.sink.scalar(marker_tag(self.prefix, alert), 1.0, alert.step)
        self.sink.text(f"{self.prefix}/alerts", f"[{alert.severity}] {alert.message}", alert.step)


class ConsoleWarning:
    """The alert's message through ``warn`` (default ``warnings.warn``; Lightning: ``rank_zero_warn``)."""

    name = "console warning"
    main_process_only = True

    def __init__(self, warn: Callable[[str], Any] | None = None) -> None:
        self.warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))

    def __call__(self, alert: Alert) -> None:
        self.warn(alert.message)


class JsonlLog:
    """One JSON object per alert appended to ``path`` (flushed and fsynced at once).

    A record that cannot be written (a full or read-only disk, a missing directory that cannot be made) is
    kept in memory (up to ``max_pending`` records; beyond that the oldest are dropped and counted in
    ``lost``) and written, in order, before the next record or at :meth:`flush` (the alert engine's flush
    and close): ``delayed`` counts the records written late. The failed call raises ``OSError`` saying
    that the record is kept, which the alert engine counts and warns about once.
    """

    name = "JSON Lines log"
    main_process_only = True

    def __init__(self, path: str | os.PathLike[str], max_pending: int = 10_000) -> None:
        self.path = Path(path)
        self.max_pending = max_pending
        self.pending: list[str] = []
        self.delayed = 0
        self.lost = 0

    def __call__(self, alert: Alert) -> None:
        self.pending.append(alert.to_json() + "\n")
        if len(self.pending) > self.max_pending:
            del self.pending[0]
            self.lost += 1
        self.delayed += max(self._write() - 1, 0)  # all but this alert's record were late

    def flush(self, timeout: float | None = None, strict: bool = False) -> None:
        """Write the kept records (in order). Raises ``OSError`` while the file cannot be written."""
        self.delayed += self._write()

    def _write(self) -> int:
        """Append every kept record at once (all or none); returns how many."""
        if not self.pending:
            return 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(self.pending))
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise OSError(
                f"cannot append to {self.path} ({type(err).__name__}: {err}); {len(self.pending)} alert record(s) are "
                "kept in memory and written as soon as the file can be written"
            ) from err
        written = len(self.pending)
        self.pending.clear()
        return written


class OnCritical:
    """Run ``fn(alert)`` on critical alerts only, on every process (checkpoint, stop: collectives)."""

    main_process_only = False
    severities = (CRITICAL,)

    def __init__(self, name: str, fn: Callable[[Alert], Any]) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, alert: Alert) -> None:
        self.fn(alert)


def action_name(action: Any) -> str:
    return str(getattr(action, "name", None) or f"action {getattr(action, '__name__', type(action).__name__)}")


def runs_for(action: Any, alert: Alert, main_process: bool) -> bool:
    """Whether ``action`` runs for ``alert`` on this process."""
    if getattr(action, "main_process_only", False) and not main_process:
        return False
    return alert.severity in getattr(action, "severities", SEVERITIES)
