"""``headwatch report``: compare the headwatch metrics of finished (or running) runs.

Reads the TensorBoard event files of one or more runs with TensorBoard's own reader and
prints, side by side, for every headwatch scalar: the final value, the mean over the last
10% of the logged points and the trend over the last half of the run; then the alerts
each run raised (TensorBoard markers ``<prefix>/alerts/<rule>`` and the JSON Lines log
``headwatch_alerts.jsonl`` written by :class:`headwatch.SharpnessCollapseAlert`). With
``--html PATH`` it writes one self-contained HTML page (no scripts, no external links)
with the same table and one chart per metric comparing the runs.

Example::

    python examples/train_tiny_lm.py                    # runs/tied/version_0
    python examples/train_tiny_lm.py --no-tie-weights   # runs/untied/version_0
    headwatch report runs --html report.html

TensorBoard and matplotlib are imported inside the functions that need them, so
importing this module is cheap; matplotlib is optional (SVG charts are drawn without it).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwatch._errors import HeadwatchError

Points = list[tuple[int, float]]
"""The points of one scalar tag: ``(step, value)`` pairs sorted by step, one per step."""

Runs = dict[str, dict[str, Points]]
"""Run name -> tag -> points."""

EVENT_FILE_PREFIX = "events.out.tfevents."
ALERTS_FILE = "headwatch_alerts.jsonl"
CONTEXT_TAGS = ("train_loss", "val_loss")
"""Non-headwatch scalars shown, when present, as context for the headwatch metrics."""

BUCKETS = ("top1", "top10", "top50", "tail", "unseen", "rare")
"""Path components of the per-frequency-bucket tags, hidden unless ``--all``."""

HIDDEN_SUFFIXES = ("_p05", "_max")
GROUP_ORDER = ("loss", "logits", "val", "grad", "update", "freq", "collision", "tokens", "alerts")
FLAT_TOLERANCE = 0.01
"""A trend is shown as flat (→) when the fitted change over its span is below 1% of the mean |value|."""

MISSING = "—"
ARROWS = {"up": "↑", "down": "↓", "flat": "→"}
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")


# --------------------------------------------------------------------------- loading


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
        rule = str(rec["rule"])
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


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Summary:
    """The summary of one tag of one run.

    ``last10_mean`` and the trend use the finite values only; ``final`` is the value at
    the last step, whatever it is.
    """

    final: float
    final_step: int
    last10_mean: float | None
    """Mean of the last ``max(1, ceil(n / 10))`` points."""
    trend_per_1k: float | None
    """Least-squares slope of value on step over the last ``ceil(n / 2)`` points (at least 2), per 1000 steps."""
    trend: str | None
    """``"up"``, ``"down"`` or ``"flat"``: flat when the fitted change over the span is below 1% of mean |value|."""
    points: int
    first_step: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become ``None``."""
        return {
            "final": _finite_or_none(self.final),
            "last10_mean": _finite_or_none(self.last10_mean),
            "trend_per_1k": _finite_or_none(self.trend_per_1k),
            "trend": self.trend,
            "steps": self.points,
            "first_step": self.first_step,
            "last_step": self.final_step,
        }


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Slope of the least-squares line ``value = a + b * step`` through ``points``, in float64.

    Returns ``None`` with fewer than 2 points or when all steps are equal.
    """
    n = len(points)
    if n < 2:
        return None
    mx = math.fsum(x for x, _ in points) / n
    my = math.fsum(y for _, y in points) / n
    sxx = math.fsum((x - mx) ** 2 for x, _ in points)
    if sxx == 0.0:
        return None
    sxy = math.fsum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx


def summarize(points: Points) -> Summary:
    """Final value, mean over the last 10% of the points and trend over the last 50%.

    With ``n`` points sorted by step: ``last10_mean`` is the mean of the last
    ``max(1, ceil(n / 10))``; the trend is the least-squares slope over the last
    ``ceil(n / 2)`` (at least 2, else ``None``), times 1000 (change per 1000 steps). Its
    direction is ``"flat"`` when ``|slope * (last_step - first_step of the span)|`` is
    below 1% of the mean ``|value|`` over the span, else ``"up"`` or ``"down"``.
    Non-finite values are left out of the mean and the trend.

    Raises:
        HeadwatchError: ``points`` is empty.
    """
    if not points:
        raise HeadwatchError("summarize needs at least one (step, value) point, got none")
    n = len(points)
    final_step, final = points[-1]
    tail = [v for _, v in points[n - max(1, -(-n // 10)) :] if math.isfinite(v)]
    last10_mean = math.fsum(tail) / len(tail) if tail else None
    span = [(float(s), v) for s, v in points[n - -(-n // 2) :] if math.isfinite(v)]
    slope = least_squares_slope(span)
    trend_per_1k = trend = None
    if slope is not None:
        trend_per_1k = slope * 1000.0
        change = abs(slope * (span[-1][0] - span[0][0]))
        scale = math.fsum(abs(v) for _, v in span) / len(span)
        if change == 0.0 or (scale > 0.0 and change / scale < FLAT_TOLERANCE):
            trend = "flat"
        else:
            trend = "up" if slope > 0 else "down"
    return Summary(final, final_step, last10_mean, trend_per_1k, trend, n, points[0][0])


def select_tags(
    tags: Iterable[str], *, show_all: bool = False, match: str | None = None, prefix: str = "headwatch"
) -> list[str]:
    """The tags to report, in display order (by group, then name).

    Kept: tags under ``<prefix>/`` and the context tags ``train_loss``, ``val_loss``. Unless
    ``show_all``, the per-bucket tags (a component in :data:`BUCKETS`) and the ``_p05`` /
    ``_max`` variants are dropped. ``match`` (a regular expression, ``re.search``) filters
    what is left.

    Raises:
        HeadwatchError: ``match`` is not a valid regular expression.
    """
    try:
        pattern = re.compile(match) if match else None
    except re.error as err:
        raise HeadwatchError(f"--match {match!r} is not a valid regular expression: {err}") from err
    head = prefix + "/"
    keep = set()
    for tag in tags:
        if not (tag.startswith(head) or tag in CONTEXT_TAGS):
            continue
        if not show_all:
            parts = tag.split("/")
            if any(p in BUCKETS for p in parts[1:-1]) or tag.endswith(HIDDEN_SUFFIXES):
                continue
        if pattern is not None and not pattern.search(tag):
            continue
        keep.add(tag)
    return sorted(keep, key=lambda t: _sort_key(t, prefix))


def tag_group(tag: str, prefix: str = "headwatch") -> str:
    """The display group of a tag: its second component (``logits``, ``grad``, ...), ``loss`` for the context tags."""
    if not tag.startswith(prefix + "/"):
        return "loss"
    rest = tag[len(prefix) + 1 :]
    return rest.split("/", 1)[0] if "/" in rest else "other"


def _sort_key(tag: str, prefix: str) -> tuple[int, str, str]:
    group = tag_group(tag, prefix)
    rank = GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)
    return rank, group, tag


def summarize_runs(runs: Mapping[str, Mapping[str, Points]], tags: Sequence[str]) -> dict[str, dict[str, Summary]]:
    """Run name -> tag -> :class:`Summary` for the ``tags`` each run has."""
    return {name: {tag: summarize(scalars[tag]) for tag in tags if scalars.get(tag)} for name, scalars in runs.items()}


# --------------------------------------------------------------------------- formatting


def format_number(x: float | None, signed: bool = False) -> str:
    """About 4 significant digits in at most 10 characters; ``—`` for a missing value."""
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("+inf" if x > 0 else "-inf")
    if x == 0.0:
        return "0"
    sign = "+" if signed else ""
    if x == int(x) and abs(x) < 1e9:
        return f"{int(x):{sign}d}"
    ax = abs(x)
    if 1e-3 <= ax < 1e6:
        decimals = max(0, 3 - math.floor(math.log10(ax)))
        return f"{x:{sign}.{decimals}f}"
    return f"{x:{sign}.3e}"


def format_trend(s: Summary | None) -> str:
    """``↓ -0.4512``: the arrow of :attr:`Summary.trend` and the slope per 1000 steps."""
    if s is None or s.trend is None:
        return MISSING
    return f"{ARROWS[s.trend]} {format_number(s.trend_per_1k, signed=True)}"


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _alert_cell(points: Points | None) -> str:
    if not points:
        return MISSING
    fired = [s for s, v in points if v == 1.0]
    return f"{len(fired)}× (last at step {fired[-1]})" if fired else "0×"


_COL = (10, 10, 12)  # final, last-10% mean, trend
_GAP = "  "
_RUN_SEP = " │ "


def render_text(
    runs: Mapping[str, Mapping[str, Points]],
    tags: Sequence[str],
    alerts: Mapping[str, Sequence[AlertRecord]] | None = None,
    *,
    width: int = 160,
    prefix: str = "headwatch",
    sources: Mapping[str, str] | None = None,
) -> str:
    """The side-by-side plain-text table and the alerts section.

    One column block per run (final, mean over the last 10%, trend per 1000 steps); rows
    grouped by the tag's second component. Runs that do not fit in ``width`` characters
    go to further tables below. Alert marker tags show how often they fired.

    Args:
        runs: run name -> tag -> points (:func:`load_runs`).
        tags: the tags to show, in order (:func:`select_tags`).
        alerts: run name -> alerts (:func:`collect_alerts`); ``None`` leaves the section out.
        width: the target line width in characters.
        prefix: the headwatch tag prefix.
        sources: run name -> where it was read from, listed above the table.
    """
    summaries = summarize_runs(runs, tags)
    names = list(runs)
    lines: list[str] = []
    if sources:
        lines.append("Runs:")
        lines.extend(f"  {name}  ({sources[name]})" for name in names if name in sources)
        lines.append("")
    if not tags:
        lines.append("No headwatch metrics matched (try --all, or check --match and --prefix).")
    else:
        head = prefix + "/"
        labels = {t: "  " + (t[len(head) :] if t.startswith(head) else t) for t in tags}
        tag_w = min(max(len(v) for v in labels.values()), 46)
        tag_w = max(tag_w, len("metric"))
        block_w = sum(_COL) + len(_GAP) * 2
        per_table = max(1, (width - tag_w) // (block_w + len(_RUN_SEP)))
        for start in range(0, len(names), per_table):
            chunk = names[start : start + per_table]
            if start:
                lines.append("")
            lines.extend(_text_table(chunk, tags, labels, tag_w, block_w, runs, summaries, prefix))
    if alerts is not None:
        lines.append("")
        lines.append("Alerts")
        for name in names:
            records = alerts.get(name, [])
            if not records:
                lines.append(f"  {name}: no alerts")
                continue
            lines.append(f"  {name}: {len(records)} alert{'s' if len(records) != 1 else ''}")
            step_w = max(len(str(a.step)) for a in records)
            rule_w = max(len(a.rule) for a in records)
            for a in records:
                message = a.message or "(TensorBoard marker only; no headwatch_alerts.jsonl entry)"
                lines.append(f"    step {a.step:>{step_w}}  {a.rule:<{rule_w}}  {message}")
    return "\n".join(lines) + "\n"


def _text_table(
    names: Sequence[str],
    tags: Sequence[str],
    labels: Mapping[str, str],
    tag_w: int,
    block_w: int,
    runs: Mapping[str, Mapping[str, Points]],
    summaries: Mapping[str, Mapping[str, Summary]],
    prefix: str,
) -> list[str]:
    def row(first: str, cells: Sequence[str]) -> str:
        return (f"{first:<{tag_w}}" + "".join(_RUN_SEP + c for c in cells)).rstrip()

    def block(a: str, b: str, c: str) -> str:
        return _GAP.join((f"{a:>{_COL[0]}}", f"{b:>{_COL[1]}}", f"{c:>{_COL[2]}}"))

    out = [
        row("", [f"{_fit(n, block_w):^{block_w}}" for n in names]),
        row("metric", [block("final", "last 10%", "trend/1k") for _ in names]),
        "─" * tag_w + "".join("─┼─" + "─" * block_w for _ in names),
    ]
    group = None
    for tag in tags:
        g = tag_group(tag, prefix)
        if g != group:
            group = g
            out.append(row(f"[{g}]", [" " * block_w for _ in names]))
        cells = []
        for name in names:
            if g == "alerts":
                cells.append(f"{_alert_cell(runs[name].get(tag)):>{block_w}}")
                continue
            s = summaries[name].get(tag)
            if s is None:
                cells.append(block(MISSING, MISSING, MISSING))
            else:
                cells.append(block(format_number(s.final), format_number(s.last10_mean), format_trend(s)))
        out.append(row(_fit(labels[tag], tag_w), cells))
    return out


def to_json(runs: Mapping[str, Mapping[str, Points]], tags: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Run name -> tag -> ``{final, last10_mean, trend_per_1k, trend, steps, first_step, last_step}``.

    ``steps`` is the number of logged points; non-finite numbers are ``None`` (JSON ``null``).
    """
    return {name: {tag: s.to_dict() for tag, s in per_tag.items()} for name, per_tag in summarize_runs(runs, tags).items()}


# --------------------------------------------------------------------------- HTML


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; } td.tag, th.tag { text-align: left; font-family: monospace; }
td.run-start, th.run-start { border-left: 2px solid #ccc; }
tr.group td { background: #fafafa; font-weight: bold; text-align: left; }
.runs li span.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: middle; }
.charts { display: flex; flex-wrap: wrap; gap: 14px; }
figure { margin: 0; border: 1px solid #e3e3e3; padding: 6px; background: #fff; }
figcaption { font-family: monospace; font-size: 0.8em; margin-bottom: 4px; }
.alerts td, .alerts th { text-align: left; white-space: normal; }
.muted { color: #888; }
"""


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _downsample(points: Points, limit: int = 1500) -> Points:
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / limit)
    kept = list(points[::stride])
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def render_svg_chart(
    series: Mapping[str, Points],
    colors: Mapping[str, str],
    *,
    title: str = "",
    alert_steps: Mapping[str, Sequence[int]] | None = None,
    width: int = 460,
    height: int = 230,
) -> str:
    """One inline ``<svg>`` line chart: a polyline per run, min/max labels on both axes, a legend.

    Non-finite values break the line; runs with a single point are drawn as dots; alert
    steps are dashed vertical lines in the run's color. The SVG has no external references.
    """
    left, right, top, bottom = 62, 12, 10, 40
    legend_h = 16 * len(series)
    h = height + legend_h
    finite = [(s, v) for pts in series.values() for s, v in pts if math.isfinite(v)]
    esc = html.escape
    parts = [f'<svg width="{width}" height="{h}" viewBox="0 0 {width} {h}" role="img" aria-label="{esc(title)}">']
    pw, ph = width - left - right, height - top - bottom
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    if not finite:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" font-size="12" fill="#888">no finite values</text>')
    else:
        x0, x1 = min(s for s, _ in finite), max(s for s, _ in finite)
        y0, y1 = min(v for _, v in finite), max(v for _, v in finite)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        if y1 == y0:
            pad = abs(y0) * 0.05 or 1.0
            y0, y1 = y0 - pad, y1 + pad

        def px(step: float) -> float:
            return left + (step - x0) / (x1 - x0) * pw

        def py(value: float) -> float:
            return top + (y1 - value) / (y1 - y0) * ph

        for name, steps in (alert_steps or {}).items():
            for step in steps:
                if x0 <= step <= x1:
                    parts.append(
                        f'<line x1="{px(step):.1f}" y1="{top}" x2="{px(step):.1f}" y2="{top + ph}" stroke="{colors[name]}" '
                        f'stroke-dasharray="4 3" stroke-opacity="0.7"><title>{esc(name)}: alert at step {step}</title></line>'
                    )
        for name, pts in series.items():
            color = colors[name]
            segments: list[list[str]] = [[]]
            for s, v in _downsample(pts):
                if math.isfinite(v):
                    segments[-1].append(f"{px(s):.1f},{py(v):.1f}")
                elif segments[-1]:
                    segments.append([])
            for seg in segments:
                if len(seg) == 1 or len(pts) <= 3:
                    for xy in seg:
                        cx, cy = xy.split(",")
                        parts.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>')
                if len(seg) >= 2:
                    parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{" ".join(seg)}"/>')
        label = 'font-size="11" fill="#444"'
        parts.append(f'<text x="{left - 4}" y="{top + 9}" text-anchor="end" {label}>{esc(format_number(y1))}</text>')
        parts.append(f'<text x="{left - 4}" y="{top + ph}" text-anchor="end" {label}>{esc(format_number(y0))}</text>')
        parts.append(f'<text x="{left}" y="{top + ph + 14}" text-anchor="start" {label}>{x0:g}</text>')
        parts.append(f'<text x="{left + pw}" y="{top + ph + 14}" text-anchor="end" {label}>{x1:g}</text>')
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph + 14}" text-anchor="middle" {label}>step</text>')
    for i, name in enumerate(series):
        y = height + 16 * i - 4
        parts.append(f'<rect x="{left}" y="{y - 9}" width="14" height="4" fill="{colors[name]}"/>')
        parts.append(f'<text x="{left + 20}" y="{y - 4}" font-size="11" fill="#222">{esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_png_chart(
    series: Mapping[str, Points],
    colors: Mapping[str, str],
    *,
    title: str = "",
    alert_steps: Mapping[str, Sequence[int]] | None = None,
) -> str:
    """The chart of :func:`render_svg_chart` drawn with matplotlib, as an ``<img>`` with a base64 PNG data URI.

    Raises:
        HeadwatchError: matplotlib is not installed (``pip install matplotlib``).
    """
    import base64
    import io

    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone
    except ImportError as err:
        raise HeadwatchError("PNG charts need matplotlib: pip install matplotlib (or use --charts svg)") from err
    fig = Figure(figsize=(4.8, 2.6), dpi=100)
    ax = fig.subplots()
    for name, pts in series.items():
        steps = [s for s, _ in pts]
        values = [v if math.isfinite(v) else float("nan") for _, v in pts]
        marker = "o" if len(pts) <= 3 else None
        ax.plot(steps, values, color=colors[name], label=name, linewidth=1.4, marker=marker, markersize=4)
        for step in (alert_steps or {}).get(name, []):
            ax.axvline(step, color=colors[name], linestyle="--", alpha=0.6, linewidth=1)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"/>'


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def render_html(
    runs: Mapping[str, Mapping[str, Points]],
    tags: Sequence[str],
    alerts: Mapping[str, Sequence[AlertRecord]] | None = None,
    *,
    charts: str = "auto",
    prefix: str = "headwatch",
    sources: Mapping[str, str] | None = None,
    title: str = "headwatch report",
) -> str:
    """One self-contained HTML page: the table of :func:`render_text`, the alerts and one chart per tag.

    Args:
        runs: run name -> tag -> points (:func:`load_runs`).
        tags: the tags to show, in order (:func:`select_tags`).
        alerts: run name -> alerts (:func:`collect_alerts`).
        charts: ``"svg"`` (inline SVG drawn here), ``"png"`` (matplotlib, base64 data URIs)
            or ``"auto"`` (PNG when matplotlib is importable, else SVG).
        prefix: the headwatch tag prefix.
        sources: run name -> where it was read from.
        title: the page title.

    Raises:
        HeadwatchError: ``charts`` is not one of the three, or ``"png"`` without matplotlib.
    """
    if charts not in ("auto", "svg", "png"):
        raise HeadwatchError(f"`charts` must be one of 'auto', 'svg', 'png', got {charts!r}")
    if charts == "auto":
        charts = "png" if _have_matplotlib() else "svg"
    esc = html.escape
    names = list(runs)
    colors = {name: _color(i) for i, name in enumerate(names)}
    summaries = summarize_runs(runs, tags)
    alerts = alerts or {}
    alert_steps = {name: sorted({a.step for a in alerts.get(name, [])}) for name in names}
    head = prefix + "/"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        '<ul class="runs">',
    ]
    for name in names:
        src = f' <span class="muted">({esc(sources[name])})</span>' if sources and name in sources else ""
        out.append(f'<li><span class="swatch" style="background:{colors[name]}"></span>{esc(name)}{src}</li>')
    out.append("</ul>")
    out.append(
        '<p class="muted">final: value at the last step; last 10%: mean of the last 10% of the points; '
        "trend/1k: least-squares slope over the last 50% of the points, per 1000 steps "
        "(→ when the change over that span is below 1% of the mean |value|).</p>"
    )
    out.append("<h2>Metrics</h2>")
    if not tags:
        out.append("<p>No headwatch metrics matched.</p>")
    else:
        out.append("<table><thead><tr><th class=\"tag\"></th>")
        out.extend(f'<th class="run-start" colspan="3" style="color:{colors[n]}">{esc(n)}</th>' for n in names)
        out.append('</tr><tr><th class="tag">metric</th>')
        out.extend('<th class="run-start">final</th><th>last 10%</th><th>trend/1k</th>' for _ in names)
        out.append("</tr></thead><tbody>")
        group = None
        for tag in tags:
            g = tag_group(tag, prefix)
            if g != group:
                group = g
                out.append(f'<tr class="group"><td colspan="{1 + 3 * len(names)}">{esc(g)}</td></tr>')
            label = tag[len(head) :] if tag.startswith(head) else tag
            out.append(f'<tr><td class="tag">{esc(label)}</td>')
            for name in names:
                if g == "alerts":
                    out.append(f'<td class="run-start" colspan="3">{esc(_alert_cell(runs[name].get(tag)))}</td>')
                    continue
                s = summaries[name].get(tag)
                cells = (MISSING,) * 3 if s is None else (format_number(s.final), format_number(s.last10_mean), format_trend(s))
                out.append(f'<td class="run-start">{esc(cells[0])}</td><td>{esc(cells[1])}</td><td>{esc(cells[2])}</td>')
            out.append("</tr>")
        out.append("</tbody></table>")
    out.append("<h2>Alerts</h2>")
    for name in names:
        records = alerts.get(name, [])
        if not records:
            out.append(f"<p><b>{esc(name)}</b>: no alerts</p>")
            continue
        out.append(f'<p><b>{esc(name)}</b>: {len(records)} alert{"s" if len(records) != 1 else ""}</p>')
        out.append('<table class="alerts"><thead><tr><th>step</th><th>rule</th><th>message</th></tr></thead><tbody>')
        for a in records:
            message = a.message or "(TensorBoard marker only)"
            out.append(f"<tr><td>{a.step}</td><td>{esc(a.rule)}</td><td>{esc(message)}</td></tr>")
        out.append("</tbody></table>")
    out.append("<h2>Charts</h2>")
    out.append(f'<p class="muted">dashed vertical lines: alert steps, in the color of the run. Charts: {charts.upper()}.</p>')
    group = None
    for tag in tags:
        g = tag_group(tag, prefix)
        if g != group:
            if group is not None:
                out.append("</div>")
            group = g
            out.append(f'<h3>{esc(g)}</h3><div class="charts">')
        series = {name: list(runs[name][tag]) for name in names if runs[name].get(tag)}
        steps = {name: alert_steps[name] for name in series}
        if charts == "png":
            chart = render_png_chart(series, colors, title=tag, alert_steps=steps)
        else:
            chart = render_svg_chart(series, colors, title=tag, alert_steps=steps)
        out.append(f"<figure><figcaption>{esc(tag)}</figcaption>{chart}</figure>")
    if group is not None:
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- command line


_EPILOG = """\
The table: one block per run with
  final     the value at the last logged step,
  last 10%  the mean of the last 10% of the run's points (at least one),
  trend/1k  the least-squares slope over the last 50% of the points, per 1000 steps:
            ↑ / ↓, or → when the fitted change over that span is below 1% of the mean |value|.
  —         the run did not log this metric.
Rows are grouped by the tag's second component (logits, val, grad, update, freq,
collision, tokens, alerts); train_loss and val_loss are shown as context when present.
By default the per-bucket tags (/top1/, /top10/, /top50/, /tail/, /unseen/, /rare/) and
the _p05 / _max variants are hidden; --all shows them, --match filters by regex.

Alerts come from the markers <prefix>/alerts/<rule> (value 1 at the alert step) and from
the nearest headwatch_alerts.jsonl in or above each run directory (up to LOGDIR).

Exit status: 0 on success, 1 when no metric matched, 2 on a usage error or when a LOGDIR
is missing or holds no TensorBoard event files.

Examples:
  headwatch report runs                        # every run under runs/
  headwatch report runs/tied runs/untied --html report.html
  headwatch report runs --match 'entropy|density' --json
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``headwatch`` argument parser with its ``report`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="headwatch", description="Tools for the metrics headwatch logs to TensorBoard."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser(
        "report",
        help="compare the headwatch metrics and alerts of one or more runs",
        description=(
            "Read the TensorBoard event files of one or more runs and print a side-by-side table of\n"
            "the headwatch metrics (final value, mean over the last 10%, trend) and the alerts;\n"
            "with --html, also write one self-contained HTML page with the comparison charts."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "logdirs",
        nargs="+",
        metavar="LOGDIR",
        help="a run directory holding events.out.tfevents.* files, or a folder of runs (searched recursively); "
        "each run is named by its path relative to LOGDIR",
    )
    report.add_argument("--all", action="store_true", dest="show_all", help="show every tag, including the per-bucket ones")
    report.add_argument("--match", metavar="REGEX", help="show only tags matching this regular expression (re.search)")
    report.add_argument("--prefix", default="headwatch", help="the tag prefix the callbacks used (default: %(default)s)")
    report.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page with the table and one chart per metric")
    report.add_argument(
        "--charts",
        choices=("auto", "svg", "png"),
        default="auto",
        help="chart format for --html: inline SVG, PNG via matplotlib, or auto (PNG if matplotlib is installed; default)",
    )
    report.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of the table: {run: {tag: {final, last10_mean, trend_per_1k, trend, steps, first_step, last_step}}}",
    )
    report.add_argument("--width", type=int, default=160, help="target width of the text table in characters (default: %(default)s)")
    return parser


def _write(text: str, stream: Any) -> None:
    try:
        stream.write(text)
    except UnicodeEncodeError:  # a terminal without UTF-8: plain ASCII stand-ins
        table = str.maketrans({"↑": "^", "↓": "v", "→": "=", "—": "-", "…": "~", "×": "x", "│": "|", "─": "-", "┼": "+"})
        stream.write(text.translate(table).encode("ascii", "replace").decode("ascii"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``headwatch report LOGDIR [LOGDIR ...]``; returns the exit status (see ``--help``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "report":  # pragma: no cover - argparse only accepts "report"
        parser.error(f"unknown command {args.command!r}")
    if args.width < 40:
        parser.error(f"--width must be at least 40, got {args.width}")
    if args.html and args.charts == "png" and not _have_matplotlib():
        print("headwatch report: error: --charts png needs matplotlib: pip install matplotlib (or use --charts svg)", file=sys.stderr)
        return 2
    try:
        found = discover_runs(args.logdirs)
        runs = {name: read_scalars(run.path) for name, run in found.items()}
        all_tags = {tag for scalars in runs.values() for tag in scalars}
        tags = select_tags(all_tags, show_all=args.show_all, match=args.match, prefix=args.prefix)
        alerts = {}
        for name, run in found.items():
            jsonl = find_alerts_file(run.path, run.root)
            records = read_alerts_jsonl(jsonl) if jsonl is not None else []
            alerts[name] = collect_alerts(runs[name], records, prefix=args.prefix)
        sources = {name: str(run.path) for name, run in found.items()}
        if args.json:
            _write(json.dumps(to_json(runs, tags), indent=2, allow_nan=False) + "\n", sys.stdout)
        else:
            _write(render_text(runs, tags, alerts, width=args.width, prefix=args.prefix, sources=sources), sys.stdout)
        if args.html:
            page = render_html(runs, tags, alerts, charts=args.charts, prefix=args.prefix, sources=sources)
            path = Path(args.html)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8")
            print(f"headwatch report: wrote {path}", file=sys.stderr)
    except HeadwatchError as err:
        print(f"headwatch report: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"headwatch report: error: {err}", file=sys.stderr)
        return 2
    if not tags:
        print("headwatch report: no metric matched", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
