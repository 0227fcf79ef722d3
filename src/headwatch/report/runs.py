"""Finding runs and what they logged: run directories, ``headwatch_alerts.jsonl``, groups of runs.

Every run is listed once: directories are walked with symlinks followed but each real directory
visited once (a symlink cycle is cut, a ``latest`` alias does not add a run), real paths before
aliases. Reading event files and ``hparams.yaml`` is :mod:`headwatch.report.events`. Problems
that leave the rest of a report intact (a damaged file, a pattern that matches nothing) are said
in ``notes`` when the caller passes a list, instead of stopping the report.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwatch.alerts.actions import marker_name
from headwatch.errors import HeadwatchError
from headwatch.report.events import (
    EVENT_FILE_PREFIX,
    TRAINER_NAMESPACES,
    Points,
    event_files,
    is_regular_file,
    read_run,
    read_scalars,
    strip_trainer_namespace,
)

__all__ = [
    "ALERTS_FILE", "EVENT_FILE_PREFIX", "TRAINER_NAMESPACES", "AlertRecord", "Points", "RunDir", "Runs",
    "collect_alerts", "discover_groups", "discover_runs", "expand_patterns", "find_alerts_file", "load_runs",
    "read_alerts_jsonl", "read_run", "read_scalars", "strip_trainer_namespace",
]  # fmt: skip

Runs = dict[str, dict[str, Points]]
"""Run name -> tag -> points."""

ALERTS_FILE = "headwatch_alerts.jsonl"
MAX_ALERT_LINES = 100_000
"""Lines of an alert log read at most (a runaway log is cut there, and said)."""


@dataclass(frozen=True)
class RunDir:
    """A directory that directly holds event files, and the LOGDIR argument it was found under."""

    path: Path
    root: Path


def _key(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk(root: Path, visited: set[tuple[int, int]], notes: list[str] | None) -> tuple[list[Path], bool]:
    """Directories under ``root`` (itself included) holding a regular event file, each real directory once,
    and whether a directory visited before was met.

    Depth first; within a directory, real subdirectories before symlinked ones, each sorted by name.
    """
    found: list[Path] = []
    met_visited = False
    stack = [root]
    while stack:
        here = stack.pop()
        key = _key(here)
        if key is None or key in visited:
            met_visited = met_visited or key is not None
            continue
        visited.add(key)
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as err:
            if notes is not None:
                notes.append(f"{here}: cannot list the directory ({err.strerror or err}); skipped")
            continue
        if any(e.name.startswith(EVENT_FILE_PREFIX) for e in entries) and event_files(here, notes):
            found.append(here)
        real, linked = [], []
        here_real = Path(os.path.realpath(here))
        for e in entries:
            try:
                if not e.is_dir(follow_symlinks=True):
                    continue
                if not e.is_symlink():
                    real.append(Path(e.path))
                    continue
                target = Path(os.path.realpath(e.path))
                if target == here_real or target in here_real.parents:  # a link up the tree: a cycle
                    continue
                linked.append(Path(e.path))
            except OSError:
                continue
        stack.extend(reversed(real + linked))  # popped in order: real ones first, by name
    return found, met_visited


def discover_runs(
    paths: Sequence[str | os.PathLike[str]],
    notes: list[str] | None = None,
    visited: set[tuple[int, int]] | None = None,
) -> dict[str, RunDir]:
    """Find every directory that directly contains a regular ``events.out.tfevents.*`` file, each once.

    Each run is named by its path relative to the LOGDIR it was found under (``tied/version_0``
    under ``runs``), or by its own directory name when the LOGDIR is the run directory. A name
    that two LOGDIRs share gets as many of its LOGDIR's last path components as tell them apart
    (``tied/seed0/version_0``, ``untied/seed0/version_0``), and is numbered if still equal.
    A directory reached twice (through a symlink, an alias, or two LOGDIRs) is listed once, under
    its first name; symlink cycles are cut.

    Args:
        paths: run directories, folders of runs, or event files.
        notes: where to say what was skipped (None: raise for a LOGDIR with no run).
        visited: real directories already listed (shared between calls: a group's patterns).

    Returns:
        Run name -> :class:`RunDir`, in the order of ``paths``, sorted within each.

    Raises:
        HeadwatchError: no path given; a path does not exist or is a file that is not an event file; a path
            holds no event files (with ``notes``: said there instead, unless its runs were listed already).
    """
    if not paths:
        raise HeadwatchError("no LOGDIR given: pass one or more run directories or folders of runs")
    visited = set() if visited is None else visited
    found: list[tuple[str, Path, RunDir]] = []  # (path under the LOGDIR, the LOGDIR, run)
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise HeadwatchError(f"LOGDIR {str(raw)!r} does not exist")
        if not root.is_dir():
            if not root.name.startswith(EVENT_FILE_PREFIX):
                raise HeadwatchError(f"{str(raw)!r} is a file but not a TensorBoard event file ({EVENT_FILE_PREFIX}*)")
            root = root.parent
        dirs, met_visited = _walk(root, visited, notes)
        if not dirs:
            if met_visited:  # an alias of, or a folder inside, what an earlier path listed
                if notes is not None:
                    notes.append(f"{raw}: its runs are listed already, each once")
                continue
            message = (f"no TensorBoard event files ({EVENT_FILE_PREFIX}*) under {str(raw)!r}; pass a run directory "
                       "(for example runs/tied/version_0) or a folder of runs (for example runs)")
            if notes is None:
                raise HeadwatchError(message)
            notes.append(message)
            continue
        for d in sorted(dirs):
            rel = d.relative_to(root).as_posix()
            found.append(("" if rel == "." else rel, root, RunDir(d, root)))
    return _name_runs(found)


def _tail(root: Path, k: int) -> str:
    """The last ``k`` components of ``root``'s absolute path (``runs/tied`` for k = 2)."""
    parts = root.resolve().parts
    return "/".join(p for p in parts[max(1, len(parts) - k) :]) or str(root)


def _name_runs(found: Sequence[tuple[str, Path, RunDir]]) -> dict[str, RunDir]:
    """Names for ``(path under its LOGDIR, LOGDIR, run)``: the path under the LOGDIR (the LOGDIR's own name
    for the LOGDIR itself); a name two LOGDIRs share gets as many of its LOGDIR's last path components as
    tell them apart (``tied/seed0/version_0`` and ``untied/seed0/version_0``), else a number (``#2``)."""
    def name(rel: str, root: Path, k: int) -> str:
        if k == 0:
            return rel or _tail(root, 1)
        return f"{_tail(root, k)}/{rel}" if rel else _tail(root, k)

    names = [name(rel, root, 0) for rel, root, _ in found]
    clashing = {n for n in names if names.count(n) > 1}
    for k in range(1, 9):
        if not clashing:
            break
        names = [name(rel, root, k) if n in clashing else n for n, (rel, root, _) in zip(names, found)]
        clashing = {n for n in names if names.count(n) > 1}
    runs: dict[str, RunDir] = {}
    for n, (_, _, run) in zip(names, found):
        unique, k = n, 2
        while unique in runs:
            unique, k = f"{n}#{k}", k + 1
        runs[unique] = run
    return runs


def load_runs(paths: Sequence[str | os.PathLike[str]]) -> Runs:
    """Discover the runs under ``paths`` (see :func:`discover_runs`) and read their scalars.

    Returns:
        Run name -> tag -> ``(step, value)`` points sorted by step.

    Raises:
        HeadwatchError: a path does not exist or holds no event files.
    """
    return {name: read_scalars(run.path) for name, run in discover_runs(paths).items()}


# --------------------------------------------------------------------------- alerts


@dataclass(frozen=True)
class AlertRecord:
    """One alert of one run, from the JSON Lines log, a TensorBoard marker, or both."""

    step: int
    rule: str
    message: str
    source: str
    """``"jsonl"``, ``"tensorboard"`` or ``"jsonl+tensorboard"``."""


def find_alerts_file(run_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path | None:
    """The nearest ``headwatch_alerts.jsonl`` in ``run_dir`` or above it, up to ``root`` (inclusive).

    Without ``root`` only ``run_dir`` itself is searched.
    """
    here = Path(run_dir).resolve()
    stop = Path(root).resolve() if root is not None else here
    while True:
        candidate = here / ALERTS_FILE
        if candidate.is_file():
            return candidate
        if here == stop or here.parent == here or stop not in here.parents:
            return None
        here = here.parent


def _step(value: Any) -> int | None:
    """An alert record's step: an int (or an integral float); -1 when absent; None when unusable."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (abs(value) < 2**62 and value == int(value)):
        return None
    return int(value)


def read_alerts_jsonl(path: str | os.PathLike[str], notes: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse a ``headwatch_alerts.jsonl`` file (keys ``time, step, epoch, rule, metrics, message``).

    Kept: JSON objects with a ``rule`` and a usable ``step`` (an integer, or absent); a record marked
    ``"undelivered"`` (the webhook gave it up at close) repeats an alert kept already and is passed over. Blank lines are
    skipped; other lines (a line cut short by a crash, bytes that are not UTF-8, a record whose step is
    not a number) are skipped and counted in one note. A file that is not a regular file (a FIFO) is
    not read; at most :data:`MAX_ALERT_LINES` lines are read.

    Args:
        path: the file.
        notes: where to say what was skipped; None: say nothing.
    """
    if not is_regular_file(path):
        if notes is not None:
            notes.append(f"{os.fspath(path)}: not a regular file, not read")
        return []
    records: list[dict[str, Any]] = []
    bad = lines = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                lines += 1
                if lines > MAX_ALERT_LINES:
                    if notes is not None:
                        notes.append(f"{os.fspath(path)}: more than {MAX_ALERT_LINES} lines; the rest not read")
                    break
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:  # JSONDecodeError, and a number too long for int()
                    bad += 1
                    continue
                if isinstance(obj, dict) and "undelivered" in obj:
                    continue  # an alert recorded above, not delivered to one channel: the same alert once
                if isinstance(obj, dict) and "rule" in obj and _step(obj.get("step")) is not None:
                    records.append(obj)
                else:
                    bad += 1
    except OSError as err:
        if notes is not None:
            notes.append(f"{os.fspath(path)}: cannot be read ({err.strerror or err})")
        return records
    if bad and notes is not None:
        notes.append(f"{os.fspath(path)}: {bad} line{'s' if bad != 1 else ''} not an alert record "
                     "(cut short, not JSON, or no rule or step); skipped")
    return records


def collect_alerts(
    scalars: Mapping[str, Points], jsonl_records: Iterable[Mapping[str, Any]] = (), prefix: str = "headwatch"
) -> list[AlertRecord]:
    """Merge the alert markers ``<prefix>/alerts/<rule>`` (steps where the value is 1) with JSON Lines records.

    An alert present in both (same step and rule) is listed once, with the JSON message.

    Returns:
        The alerts sorted by step, then rule.
    """
    merged: dict[tuple[int, str], AlertRecord] = {}
    for rec in jsonl_records:
        step = _step(rec.get("step"))
        if step is None or "rule" not in rec:
            continue
        # markers are named <rule> (critical) or <rule>_<severity>: key records the same way
        rule = marker_name(str(rec["rule"]), str(rec.get("severity", "critical")))
        merged[(step, rule)] = AlertRecord(step, rule, str(rec.get("message", "")), "jsonl")
    marker = f"{prefix}/alerts/"
    for tag, points in scalars.items():
        if not tag.startswith(marker):
            continue
        rule = tag[len(marker) :]
        for step, value in points:
            if value != 1.0:
                continue
            old = merged.get((step, rule))
            if old is None:
                merged[(step, rule)] = AlertRecord(step, rule, "", "tensorboard")
            else:
                merged[(step, rule)] = AlertRecord(step, rule, old.message, "jsonl+tensorboard")
    return sorted(merged.values(), key=lambda a: (a.step, a.rule))



_GLOB_CHARS = frozenset("*?[")


def expand_patterns(patterns: Sequence[str], notes: list[str] | None = None) -> list[str]:
    """Expand shell-style globs (``runs/tied_*``; ``**`` is recursive) with :func:`glob.glob`, sorted.

    The tool expands them itself, so a quoted pattern (or a shell that did not expand it, as in
    ``tied=runs/tied_*``) works. A path without glob characters is kept as it is (a missing one
    is reported by :func:`discover_runs`).

    Raises:
        HeadwatchError: a pattern matches nothing (with ``notes``: said there instead).
    """
    paths: list[str] = []
    for pattern in patterns:
        if not _GLOB_CHARS.intersection(pattern):
            paths.append(pattern)
            continue
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            if notes is None:
                raise HeadwatchError(f"the pattern {pattern!r} matches no file or directory")
            notes.append(f"the pattern {pattern!r} matches no file or directory")
        paths.extend(matched)
    return paths


def discover_groups(
    specs: Mapping[str, Sequence[str]], notes: list[str] | None = None
) -> dict[str, dict[str, RunDir]]:
    """The runs of each group: its patterns expanded (:func:`expand_patterns`), then :func:`discover_runs`.

    A run that a group's patterns match twice (an alias, overlapping patterns) counts once.

    Args:
        specs: group name -> paths or glob patterns, in display order.
        notes: where to say what was left out (a pattern matching nothing, a missing path, a run in two
            groups: kept in the first); None: raise instead.

    Returns:
        Group name -> run name -> :class:`RunDir` (with ``notes``, a group may be empty); a run name found
        in two groups is prefixed with its group name (``untied/seed1``).

    Raises:
        HeadwatchError: without ``notes``: a pattern matches nothing, a path holds no event files, or one
            run directory belongs to two groups.
    """
    groups: dict[str, dict[str, RunDir]] = {}
    owner: dict[tuple[int, int], str] = {}
    for group, patterns in specs.items():
        paths = expand_patterns(patterns, notes)
        if notes is not None:
            for missing in [q for q in paths if not os.path.exists(q)]:
                notes.append(f"group {group!r}: {missing!r} does not exist")
            paths = [q for q in paths if os.path.exists(q)]
        runs = discover_runs(paths, notes, visited=set()) if paths else {}
        for name, run in list(runs.items()):
            key = _key(run.path)
            if key is not None and key in owner and owner[key] != group:
                if notes is None:
                    raise HeadwatchError(f"the run {str(run.path)!r} is in two groups, {owner[key]!r} and {group!r}")
                notes.append(f"the run {str(run.path)!r} is in two groups, {owner[key]!r} and {group!r}: kept in {owner[key]!r}")
                del runs[name]
                continue
            if key is not None:
                owner[key] = group
        groups[group] = runs
    seen: dict[str, int] = {}
    for runs in groups.values():
        for name in runs:
            seen[name] = seen.get(name, 0) + 1
    # a name two groups share (tied=a/seed1 untied=b/seed1) is told apart by its group
    return {g: {(f"{g}/{n}" if seen[n] > 1 else n): r for n, r in runs.items()} for g, runs in groups.items()}
