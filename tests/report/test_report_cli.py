"""``headwatch report`` output on what other tests leave out: layout by width, a terminal without
UTF-8, HTML escaping, pages and tables with nothing or too little to show, grouped cells.

Every expected string is built here by hand from the definitions (column widths 10/10/12, the
``format_number`` rules, the ``needs 2 runs a group`` rule), on event files written with
``SummaryWriter`` or on in-memory runs.
"""

from __future__ import annotations

import io
import math
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from headwatch import HeadwatchError
from headwatch.report import (
    AlertRecord,
    compare_groups,
    format_number,
    main,
    render_chart,
    render_comparison,
    render_group_html,
    render_html,
    render_text,
)
from headwatch.report.html import resolve_charts
from headwatch.report.text import alert_cell

E, P = "headwatch/logits/entropy", "headwatch/logits/max_prob"


def write(path, points) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for tag, pts in points.items():
        for step, value in pts:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "runs"
    # E falls by 1 per 1000 steps in run a (0..1125 by 125, every value exact in float32): final 0.875
    write(root / "a", {E: [(s, 2.0 - s / 1000) for s in range(0, 1250, 125)], "train_loss": [(0, 3.0), (900, 2.0)]})
    write(root / "r&d<x>", {E: [(0, 1.5), (100, 1.5)], "headwatch/alerts/entropy_floor": [(100, 1.0)]})
    return root


# --------------------------------------------------------------------------- numbers and cells


@pytest.mark.parametrize(("x", "signed", "text"), [
    (999_999_999.0, False, "999999999"),  # an integer below 1e9: all digits
    (1e9, False, "1.000e+09"),
    (1_234_567.5, False, "1.235e+06"),
    (0.001, False, "0.001000"),  # 3 - floor(log10 0.001) = 6 decimals
    (0.000999, False, "9.990e-04"),
    (-42.125, False, "-42.12"),  # 4 significant digits, round half to even on the binary value
    (3.0, True, "+3"),
    (12.5, True, "+12.50"),
    (-0.0, True, "0"),
    (math.inf, True, "+inf"),
    (-math.inf, False, "-inf"),
])
def test_format_number_edges(x, signed, text):
    assert format_number(x, signed=signed) == text


def test_alert_cell_counts_markers_of_value_one():
    assert alert_cell(None) == "—" and alert_cell([]) == "—"
    assert alert_cell([(5, 0.0)]) == "0×"
    assert alert_cell([(5, 1.0), (9, 1.0), (12, 0.0)]) == "2× (last at step 9)"


# --------------------------------------------------------------------------- text


def test_runs_that_do_not_fit_go_to_further_tables():
    runs = {name: {E: [(0, 1.0), (10, 2.0), (20, 3.0)]} for name in ("a", "b", "c")}
    # label "  logits/entropy": 16 characters; a run block 10 + 2 + 10 + 2 + 12 = 36, plus " │ ": 39;
    # (120 - 16) // 39 = 2 runs a table: a, b, then c
    text = render_text(runs, [E], width=120)
    tables = text.split("\n\n")
    assert len(tables) == 2 and text.count("metric") == 2
    assert tables[0].splitlines()[0] == " " * 16 + " │ " + f"{'a':^36}" + " │ " + f"{'b':^36}".rstrip()
    assert tables[1].splitlines()[0] == " " * 16 + " │ " + f"{'c':^36}".rstrip()
    row = next(line for line in tables[1].splitlines() if line.startswith("  logits/entropy"))
    # final 3, mean of the last ceil(3 / 10) = 1 point 3, slope over the last ceil(3 / 2) = 2 points
    # 0.1 per step = +100 per 1000 steps, up
    assert row == "  logits/entropy" + " │ " + f"{'3':>10}  {'3':>10}  {'↑ +100':>12}"
    assert render_text(runs, [E], width=40).count("metric") == 3  # never fewer than one run a table


def test_text_sources_empty_selection_and_marker_only_alerts():
    runs = {"a": {E: [(0, 1.0)]}, "b": {}}
    alerts = {"a": [AlertRecord(7, "kl_ceiling", "", "tensorboard")], "b": []}
    text = render_text(runs, [], alerts, sources={"a": "/logs/a", "b": "/logs/b"})
    assert text.startswith("Runs:\n  a  (/logs/a)\n  b  (/logs/b)\n\nNo headwatch metrics matched (try --all")
    assert "  a: 1 alert\n    step 7  kl_ceiling  (TensorBoard marker only; no headwatch_alerts.jsonl entry)" in text
    assert "  b: no alerts" in text


def test_a_terminal_without_utf8_gets_ascii_stand_ins(runs_dir, monkeypatch):
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    assert main(["report", str(runs_dir / "a"), "--match", "."]) == 0
    sys.stdout.flush()
    out = raw.getvalue().decode("ascii")  # would raise on any non-ASCII byte
    row = next(line for line in out.splitlines() if line.startswith("  logits/entropy"))
    # final 2 - 1.125 = 0.875, the mean of the last point; trend -1 per 1000 steps: the down arrow
    # becomes "v", the bar "|"
    assert row.split("|")[1].split() == ["0.8750", "0.8750", "v", "-1"]
    assert "-+-" in out and "No headwatch" not in out


def test_width_below_40_is_a_usage_error(runs_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(runs_dir), "--width", "39"])
    assert exc.value.code == 2 and "--width must be at least 40, got 39" in capsys.readouterr().err


# --------------------------------------------------------------------------- HTML


def test_html_escapes_run_names_and_alert_messages(runs_dir, tmp_path, capsys):
    page = tmp_path / "p.html"
    assert main(["report", str(runs_dir), "--html", str(page), "--charts", "none"]) == 0
    text = page.read_text(encoding="utf-8")
    assert "r&amp;d&lt;x&gt;" in text and "r&d<x>" not in text
    assert "No charts: charts need matplotlib" in text and "<figure>" not in text
    # the marker-only alert of r&d<x>, and a's table cells
    assert "<tr><td>100</td><td>entropy_floor</td><td>(TensorBoard marker only)</td></tr>" in text
    assert '<td class="run-start">0.8750</td><td>0.8750</td><td>↓ -1</td>' in text
    assert "r&d<x>" in capsys.readouterr().out  # the terminal table shows the name as it is


def test_html_with_no_metric_matched_is_still_written_and_exits_1(runs_dir, tmp_path, capsys):
    page = tmp_path / "none.html"
    assert main(["report", str(runs_dir), "--match", "^nothing$", "--html", str(page), "--charts", "none"]) == 1
    assert "<p>No headwatch metrics matched.</p>" in page.read_text(encoding="utf-8")
    assert "no metric matched" in capsys.readouterr().err


def test_charts_choice_without_matplotlib(monkeypatch):
    monkeypatch.setattr("headwatch.report.charts.have_matplotlib", lambda: False)
    assert resolve_charts("auto") == "none" and resolve_charts("none") == "none"
    with pytest.raises(HeadwatchError, match=r"--charts png: charts need matplotlib"):
        resolve_charts("png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # installed but broken: the import fails
    with pytest.raises(HeadwatchError, match="pip install matplotlib"):
        render_chart({"a": [(0, 1.0)]}, {"a": "#000"})


def test_html_lists_runs_with_their_colors_and_sources():
    page = render_html({"a": {E: [(0, 1.0)]}, "b": {E: [(0, 2.0)]}}, [E], charts="none", sources={"a": "/x/a"}, title="T & U")
    assert "<title>T &amp; U</title>" in page and "<h1>T &amp; U</h1>" in page
    # matplotlib's tab10 order: the first run blue, the second red
    assert '<li><span class="swatch" style="background:#1f77b4"></span>a <span class="muted">(/x/a)</span></li>' in page
    assert '<li><span class="swatch" style="background:#d62728"></span>b</li>' in page


# --------------------------------------------------------------------------- grouped output


@pytest.fixture
def comparison():
    groups = {
        "a": {"a1": {E: [(0, 1.0), (10, 2.0)], P: [(0, 0.5), (10, 0.25)]}, "a2": {E: [(0, 3.0), (10, 4.0)]}},
        "b": {"b1": {E: [(0, 1.0), (10, 5.0)]}},
    }
    return compare_groups(groups, [E, P]), groups


def cells(mean, sd, lo, hi, n) -> str:
    return f"{mean:>10} {sd:>10} {f'[{lo}, {hi}]':>21} {n:>2}"


def test_group_text_cells_with_one_run_and_no_run(comparison):
    c, _ = comparison
    text = render_comparison(c)
    entropy = next(line for line in text.splitlines() if line.startswith("logits/entropy "))
    # step 10 (the last common step): a = 2, 4: mean 3, sd sqrt(2) = 1.414; b = 5 alone: no sd, no interval
    assert entropy == ("logits/entropy " + f"{'10':>9}" + " │ " + cells("3", "1.414", "2", "4", 2) + " │ "
                       + cells("5", "—", "5", "5", 1) + " │ " + f"{'+2':>10} {'(needs 2 runs a group)':<24}").rstrip()
    max_prob = next(line for line in text.splitlines() if line.startswith("logits/max_prob"))
    # logged by a1 only (last step 10): a = 0.25, b has none: its cells are dashes and n = 0, no difference
    assert max_prob == ("logits/max_prob" + f"{'10':>9}" + " │ " + cells("0.2500", "—", "0.2500", "0.2500", 1) + " │ "
                        + f"{'—':>10} {'—':>10} {'—':>21} {0:>2}" + " │ " + f"{'—':>10}")
    assert "a  2 runs: a1, a2\n  b  1 run: b1" in text
    assert text.rstrip().endswith("Note: no run logged 'val_loss' or 'eval/loss': no comparison at matched loss (pass --loss-tag)")
    assert "At matched loss" not in text


def test_group_html_cells_with_one_run_and_no_run(comparison):
    c, groups = comparison
    page = render_group_html(c, groups, charts="none")
    assert '<td class="run-start">+2</td><td>needs 2 runs a group</td>' in page
    assert '<td class="run-start">—</td><td>—</td><td>—</td><td>0</td>' in page
    assert '<td class="run-start">3</td><td>1.414</td><td>[2, 4]</td><td>2</td>' in page
    assert "<p class=\"muted\">Note: no run logged &#x27;val_loss&#x27; or &#x27;eval/loss&#x27;" in page
    assert "No charts: charts need matplotlib" in page and "<svg" not in page
    assert "<b>a</b> (2): a1, a2" in page and "<b>b</b> (1): b1" in page
