"""The plain-text side-by-side table, its number formatting, and the JSON of the per-run summaries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from headwatch.report.events import Points
from headwatch.report.runs import AlertRecord
from headwatch.report.safe import column_labels, printable
from headwatch.report.stats import Summary, summarize_runs, tag_group

MISSING = "—"
ARROWS = {"up": "↑", "down": "↓", "flat": "→"}


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


def alert_cell(points: Points | None) -> str:
    """``3× (last at step 900)``: how often an alert marker tag fired (value 1)."""
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
    grouped by :func:`~headwatch.report.tag_group` (the declaring monitor). Runs that do not fit in ``width`` characters
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
    block_w = sum(_COL) + len(_GAP) * 2
    headers = dict(zip(names, column_labels(names, block_w)))  # distinct, printable; "#i" when names agree cut
    numbered = any(h.startswith("#") for h in headers.values())
    lines: list[str] = []
    if sources or numbered:
        lines.append("Runs:")
        for name in names:
            key = f"{headers[name]}  " if numbered else ""
            source = f"  ({printable(sources[name])})" if sources and name in sources else ""
            lines.append(f"  {key}{printable(name)}{source}")
        lines.append("")
    if not tags:
        lines.append("No headwatch metrics matched (try --all, or check --match and --prefix).")
    else:
        head = prefix + "/"
        labels = {t: "  " + printable(t[len(head) :] if t.startswith(head) else t) for t in tags}
        tag_w = min(max(len(v) for v in labels.values()), 46)
        tag_w = max(tag_w, len("metric"))
        per_table = max(1, (width - tag_w) // (block_w + len(_RUN_SEP)))
        for start in range(0, len(names), per_table):
            chunk = names[start : start + per_table]
            if start:
                lines.append("")
            lines.extend(_text_table(chunk, tags, labels, tag_w, block_w, runs, summaries, prefix, headers))
    if alerts is not None:
        lines += _alerts_text(names, alerts)
    return "\n".join(lines) + "\n"


def alerts_by_run(
    names: Sequence[str], alerts: Mapping[str, Sequence[AlertRecord]]
) -> list[tuple[str, Sequence[AlertRecord], str]]:
    """``(run, its alert records, "no alerts" | "1 alert" | "<n> alerts")`` for each run, in ``names`` order:
    the alerts section of the text and the HTML report."""
    out = []
    for name in names:
        records = alerts.get(name, [])
        count = f"{len(records)} alert{'s' if len(records) != 1 else ''}" if records else "no alerts"
        out.append((name, records, count))
    return out


def _alerts_text(names: Sequence[str], alerts: Mapping[str, Sequence[AlertRecord]]) -> list[str]:
    lines = ["", "Alerts"]
    for name, records, count in alerts_by_run(names, alerts):
        lines.append(f"  {printable(name)}: {count}")
        if not records:
            continue
        step_w = max(len(str(a.step)) for a in records)
        rule_w = max(len(printable(a.rule)) for a in records)
        for a in records:
            message = printable(a.message) if a.message else "(TensorBoard marker only; no headwatch_alerts.jsonl entry)"
            lines.append(f"    step {a.step:>{step_w}}  {printable(a.rule):<{rule_w}}  {message}")
    return lines


def _text_table(
    names: Sequence[str],
    tags: Sequence[str],
    labels: Mapping[str, str],
    tag_w: int,
    block_w: int,
    runs: Mapping[str, Mapping[str, Points]],
    summaries: Mapping[str, Mapping[str, Summary]],
    prefix: str,
    headers: Mapping[str, str],
) -> list[str]:
    def row(first: str, cells: Sequence[str]) -> str:
        return (f"{first:<{tag_w}}" + "".join(_RUN_SEP + c for c in cells)).rstrip()

    def block(a: str, b: str, c: str) -> str:
        return _GAP.join((f"{a:>{_COL[0]}}", f"{b:>{_COL[1]}}", f"{c:>{_COL[2]}}"))

    out = [
        row("", [f"{headers[n]:^{block_w}}" for n in names]),
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
                cells.append(f"{alert_cell(runs[name].get(tag)):>{block_w}}")
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

