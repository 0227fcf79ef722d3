"""``headwatch report``: the argument parser and the command (``main``)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwatch.errors import HeadwatchError
from headwatch.report import charts as _charts
from headwatch.report.answer import SHORT, render_answer, render_answer_html
from headwatch.report.charts import INSTALL_HINT
from headwatch.report.compare import compare_groups
from headwatch.report.events import model_shapes, published_shapes, read_hparams, read_run, run_seed
from headwatch.report.group_html import render_group_html
from headwatch.report.group_text import render_comparison
from headwatch.report.headlines import RunData, headline_table, verdicts
from headwatch.report.html import render_html
from headwatch.report.runs import AlertRecord, RunDir, collect_alerts, discover_groups, discover_runs, find_alerts_file, read_alerts_jsonl
from headwatch.report.safe import printable
from headwatch.report.stats import select_tags, tag_group
from headwatch.report.text import render_text, to_json
from headwatch.report.verdict import BETTER, NO_DIFFERENCE, WORSE

_DIRECTION = {"lower": "lower is better", "higher": "higher is better", None: "no preferred direction: a difference, no verdict"}


def _epilog() -> str:
    rows = "\n".join(f"  {q + (', ' + u if u and u != 'parameters' else ''):<34}{_DIRECTION[b]}" for q, u, b in headline_table())
    return f"""\
The first screen answers one question: did the other sides change anything, compared with the first
(the reference), on what, and how sure is that? One row per headline:
{rows}
Columns (two sides): headline, the reference's value, the other side's value (a side's mean over
its runs), "<side> − <reference> [interval]", verdict. With more sides: one column
"<side> − <reference>" each (verdicts: {', '.join(SHORT.values())}).
Verdicts: "{BETTER}", "{WORSE}", "{NO_DIFFERENCE}" (with "could show ±g": the smallest
gap these runs would have called). Two or more runs a side: a paired t-test over the per-seed
differences when both sides have the same seeds, else Welch's (named in the output); the headlines
with a good direction are one family, Holm's step-down at family-wise error 5%; a verdict needs
the adjusted test to reject and the direction. Intervals of the family at 1 - 5%/m (m tests), the
others at 95%. One run a side: the difference only, and how to train seeds.
A run's seed: `seed` in its hparams.yaml (Lightning), else seed<N> in its path (runs/tied/seed3/...).
Values are read at the last step every run logged (the end of training); collision at the
last probe every run has (called the end-of-training probe only when it is every run's last step);
tied-flow conflict as the mean over the last 10% of the steps; the entropy fall over each run's own
second half (from the midpoint of its logged steps to its last). Without validation the first row
reads the training target NLL and says so ("target NLL (train)"). A run that logged a figure but
ended before another began says so instead of "not recorded".
A row says (val) or (train) when it reads the validation or the training figure (the first one
every run has). Rows the same in every run, or recorded by no run, are folded into one line each.

Sides: each run found under the LOGDIRs is a side; when every run has a seed and the runs' paths without their
seed<N> and version_<N> parts fall into groups (runs/tied/seed*/..., runs/untied/seed*/...), each
group is a side (said on the screen). --group NAME=PATTERN ... names the sides itself (patterns are
expanded here; a run that two patterns match counts once).

--all adds the table of every metric of every run (final value; the mean over the last 10% of
the points, "last 10%"; the least-squares slope over the last 50%, per 1000 steps, "trend/1k",
with ↑ / ↓, or → when the change is below 1% of the mean |value|; "—": not logged), the alerts of
each run and every note; with --group, each group's mean, sd (n - 1), [min, max] and n per metric
and the Welch interval of each difference, at a matched step (--at-step N, default the last common
step) and at matched validation loss (--loss-tag, default val_loss, else eval/loss; --at-loss L).
--match REGEX adds the same table for the tags it matches (re.search).

Only regular files are read; names and texts are shown printable (control bytes as escapes);
a damaged file, an empty group or a run listed twice gets one line and the rest is reported.
Exit status: 0 on success; 1 when --match or --all selects no metric; 2 on a usage error, a
missing LOGDIR, or no run at all.

Examples:
  headwatch report runs                        # every run under runs/ (grouped by seed when it can)
  headwatch report runs/tied runs/untied --html report.html
  headwatch report --group tied='runs/tied/seed*' untied='runs/untied/seed*' --json
  headwatch report runs --match 'entropy|density'
"""


def _add_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument(
        "logdirs",
        nargs="*",
        metavar="LOGDIR",
        help="a run directory holding events.out.tfevents.* files, or a folder of runs (searched recursively); "
        "each run is named by its path relative to LOGDIR",
    )
    report.add_argument("--all", action="store_true", dest="show_all",
                        help="also show every metric of every run (per-bucket tags included), every alert and every note")
    report.add_argument("--match", metavar="REGEX", help="also show the metrics whose tag matches this regular expression (re.search)")
    report.add_argument("--prefix", default="headwatch", help="the tag prefix the callbacks used (default: %(default)s)")
    report.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page: the answer, the tables, one chart per metric")
    report.add_argument(
        "--charts",
        choices=("auto", "svg", "png", "none"),
        default="auto",
        help="charts for --html, drawn by matplotlib: inline SVG, PNG data URIs, none, or auto "
        "(SVG if matplotlib is installed, else none; default)",
    )
    report.add_argument(
        "--json",
        action="store_true",
        help="print the answer as JSON instead (the verdicts of every headline; docs/report.md has the schema); "
        "with --all or --match also the metrics",
    )
    report.add_argument("--width", type=int, default=160, help="target width of the text in characters (default: %(default)s)")
    grouped = report.add_argument_group("sides named by patterns (groups of runs over seeds)")
    grouped.add_argument(
        "--group",
        nargs="+",
        action="extend",
        metavar="NAME=PATTERN",
        help="a side and its runs, instead of LOGDIRs (glob patterns expanded here; repeat a NAME to add patterns)",
    )
    grouped.add_argument("--at-step", type=int, metavar="N", help="the tables' matched step (implies the tables of --all; "
                         "default: each metric's last common step)")
    grouped.add_argument(
        "--loss-tag", metavar="TAG", help="--all's matched-loss curve (default: val_loss, else eval/loss, when logged)"
    )
    grouped.add_argument("--at-loss", type=float, metavar="L", help="--all's matched loss (default: the lowest loss every run reaches)")


def build_parser() -> argparse.ArgumentParser:
    """The ``headwatch`` argument parser with its ``report`` subcommand."""
    parser = argparse.ArgumentParser(prog="headwatch", description="Tools for the metrics headwatch logs to TensorBoard.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser(
        "report",
        help="did a setting change anything? compare runs, or groups of runs over seeds, with verdicts",
        description=(
            "Read the TensorBoard event files of runs and answer, headline by headline (validation loss,\n"
            "rare-token NLL, calibration, collision, tied-flow conflict, entropy, alerts, what untying costs):\n"
            "what changed against the first side, with an interval and, given seeds, a verdict.\n"
            "--all adds every metric of every run; --html writes a page with charts; --json the verdicts."
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(report)
    return parser


def parse_group_specs(specs: Sequence[str]) -> dict[str, list[str]]:
    """``["tied=runs/tied_*", "untied=runs/untied_*"]`` -> ``{"tied": ["runs/tied_*"], "untied": [...]}``.

    A NAME given twice collects both patterns.

    Raises:
        HeadwatchError: a spec is not ``NAME=PATTERN`` with a non-empty name and pattern, or
            fewer than 2 groups are named.
    """
    groups: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name.strip() or not pattern:
            raise HeadwatchError(f"--group expects NAME=PATTERN (for example tied='runs/tied_*'), got {spec!r}")
        groups.setdefault(name.strip(), []).append(pattern)
    if len(groups) < 2:
        raise HeadwatchError(f"--group needs at least 2 groups to compare, got {len(groups)}: {list(groups)}")
    return groups


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.width < 40:
        parser.error(f"--width must be at least 40, got {args.width}")
    grouped_only = [f"--{k.replace('_', '-')}" for k in ("at_step", "loss_tag", "at_loss") if getattr(args, k) is not None]
    if args.group is None:
        if not args.logdirs:
            parser.error("pass one or more LOGDIRs, or --group NAME=PATTERN NAME=PATTERN")
        if grouped_only:
            parser.error(f"{', '.join(grouped_only)} only apply with --group")
        return
    if args.logdirs:
        parser.error(f"pass LOGDIRs or --group, not both (got LOGDIRs {args.logdirs})")
    if args.at_step is not None and args.at_step < 0:
        parser.error(f"--at-step must be a step >= 0, got {args.at_step}")
    if args.at_loss is not None and not math.isfinite(args.at_loss):
        parser.error(f"--at-loss must be a finite number, got {args.at_loss}")
    try:
        args.group = parse_group_specs(args.group)
    except HeadwatchError as err:
        parser.error(str(err))


_ASCII = str.maketrans({"↑": "^", "↓": "v", "→": "=", "—": "-", "…": "~", "×": "x", "│": "|", "─": "-", "┼": "+", "−": "-", "±": "+-"})


def _write(text: str, stream: Any) -> None:
    """Write ``text`` made printable (control characters escaped, newlines kept); ASCII stand-ins without UTF-8."""
    text = printable(text, keep_newlines=True)
    try:
        stream.write(text)
    except UnicodeEncodeError:  # a terminal without UTF-8: plain ASCII stand-ins
        stream.write(text.translate(_ASCII).encode("ascii", "replace").decode("ascii"))


@dataclass
class _Run:
    path: Path
    scalars: dict[str, Any]
    alerts: list[AlertRecord]
    data: RunData


def run_data(scalars: Mapping[str, Any], path: Path | None, root: Path | str | None, prefix: str,
             notes: list[str]) -> tuple[RunData, list[AlertRecord]]:  # fmt: skip
    """What the verdicts read of one run, from its ``scalars`` (tag -> points, however they were read: the event
    files, TensorBoard's data provider) and its folder ``path`` (None: no folder to read): the alerts (markers and
    ``headwatch_alerts.jsonl``), the seed and the shapes (published ``model/*``, else ``hparams.yaml``)."""
    records, hparams = [], None
    if path is not None and Path(path).is_dir():
        jsonl = find_alerts_file(Path(path), root)
        records = read_alerts_jsonl(jsonl, notes) if jsonl is not None else []
        hparams = read_hparams(Path(path), notes)
    alerts = collect_alerts(scalars, records, prefix=prefix)
    shapes = {**model_shapes(hparams), **published_shapes(scalars, prefix)}  # what the run published wins
    seed = run_seed(Path(path), hparams) if path is not None else None
    return RunData(scalars, alerts=len(alerts), seed=seed, shapes=shapes), alerts


def _load(found: Mapping[str, RunDir], prefix: str, notes: list[str]) -> dict[str, _Run]:
    loaded = {}
    for name, run in found.items():
        scalars = read_run(run.path, prefix, notes)
        data, alerts = run_data(scalars, run.path, run.root, prefix, notes)
        loaded[name] = _Run(run.path, scalars, alerts, data)
    return loaded


_SEED_PART = re.compile(r"seed[_\-=]?\d+|version_\d+", re.IGNORECASE)
_SEED_SUFFIX = re.compile(r"[_\-.]seed[_\-=]?\d+$", re.IGNORECASE)


def side_of(name: str) -> str:
    """A run's name without its ``seed<N>`` and ``version_<N>`` parts: ``tied/seed3/version_0`` -> ``tied``."""
    parts = [_SEED_SUFFIX.sub("", p) for p in name.split("/") if not _SEED_PART.fullmatch(p)]
    return "/".join(p for p in parts if p)


def group_by_seed(names: Sequence[str], seeds: Mapping[str, int | None]) -> dict[str, list[str]] | None:
    """The runs as sides over seeds, when their names say so: every run has a seed, the names without
    their seed and version parts (:func:`side_of`) give 2 or more sides, each with distinct seeds, one
    with 2 runs or more. None otherwise (each run is then its own side)."""
    if any(seeds.get(n) is None for n in names):
        return None
    sides: dict[str, list[str]] = {}
    for n in names:
        sides.setdefault(side_of(n), []).append(n)
    if len(sides) < 2 or "" in sides or all(len(v) == 1 for v in sides.values()):
        return None
    if any(len({seeds[n] for n in v}) != len(v) for v in sides.values()):
        return None
    return sides


def _sides(args: argparse.Namespace, notes: list[str]) -> tuple[dict[str, list[str]], dict[str, RunDir], bool]:
    """Side -> run names, every run, and whether the sides are groups named by --group."""
    if args.group is not None:
        groups = discover_groups(args.group, notes)
        for g, runs in groups.items():
            if not runs:
                notes.append(f"group {g!r} has no run: left out")
        found = {name: run for runs in groups.values() for name, run in runs.items()}
        return {g: list(runs) for g, runs in groups.items() if runs}, found, True
    found = discover_runs(args.logdirs, notes)
    return {name: [name] for name in found}, found, False


def _run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    sides, found, grouped = _sides(args, notes)
    if not found:
        raise HeadwatchError("no run to report: " + "; ".join(notes) if notes else "no run to report")
    loaded = _load(found, args.prefix, notes)
    if not grouped:
        by_seed = group_by_seed(list(found), {n: r.data.seed for n, r in loaded.items()})
        if by_seed is not None:
            sides = by_seed
            notes.insert(0, "sides: the runs grouped by their paths without seed<N> and version_<N> (--group chooses others)")
    data = verdicts({s: {n: loaded[n].data for n in runs} for s, runs in sides.items()}, prefix=args.prefix)
    every = {tag for run in loaded.values() for tag in run.scalars}
    # the matched-step and matched-loss options choose what the tables of every metric show: they ask for them
    detail = args.show_all or args.match is not None or any(x is not None for x in (args.at_step, args.loss_tag, args.at_loss))
    tags = select_tags(every, show_all=args.show_all, match=args.match, prefix=args.prefix)
    groups = {s: {n: loaded[n].scalars for n in runs} for s, runs in sides.items()}
    comparison = None
    if grouped and len(groups) >= 2 and (detail or args.html):
        group_tags = [t for t in tags if tag_group(t, args.prefix) != "alerts"]
        comparison = compare_groups(groups, group_tags, at_step=args.at_step, loss_tag=args.loss_tag, at_loss=args.at_loss)
    runs = {n: r.scalars for n, r in loaded.items()}
    alerts = {n: r.alerts for n, r in loaded.items()}
    if args.json:
        out = dict(data, notes=notes)
        if detail:
            out["metrics"] = comparison.to_dict() if comparison is not None else to_json(runs, tags)
        _write(json.dumps(out, indent=2, allow_nan=False) + "\n", sys.stdout)
    else:
        sources = {n: str(r.path) for n, r in loaded.items()}
        text = render_answer(data, width=args.width, notes=notes if not args.show_all else (), sources=sources)
        if detail:
            text += "\n" + (render_comparison(comparison, prefix=args.prefix) if comparison is not None else render_text(
                runs, tags, alerts, width=args.width, prefix=args.prefix, sources={n: str(r.path) for n, r in loaded.items()}))
            if args.show_all and notes:
                text += "\nNotes\n" + "".join(f"  {n}\n" for n in notes)
        _write(text, sys.stdout)
    if args.html:
        preface = render_answer_html(data, notes)
        if comparison is not None:
            page = render_group_html(comparison, groups, charts=args.charts, prefix=args.prefix, preface=preface)
        else:
            page = render_html(runs, tags, alerts, charts=args.charts, prefix=args.prefix,
                               sources={n: str(r.path) for n, r in loaded.items()}, preface=preface)
        _write_page(args.html, page)
    if detail and not tags:
        print("headwatch report: no metric matched", file=sys.stderr)
        return 1
    return 0


def _write_page(html_path: str, page: str) -> None:
    path = Path(html_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    _write(f"headwatch report: wrote {path}\n", sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``headwatch report LOGDIR [LOGDIR ...]`` or ``headwatch report --group NAME=PATTERN ...``.

    ``argv`` starts with the subcommand (``["report", "runs"]``); returns the exit status (see ``--help``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.html and args.charts in ("svg", "png") and not _charts.have_matplotlib():
        print(f"headwatch report: error: --charts {args.charts}: {INSTALL_HINT} (or use --charts none)", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (HeadwatchError, OSError) as err:
        _write(f"headwatch report: error: {err}\n", sys.stderr)
        return 2
