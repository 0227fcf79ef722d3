"""``headwatch report`` on what users' folders hold: odd names, control bytes, FIFOs, symlink cycles,
aliases, damaged files, all-NaN groups, sweeps of many runs; and a property test over names and files.

Every run is a real event file written with ``SummaryWriter``; the report runs in a subprocess where
a hang is possible (a FIFO), so a hang fails the test instead of stopping the suite.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.tensorboard import SummaryWriter

from headwatch.report import main
from headwatch.report.safe import printable

E, V = "headwatch/logits/entropy", "headwatch/val/logits/target_nll"
BIDI = set("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")


def write(path: Path, series: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for tag, points in series.items():
        for step, value in points:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


def run_series(c: float = 5.0) -> dict[str, list[tuple[int, float]]]:
    return {E: [(s, c - s / 64) for s in range(0, 65, 16)], V: [(0, 7.0), (64, c)]}


def assert_printable(text: str) -> None:
    """No control character but the newline, no bidirectional override, no line separator."""
    for ch in text:
        assert ch == "\n" or (unicodedata.category(ch) != "Cc" and ch not in BIDI), repr(ch)


def report_in_subprocess(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "headwatch", "report", *args], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", env=env, timeout=timeout)


# --------------------------------------------------------------------------- names


def test_a_run_named_like_a_shell_variable_gets_its_html_page_with_charts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write(tmp_path / "runs" / "exp_$USER_$HOST", run_series(5.0))
    write(tmp_path / "runs" / "exp_$HOME", run_series(5.5))
    page = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "runs"), "--html", str(page), "--charts", "svg"]) == 0
    text = page.read_text(encoding="utf-8")
    assert "exp_$USER_$HOST" in text and ">exp_$USER_$HOST</text>" in text  # the legend shows the name as written
    assert text.count("<svg") > 0 and "exp_$USER_$HOST" in capsys.readouterr().out


def test_control_bytes_in_names_tags_and_alert_messages_are_shown_escaped(tmp_path):
    evil = "evil\x1b]0;pwned\x07\x1b[2J"
    run = tmp_path / "runs" / evil
    write(run, {**run_series(), "headwatch/logits/odd\x1b[31mred": [(0, 1.0), (64, 2.0)]})
    (run / "headwatch_alerts.jsonl").write_text(json.dumps(
        {"step": 32, "rule": "entropy_floor\x1b[2J", "message": "entropy fell\x1b]0;title\x07\r\u202egnp.exe"}) + "\n")
    write(tmp_path / "runs" / "plain", run_series(5.5))
    page = tmp_path / "p.html"
    proc = report_in_subprocess([str(tmp_path / "runs"), "--all", "--html", str(page), "--charts", "none"])
    assert proc.returncode == 0, proc.stderr
    assert_printable(proc.stdout)
    assert_printable(proc.stderr)
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J" in proc.stdout  # the name, escaped, in the answer and the table
    assert "odd\\x1b[31mred" in proc.stdout and "entropy fell\\x1b]0;title\\x07\\x0d\\u202egnp.exe" in proc.stdout
    text = page.read_text(encoding="utf-8")
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert html.escape("evil\\x1b]0;pwned\\x07\\x1b[2J") in text


# --------------------------------------------------------------------------- files


def test_a_fifo_named_like_an_event_file_is_never_opened(tmp_path):
    write(tmp_path / "runs" / "a", run_series())
    os.mkfifo(tmp_path / "runs" / "a" / "events.out.tfevents.0.fifo")
    (tmp_path / "runs" / "b").mkdir()
    os.mkfifo(tmp_path / "runs" / "b" / "events.out.tfevents.1.fifo")  # a "run" of only a FIFO: none
    os.mkfifo(tmp_path / "runs" / "a" / "headwatch_alerts.jsonl")  # nor an alert log that is one
    os.mkfifo(tmp_path / "runs" / "a" / "hparams.yaml")
    proc = report_in_subprocess([str(tmp_path / "runs"), "--json"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert list(data["sides"]) == ["a"]
    assert any("events.out.tfevents.0.fifo: not a regular file" in n for n in data["notes"])


def test_a_symlink_cycle_and_a_latest_alias_list_each_run_once(tmp_path, capsys):
    root = tmp_path / "runs"
    write(root / "exp" / "version_0", run_series(5.0))
    write(root / "exp" / "version_1", run_series(5.5))
    os.symlink("version_1", root / "exp" / "latest")  # Lightning users' alias
    os.symlink("..", root / "exp" / "version_0" / "up")  # a cycle: exp/version_0/up/version_0/up/...
    os.symlink(str(root), root / "exp" / "all_runs")  # and another, to the top
    assert main(["report", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r for s in data["sides"].values() for r in s["runs"]] == ["exp/version_0", "exp/version_1"]
    # a group whose patterns match one run twice (an alias, overlapping patterns) counts it once
    assert main(["report", "--group", f"a={root}/exp/version_*", f"a={root}/exp/latest", f"a={root}/exp/*",
                 f"b={root}/exp/version_0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sides"]["a"]["runs"] == ["version_0", "version_1"]
    assert any("is in two groups, 'a' and 'b': kept in 'a'" in n for n in data["notes"])


def test_damaged_alert_logs_and_event_files_get_one_line_each(tmp_path, capsys):
    root = tmp_path / "runs"
    write(root / "a", run_series(5.0))
    write(root / "b", {**run_series(5.5), "headwatch/alerts/entropy_floor": [(32, 1.0)]})
    lines = [b"\xff\xfe not UTF-8 \x00\x01", json.dumps({"step": "abc", "rule": "x"}).encode(),
             json.dumps({"step": 1e300, "rule": "x"}).encode(), json.dumps({"step": None, "rule": "kl_ceiling"}).encode(),
             json.dumps({"step": 32, "rule": "entropy_floor", "message": "kept"}).encode(), b"[1, 2", b"9" * 5000]
    (root / "b" / "headwatch_alerts.jsonl").write_bytes(b"\n".join(lines))
    (root / "a" / "headwatch_alerts.jsonl").mkdir()  # a directory named like the log: not read
    (event,) = (root / "a").glob("events.out.tfevents.*")
    data = event.read_bytes()
    write(root / "c", run_series(6.0))
    (cut,) = (root / "c").glob("events.out.tfevents.*")
    cut.write_bytes(cut.read_bytes()[:-7])  # a file cut short (a run still writing)
    (root / "a" / "events.out.tfevents.9.damaged").write_bytes(data[:60] + b"\x00" * 16 + data[76:])
    assert main(["report", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    notes = "\n".join(out["notes"])
    assert "events.out.tfevents.9.damaged: damaged (a CRC check failed) after" in notes
    assert "cut short (a run still writing, or a file cut off) after" in notes
    assert "headwatch_alerts.jsonl: 5 lines not an alert record" in notes
    alerts = next(r for r in out["headlines"] if r["key"] == "alerts_fired")
    assert alerts["values"]["b"] == {"b": 2.0}  # the kept record (step 32) and the step-less one
    assert main(["report", str(root)]) == 0  # the screen: one line a problem, then the answer
    text = capsys.readouterr().out
    assert text.count("\nNote: ") == 3 and "\nheadline " in text


def test_an_all_nan_group_is_reported(tmp_path, capsys):
    nan = float("nan")
    for g in ("a", "b"):
        for s in (1, 2):
            write(tmp_path / g / f"seed{s}", {E: [(0, nan), (10, nan)], "val_loss": [(0, nan), (10, nan)]})
    args = ["report", "--group", f"a={tmp_path}/a/*", f"b={tmp_path}/b/*"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Recorded by no run" in out and "nan" not in out
    assert main([*args, "--all"]) == 0
    assert "has no finite value" in capsys.readouterr().out


@pytest.mark.parametrize("damaged", [float("inf"), 1e300, 2.5, -3.0])
def test_a_damaged_published_vocab_size_is_left_out_and_the_report_goes_on(tmp_path, capsys, damaged):
    vocab = "headwatch/model/vocab_size"
    for side in ("tied", "untied"):
        write(tmp_path / side, {E: [(0, 5.0), (10, 4.0)], vocab: [(0, 512.0), (10, damaged)],
                                "headwatch/model/hidden_size": [(0, 32.0), (10, 32.0)]})
    assert main(["report", str(tmp_path / "tied"), str(tmp_path / "untied")]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "entropy" in out


def test_a_sweep_of_12_runs_gets_12_colours_and_12_headers(tmp_path, capsys):
    root = tmp_path / "sweep"
    names = [f"lr_0.00{i % 3}_wd_0.1_warmup_long_name_seed{i}" for i in range(12)]
    for i, n in enumerate(names):
        write(root / n / "version_0", run_series(5.0 + i / 16))
    page = tmp_path / "s.html"
    assert main(["report", str(root), "--all", "--html", str(page), "--charts", "none"]) == 0
    out = capsys.readouterr().out
    swatches = re.findall(r'class="swatch" style="background:(#[0-9a-f]{6})"', page.read_text(encoding="utf-8"))
    assert len(swatches) == 12 and len(set(swatches)) == 12
    header = next(line for line in out.splitlines() if line.startswith(" " * 10) and "│" in line)
    table_headers = []
    for line in out.splitlines():
        if "│" in line and line.split("│")[0].strip() == "" and "final" not in line:
            table_headers += [c.strip() for c in line.split("│")[1:]]
    assert len(table_headers) == 12 and len(set(table_headers)) == 12, table_headers
    assert header


# --------------------------------------------------------------------------- the property test

NAME = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1, max_size=24,
).filter(lambda n: n not in (".", "..") and len(n.encode("utf-8")) < 200)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(NAME, min_size=2, max_size=3, unique_by=lambda n: n.casefold()), message=st.text(max_size=40),
       tag=st.text(min_size=1, max_size=12).filter(lambda t: "\x00" not in t), junk=st.binary(max_size=200))
def test_any_names_and_files_give_a_printable_report_with_every_run_once(names, message, tag, junk):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        for i, name in enumerate(names):
            write(root / name, {**run_series(5.0 + i), f"headwatch/{tag}": [(0, 1.0)]})
        first = root / names[0]
        (first / "headwatch_alerts.jsonl").write_text(json.dumps({"step": 16, "rule": "entropy_floor", "message": message}) + "\n")
        (root / names[-1] / "headwatch_alerts.jsonl").write_bytes(junk)
        (root / names[-1] / "events.out.tfevents.0.junk").write_bytes(junk)
        page = Path(tmp) / "r.html"
        for extra in ([], ["--all"], ["--json"]):
            out_stream = _capture(["report", str(root), *extra, "--html", str(page), "--charts", "none"])
            status, out = out_stream
            assert status == 0
            assert_printable(out)
            if extra == ["--json"]:
                data = json.loads(out)
                listed = [r for s in data["sides"].values() for r in s["runs"]]
                assert sorted(listed) == sorted(names)  # every run, once
            text = page.read_text(encoding="utf-8")
            for name in names:
                assert html.escape(printable(name)) in text
            assert text.count('<li><span class="swatch"') == len(names)
        shutil.rmtree(root)


def _capture(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, buf.getvalue()
