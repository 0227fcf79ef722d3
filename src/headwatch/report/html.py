"""One self-contained HTML page (no scripts, no external links): the table, the alerts, one chart per metric."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

from headwatch.errors import HeadwatchError
from headwatch.report import charts as _charts
from headwatch.report.charts import INSTALL_HINT, color, render_chart
from headwatch.report.events import Points
from headwatch.report.runs import AlertRecord
from headwatch.report.safe import printable
from headwatch.report.stats import Summary, summarize_runs, tag_group
from headwatch.report.text import MISSING, alert_cell, alerts_by_run, format_number, format_trend

CHART_CHOICES = ("auto", "svg", "png", "none")

CSS = """
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
section.answer td { white-space: normal; max-width: 26em; }
"""


_LEGEND = (
    '<p class="muted">final: value at the last step; last 10%: mean of the last 10% of the points; '
    "trend/1k: least-squares slope over the last 50% of the points, per 1000 steps "
    "(→ when the change over that span is below 1% of the mean |value|).</p>"
)


def esc(text: object) -> str:
    """A name or text from a run, for HTML: control characters as escapes (:func:`printable`), then HTML-escaped."""
    return html.escape(printable(text))



def resolve_charts(charts: str) -> str:
    """``auto`` becomes ``svg`` when matplotlib is importable, else ``none``.

    Raises:
        HeadwatchError: ``charts`` is not one of :data:`CHART_CHOICES`, or ``svg``/``png`` without matplotlib.
    """
    if charts not in CHART_CHOICES:
        raise HeadwatchError(f"`charts` must be one of {', '.join(map(repr, CHART_CHOICES))}, got {charts!r}")
    if charts == "auto":
        return "svg" if _charts.have_matplotlib() else "none"
    if charts != "none" and not _charts.have_matplotlib():
        raise HeadwatchError(f"--charts {charts}: {INSTALL_HINT} (or use --charts none)")
    return charts


def render_html(
    runs: Mapping[str, Mapping[str, Points]],
    tags: Sequence[str],
    alerts: Mapping[str, Sequence[AlertRecord]] | None = None,
    *,
    charts: str = "auto",
    prefix: str = "headwatch",
    sources: Mapping[str, str] | None = None,
    title: str = "headwatch report",
    preface: Sequence[str] = (),
) -> str:
    """One self-contained HTML page: the table of :func:`~headwatch.report.render_text`, the alerts and one chart per tag.

    Args:
        runs: run name -> tag -> points (:func:`~headwatch.report.load_runs`).
        tags: the tags to show, in order (:func:`~headwatch.report.select_tags`).
        alerts: run name -> alerts (:func:`~headwatch.report.collect_alerts`).
        charts: ``"svg"`` (matplotlib's SVG inlined), ``"png"`` (matplotlib, base64 data URIs),
            ``"none"``, or ``"auto"`` (SVG when matplotlib is importable, else no charts and an
            install hint on the page).
        prefix: the headwatch tag prefix.
        sources: run name -> where it was read from.
        title: the page title.
        preface: HTML elements shown first, under the title (the answer of
            :func:`~headwatch.report.answer.render_answer_html`).

    Raises:
        HeadwatchError: ``charts`` is not one of the four, or ``"svg"``/``"png"`` without matplotlib.
    """
    charts = resolve_charts(charts)
    names = list(runs)
    colors = {name: color(i) for i, name in enumerate(names)}
    alerts = alerts or {}
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        *preface,
        "<h2>Runs</h2>",
        '<ul class="runs">',
    ]
    for name in names:
        src = f' <span class="muted">({esc(sources[name])})</span>' if sources and name in sources else ""
        out.append(f'<li><span class="swatch" style="background:{colors[name]}"></span>{esc(name)}{src}</li>')
    out += ["</ul>", _LEGEND, "<h2>Metrics</h2>"]
    out += _metrics_table(runs, tags, summarize_runs(runs, tags), colors, prefix)
    out += _alerts_section(names, alerts)
    out += _charts_section(runs, tags, alerts, colors, charts, prefix)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _metrics_table(
    runs: Mapping[str, Mapping[str, Points]],
    tags: Sequence[str],
    summaries: Mapping[str, Mapping[str, Summary]],
    colors: Mapping[str, str],
    prefix: str,
) -> list[str]:
    if not tags:
        return ["<p>No headwatch metrics matched.</p>"]
    names = list(runs)
    head = prefix + "/"
    out = ['<table><thead><tr><th class="tag"></th>']
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
                out.append(f'<td class="run-start" colspan="3">{esc(alert_cell(runs[name].get(tag)))}</td>')
                continue
            s = summaries[name].get(tag)
            cells = (MISSING,) * 3 if s is None else (format_number(s.final), format_number(s.last10_mean), format_trend(s))
            out.append(f'<td class="run-start">{esc(cells[0])}</td><td>{esc(cells[1])}</td><td>{esc(cells[2])}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return out


def _alerts_section(names: Sequence[str], alerts: Mapping[str, Sequence[AlertRecord]]) -> list[str]:
    out = ["<h2>Alerts</h2>"]
    for name, records, count in alerts_by_run(names, alerts):
        out.append(f"<p><b>{esc(name)}</b>: {count}</p>")
        if not records:
            continue
        out.append('<table class="alerts"><thead><tr><th>step</th><th>rule</th><th>message</th></tr></thead><tbody>')
        for a in records:
            message = a.message or "(TensorBoard marker only)"
            out.append(f"<tr><td>{a.step}</td><td>{esc(a.rule)}</td><td>{esc(message)}</td></tr>")
        out.append("</tbody></table>")
    return out


def _charts_section(
    runs: Mapping[str, Mapping[str, Points]],
    tags: Sequence[str],
    alerts: Mapping[str, Sequence[AlertRecord]],
    colors: Mapping[str, str],
    charts: str,
    prefix: str,
) -> list[str]:
    out = ["<h2>Charts</h2>"]
    if charts == "none":
        return out + [f'<p class="muted">No charts: {esc(INSTALL_HINT)}.</p>']
    out.append(f'<p class="muted">dashed vertical lines: alert steps, in the color of the run. Charts: {charts.upper()} (matplotlib).</p>')
    alert_steps = {name: sorted({a.step for a in alerts.get(name, [])}) for name in runs}
    group = None
    for tag in tags:
        g = tag_group(tag, prefix)
        if g != group:
            if group is not None:
                out.append("</div>")
            group = g
            out.append(f'<h3>{esc(g)}</h3><div class="charts">')
        series = {name: list(runs[name][tag]) for name in runs if runs[name].get(tag)}
        steps = {name: alert_steps[name] for name in series}
        chart = render_chart(series, colors, fmt=charts, title=tag, alert_steps=steps)
        out.append(f"<figure><figcaption>{esc(tag)}</figcaption>{chart}</figure>")
    if group is not None:
        out.append("</div>")
    return out
