"""``headwatch report``: did a setting change anything, on what, and how sure is that?

Reads the TensorBoard event files of runs and answers headline questions (validation loss,
rare-token NLL, calibration ECE, collision beyond drift, tied-flow conflict, final entropy and
its fall, alerts fired, what untying costs) for every side against the first: one run a side
gives differences only; two or more runs a side (seeds) give an interval (paired by seed when
both sides have the same seeds, else Welch) and a verdict under Holm's family-wise rule. The
answer is one dict, :func:`verdicts` (``--json`` prints it; the text and the HTML page render it).
``--all`` adds the side-by-side table of every metric of every run (final value, mean over the
last 10%, trend) with the alerts, or with ``--group`` the groups' statistics at matched step and
matched validation loss (:mod:`headwatch.report.compare`).

Example::

    python examples/train_tiny_lm.py --seed 1 --run-name tied/seed1      # and seeds 2, 3
    python examples/train_tiny_lm.py --seed 1 --no-tie-weights --run-name untied/seed1
    headwatch report runs --html report.html

The modules, one job each: :mod:`~headwatch.report.events` (reading one run: event files,
``hparams.yaml``, its seed), :mod:`~headwatch.report.runs` (finding runs, each once; alert logs;
groups), :mod:`~headwatch.report.safe` (names made printable and distinct),
:mod:`~headwatch.report.verdict` (t-tests, Holm, Wilson), :mod:`~headwatch.report.headlines` (the
questions and :func:`verdicts`), :mod:`~headwatch.report.answer` (the first screen, text and HTML),
:mod:`~headwatch.report.stats` (per-run summaries, tag selection), :mod:`~headwatch.report.text`
(the table, JSON), :mod:`~headwatch.report.charts` (matplotlib), :mod:`~headwatch.report.html`
(the page), :mod:`~headwatch.report.compare`, :mod:`~headwatch.report.group_text` and
:mod:`~headwatch.report.group_html` (groups over seeds), :mod:`~headwatch.report.cli` (arguments).
TensorBoard and matplotlib are imported inside the functions that need them, so importing this
package is cheap; matplotlib is optional.
"""

from __future__ import annotations

from headwatch.report.answer import render_answer, render_answer_html
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
from headwatch.report.events import model_shapes, read_hparams, run_seed
from headwatch.report.group_html import render_group_html
from headwatch.report.group_text import render_comparison
from headwatch.report.headlines import HEADLINES, Headline, RunData, verdicts
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
from headwatch.report.verdict import holm, paired_test, welch_test, wilson_interval

__all__ = [
    "HEADLINES",
    "AlertRecord",
    "Comparison",
    "Difference",
    "GroupStats",
    "Headline",
    "MetricComparison",
    "Points",
    "RunData",
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
    "holm",
    "least_squares_slope",
    "load_runs",
    "main",
    "model_shapes",
    "paired_test",
    "parse_group_specs",
    "read_alerts_jsonl",
    "read_hparams",
    "read_run",
    "read_scalars",
    "render_answer",
    "render_answer_html",
    "render_chart",
    "render_comparison",
    "render_group_html",
    "render_html",
    "render_text",
    "run_seed",
    "select_tags",
    "student_t_quantile",
    "strip_trainer_namespace",
    "summarize",
    "summarize_runs",
    "tag_group",
    "to_json",
    "value_at",
    "verdicts",
    "welch_interval",
    "welch_test",
    "wilson_interval",
]
