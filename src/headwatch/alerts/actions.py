"""What happens at an alert, trainer-free (no torch, no Lightning): console, JSON Lines, a
scalar/text sink (TensorBoard), checkpoint, stop. The webhook is in :mod:`headwatch.alerts.webhook`.

An action is any callable taking an :class:`~headwatch.alerts.events.Alert`. Optional attributes
read by :class:`~headwatch.alerts.engine.AlertEngine`: ``name`` (for failure messages),
``main_process_only`` (default False: run on every process) and ``severities`` (default: all).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from headwatch.alerts.events import CRITICAL, SEVERITIES, Alert
from headwatch.errors import (
    check_callable,
    check_instance,
    check_int,
    check_optional,
    check_prefix,
    check_protocol,
    check_str,
)

JSONL_NAME = "headwatch_alerts.jsonl"


class AlertSink(Protocol):
    """Where markers and messages go (a TensorBoard writer, Lightning's loggers, ...)."""

    def scalar(self, tag: str, value: float, step: int) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...


class SummaryWriterSink:
    """:class:`AlertSink` over a ``torch.utils.tensorboard.SummaryWriter`` (or anything with
    ``add_scalar`` / ``add_text`` / ``flush``); flushed at once so that the marker shows live."""

    def __init__(self, writer: Any) -> None:
        self.writer = check_protocol("writer", writer, ["add_scalar", "add_text", "flush"], "a SummaryWriter (add_scalar, add_text, flush)")

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
        self.sink = check_protocol("sink", sink, ["scalar", "text"], "an AlertSink (scalar and text methods)")
        self.prefix = check_prefix(prefix)

    def __call__(self, alert: Alert) -> None:
        self.sink.scalar(marker_tag(self.prefix, alert), 1.0, alert.step)
        self.sink.text(f"{self.prefix}/alerts", f"[{alert.severity}] {alert.message}", alert.step)


class ConsoleWarning:
    """The alert's message through ``warn`` (default ``warnings.warn``; Lightning: ``rank_zero_warn``)."""

    name = "console warning"
    main_process_only = True

    def __init__(self, warn: Callable[[str], Any] | None = None) -> None:
        check_optional(check_callable, "warn", warn, "a callable taking a message")
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
        check_instance("path", path, (str, os.PathLike), "a path (str or os.PathLike)")
        check_int("max_pending", max_pending, minimum=1)
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

    def mark_undelivered(self, alerts: list[Alert], channel: str) -> None:
        """Append each alert's record again with ``"undelivered": channel`` (a reader counts the alert once: the
        record without that key). Kept back like any record when the file cannot be written."""
        for alert in alerts:
            record = json.loads(alert.to_json())
            record["undelivered"] = channel
            self.pending.append(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self.delayed += max(self._write() - len(alerts), 0)

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
        self.name = check_str("name", name)
        self.fn = check_callable("fn", fn, "a callable taking an Alert")

    def __call__(self, alert: Alert) -> None:
        self.fn(alert)


KEEP_CHECKPOINTS = 3
"""Checkpoints written by the alert's checkpoint action kept on disk by default (the latest ones)."""


class CheckpointOnCritical:
    """``save(alert)`` on critical alerts, on every process (a collective), at most once per step, and only the
    latest ``keep`` of the files it wrote kept.

    Each alert is one firing episode of one rule (an episode fires once, until its value re-arms past the
    margin), so this writes one checkpoint per episode; rules firing at one step (an entropy floor and a KL
    ceiling move together) share one. ``save`` returns the path it wrote (it is then removed once ``keep`` newer
    ones exist) or None (a trainer that rotates its own checkpoints: nothing removed). 0.3 wrote one full
    checkpoint per firing and kept them all: 11 in 60 steps for a value hovering at the floor.
    """

    name = "checkpoint"
    main_process_only = False
    severities = (CRITICAL,)

    def __init__(self, save: Callable[[Alert], Any], keep: int = KEEP_CHECKPOINTS) -> None:
        self.save = check_callable("save", save, "a callable taking an Alert")
        self.keep = check_int("keep", keep, minimum=1)
        self.written: list[Path] = []  # the files kept, oldest first
        self.saved = 0
        self._last_step: int | None = None

    def __call__(self, alert: Alert) -> None:
        if alert.step == self._last_step:
            return
        self._last_step = alert.step
        path = self.save(alert)
        self.saved += 1
        if path is None:
            return
        self.written = [p for p in self.written if p != Path(path)] + [Path(path)]
        while len(self.written) > self.keep:
            Path(self.written.pop(0)).unlink(missing_ok=True)  # missing: another process shares the folder


def action_name(action: Any) -> str:
    return str(getattr(action, "name", None) or f"action {getattr(action, '__name__', type(action).__name__)}")


def runs_for(action: Any, alert: Alert, main_process: bool) -> bool:
    """Whether ``action`` runs for ``alert`` on this process."""
    if getattr(action, "main_process_only", False) and not main_process:
        return False
    return alert.severity in getattr(action, "severities", SEVERITIES)
