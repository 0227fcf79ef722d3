"""The first screen of ``headwatch report``: the headline questions answered, as text and as HTML.

Both render the dict of :func:`~headwatch.report.headlines.verdicts` and nothing else, so the text,
the HTML page and ``--json`` always show the same verdicts. Rows whose value is the same in every
run, or recorded by no run, are folded into one line each (a count that never moved is no answer).
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from headwatch.report.headlines import END_FIRST
from headwatch.report.safe import column_labels, printable, shorten
from headwatch.report.text import MISSING, format_number
from headwatch.report.verdict import BETTER, NO_DIFFERENCE, WORSE

VALUE_W = 10
LABEL_W = 30
MAX_NOTES = 4
"""Notes shown on the first screen; the rest with ``--all``."""
SHORT = {BETTER: "better", WORSE: "worse", NO_DIFFERENCE: "no diff"}
NOT_RECORDED = {
    "step_time": "Lightning logs no step time; the Hugging Face Trainer logs train_steps_per_second",
    "collision": "SynonymCollisionMonitor publishes it",
    "tied_flow_conflict": "a tied run's GradientDensityMonitor publishes it",
    "untying_cost": "GradientDensityMonitor publishes grad/tied",
}
"""Why a headline may be recorded by no run, said beside it."""
"""The verdict words in a column of several sides."""

TRAIN_SEEDS = (
    "  for s in 1 2 3; do",
    "    python examples/train_tiny_lm.py --seed $s --run-name tied/seed$s",
    "    python examples/train_tiny_lm.py --seed $s --no-tie-weights --run-name untied/seed$s",
    "  done",
    "  headwatch report runs    # sides: runs/tied/seed*, runs/untied/seed*, paired by seed",
)
"""How to train seeds of the example (it takes ``--seed``), printed when a side has one run."""


def _bytes(n: int) -> str:
    sign = "+" if n > 0 else "-" if n < 0 else ""
    x = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{sign}{x:.3g} {unit}" if unit != "B" else f"{sign}{int(x)} B"
        x /= 1024
    return ""  # pragma: no cover


def cost_text(cost: Mapping[str, Any]) -> str:
    """``+131,072 parameters (+512 KiB fp32 weights, +2 MiB training, fp32 AdamW)``, or why it is unknown."""
    p = cost.get("parameters")
    if p is None:
        return f"unknown: {cost.get('why')}"
    if p == 0:
        return "0 (the same tie)"
    b = cost["bytes"]
    shape = f"{cost['vocab_size']:,} x {cost['d_model']:,}"
    return (f"{p:+,} parameters ({shape}): {_bytes(b['weights_fp32'])} fp32 weights, "
            f"{_bytes(b['training_fp32_adamw'])} training (fp32 AdamW)")


def short_cost(parameters: int | None) -> str:
    """The cost in a column of several sides: ``+131,072 parameters``, ``0 (the same tie)`` or ``unknown``."""
    return "unknown" if parameters is None else "0 (the same tie)" if parameters == 0 else f"{parameters:+,} parameters"


def tie_word(mean: float | None) -> str:
    """A side's tie from the mean of its runs' ``grad/tied`` (1 tied, 0 untied)."""
    if mean is None or not math.isfinite(mean):
        return MISSING
    return "tied" if mean == 1.0 else "untied" if mean == 0.0 else "mixed"


def _label(row: Mapping[str, Any]) -> str:
    where = f" ({row['where']})" if row.get("where") else ""
    unit = f", {row['unit']}" if row.get("unit") and row["key"] != "untying_cost" else ""
    return f"{row['question']}{where}{unit}"


def _interval(c: Mapping[str, Any]) -> str:
    iv = c.get("interval")
    if not iv:
        return ""
    return f"[{format_number(iv['low'], signed=True)}, {format_number(iv['high'], signed=True)}]"


def _verdict(c: Mapping[str, Any], short: bool) -> str:
    word = c.get("verdict")
    if word is None:
        return "" if short else (c.get("why") or "")
    if word == NO_DIFFERENCE and c.get("detectable") is not None and not short:
        return f"{word} (could show ±{format_number(c['detectable'])})"
    return SHORT[word] if short else word


def _constant(row: Mapping[str, Any]) -> float | None:
    values = [v for side in row["values"].values() for v in side.values()]
    if len(values) < 2 or any(v is None for v in values):
        return None
    return values[0] if all(v == values[0] for v in values) else None


def _constant_text(row: Mapping[str, Any]) -> str:
    value = _constant(row)
    if row["key"] == "untying_cost":
        return f"{row['question']} 0 (every run {tie_word(value)})"
    return f"{_label(row)} {format_number(value)}"


def partition(rows: Sequence[Mapping[str, Any]]) -> tuple[list, list, list]:
    """The headlines shown as rows, those the same in every run, those recorded by no run."""
    shown: list = []
    constant: list = []
    missing: list = []
    for row in rows:
        if all(v is None for side in row["values"].values() for v in side.values()):
            missing.append(row)
        elif _constant(row) is not None:
            constant.append(row)
        else:
            shown.append(row)
    return shown, constant, missing


def _folded(constant: Sequence[Mapping[str, Any]], missing: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    if constant:
        out.append("The same in every run: " + "; ".join(_constant_text(r) for r in constant) + ".")
    if missing:
        out.append("Recorded by no run: " + "; ".join(
            _label(r) + (f" ({NOT_RECORDED[r['key']]})" if r["key"] in NOT_RECORDED else "") for r in missing) + ".")
    return out


def _fit_row(head: str, tail: str, width: int) -> list[str]:
    """``head + tail``, the tail wrapped under itself when the line would pass ``width``."""
    if len(head) + len(tail) <= width or width - len(head) < 20:
        return [head + tail]
    parts = textwrap.wrap(tail, width - len(head), break_on_hyphens=False) or [""]
    return [head + parts[0], *(" " * len(head) + part for part in parts[1:])]


def _ranges(a: Mapping[str, Any]) -> str:
    """The steps a fall was read between: one range when every run has the same, else each run's."""
    if a.get("from_step") is not None:
        return f"from step {a['from_step']:g} to {a['step']:g}"
    each = ", ".join(f"{printable(run)} {mid:g} to {end:g}" for run, (mid, end) in a["ranges"].items())
    return f"from the midpoint of each run's logged steps to its last ({each})"


def _anchor_line(rows: Sequence[Mapping[str, Any]]) -> str:
    parts, end = [], None
    for row in rows:
        a = row.get("anchor") or {}
        if row["key"] in ("alerts_fired", "untying_cost") or "step" not in a:
            continue
        if a["rule"] in ("the end of training", "the last step every run logged", END_FIRST):
            if end is None:
                end = (a["rule"], a["step"])
                parts.insert(0, f"values at step {format_number(a['step'])}, {a['rule']}")
            continue
        if "ranges" in a:
            parts.append(f"{row['question']}: {_ranges(a)}")
        elif row["key"] == "tied_flow_conflict":
            parts.append(f"{row['question']}: {a['rule']}")
        elif a.get("of"):
            ends = a["of"]
            of = f" of {format_number(ends[0])}" if len(ends) == 1 else f"; the runs end at steps {', '.join(format_number(e) for e in ends)}"
            parts.append(f"{row['question']}: {a['rule']} (step {format_number(a['step'])}{of})")
        else:
            parts.append(f"{row['question']}: {a['rule']} (step {format_number(a['step'])})")
    return "; ".join(parts) + "." if parts else ""


def render_answer(data: Mapping[str, Any], *, width: int = 160, notes: Sequence[str] = (),
                  commands: Sequence[str] = TRAIN_SEEDS, sources: Mapping[str, str] | None = None) -> str:
    """The first screen as text: who is compared, one row per headline, the verdicts and how they were made.

    Args:
        data: the dict of :func:`~headwatch.report.headlines.verdicts`.
        width: the target line width; several sides that do not fit go to further tables.
        notes: lines about the input (files skipped, groups empty), shown first (at most
            :data:`MAX_NOTES`; the rest with ``--all``).
        commands: what to run to train seeds, shown when a side has one run.
        sources: run name -> where it was read from, listed for a side of one run.
    """
    sides = list(data["sides"])
    ref, others = sides[0], sides[1:]
    labels = dict(zip(sides, column_labels(sides, 20 if len(sides) <= 3 else 14)))
    runs = {s: data["sides"][s]["runs"] for s in sides}
    one_each = data["one_run_a_side"]
    lines = []
    if not others:
        lines.append(f"headwatch report: {printable(ref)} alone, nothing to compare it with (name two runs, or --group)")
    elif one_each:
        lines.append(f"headwatch report: {len(sides)} runs, one a side; reference {printable(ref)}")
    else:
        counts = sorted({len(r) for r in runs.values()})
        n = f"{counts[0]} runs a side" if len(counts) == 1 else "runs per side: " + ", ".join(f"{labels[s]} {len(runs[s])}" for s in sides)
        paired = [o for o in others if data["pairing"][o]["paired"]]
        how = ("paired by seed (" + ", ".join(map(str, sorted(data["sides"][ref]["seeds"]))) + ")") if len(paired) == len(others) else (
            "Welch, not paired: " + data["pairing"][others[0]]["why"] if not paired else "paired where the seeds match, else Welch")
        title = f"headwatch report: {', '.join(printable(o) for o in others)} against {printable(ref)}; {n}, {how}"
        lines += textwrap.wrap(title, width, break_on_hyphens=False, subsequent_indent="  ")
    for s in sides:
        listed = ", ".join(printable(r) for r in runs[s])
        if len(runs[s]) == 1 and sources and runs[s][0] in sources:
            listed = printable(sources[runs[s][0]])
        lines.append(shorten(f"  {labels[s]:<8} {listed}", width))
    for note in list(notes)[:MAX_NOTES]:
        lines.append(shorten("Note: " + printable(note), width))
    if len(notes) > MAX_NOTES:
        lines.append(f"Note: {len(notes) - MAX_NOTES} more (--all lists them)")
    if others and (one_each or any(len(r) == 1 for r in runs.values())):
        lines += ["", "One run a side cannot separate the setting from the seed: no verdict without seeds.",
                  "Train the same seeds for each setting (seed<N> in the run's path, or `seed` in its hparams.yaml,",
                  "pairs them) and compare the groups; the example takes --seed:", *commands]
    rows = data["headlines"]
    shown, constant, missing = partition(rows)
    lines.append("")
    if others:
        lines += _table(shown, sides, labels, width, short=len(others) > 1)
    else:
        label_w = max([len("headline"), *(len(_label(r)) for r in shown)])
        lines.append(f"{'headline':<{label_w}}  {labels[ref]:>{VALUE_W}}")
        for row in shown:
            value = tie_word(row["means"].get(ref)) if row["key"] == "untying_cost" else format_number(row["means"].get(ref))
            lines.append(f"{_label(row):<{label_w}}  {value:>{VALUE_W}}")
    prose = _folded(constant, missing)
    anchor = _anchor_line(rows)
    if anchor:
        prose.append(anchor[0].upper() + anchor[1:])
    prose += ["", *_method_lines(data, shown),
              "Every metric of every run: --all; this as JSON: --json; a page with charts: --html PATH."]
    for text in prose:
        lines += textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _table(rows: Sequence[Mapping[str, Any]], sides: Sequence[str], labels: Mapping[str, str], width: int,
           short: bool) -> list[str]:
    ref, others = sides[0], sides[1:]
    label_w = max([len("headline"), *(len(_label(r)) for r in rows)])
    value_w = max(VALUE_W, *(len(labels[s]) for s in sides))

    def values(row: Mapping[str, Any]) -> list[str]:
        shown = [ref] if short else sides
        if row["key"] == "untying_cost":
            return [tie_word(row["means"].get(s)) for s in shown]
        return [format_number(row["means"].get(s)) for s in shown]

    def cell(row: Mapping[str, Any], o: str) -> str:
        c = row["comparisons"][o]
        if "cost" in c:
            p = c["cost"].get("parameters")
            return cost_text(c["cost"]) if not short else short_cost(p)
        if c.get("difference") is None:
            return c.get("why") or MISSING
        diff = f"{format_number(c['difference'], signed=True)} {_interval(c)}".strip()
        return f"{diff} {_verdict(c, short)}".rstrip() if short else diff

    if not short:  # two sides: both values, the difference, the verdict
        o = others[0]
        level = next((c["interval"]["level"] for r in rows for c in r["comparisons"].values()
                      if c.get("interval") and c.get("p_adjusted") is not None), None)
        head = f"{labels[o]} − {labels[ref]}" + (f" [{100 * level:.3g}% interval]" if level else "")
        diffs = {r["key"]: cell(r, o) for r in rows}
        verdicts = {r["key"]: ("" if "cost" in r["comparisons"][o] or r["comparisons"][o].get("difference") is None
                               or r["comparisons"][o].get("why") == "one run a side" else _verdict(r["comparisons"][o], False))
                    for r in rows}
        diff_w = max([len(head), *(len(d) for k, d in diffs.items() if verdicts[k])])
        title = "verdict" if any(verdicts.values()) else ""
        out = [f"{'headline':<{label_w}}  {labels[ref]:>{value_w}}  {labels[o]:>{value_w}}  {head:<{diff_w}}  {title}"]
        for row in rows:
            a, b = values(row)
            head = f"{_label(row):<{label_w}}  {a:>{value_w}}  {b:>{value_w}}  "
            if verdicts[row["key"]]:
                head += f"{diffs[row['key']]:<{diff_w}}  "
                out += _fit_row(head, verdicts[row["key"]], width)
            else:
                out += _fit_row(head, diffs[row["key"]], width)
        return out
    cells = {o: [cell(row, o) for row in rows] for o in others}
    col_w = {o: max(len(f"{labels[o]} − {labels[ref]}"), *(len(c) for c in cells[o])) for o in others}
    out: list[str] = []
    chunk: list[str] = []
    used = label_w + 2 + value_w
    for o in others + [None]:  # type: ignore[list-item]
        if o is not None and (not chunk or used + 2 + col_w[o] <= width):
            chunk.append(o)
            used += 2 + col_w[o]
            continue
        if out:
            out.append("")
        out.append(f"{'headline':<{label_w}}  {labels[ref]:>{value_w}}" + "".join(f"  {labels[c] + ' − ' + labels[ref]:<{col_w[c]}}" for c in chunk))
        for i, row in enumerate(rows):
            out.append(f"{_label(row):<{label_w}}  {values(row)[0]:>{value_w}}" + "".join(f"  {cells[c][i]:<{col_w[c]}}" for c in chunk))
        if o is not None:
            chunk, used = [o], label_w + 2 + value_w + 2 + col_w[o]
    return out


def _method_lines(data: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    fam = data["family"]
    sides = list(data["sides"])
    if data["one_run_a_side"] or not fam["size"]:
        return ["Differences are mean(side) − mean(reference); no test without two runs a side."]
    rows = data["headlines"] if rows is None else rows
    methods = sorted({c["method"] for r in rows for c in r["comparisons"].values() if c.get("method") not in (None, "exact")},
                     key=lambda m: m not in ("paired-t", "welch-t"))
    named = {"paired-t": "paired t over the per-seed differences", "welch-t": "Welch's t (unequal variances)",
             "paired-sign-flip": "exact sign flips where every seed moved alike",
             "permutation": "an exact permutation test where both sides are constant"}
    level = f"{100 * fam['level']:.3g}%"
    out = [f"Tests: {'; '.join(named[m] for m in methods) or 'none'}. Verdicts: Holm's step-down over the {fam['size']} "
           f"comparison{'s' if fam['size'] != 1 else ''} with a good direction, family-wise error {100 * data['alpha']:g}%; "
           f"their intervals at {level} each ({100 * (1 - data['alpha']):g}% together), other rows at 95%; "
           "\"could show\": the smallest gap these runs would have called."]
    n = min(len(data["sides"][s]["runs"]) for s in sides)
    if n <= 3:
        out.append(f"With {n} runs a side only a large gap can clear a family-wise rule: more seeds show smaller ones.")
    return out


# --------------------------------------------------------------------------- HTML


def render_answer_html(data: Mapping[str, Any], notes: Sequence[str] = ()) -> list[str]:
    """The same answer as :func:`render_answer`, as HTML elements (names escaped), for the top of a page."""
    esc = lambda x: html.escape(printable(x))  # noqa: E731
    sides = list(data["sides"])
    ref, others = sides[0], sides[1:]
    out = ['<section class="answer"><h2>The answer</h2>']
    if data["one_run_a_side"] or any(len(data["sides"][s]["runs"]) == 1 for s in sides):
        out.append("<p><b>One run a side cannot separate the setting from the seed: no verdict without seeds.</b> "
                   "Train the same seeds for each setting (<code>--seed</code>; <code>seed&lt;N&gt;</code> in the run's "
                   "path or <code>seed</code> in its hparams.yaml pairs them) and compare the groups.</p>")
    out += [f'<p class="muted">Note: {esc(n)}</p>' for n in notes]
    out.append('<table class="answer"><thead><tr><th class="tag">headline</th>')
    out += [f"<th>{esc(s)}</th>" for s in sides]
    verdicts = not data["one_run_a_side"]
    out += [f'<th class="run-start">{esc(o)} − {esc(ref)}</th>' + ("<th>verdict</th>" if verdicts else "") for o in others]
    out.append("</tr></thead><tbody>")
    shown, constant, missing = partition(data["headlines"])
    for row in shown:
        cells = [f'<td class="tag">{esc(_label(row))}</td>']
        for s in sides:
            mean = row["means"].get(s)
            text = tie_word(mean) if row["key"] == "untying_cost" else format_number(mean)
            cells.append(f"<td>{esc(text)}</td>")
        for o in others:
            c = row["comparisons"][o]
            if "cost" in c:
                span = ' colspan="2"' if verdicts else ""
                p = c["cost"].get("parameters")
                text = cost_text(c["cost"]) if len(others) == 1 or p is None else short_cost(p)
                cells.append(f'<td class="run-start"{span}>{esc(text)}</td>')
                continue
            diff = c.get("why") or MISSING if c.get("difference") is None else f"{format_number(c['difference'], signed=True)} {_interval(c)}"
            cells.append(f'<td class="run-start">{esc(diff)}</td>' + (f"<td>{esc(_verdict(c, False))}</td>" if verdicts else ""))
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    anchor = _anchor_line(data["headlines"])
    lines = (*_folded(constant, missing), anchor[:1].upper() + anchor[1:], *_method_lines(data, shown))
    out += [f'<p class="muted">{esc(line)}</p>' for line in lines if line]
    out.append("</section>")
    return out
