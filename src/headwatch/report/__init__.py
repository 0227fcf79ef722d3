"""``headwatch report``: compare the headwatch metrics of finished (or running) runs.

Reads the TensorBoard event files of one or more runs with TensorBoard's own reader and
prints, side by side, for every headwatch scalar: the final value, the mean over the last
10% of the logged points and the trend over the last half of the run; then the alerts
each run raised (TensorBoard markers ``<prefix>/alerts/<rule>`` and the JSON Lines log
``headwatch_alerts.jsonl`` written by :class:`headwatch.SharpnessCollapseAlert`). With
``--html PATH`` it writes one self-contained HTML page (no scripts, no external links)
with the same table and one matplotlib chart per metric comparing the runs. With
``--group NAME=PATTERN ...`` it compares groups of runs (seeds) instead: per metric, each
group's mean and spread and the difference between groups with a 95% Welch t-interval, at
matched steps and at matched validation loss (:mod:`headwatch.report.compare`).

Example::

    python examples/train_tiny_lm.py                    # runs/tied/version_0
    python examples/train_tiny_lm.py --no-tie-weights   # runs/untied/version_0
    headwatch report runs --html report.html

The modules, one job each: :mod:`~headwatch.report.runs` (finding runs, reading event files
and alert logs), :mod:`~headwatch.report.stats` (per-run summaries, tag selection),
:mod:`~headwatch.report.text` (the table, JSON), :mod:`~headwatch.report.charts`
(matplotlib), :mod:`~headwatch.report.html` (the page), :mod:`~headwatch.report.compare`,
:mod:`~headwatch.report.group_text` and :mod:`~headwatch.report.group_html` (groups over seeds), :mod:`~headwatch.report.cli`
(arguments). TensorBoard and matplotlib are imported inside the functions that need them,
so importing this package is cheap; matplotlib is optional.
"""

from __future__ import annotations

from headwatch.report.charts import have_matplotlib, render_chart
from headwatch.report.cli import build_parser, main, parse_group_specs
from headwatch.report.compare import (
    Comparison,
    Difference,
    GroupStats,
    MetricComparison,
    compare_groups,
    first_crossing,
    group_stats,
    student_t_quantile,
    value_at,
    welch_interval,
)
from headwatch.report.group_html import render_group_html
from headwatch.report.group_text import render_comparison
from headwatch.report.html import render_html
from headwatch.report.runs import (
    AlertRecord,
    Points,
    RunDir,
    Runs,
    collect_alerts,
    discover_groups,
    discover_runs,
    expand_patterns,
    find_alerts_file,
    load_runs,
    read_alerts_jsonl,
    read_run,
    read_scalars,
    strip_trainer_namespace,
)
from headwatch.report.stats import Summary, least_squares_slope, select_tags, summarize, summarize_runs, tag_group
from headwatch.report.text import format_number, format_trend, render_text, to_json

__all__ = [
    "AlertRecord",
    "Comparison",
    "Difference",
    "GroupStats",
    "MetricComparison",
    "Points",
    "RunDir",
    "Runs",
    "Summary",
    "build_parser",
    "collect_alerts",
    "compare_groups",
    "discover_groups",
    "discover_runs",
    "expand_patterns",
    "find_alerts_file",
    "first_crossing",
    "format_number",
    "format_trend",
    "group_stats",
    "have_matplotlib",
    "least_squares_slope",
    "load_runs",
    "main",
    "parse_group_specs",
    "read_alerts_jsonl",
    "read_run",
    "read_scalars",
    "render_chart",
    "render_comparison",
    "render_group_html",
    "render_html",
    "render_text",
    "select_tags",
    "student_t_quantile",
    "strip_trainer_namespace",
    "summarize",
    "summarize_runs",
    "tag_group",
    "to_json",
    "value_at",
    "welch_interval",
]
