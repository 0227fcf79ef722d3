"""The HTML page of a grouped comparison: the groups, both tables, one chart per metric (runs colored by group)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from headwatch.report.charts import INSTALL_HINT, color, render_chart
from headwatch.report.compare import METHOD_TEXT, SPREAD_TEXT, Comparison, MetricComparison
from headwatch.report.group_text import SIGNIFICANT
from headwatch.report.safe import printable
from headwatch.report.events import Points
from headwatch.report.html import CSS, esc, resolve_charts
from headwatch.report.text import MISSING, format_number


def _table(rows: Sequence[MetricComparison], groups: Sequence[str], with_step: bool, colors: Mapping[str, str], prefix: str) -> list[str]:
    ref, others = groups[0], groups[1:]
    head = prefix + "/"
    out = ['<table><thead><tr><th class="tag"></th>' + ("<th></th>" if with_step else "")]
    out += [f'<th class="run-start" colspan="4" style="color:{colors[g]}">{esc(g)}</th>' for g in groups]
    out += [f'<th class="run-start" colspan="2">{esc(g)} − {esc(ref)}</th>' for g in others]
    out.append('</tr><tr><th class="tag">metric</th>' + ("<th>step</th>" if with_step else ""))
    out += ['<th class="run-start">mean</th><th>sd</th><th>[min, max]</th><th>n</th>' for _ in groups]
    out += ['<th class="run-start">diff</th><th>95% CI</th>' for _ in others]
    out.append("</tr></thead><tbody>")
    for r in rows:
        label = r.tag[len(head) :] if r.tag.startswith(head) else r.tag
        cells = [f'<td class="tag">{esc(label)}</td>'] + ([f"<td>{esc(format_number(r.step))}</td>"] if with_step else [])
        for g in groups:
            s = r.groups.get(g)
            if s is None or s.n == 0:
                cells.append(f'<td class="run-start">{MISSING}</td><td>{MISSING}</td><td>{MISSING}</td><td>0</td>')
                continue
            spread = f"[{format_number(s.min)}, {format_number(s.max)}]"
            cells.append(f'<td class="run-start">{format_number(s.mean)}</td><td>{format_number(s.std)}</td><td>{spread}</td><td>{s.n}</td>')
        for g in others:
            d = r.diffs.get(g)
            if d is None:
                cells.append(f'<td class="run-start">{MISSING}</td><td></td>')
                continue
            ci = f"[{format_number(d.low, signed=True)}, {format_number(d.high, signed=True)}]" if d.low is not None else "needs 2 runs a group"
            mark = f" <b>{SIGNIFICANT}</b>" if d.excludes_zero else ""
            cells.append(f'<td class="run-start">{format_number(d.diff, signed=True)}</td><td>{ci}{mark}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return out


def _charts(groups: Mapping[str, Mapping[str, Mapping[str, Points]]], tags: Sequence[str], colors: Mapping[str, str], charts: str) -> list[str]:
    out = ["<h2>Charts</h2>"]
    if charts == "none":
        return out + [f'<p class="muted">No charts: {esc(INSTALL_HINT)}.</p>']
    out.append(f'<p class="muted">every run, in the color of its group. Charts: {charts.upper()} (matplotlib).</p><div class="charts">')
    run_colors = {name: colors[g] for g, runs in groups.items() for name in runs}
    labels = {name: g for g, runs in groups.items() for name in runs}
    for tag in tags:
        series = {name: list(s[tag]) for runs in groups.values() for name, s in runs.items() if s.get(tag)}
        chart = render_chart(series, run_colors, fmt=charts, title=tag, labels=labels)
        out.append(f"<figure><figcaption>{esc(tag)}</figcaption>{chart}</figure>")
    return out + ["</div>"]


def render_group_html(
    comparison: Comparison,
    groups: Mapping[str, Mapping[str, Mapping[str, Points]]],
    *,
    charts: str = "auto",
    prefix: str = "headwatch",
    title: str = "headwatch report: groups",
    preface: Sequence[str] = (),
) -> str:
    """One self-contained HTML page of a grouped comparison (the tables of the text output, and charts).

    Args:
        comparison: the result of :func:`~headwatch.report.compare_groups`.
        groups: group name -> run name -> tag -> points, as given to ``compare_groups``.
        charts: ``"svg"``, ``"png"``, ``"none"`` or ``"auto"`` (see :func:`~headwatch.report.render_html`).
        prefix: the headwatch tag prefix.
        title: the page title.
        preface: HTML elements shown first, under the title (the answer).

    Raises:
        HeadwatchError: ``charts`` is not one of the four, or ``"svg"``/``"png"`` without matplotlib.
    """
    charts = resolve_charts(charts)
    c = comparison
    names = list(c.groups)
    colors = {g: color(i) for i, g in enumerate(names)}
    level = f"{100 * c.level:g}%"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"]
    out += [f"<h1>{esc(title)}</h1>", *preface, "<h2>Groups</h2>", '<ul class="runs">']
    for g in names:
        runs = ", ".join(map(printable, c.groups[g]))
        out.append(f'<li><span class="swatch" style="background:{colors[g]}"></span><b>{esc(g)}</b> ({len(c.groups[g])}): {esc(runs)}</li>')
    out.append("</ul>")
    out.append(f'<p class="muted">Spread: {esc(SPREAD_TEXT)}. Interval: {level} {esc(METHOD_TEXT)}. {SIGNIFICANT}: the interval excludes 0. '
               f"Differences are mean(group) − mean({esc(c.reference)}).</p>")
    out += [f"<h2>At matched step: {esc(c.step_rule)}</h2>", *_table(c.at_step, names, True, colors, prefix)]
    if c.loss_tag is not None:
        target = MISSING if c.loss_target is None else format_number(c.loss_target)
        out.append(f"<h2>At matched loss: {esc(c.loss_tag)} = {target}</h2>")
        steps = ", ".join(f"{name} {format_number(s)}" for name, s in c.loss_steps.items())
        out.append(f'<p class="muted">each run where its {esc(c.loss_tag)} first reaches {target} (interpolated): {esc(steps)}</p>')
        out += _table(c.at_loss, names, False, colors, prefix)
    out += [f'<p class="muted">Note: {esc(note)}</p>' for note in c.notes]
    out += _charts(groups, [r.tag for r in c.at_step], colors, charts)
    out.append("</body></html>")
    return "\n".join(out) + "\n"
