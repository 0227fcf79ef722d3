"""Finding runs and reading what they logged: TensorBoard event files and ``headwatch_alerts.jsonl``.

Reading goes through TensorBoard's own ``EventAccumulator`` (imported lazily, so importing
this module is cheap).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwatch.errors import HeadwatchError
from headwatch.alerts.actions import marker_name

Points = list[tuple[int, float]]
"""The points of one scalar tag: ``(step, value)`` pairs sorted by step, one per step."""

Runs = dict[str, dict[str, Points]]
"""Run name -> tag -> points."""

EVENT_FILE_PREFIX = "events.out.tfevents."
ALERTS_FILE = "headwatch_alerts.jsonl"



@dataclass(frozen=True)
class RunDir:
    """A directory that directly holds event files, and the LOGDIR argument it was found under."""

    path: Path
    root: Path


def discover_runs(paths: Sequence[str | os.PathLike[str]]) -> dict[str, RunDir]:
    """Find every directory that directly contains ``events.out.tfevents.*`` files.

    Each run is named by its path relative to the LOGDIR it was found under (``tied/version_0``
    under ``runs``), or by its own directory name when the LOGDIR is the run directory. Names
    that two LOGDIRs share are prefixed with the LOGDIR's name (and numbered if still equal).

    Args:
        paths: run directories, folders of runs, or event files.

    Returns:
        Run name -> :class:`RunDir`, in the order of ``paths``, sorted within each.

    Raises:
        HeadwatchError: a path does not exist or holds no event files.
    """
    if not paths:
        raise HeadwatchError("no LOGDIR given: pass one or more run directories or folders of runs")
    found: list[tuple[str, str, RunDir]] = []  # (name, root name, run)
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise HeadwatchError(f"LOGDIR {str(raw)!r} does not exist")
        if root.is_file():
            if not root.name.startswith(EVENT_FILE_PREFIX):
                raise HeadwatchError(f"{str(raw)!r} is a file but not a TensorBoard event file ({EVENT_FILE_PREFIX}*)")
            root = root.parent
        dirs = sorted(
            Path(d) for d, _, files in os.walk(root, followlinks=True) if any(f.startswith(EVENT_FILE_PREFIX) for f in files)
        )
        if not dirs:
            raise HeadwatchError(
                f"no TensorBoard event files ({EVENT_FILE_PREFIX}*) under {str(raw)!r}; pass a run directory "
                "(for example runs/tied/version_0) or a folder of runs (for example runs)"
            )
        root_name = root.resolve().name or str(root)
        for d in dirs:
            rel = d.relative_to(root).as_posix()
            found.append((root_name if rel == "." else rel, root_name, RunDir(d, root)))
    counts: dict[str, int] = {}
    for name, _, _ in found:
        counts[name] = counts.get(name, 0) + 1
    runs: dict[str, RunDir] = {}
    for name, root_name, run in found:
        if counts[name] > 1 and not name.startswith(root_name):
            name = f"{root_name}/{name}"
        unique, k = name, 2
        while unique in runs:
            unique, k = f"{name}#{k}", k + 1
        runs[unique] = run
    return runs


def read_scalars(run_dir: str | os.PathLike[str]) -> dict[str, Points]:
    """Read every scalar tag of the event files directly in ``run_dir``.

    Uses TensorBoard's ``EventAccumulator`` with no sampling; reads both classic scalar
    summaries (``SummaryWriter.add_scalar``) and scalars stored as rank-0 tensors (the
    TensorFlow 2 writers). Several event files (a resumed run) are merged; when a step was
    written twice the last value read wins.

    Returns:
        Tag -> ``(step, value)`` points sorted by step.

    Raises:
        HeadwatchError: the event files cannot be read.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    try:
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        by_tag: dict[str, dict[int, float]] = {}
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            series = by_tag.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                series[int(ev.step)] = float(ev.value)
        for tag in tags.get("tensors", []):
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
                continue
            series = by_tag.setdefault(tag, {})
            for ev in acc.Tensors(tag):
                array = tensor_util.make_ndarray(ev.tensor_proto)
                if array.size == 1:
                    series[int(ev.step)] = float(array.reshape(()))
    except Exception as err:  # the reader raises many types (proto decode, OSError, ...)
        raise HeadwatchError(f"cannot read the TensorBoard event files in {str(run_dir)!r}: {err}") from err
    return {tag: sorted(series.items()) for tag, series in by_tag.items() if series}


def load_runs(paths: Sequence[str | os.PathLike[str]]) -> Runs:
    """Discover the runs under ``paths`` (see :func:`discover_runs`) and read their scalars.

    Returns:
        Run name -> tag -> ``(step, value)`` points sorted by step.

    Raises:
        HeadwatchError: a path does not exist, holds no event files, or cannot be read.
    """
    return {name: read_scalars(run.path) for name, run in discover_runs(paths).items()}


TRAINER_NAMESPACES = ("train/", "eval/")
"""The namespaces the Hugging Face Trainer's TensorBoard callback puts before every logged key."""


def strip_trainer_namespace(scalars: Mapping[str, Points], prefix: str = "headwatch") -> dict[str, Points]:
    """Read a Hugging Face Trainer run as if it were logged without the Trainer's ``train/`` namespace.

    The Trainer's TensorBoard callback writes ``train/<prefix>/...`` (and ``train/loss``,
    ``eval/loss``). When no tag of the run starts with ``<prefix>/`` but some start with
    ``train/<prefix>/``, those are renamed to ``<prefix>/...`` so that display, grouping and the
    alert markers work as for a Lightning run; every other tag (``train/loss``, ``eval/loss``,
    ``eval/<prefix>/...``) is kept as written. A run that already has ``<prefix>/`` tags is
    returned unchanged (a copy).

    Returns:
        Tag -> points, with the ``train/<prefix>/`` tags renamed.
    """
    head = prefix + "/"
    if any(tag.startswith(head) for tag in scalars):
        return dict(scalars)
    trainer_head = "train/" + head
    return {(tag[len("train/") :] if tag.startswith(trainer_head) else tag): points for tag, points in scalars.items()}


def read_run(run_dir: str | os.PathLike[str], prefix: str = "headwatch") -> dict[str, Points]:
    """:func:`read_scalars` then :func:`strip_trainer_namespace`: a Lightning or a Hugging Face Trainer run alike."""
    return strip_trainer_namespace(read_scalars(run_dir), prefix)


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


def read_alerts_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse a ``headwatch_alerts.jsonl`` file (keys ``time, step, epoch, rule, metrics, message``).

    Blank lines and lines that are not JSON objects (a line cut short by a crash) are skipped.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "rule" in obj:
                records.append(obj)
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
        step = int(rec.get("step", -1))
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


def expand_patterns(patterns: Sequence[str]) -> list[str]:
    """Expand shell-style globs (``runs/tied_*``; ``**`` is recursive) with :func:`glob.glob`, sorted.

    The tool expands them itself, so a quoted pattern (or a shell that did not expand it, as in
    ``tied=runs/tied_*``) works. A path without glob characters is kept as it is (a missing one
    is reported by :func:`discover_runs`).

    Raises:
        HeadwatchError: a pattern matches nothing.
    """
    paths: list[str] = []
    for pattern in patterns:
        if not _GLOB_CHARS.intersection(pattern):
            paths.append(pattern)
            continue
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise HeadwatchError(f"the pattern {pattern!r} matches no file or directory")
        paths.extend(matched)
    return paths


def discover_groups(specs: Mapping[str, Sequence[str]]) -> dict[str, dict[str, RunDir]]:
    """The runs of each group: its patterns expanded (:func:`expand_patterns`), then :func:`discover_runs`.

    Args:
        specs: group name -> paths or glob patterns, in display order.

    Returns:
        Group name -> run name -> :class:`RunDir`; a run name found in two groups is prefixed
        with its group name (``untied/seed1``).

    Raises:
        HeadwatchError: a pattern matches nothing, a path holds no event files, or one run
            directory belongs to two groups.
    """
    groups: dict[str, dict[str, RunDir]] = {}
    owner: dict[Path, str] = {}
    for group, patterns in specs.items():
        runs = discover_runs(expand_patterns(patterns))
        for run in runs.values():
            key = run.path.resolve()
            if key in owner and owner[key] != group:
                raise HeadwatchError(f"the run {str(run.path)!r} is in two groups, {owner[key]!r} and {group!r}")
            owner[key] = group
        groups[group] = runs
    seen: dict[str, int] = {}
    for runs in groups.values():
        for name in runs:
            seen[name] = seen.get(name, 0) + 1
    # a name two groups share (tied=a/seed1 untied=b/seed1) is told apart by its group
    return {g: {(f"{g}/{n}" if seen[n] > 1 else n): r for n, r in runs.items()} for g, runs in groups.items()}
