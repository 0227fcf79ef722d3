"""``headwatch report``: event files written here, numbers checked against NumPy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from headwatch import HeadwatchError
from headwatch.report import (
    collect_alerts,
    discover_runs,
    find_alerts_file,
    format_number,
    format_trend,
    load_runs,
    main,
    render_html,
    render_chart,
    render_text,
    select_tags,
    summarize,
)

TIED_STEPS = list(range(0, 1000, 10))  # 100 points
UNTIED_STEPS = list(range(0, 600, 5))  # 120 points


def tied_series() -> dict[str, list[tuple[int, float]]]:
    s = TIED_STEPS
    return {
        "headwatch/logits/entropy": [(t, 6.0 - 0.002 * t) for t in s],
        "headwatch/logits/kl_to_uniform": [(t, 0.5 + 1e-6 * t * t + 0.01 * math.sin(t)) for t in s],
        "headwatch/logits/entropy_p05": [(t, 1.0) for t in s],
        "headwatch/val/logits/entropy": [(t, 5.5 - 0.001 * t) for t in (199, 399, 599, 799, 999)],
        "headwatch/grad/embedding_row_density": [(t, 0.3) for t in s],
        "headwatch/grad/top1/embedding_row_norm_mean": [(t, 0.1 + 0.0001 * t) for t in s],
        "headwatch/tokens/total": [(t, 512.0 * (t + 10)) for t in s],
        "headwatch/alerts/entropy_floor": [(500, 1.0)],
        "train_loss": [(t, 4.0 - 0.001 * t) for t in s],
        "epoch": [(t, 0.0) for t in s],
    }


def untied_series() -> dict[str, list[tuple[int, float]]]:
    s = UNTIED_STEPS
    return {
        "headwatch/logits/entropy": [(t, 6.0 - 0.001 * t) for t in s],
        "headwatch/grad/embedding_row_density": [(t, 0.02 + 0.0005 * t) for t in s],
        "train_loss": [(t, 4.2 - 0.001 * t) for t in s],
    }


def write_run(path: Path, series: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for tag, points in series.items():
        for step, value in points:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


def f32(points: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the values as TensorBoard stores them (float32), in float64 for the reference."""
    steps = np.array([s for s, _ in points], dtype=np.float64)
    values = np.array([v for _, v in points], dtype=np.float32).astype(np.float64)
    return steps, values


def reference(points: list[tuple[int, float]]) -> dict[str, float]:
    """Hand computation: last value, mean of the last ceil(n/10), polyfit slope over the last ceil(n/2), per 1k."""
    steps, values = f32(points)
    n = len(values)
    k10 = max(1, math.ceil(n / 10))
    k50 = math.ceil(n / 2)
    slope = np.polyfit(steps[-k50:], values[-k50:], 1)[0] if k50 >= 2 else None
    return {
        "final": float(values[-1]),
        "last10_mean": float(values[-k10:].mean()),
        "trend_per_1k": None if slope is None else float(slope * 1000),
    }


ALERT_LINES = [
    {
        "time": "2024-05-01T12:00:00+00:00",
        "step": 500,
        "epoch": 0,
        "rule": "entropy_floor",
        "metrics": {"headwatch/logits/entropy": 4.9},
        "message": "entropy 4.9 nats fell below the floor 5.0",
    },
    {
        "time": "2024-05-01T12:01:00+00:00",
        "step": 800,
        "epoch": 0,
        "rule": "kl_ceiling",
        "metrics": {"headwatch/logits/kl_to_uniform": 1.2},
        "message": "KL to uniform 1.2 nats rose above the ceiling 1.1",
    },
]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report") / "runs"
    write_run(root / "tied" / "version_0", tied_series())
    write_run(root / "untied" / "version_0", untied_series())
    with open(root / "tied" / "version_0" / "headwatch_alerts.jsonl", "w", encoding="utf-8") as f:
        for line in ALERT_LINES:
            f.write(json.dumps(line) + "\n")
        f.write('{"time": "cut short by a cra')  # a torn last line is skipped
    return root


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 11, 19, 30, 101])
def test_summarize_matches_numpy(n):
    rng = np.random.default_rng(n)
    steps = np.cumsum(rng.integers(1, 20, size=n))
    values = rng.normal(size=n) + 0.01 * steps
    points = [(int(s), float(v)) for s, v in zip(steps, values)]
    s = summarize(points)
    k10, k50 = max(1, math.ceil(n / 10)), math.ceil(n / 2)
    assert s.final == values[-1] and s.final_step == steps[-1] and s.points == n
    assert s.last10_mean == pytest.approx(values[-k10:].mean(), rel=1e-12, abs=1e-12)
    if k50 < 2:
        assert s.trend_per_1k is None and s.trend is None and format_trend(s) == "—"
    else:
        slope = np.polyfit(steps[-k50:].astype(np.float64), values[-k50:], 1)[0]
        assert s.trend_per_1k == pytest.approx(slope * 1000, rel=1e-9, abs=1e-12)


def test_trend_direction_and_flat_threshold():
    steps = range(0, 1000, 10)
    assert summarize([(t, 5.0) for t in steps]).trend == "flat"
    # change over the last half (step 500..990) = 490 * slope; 0.5% of the level -> flat, 2% -> down / up
    assert summarize([(t, 10.0 - 0.05 / 490 * t) for t in steps]).trend == "flat"
    assert summarize([(t, 10.0 - 0.2 / 490 * t) for t in steps]).trend == "down"
    assert summarize([(t, 10.0 + 0.2 / 490 * t) for t in steps]).trend == "up"
    assert summarize([(t, 0.0) for t in steps]).trend == "flat"
    down = summarize([(t, 6.0 - 0.002 * t) for t in steps])
    assert format_trend(down) == "↓ -2"
    assert summarize([(0, 1.0), (10, float("nan")), (20, 3.0), (30, 4.0)]).trend_per_1k == pytest.approx(100.0)


def test_summarize_rejects_empty():
    with pytest.raises(HeadwatchError, match="at least one"):
        summarize([])


def test_format_number():
    assert format_number(None) == "—"
    assert format_number(4.055) == "4.055"
    assert format_number(0.012345) == "0.01235"
    assert format_number(123.456) == "123.5"
    assert format_number(512000.0) == "512000"
    assert format_number(1.5e-5) == "1.500e-05"
    assert format_number(-0.5, signed=True) == "-0.5000"
    assert format_number(float("nan")) == "nan"


def test_select_tags_curation():
    tags = set(tied_series()) | {"headwatch/collision/rare_rate_head", "val_loss", "other/thing"}
    default = select_tags(tags)
    assert "headwatch/grad/top1/embedding_row_norm_mean" not in default
    assert "headwatch/logits/entropy_p05" not in default
    assert "epoch" not in default and "other/thing" not in default
    assert default[:2] == ["train_loss", "val_loss"]  # context first, then groups in order
    assert default.index("headwatch/logits/entropy") < default.index("headwatch/val/logits/entropy")
    assert default.index("headwatch/grad/embedding_row_density") < default.index("headwatch/collision/rare_rate_head")
    assert default[-1] == "headwatch/alerts/entropy_floor"
    everything = select_tags(tags, show_all=True)
    assert "headwatch/grad/top1/embedding_row_norm_mean" in everything and "headwatch/logits/entropy_p05" in everything
    assert select_tags(tags, match="entropy$") == ["headwatch/logits/entropy", "headwatch/val/logits/entropy"]
    with pytest.raises(HeadwatchError, match="regular expression"):
        select_tags(tags, match="(")


# --------------------------------------------------------------------------- reading


def test_discover_and_load(logdir):
    found = discover_runs([logdir])
    assert list(found) == ["tied/version_0", "untied/version_0"]
    runs = load_runs([logdir])
    for name, series in (("tied/version_0", tied_series()), ("untied/version_0", untied_series())):
        for tag, points in series.items():
            steps, values = f32(points)
            got = runs[name][tag]
            assert [s for s, _ in got] == list(steps.astype(int))
            assert np.array_equal([v for _, v in got], values)
    # a run directory given directly is named by its directory name; equal names are told apart
    both = discover_runs([logdir / "tied" / "version_0", logdir / "untied" / "version_0"])
    assert list(both) == ["tied/version_0", "untied/version_0"]
    assert list(discover_runs([logdir / "tied", logdir / "untied"])) == ["tied/version_0", "untied/version_0"]


def test_missing_or_empty_path(tmp_path):
    with pytest.raises(HeadwatchError, match="does not exist"):
        discover_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadwatchError, match="no TensorBoard event files"):
        discover_runs([tmp_path / "empty"])


def test_alerts_file_search_is_bounded(tmp_path):
    run = tmp_path / "a" / "b" / "version_0"
    run.mkdir(parents=True)
    (tmp_path / "headwatch_alerts.jsonl").write_text("")
    assert find_alerts_file(run, tmp_path / "a") is None  # above the LOGDIR: not searched
    (tmp_path / "a" / "headwatch_alerts.jsonl").write_text("")
    assert find_alerts_file(run, tmp_path / "a") == (tmp_path / "a" / "headwatch_alerts.jsonl").resolve()
    (run / "headwatch_alerts.jsonl").write_text("")
    assert find_alerts_file(run, tmp_path / "a") == (run / "headwatch_alerts.jsonl").resolve()


def test_collect_alerts_merges_markers_and_jsonl():
    scalars = {"headwatch/alerts/entropy_floor": [(500, 1.0)], "headwatch/alerts/val_stall": [(900, 1.0), (950, 0.0)]}
    alerts = collect_alerts(scalars, ALERT_LINES)
    assert [(a.step, a.rule, a.source) for a in alerts] == [
        (500, "entropy_floor", "jsonl+tensorboard"),
        (800, "kl_ceiling", "jsonl"),
        (900, "val_stall", "tensorboard"),
    ]
    assert alerts[0].message == ALERT_LINES[0]["message"]


# --------------------------------------------------------------------------- command


def _row(text: str, label: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"  {label} ")]
    assert len(rows) == 1, (label, text)
    return rows[0]


def test_text_table_numbers(logdir, capsys):
    assert main(["report", str(logdir), "--match", "."]) == 0  # the table of the metrics, after the answer
    out = capsys.readouterr().out
    assert "tied/version_0" in out and "untied/version_0" in out
    assert max(len(line) for line in out.splitlines() if not line.startswith("  step")) <= 160
    for label, tag in (("logits/entropy", "headwatch/logits/entropy"), ("grad/embedding_row_density", "headwatch/grad/embedding_row_density")):
        row = _row(out, label)
        cells = [c.split() for c in row.split("│")[1:]]
        for cell, series in zip(cells, (tied_series(), untied_series())):
            ref = reference(series[tag])
            s = summarize(list(zip(*[a.tolist() for a in f32(series[tag])])))
            assert cell[0] == format_number(ref["final"])
            assert cell[1] == format_number(ref["last10_mean"])
            assert " ".join(cell[2:]) == format_trend(s)
    tied_entropy = _row(out, "logits/entropy").split("│")[1].split()
    assert tied_entropy[:2] == ["4.020", "4.110"]  # 6 - 0.002 * 990; mean over steps 900..990
    assert tied_entropy[2:] == ["↓", "-2.000"]
    assert _row(out, "grad/embedding_row_density").split("│")[1].split()[2] == "→"
    assert _row(out, "grad/embedding_row_density").split("│")[2].split()[2] == "↑"
    kl = _row(out, "logits/kl_to_uniform").split("│")[2].split()
    assert kl == ["—", "—", "—"]  # the untied run did not log it
    assert "grad/top1/embedding_row_norm_mean" not in out and "entropy_p05" not in out
    assert "1× (last at step 500)" in _row(out, "alerts/entropy_floor")
    for group in ("[loss]", "[logits]", "[gradients]", "[tokens]", "[alerts]"):
        assert group in out
    alerts = out.split("\nAlerts\n", 1)[1]
    assert "tied/version_0: 2 alerts" in alerts
    assert "step 500  entropy_floor  entropy 4.9 nats fell below the floor 5.0" in alerts
    assert "step 800  kl_ceiling     KL to uniform 1.2 nats rose above the ceiling 1.1" in alerts
    assert "untied/version_0: no alerts" in alerts


def test_all_and_match(logdir, capsys):
    assert main(["report", str(logdir), "--all"]) == 0
    out = capsys.readouterr().out
    assert "grad/top1/embedding_row_norm_mean" in out and "logits/entropy_p05" in out
    assert main(["report", str(logdir), "--match", "density"]) == 0
    out = capsys.readouterr().out
    assert "grad/embedding_row_density" in out and "logits/entropy " not in out
    assert main(["report", str(logdir), "--match", "no_such_metric"]) == 1
    assert "no metric matched" in capsys.readouterr().err


def test_narrow_width_splits_runs(logdir):
    runs = load_runs([logdir])
    tags = select_tags({t for r in runs.values() for t in r})
    text = render_text(runs, tags, None, width=60)
    assert text.count("metric") == 2  # one table per run
    assert "Alerts" not in text


def test_json_output(logdir, capsys):
    assert main(["report", str(logdir), "--json", "--match", "."]) == 0
    data = json.loads(capsys.readouterr().out)["metrics"]
    assert set(data) == {"tied/version_0", "untied/version_0"}
    for name, series in (("tied/version_0", tied_series()), ("untied/version_0", untied_series())):
        for tag in ("headwatch/logits/entropy", "headwatch/grad/embedding_row_density", "train_loss"):
            ref = reference(series[tag])
            got = data[name][tag]
            assert got["final"] == ref["final"]
            assert got["last10_mean"] == pytest.approx(ref["last10_mean"], rel=1e-12)
            assert got["trend_per_1k"] == pytest.approx(ref["trend_per_1k"], rel=1e-9, abs=1e-12)
            assert got["steps"] == len(series[tag]) and got["last_step"] == series[tag][-1][0]
    kl = reference(tied_series()["headwatch/logits/kl_to_uniform"])  # nonlinear: slope of the last half only
    assert data["tied/version_0"]["headwatch/logits/kl_to_uniform"]["trend_per_1k"] == pytest.approx(kl["trend_per_1k"], rel=1e-9)
    assert "headwatch/logits/kl_to_uniform" not in data["untied/version_0"]
    assert data["tied/version_0"]["headwatch/alerts/entropy_floor"]["trend_per_1k"] is None


def _no_external_reference(text: str) -> None:
    """No link, script or resource the page would fetch (namespace URIs of inline SVG excepted)."""
    assert "<script" not in text
    for attr in ("href=", "src="):
        for part in text.split(attr)[1:]:
            assert not part.lstrip("\"'").startswith(("http:", "https:", "//")), part[:60]
    assert "url(http" not in text and "@import" not in text


def test_html_is_self_contained(logdir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    page = tmp_path / "out" / "report.html"
    assert main(["report", str(logdir), "--html", str(page), "--charts", "svg"]) == 0
    assert "wrote" in capsys.readouterr().err
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert text.count("<svg") == text.count("</svg>") > 0 and "<path" in text and "<?xml" not in text
    assert "tied/version_0" in text and "untied/version_0" in text
    _no_external_reference(text)
    tags = select_tags({t for r in load_runs([logdir]).values() for t in r})
    assert text.count("<figure>") == len(tags) == text.count("<svg")
    assert "entropy 4.9 nats fell below the floor 5.0" in text
    assert "4.020" in text and "↓ -2.000" in text
    # auto: SVG charts when matplotlib is importable; self-contained either way
    auto = tmp_path / "auto.html"
    assert main(["report", str(logdir), "--html", str(auto)]) == 0
    text = auto.read_text(encoding="utf-8")
    assert text.count("<svg") == len(tags)
    _no_external_reference(text)


def test_html_png_charts(logdir, tmp_path):
    pytest.importorskip("matplotlib")
    page = tmp_path / "png.html"
    assert main(["report", str(logdir), "--html", str(page), "--charts", "png"]) == 0
    text = page.read_text(encoding="utf-8")
    assert "data:image/png;base64," in text and "<svg" not in text
    _no_external_reference(text)


def test_charts_without_matplotlib(logdir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("headwatch.report.charts.have_matplotlib", lambda: False)
    for fmt in ("png", "svg"):
        assert main(["report", str(logdir), "--html", str(tmp_path / "x.html"), "--charts", fmt]) == 2
        assert "pip install matplotlib" in capsys.readouterr().err
        assert not (tmp_path / "x.html").exists()
    assert main(["report", str(logdir), "--html", str(tmp_path / "y.html")]) == 0  # auto: the page without charts
    text = (tmp_path / "y.html").read_text(encoding="utf-8")
    assert "<svg" not in text and "<figure>" not in text and "pip install matplotlib" in text
    assert "4.020" in text  # the table is still there
    with pytest.raises(HeadwatchError, match="pip install matplotlib"):
        render_html({}, [], charts="svg")


def test_chart_edge_cases():
    pytest.importorskip("matplotlib")
    colors = {"a": "#000000", "b": "#111111"}
    svg = render_chart({"a": [(0, 1.0)], "b": [(0, 2.0), (5, float("nan")), (10, 3.0), (20, 4.0)]}, colors, title="t")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>") and 'aria-label="t"' in svg
    assert ">a</text>" in svg and ">b</text>" in svg  # the legend, as text
    assert "no finite values" in render_chart({"a": [(0, float("nan"))]}, {"a": "#000"})
    assert render_chart({"a": [(0, 1.0)]}, {"a": "#000"}, fmt="png").startswith('<img alt="" src="data:image/png;base64,')
    with pytest.raises(HeadwatchError, match="`charts`"):
        render_html({}, [], charts="gif")
    with pytest.raises(HeadwatchError, match="`fmt`"):
        render_chart({}, {}, fmt="gif")


def test_missing_path_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "does_not_exist")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "does_not_exist" in err and "does not exist" in err
    assert main(["report", str(tmp_path)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["report"])
    assert exc.value.code == 2


def test_python_dash_m(logdir, tmp_path):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    cmd = [sys.executable, "-m", "headwatch", "report", str(logdir / "tied"), str(logdir / "untied"), "--json", "--all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)["metrics"]
    ref = reference(untied_series()["headwatch/logits/entropy"])
    assert data["untied/version_0"]["headwatch/logits/entropy"]["final"] == ref["final"]
    proc = subprocess.run(
        [sys.executable, "-m", "headwatch", "report", str(tmp_path / "missing")],
        capture_output=True, text=True, encoding="utf-8", env=env, timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "headwatch", "report", "--help"], capture_output=True, text=True, encoding="utf-8", env=env)
    assert proc.returncode == 0 and "--html PATH" in proc.stdout and "trend/1k" in proc.stdout


def test_collect_alerts_keeps_severities_apart():
    # a warning and a critical alert of one rule at one step: two markers, two records, listed twice
    scalars = {"headwatch/alerts/entropy_floor": [(40, 1.0)], "headwatch/alerts/entropy_floor_warning": [(40, 1.0)]}
    records = [
        {"step": 40, "rule": "entropy_floor", "severity": "warning", "message": "warn"},
        {"step": 40, "rule": "entropy_floor", "severity": "critical", "message": "crit"},
    ]
    alerts = collect_alerts(scalars, records)
    assert [(a.step, a.rule, a.source, a.message) for a in alerts] == [
        (40, "entropy_floor", "jsonl+tensorboard", "crit"),
        (40, "entropy_floor_warning", "jsonl+tensorboard", "warn"),
    ]

