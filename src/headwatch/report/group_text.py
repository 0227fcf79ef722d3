"""The plain-text rendering of a grouped comparison (:class:`~headwatch.report.compare.Comparison`)."""

from __future__ import annotations

from collections.abc import Sequence

from headwatch.report.compare import METHOD_TEXT, SPREAD_TEXT, Comparison, Difference, GroupStats, MetricComparison
from headwatch.report.safe import printable
from headwatch.report.text import MISSING, format_number

_SEP = " │ "
SIGNIFICANT = "*"


def _stats_cell(s: GroupStats | None) -> str:
    if s is None or s.n == 0:
        return f"{MISSING:>10} {MISSING:>10} {MISSING:>21} {0:>2}"
    spread = f"[{format_number(s.min)}, {format_number(s.max)}]"
    return f"{format_number(s.mean):>10} {format_number(s.std):>10} {spread:>21} {s.n:>2}"


def _diff_cell(d: Difference | None) -> str:
    if d is None:
        return f"{MISSING:>10}"
    ci = f"[{format_number(d.low, signed=True)}, {format_number(d.high, signed=True)}]" if d.low is not None else "(needs 2 runs a group)"
    return f"{format_number(d.diff, signed=True):>10} {ci:<24}{' ' + SIGNIFICANT if d.excludes_zero else ''}"


def _table(rows: Sequence[MetricComparison], groups: Sequence[str], with_step: bool, prefix: str) -> list[str]:
    ref, others = groups[0], groups[1:]
    head = prefix + "/"
    labels = {r.tag: printable(r.tag[len(head) :] if r.tag.startswith(head) else r.tag) for r in rows}
    tag_w = max([len("metric"), *(len(v) for v in labels.values())])
    step_w = 9 if with_step else 0
    blank = _stats_cell(None)
    block_w = len(blank)
    top = f"{'':<{tag_w}}{'':>{step_w}}" + "".join(_SEP + f"{g:^{block_w}}" for g in groups)
    top += "".join(f"{_SEP}{g} − {ref}" for g in others)
    sub = f"{'metric':<{tag_w}}{'step':>{step_w}}" if with_step else f"{'metric':<{tag_w}}"
    sub += "".join(_SEP + f"{'mean':>10} {'sd':>10} {'[min, max]':>21} {'n':>2}" for _ in groups)
    sub += "".join(f"{_SEP}{'diff':>10} [95% CI]" for _ in others)
    out = [top.rstrip(), sub, "─" * len(sub)]
    for r in rows:
        line = f"{labels[r.tag]:<{tag_w}}"
        if with_step:
            line += f"{format_number(r.step):>{step_w}}"
        line += "".join(_SEP + _stats_cell(r.groups.get(g)) for g in groups)
        line += "".join(_SEP + _diff_cell(r.diffs.get(g)) for g in others)
        out.append(line.rstrip())
    return out


def render_comparison(comparison: Comparison, *, prefix: str = "headwatch") -> str:
    """The grouped comparison as text: the groups, how the numbers are made, one table per anchor."""
    c = comparison
    names = list(c.groups)
    level = f"{100 * c.level:g}%"
    lines = [f"Groups (reference: {c.reference}; differences are mean(group) − mean({c.reference}))"]
    width = max(len(g) for g in names)
    for g in names:
        runs = c.groups[g]
        lines.append(f"  {printable(g):<{width}}  {len(runs)} run{'s' if len(runs) != 1 else ''}: {', '.join(map(printable, runs))}")
    lines.append(f"Spread: {SPREAD_TEXT}.")
    lines.append(f"Interval: {level} {METHOD_TEXT}.")
    lines.append(f"{SIGNIFICANT}: the {level} interval excludes 0.")
    lines += ["", f"At matched step: {c.step_rule}"]
    lines += _table(c.at_step, names, True, prefix) if c.at_step else ["  no metric matched"]
    if c.loss_tag is not None:
        target = MISSING if c.loss_target is None else format_number(c.loss_target)
        lines += ["", f"At matched loss: {c.loss_tag} = {target} (each run where its {c.loss_tag} first reaches it, interpolated)"]
        steps = ", ".join(f"{name} {format_number(s)}" for name, s in c.loss_steps.items())
        lines.append(f"  steps: {steps}")
        lines += _table(c.at_loss, names, False, prefix) if c.at_loss else ["  no metric matched"]
    if c.notes:
        lines.append("")
        lines.extend(f"Note: {note}" for note in c.notes)
    return "\n".join(lines) + "\n"
