"""``headwatch report``: the argument parser and the command (``main``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headwatch.errors import HeadwatchError
from headwatch.report import charts as _charts
from headwatch.report.charts import INSTALL_HINT
from headwatch.report.compare import compare_groups
from headwatch.report.group_html import render_group_html
from headwatch.report.group_text import render_comparison
from headwatch.report.html import render_html
from headwatch.report.runs import collect_alerts, discover_groups, discover_runs, find_alerts_file, read_alerts_jsonl, read_run
from headwatch.report.stats import select_tags, tag_group
from headwatch.report.text import render_text, to_json

_EPILOG = """\
The table: one block per run with
  final     the value at the last logged step,
  last 10%  the mean of the last 10% of the run's points (at least one),
  trend/1k  the least-squares slope over the last 50% of the points, per 1000 steps:
            ↑ / ↓, or → when the fitted change over that span is below 1% of the mean |value|.
  —         the run did not log this metric.
Rows are grouped by the monitor that declares the metric in headwatch.names (logits,
gradients, collision, tokens, alerts; other for undeclared tags); train_loss and val_loss
(train/loss and eval/loss in Hugging Face Trainer runs) are shown as context when present.
Trainer runs write train/<prefix>/...: when a run has no <prefix>/ tag, its train/<prefix>/
tags are read as <prefix>/... (no --prefix needed). By default the names declared as detail are hidden (the
per-bucket tags /top1/, /top10/, /top50/, /tail/, /unseen/, /rare/ and the _p05 / _max
variants); --all shows them, --match filters by regex.

Alerts come from the markers <prefix>/alerts/<rule> (value 1 at the alert step) and from
the nearest headwatch_alerts.jsonl in or above each run directory (up to LOGDIR).

Exit status: 0 on success, 1 when no metric matched, 2 on a usage error or when a LOGDIR
is missing or holds no TensorBoard event files.

Grouped comparison over seeds (--group NAME=PATTERN ...; patterns are expanded here, so
quote them or not): per metric, each group's mean, sample sd (n - 1), [min, max] and n
over its runs, and each group's difference to the first group with a 95% Welch
t-interval (* when it excludes 0), at a matched step (--at-step N, default the last
common step) and at matched validation loss (each run read where its --loss-tag curve,
default val_loss, else eval/loss, first reaches a common value: --at-loss, default the lowest loss every
run reaches; values between logged points are linearly interpolated). --html writes the
same tables and one chart per metric with every run in the color of its group.

Examples:
  headwatch report runs                        # every run under runs/
  headwatch report runs/tied runs/untied --html report.html
  headwatch report runs --match 'entropy|density' --json
  headwatch report --group tied='runs/tied_*' untied='runs/untied_*' --match 'entropy$|val_loss'
"""


def _add_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument(
        "logdirs",
        nargs="*",
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
        choices=("auto", "svg", "png", "none"),
        default="auto",
        help="charts for --html, drawn by matplotlib: inline SVG, PNG data URIs, none, or auto "
        "(SVG if matplotlib is installed, else none; default)",
    )
    report.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of the table: {run: {tag: {final, last10_mean, trend_per_1k, trend, steps, first_step, last_step}}}",
    )
    report.add_argument("--width", type=int, default=160, help="target width of the text table in characters (default: %(default)s)")
    grouped = report.add_argument_group("grouped comparison over seeds")
    grouped.add_argument(
        "--group",
        nargs="+",
        action="extend",
        metavar="NAME=PATTERN",
        help="groups of runs to compare instead of LOGDIRs (glob patterns expanded here; repeat a NAME to add patterns)",
    )
    grouped.add_argument("--at-step", type=int, metavar="N", help="the matched step (default: each metric's last common step)")
    grouped.add_argument(
        "--loss-tag", metavar="TAG", help="the loss curve that defines matched loss (default: val_loss, else eval/loss, when logged)"
    )
    grouped.add_argument("--at-loss", type=float, metavar="L", help="the matched loss (default: the lowest loss every run reaches)")


def build_parser() -> argparse.ArgumentParser:
    """The ``headwatch`` argument parser with its ``report`` subcommand."""
    parser = argparse.ArgumentParser(prog="headwatch", description="Tools for the metrics headwatch logs to TensorBoard.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser(
        "report",
        help="compare the headwatch metrics and alerts of one or more runs, or groups of runs over seeds",
        description=(
            "Read the TensorBoard event files of one or more runs and print a side-by-side table of\n"
            "the headwatch metrics (final value, mean over the last 10%, trend) and the alerts;\n"
            "with --html, also write one self-contained HTML page with the comparison charts.\n"
            "With --group, compare groups of runs (seeds) instead: means, spreads and intervals."
        ),
        epilog=_EPILOG,
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


def _write(text: str, stream: Any) -> None:
    try:
        stream.write(text)
    except UnicodeEncodeError:  # a terminal without UTF-8: plain ASCII stand-ins
        table = str.maketrans({"↑": "^", "↓": "v", "→": "=", "—": "-", "…": "~", "×": "x", "│": "|", "─": "-", "┼": "+", "−": "-"})
        stream.write(text.translate(table).encode("ascii", "replace").decode("ascii"))


def _run_report(args: argparse.Namespace) -> int:
    found = discover_runs(args.logdirs)
    runs = {name: read_run(run.path, args.prefix) for name, run in found.items()}
    tags = select_tags({tag for scalars in runs.values() for tag in scalars}, show_all=args.show_all, match=args.match, prefix=args.prefix)
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
        _write_page(args.html, render_html(runs, tags, alerts, charts=args.charts, prefix=args.prefix, sources=sources))
    return _no_match(tags)


def _write_page(html_path: str, page: str) -> None:
    path = Path(html_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    print(f"headwatch report: wrote {path}", file=sys.stderr)


def _run_groups(args: argparse.Namespace) -> int:
    found = discover_groups(args.group)
    groups = {g: {name: read_run(run.path, args.prefix) for name, run in runs.items()} for g, runs in found.items()}
    every = {tag for runs in groups.values() for scalars in runs.values() for tag in scalars}
    tags = [t for t in select_tags(every, show_all=args.show_all, match=args.match, prefix=args.prefix) if tag_group(t, args.prefix) != "alerts"]
    comparison = compare_groups(groups, tags, at_step=args.at_step, loss_tag=args.loss_tag, at_loss=args.at_loss)
    if args.json:
        _write(json.dumps(comparison.to_dict(), indent=2, allow_nan=False) + "\n", sys.stdout)
    else:
        _write(render_comparison(comparison, prefix=args.prefix), sys.stdout)
    if args.html:
        _write_page(args.html, render_group_html(comparison, groups, charts=args.charts, prefix=args.prefix))
    return _no_match(tags)


def _no_match(tags: Sequence[str]) -> int:
    if not tags:
        print("headwatch report: no metric matched", file=sys.stderr)
        return 1
    return 0


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
        return _run_groups(args) if args.group is not None else _run_report(args)
    except (HeadwatchError, OSError) as err:
        print(f"headwatch report: error: {err}", file=sys.stderr)
        return 2
