"""``headwatch report --group``: groups of runs over seeds, checked against NumPy and scipy.stats.

The event files are written here with ``SummaryWriter``; every logged value is a dyadic rational
(exact in float32), so the values read back equal the hand formulas below.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
from scipy import stats as sps
from torch.utils.tensorboard import SummaryWriter

from headwatch import HeadwatchError
from headwatch.cli import main as cli_main
from headwatch.report import (
    GroupStats,
    compare_groups,
    first_crossing,
    format_number,
    group_stats,
    main,
    parse_group_specs,
    student_t_quantile,
    value_at,
    welch_interval,
)

ENTROPY = "headwatch/logits/entropy"
VAL_ENTROPY = "headwatch/val/logits/entropy"

# run -> (val_loss slope k per step, entropy level c, entropy slope m per step, last step)
# val_loss(s) = 6 - k s at steps 0, 100, ...; entropy(s) = c - m s at steps 0, 50, ...;
# val entropy(s) = 2 + val_loss(s) / 2: a function of the loss alone, the same in every run.
RUNS = {
    "tied": {
        "tied_0": (1 / 256, 5.0, 1 / 512, 400),
        "tied_1": (1 / 256, 5.25, 1 / 512, 400),
        "tied_2": (3 / 1024, 5.5, 1 / 1024, 400),
    },
    "untied": {
        "untied_0": (1 / 128, 4.5, 1 / 256, 400),
        "untied_1": (1 / 128, 4.75, 1 / 256, 300),
        "untied_2": (3 / 256, 4.25, 1 / 256, 400),
        "untied_3": (3 / 256, 4.0, 1 / 128, 400),
    },
}


def loss(k: float, s: float) -> float:
    return 6.0 - k * s


def write_run(path, k, c, m, last) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for s in range(0, last + 1, 50):
        writer.add_scalar(ENTROPY, c - m * s, global_step=s)
        if s % 100 == 0:
            writer.add_scalar("val_loss", loss(k, s), global_step=s)
            writer.add_scalar(VAL_ENTROPY, 2.0 + loss(k, s) / 2, global_step=s)
    writer.add_scalar("headwatch/alerts/entropy_floor", 1.0, global_step=last)  # markers are not compared
    writer.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups") / "runs"
    for runs in RUNS.values():
        for name, spec in runs.items():
            write_run(root / name / "version_0", *spec)
    return root


def group_args(root, *extra):
    return ["report", "--group", f"tied={root}/tied_*", f"untied={root}/untied_*", *extra]


def group_metrics(capsys) -> dict:
    """The grouped comparison of every metric: the ``metrics`` of ``--json --all``."""
    return json.loads(capsys.readouterr().out)["metrics"]


def expected(anchor) -> dict[str, dict[str, float]]:
    """Group -> run -> (entropy, val entropy) by the hand formulas, at ``anchor(run spec)`` (a step)."""
    out = {}
    for g, runs in RUNS.items():
        out[g] = {}
        for name, (k, c, m, last) in runs.items():
            s = anchor(k, last)
            if s is not None and 0 <= s <= last:
                out[g][f"{name}/version_0"] = (c - m * s, 2.0 + loss(k, s) / 2)
    return out


def check_group(got: dict, values: list[float]) -> None:
    x = np.asarray(values, dtype=np.float64)
    assert got["n"] == len(x)
    assert got["mean"] == pytest.approx(x.mean(), rel=1e-12, abs=1e-12)
    assert got["std"] == pytest.approx(x.std(ddof=1), rel=1e-9, abs=1e-12)
    assert (got["min"], got["max"]) == (pytest.approx(x.min(), rel=1e-12), pytest.approx(x.max(), rel=1e-12))


def check_diff(got: dict, tied: list[float], untied: list[float]) -> None:
    """Against scipy's Welch test (an independent t quantile and Welch-Satterthwaite df)."""
    res = sps.ttest_ind(untied, tied, equal_var=False)
    ci = res.confidence_interval(0.95)
    assert got["diff"] == pytest.approx(np.mean(untied) - np.mean(tied), rel=1e-12, abs=1e-12)
    assert got["df"] == pytest.approx(res.df, rel=1e-9)
    assert (got["low"], got["high"]) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    assert got["excludes_zero"] == (ci.low > 0 or ci.high < 0)


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("df", [1.0, 1.5, 2.0, 3.7, 5.0, 10.0, 29.5, 100.0, 1e4])
@pytest.mark.parametrize("p", [0.975, 0.995, 0.9, 0.025, 0.6])
def test_t_quantile_matches_scipy(p, df):
    assert student_t_quantile(p, df) == pytest.approx(sps.t.ppf(p, df), rel=1e-10)


def test_t_quantile_rejects_bad_input():
    with pytest.raises(HeadwatchError, match="`p` must be in"):
        student_t_quantile(1.0, 3)
    with pytest.raises(HeadwatchError, match="`df` must be positive"):
        student_t_quantile(0.975, 0)


def test_group_stats_and_welch_by_hand():
    a = group_stats({"r0": 1.0, "r1": 2.0, "r2": 4.0, "bad": float("nan")})
    assert (a.n, a.mean, a.min, a.max) == (3, 7 / 3, 1.0, 4.0)
    assert a.std == pytest.approx(np.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2), rel=1e-15)
    b = group_stats({"r0": 5.0, "r1": 6.0})
    d = welch_interval(a, b)
    res = sps.ttest_ind([5.0, 6.0], [1.0, 2.0, 4.0], equal_var=False)
    assert (d.low, d.high) == (pytest.approx(res.confidence_interval().low, rel=1e-10), pytest.approx(res.confidence_interval().high, rel=1e-10))
    one = group_stats({"r0": 3.0})
    assert one.std is None and welch_interval(a, one).low is None  # an interval needs 2 runs a group
    flat = welch_interval(group_stats({"a": 1.0, "b": 1.0}), group_stats({"a": 2.0, "b": 2.0}))
    assert (flat.low, flat.high, flat.excludes_zero) == (1.0, 1.0, True)  # no spread: a point
    assert welch_interval(GroupStats(0, None, None, None, None), b) is None


def test_matched_loss_interpolation_on_hand_built_curves():
    curve = [(0, 6.0), (100, 5.0), (200, 4.0), (300, 4.5), (400, 3.5)]
    assert first_crossing(curve, 4.25) == pytest.approx(175.0)  # the first crossing, not the one after 300
    assert first_crossing(curve, 5.0) == 100.0 and first_crossing(curve, 7.0) == 0.0
    assert first_crossing(curve, 3.0) is None
    assert first_crossing([(0, 6.0), (100, float("nan")), (200, 4.0)], 5.0) == pytest.approx(100.0)  # NaN skipped
    metric = [(0, 1.0), (100, 2.0), (200, 4.0)]
    assert value_at(metric, 175.0) == pytest.approx(3.5) and value_at(metric, 100) == 2.0
    assert value_at(metric, -1) is None and value_at(metric, 201) is None  # never extrapolated


def test_compare_groups_validates():
    runs = {"a": {ENTROPY: [(0, 1.0)]}}
    with pytest.raises(HeadwatchError, match="at least 2 groups"):
        compare_groups({"g": runs}, [ENTROPY])
    with pytest.raises(HeadwatchError, match="hold no run"):
        compare_groups({"g": runs, "h": {}}, [ENTROPY])
    with pytest.raises(HeadwatchError, match=r"in more than one group: \['a'\]"):
        compare_groups({"g": runs, "h": runs}, [ENTROPY])
    with pytest.raises(HeadwatchError, match="`level` must be in"):
        compare_groups({"g": runs, "h": {"b": {}}}, [ENTROPY], level=95)
    with pytest.raises(HeadwatchError, match="no run logged"):
        compare_groups({"g": runs, "h": {"b": {}}}, [ENTROPY], loss_tag="my_loss")


# --------------------------------------------------------------------------- the command


def test_groups_json_at_matched_step(root, capsys):
    assert main(group_args(root, "--json", "--all")) == 0
    data = group_metrics(capsys)
    assert data["groups"] == {g: [f"{n}/version_0" for n in runs] for g, runs in RUNS.items()}
    assert data["interval"]["method"] == "welch-t" and data["interval"]["level"] == 0.95 and data["reference"] == "tied"
    rows = {r["tag"]: r for r in data["at_step"]}
    assert set(rows) == {ENTROPY, VAL_ENTROPY, "val_loss"}  # alert markers are not compared
    assert rows[ENTROPY]["step"] == 300  # untied_1 stops at 300: the last common step
    ref = expected(lambda k, last: 300)
    for i, tag in enumerate((ENTROPY, VAL_ENTROPY)):
        tied = [v[i] for v in ref["tied"].values()]
        untied = [v[i] for v in ref["untied"].values()]
        check_group(rows[tag]["groups"]["tied"], tied)
        check_group(rows[tag]["groups"]["untied"], untied)
        check_diff(rows[tag]["diffs"]["untied"], tied, untied)
    assert rows[ENTROPY]["groups"]["tied"]["values"] == {k: v[0] for k, v in ref["tied"].items()}


def test_groups_at_step_option(root, capsys):
    assert main(group_args(root, "--json", "--all", "--at-step", "350")) == 0
    rows = {r["tag"]: r for r in group_metrics(capsys)["at_step"]}
    ref = expected(lambda k, last: 350)  # untied_1 (last step 300) is left out: n = 3
    assert rows[ENTROPY]["step"] == 350 and rows[ENTROPY]["groups"]["untied"]["n"] == 3
    tied, untied = [v[0] for v in ref["tied"].values()], [v[0] for v in ref["untied"].values()]
    check_group(rows[ENTROPY]["groups"]["untied"], untied)
    check_diff(rows[ENTROPY]["diffs"]["untied"], tied, untied)
    # val entropy at 350 is interpolated between the points at 300 and 400 of each run
    check_group(rows[VAL_ENTROPY]["groups"]["tied"], [v[1] for v in ref["tied"].values()])


@pytest.mark.parametrize("at_loss", [None, 5.0])
def test_groups_at_matched_loss(root, capsys, at_loss):
    extra = [] if at_loss is None else ["--at-loss", str(at_loss)]
    assert main(group_args(root, "--json", "--all", *extra)) == 0
    data = group_metrics(capsys)
    lowest = {n: loss(k, last) for runs in RUNS.values() for n, (k, _, _, last) in runs.items()}
    target = max(lowest.values()) if at_loss is None else at_loss  # the lowest loss every run reaches
    assert data["loss_tag"] == "val_loss" and data["loss_target"] == target
    crossing = lambda k, last: (6.0 - target) / k  # noqa: E731 - val_loss(s) = 6 - k s
    ref = expected(crossing)
    for g, runs in RUNS.items():
        for name, (k, _, _, last) in runs.items():
            assert data["loss_steps"][f"{name}/version_0"] == pytest.approx(crossing(k, last), rel=1e-12)
    rows = {r["tag"]: r for r in data["at_loss"]}
    tied, untied = [v[0] for v in ref["tied"].values()], [v[0] for v in ref["untied"].values()]
    check_group(rows[ENTROPY]["groups"]["tied"], tied)
    check_group(rows[ENTROPY]["groups"]["untied"], untied)
    check_diff(rows[ENTROPY]["diffs"]["untied"], tied, untied)
    # a metric that depends on the loss alone: equal at matched loss (no difference), while at the
    # matched step the faster-training untied runs look different
    same = rows[VAL_ENTROPY]
    assert same["groups"]["tied"]["mean"] == pytest.approx(2 + target / 2) == same["groups"]["untied"]["mean"]
    assert same["diffs"]["untied"]["excludes_zero"] is False
    at_step = {r["tag"]: r for r in data["at_step"]}[VAL_ENTROPY]
    assert at_step["diffs"]["untied"]["high"] < 0 and at_step["diffs"]["untied"]["excludes_zero"] is True


def test_groups_text(root, capsys):
    assert main(group_args(root, "--match", "entropy")) == 0
    out = capsys.readouterr().out
    assert "tied    3 runs" in out and "untied  4 runs" in out
    assert "Welch t-interval" in out and "sample standard deviation" in out and "n - 1" in out
    assert "At matched step: last common step" in out and "At matched loss: val_loss = 4.828" in out
    step_part, loss_part = out.split("At matched loss")
    val_rows = [line for line in step_part.splitlines() if line.startswith("val/logits/entropy")]
    assert len(val_rows) == 1 and val_rows[0].endswith("*")  # interval excludes 0 at the matched step
    val_rows = [line for line in loss_part.splitlines() if line.startswith("val/logits/entropy")]
    assert len(val_rows) == 1 and not val_rows[0].endswith("*")  # and not at matched loss
    assert "untied − tied" in out


def test_groups_html(root, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    page = tmp_path / "groups.html"
    assert main(group_args(root, "--json", "--match", ".", "--html", str(page))) == 0
    data = group_metrics(capsys)
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text and 'href="http' not in text
    assert text.count("<figure>") == text.count("<svg") == len(data["at_step"]) == 3
    assert "Welch t-interval" in text and "At matched loss: val_loss = 4.828" in text
    val = next(r for r in data["at_step"] if r["tag"] == VAL_ENTROPY)
    row = next(line for line in text.splitlines() if line.startswith('<tr><td class="tag">val/logits/entropy</td>'))
    assert format_number(val["groups"]["untied"]["mean"]) in row and row.endswith("<b>*</b></td></tr>")
    assert ">tied</text>" in text and ">untied</text>" in text  # one legend entry per group
    assert ">tied_0/version_0</text>" not in text


def test_groups_missing_loss_tag_is_a_note(root, capsys):
    assert main(group_args(root, "--json", "--match", "entropy")) == 0  # val_loss is still read for matching
    assert group_metrics(capsys)["loss_tag"] == "val_loss"
    assert main(group_args(root, "--loss-tag", "no_such_loss")) == 2
    assert "--loss-tag 'no_such_loss': no run logged this tag" in capsys.readouterr().err
    no_loss = compare_groups({"g": {"a": {ENTROPY: [(0, 1.0)]}}, "h": {"b": {ENTROPY: [(0, 2.0)]}}}, [ENTROPY])
    assert no_loss.loss_tag is None and no_loss.at_loss == [] and "no run logged 'val_loss'" in no_loss.notes[0]
    assert no_loss.at_step[0].diffs["h"].diff == 1.0 and no_loss.at_step[0].diffs["h"].low is None  # n = 1: no interval


def test_groups_glob_expanded_by_the_tool_and_names(root, capsys):
    # a group given as a list of directories (expanded by a shell) and one given as a pattern
    args = ["report", "--group", f"a={root}/tied_0", f"a={root}/tied_1", f"b={root}/untied_[01]", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s: v["runs"] for s, v in data["sides"].items()} == {
        "a": ["tied_0/version_0", "tied_1/version_0"], "b": ["untied_0/version_0", "untied_1/version_0"]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group", "tied"], "expects NAME=PATTERN"),
        (["--group", "=runs/x", "b=y"], "expects NAME=PATTERN"),
        (["--group", "tied=runs/x"], "at least 2 groups"),
        (["--group", "tied=a", "tied=b"], "at least 2 groups"),
        (["runs", "--group", "a=x", "b=y"], "not both"),
        (["runs", "--at-step", "5"], "only apply with --group"),
        (["runs", "--loss-tag", "loss"], "only apply with --group"),
        ([], "pass one or more LOGDIRs"),
        (["--group", "a=x", "b=y", "--at-step", "-1"], "--at-step must be"),
        (["--group", "a=x", "b=y", "--at-loss", "nan"], "--at-loss must be a finite"),
        (["--group", "a=x", "b=y", "--at-step", "ten"], "invalid int value"),
    ],
)
def test_group_parse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_group_specs():
    assert parse_group_specs(["t=a*", "u=b", "t=c"]) == {"t": ["a*", "c"], "u": ["b"]}
    with pytest.raises(HeadwatchError, match=r"expects NAME=PATTERN .* got 'x'"):
        parse_group_specs(["x", "y=z"])


def test_group_problems_are_one_line_each_and_the_rest_is_reported(root, tmp_path, capsys):
    # a pattern that matches nothing: the group is empty, said once; the other group is still reported
    assert main(["report", "--group", f"a={tmp_path}/nothing_*", f"b={root}/untied_*"]) == 0
    out = capsys.readouterr().out
    assert "matches no file or directory" in out and "group 'a' has no run: left out" in out
    assert "b alone, nothing to compare it with" in out
    # a run in two groups stays in the first
    assert main(["report", "--group", f"a={root}/tied_*", f"b={root}/*_0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("is in two groups, 'a' and 'b': kept in 'a'" in n for n in data["notes"])
    assert data["sides"]["b"]["runs"] == ["untied_0/version_0"]
    assert main(["report", "--group", f"a={tmp_path}/x_*", f"b={tmp_path}/y_*"]) == 2  # nothing at all
    assert "no run to report" in capsys.readouterr().err


# --------------------------------------------------------------------------- the dispatcher


def test_cli_dispatches_report(root, capsys):
    assert cli_main(group_args(root, "--json", "--match", "^val_loss$")) == 0
    assert group_metrics(capsys)["at_step"][0]["tag"] == "val_loss"


def test_cli_cost_is_imported_lazily(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("headwatch.remedies.cost")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "headwatch.remedies.cost", fake)
    assert cli_main(["cost", "--model", "x"]) == 7 and seen == [["--model", "x"]]
    monkeypatch.setitem(sys.modules, "headwatch.remedies.cost", None)  # as if the module were missing
    assert cli_main(["cost"]) == 2
    assert "no `headwatch.remedies.cost` module" in capsys.readouterr().err


def test_cli_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "report" in out and "cost" in out
    for argv, message in (([], "required: COMMAND"), (["nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_import_is_cheap():
    code = (
        "import sys, headwatch.cli, headwatch.report; "
        "print(','.join(m for m in ('tensorboard', 'matplotlib', 'scipy', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing headwatch.report loaded {out}"
