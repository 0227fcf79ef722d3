"""``headwatch report`` reading and statistics, on what other tests leave out.

Event files are written here with ``SummaryWriter`` (and, for the TensorFlow 2 layout, raw
``Summary`` protos with a rank-0 tensor); expected points are the values written, rounded to
float32 as TensorBoard stores them. Statistics are checked against ``scipy`` (``special.betainc``,
``stats.ttest_ind``), ``numpy.polyfit`` and hand-worked interpolation.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import special, stats
from torch.utils.tensorboard import SummaryWriter

from headwatch import HeadwatchError
from headwatch.report import (
    collect_alerts,
    compare_groups,
    discover_groups,
    discover_runs,
    expand_patterns,
    first_crossing,
    group_stats,
    student_t_quantile,
    least_squares_slope,
    read_alerts_jsonl,
    read_scalars,
    summarize,
    value_at,
    welch_interval,
)
from headwatch.report.compare import betainc, common_loss_target

E = "headwatch/logits/entropy"


def write(path, points: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for tag, pts in points.items():
        for step, value in pts:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


# --------------------------------------------------------------------------- reading event files


def test_a_resumed_run_reads_the_later_file_from_the_restart_step(tmp_path):
    write(tmp_path, {E: [(s, float(s)) for s in range(5)]})  # the first run: steps 0..4
    write(tmp_path, {E: [(s, 10.0 + s) for s in range(3, 6)]})  # resumed from step 3 into a second file
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert read_scalars(tmp_path) == {E: [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]}


def test_event_files_are_read_in_the_order_they_were_written(tmp_path):
    """A writer's tenth file (``.10``) comes after its ninth (``.9``): numbers in the name by value."""
    names = []
    for k, value in enumerate((1.0, 2.0)):
        write(tmp_path / "tmp", {E: [(5, value)]})
        (made,) = (tmp_path / "tmp").glob("events.out.tfevents.*")
        stem = names[0].rsplit(".", 1)[0] if names else made.name.rsplit(".", 1)[0]  # one writer process
        names.append(f"{stem}.{(9, 10)[k]}")
        made.rename(tmp_path / names[-1])
    assert sorted(names)[0].endswith(".10")  # as text, the tenth sorts first
    assert read_scalars(tmp_path) == {E: [(5, 2.0)]}  # the tenth, written last, wins


def tensor_summary(tag: str, array, plugin: str):
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.util import tensor_util

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin))
    proto = tensor_util.make_tensor_proto(np.asarray(array, dtype=np.float32))
    return Summary(value=[Summary.Value(tag=tag, tensor=proto, metadata=metadata)])


def test_scalars_stored_as_rank_0_tensors_are_read(tmp_path):
    """The TensorFlow 2 writers store a scalar as a rank-0 tensor with the scalars plugin's metadata."""
    writer = SummaryWriter(log_dir=str(tmp_path))
    file_writer = writer._get_file_writer()
    for step, value in ((0, 1.5), (1, 1.25), (2, 0.75)):
        file_writer.add_summary(tensor_summary("tf2/loss", value, "scalars"), step)
        file_writer.add_summary(tensor_summary("tf2/not_a_scalar", [value, value], "scalars"), step)  # 2 values
        file_writer.add_summary(tensor_summary("tf2/other_plugin", value, "histograms"), step)
    writer.add_scalar("classic", 2.0, global_step=0)
    writer.close()
    # only the rank-0 tensors of the scalars plugin; a tag with no usable point is left out
    assert read_scalars(tmp_path) == {"tf2/loss": [(0, 1.5), (1, 1.25), (2, 0.75)], "classic": [(0, 2.0)]}


def test_values_read_back_are_the_float32_values_written(tmp_path):
    values = [0.1, 1 / 3, 1e-8, -2.5e7, math.pi]
    write(tmp_path, {"x": list(enumerate(values))})
    got = read_scalars(tmp_path)["x"]
    assert got == [(i, float(np.float32(v))) for i, v in enumerate(values)]


# --------------------------------------------------------------------------- naming runs


@pytest.fixture
def two_roots(tmp_path):
    for root in ("alpha", "beta"):
        write(tmp_path / root / "seed" / "version_0", {E: [(0, 1.0)]})
    write(tmp_path / "alpha" / "only_here", {E: [(0, 1.0)]})
    write(tmp_path / "x" / "runs" / "seed", {E: [(0, 1.0)]})
    write(tmp_path / "y" / "runs" / "seed", {E: [(0, 1.0)]})
    return tmp_path


def test_names_two_logdirs_share_get_the_logdir_name(two_roots):
    runs = discover_runs([two_roots / "alpha", two_roots / "beta"])
    # sorted within each LOGDIR, in the order of the LOGDIRs; the shared relative name is prefixed
    assert list(runs) == ["only_here", "alpha/seed/version_0", "beta/seed/version_0"]
    assert runs["beta/seed/version_0"].path == two_roots / "beta" / "seed" / "version_0"
    assert runs["beta/seed/version_0"].root == two_roots / "beta"


def test_logdirs_with_the_same_name_get_the_path_components_that_tell_them_apart(two_roots):
    runs = discover_runs([two_roots / "x" / "runs", two_roots / "y" / "runs"])
    assert list(runs) == ["x/runs/seed", "y/runs/seed"]
    assert [r.path.parent.parent.name for r in runs.values()] == ["x", "y"]
    # the same LOGDIR twice: one run, listed once
    assert list(discover_runs([two_roots / "x" / "runs", two_roots / "x" / "runs"])) == ["seed"]


def test_an_event_file_names_its_directory(two_roots):
    (event,) = (two_roots / "alpha" / "only_here").glob("events.out.tfevents.*")
    assert list(discover_runs([event])) == ["only_here"]
    (two_roots / "notes.txt").write_text("x")
    with pytest.raises(HeadwatchError, match=r"is a file but not a TensorBoard event file \(events.out.tfevents.\*\)"):
        discover_runs([two_roots / "notes.txt"])
    with pytest.raises(HeadwatchError, match="no LOGDIR given"):
        discover_runs([])


def test_patterns_are_expanded_by_the_tool(two_roots):
    assert expand_patterns([str(two_roots / "*" / "seed")]) == [str(two_roots / "alpha" / "seed"), str(two_roots / "beta" / "seed")]
    # ** is recursive; a path without glob characters is kept as given, even a missing one
    deep = expand_patterns([str(two_roots / "**" / "version_0"), str(two_roots / "missing")])
    assert deep == [str(two_roots / "alpha" / "seed" / "version_0"), str(two_roots / "beta" / "seed" / "version_0"),
                    str(two_roots / "missing")]
    with pytest.raises(HeadwatchError, match=r"the pattern '.*nothing_\*' matches no file or directory"):
        expand_patterns([str(two_roots / "nothing_*")])


def test_groups_tell_apart_a_run_name_they_share(two_roots):
    groups = discover_groups({"a": [str(two_roots / "alpha" / "seed")], "b": [str(two_roots / "beta" / "seed")],
                              "c": [str(two_roots / "alpha" / "only_here")]})
    # "version_0" in a and in b: prefixed with the group; "only_here" is unique: kept
    assert {g: list(r) for g, r in groups.items()} == {"a": ["a/version_0"], "b": ["b/version_0"], "c": ["only_here"]}
    with pytest.raises(HeadwatchError, match="is in two groups, 'a' and 'b'"):
        discover_groups({"a": [str(two_roots / "alpha")], "b": [str(two_roots / "alpha" / "seed")]})


# --------------------------------------------------------------------------- alert logs


def test_alert_log_keeps_only_objects_with_a_rule(tmp_path):
    path = tmp_path / "headwatch_alerts.jsonl"
    lines = [
        json.dumps({"step": 1, "rule": "kl_ceiling", "severity": "warning", "message": "a"}),
        "",
        "[1, 2, 3]",  # JSON, not an object
        json.dumps({"step": 2, "message": "no rule"}),
        "{not json",
        json.dumps({"step": 3, "rule": "entropy_floor", "message": "b"}),  # no severity: a 0.1 record, critical
    ]
    path.write_text("\n".join(lines) + "\n")
    records = read_alerts_jsonl(path)
    assert [r["step"] for r in records] == [1, 3]
    scalars = {"headwatch/alerts/kl_ceiling_warning": [(1, 1.0), (2, 0.0)], "headwatch/alerts/entropy_floor": [(3, 1.0)],
               "headwatch/logits/entropy": [(1, 1.0)]}
    merged = collect_alerts(scalars, records)
    # the marker value 0 at step 2 is not an alert; a non-alert tag with value 1 is not a marker
    assert [(a.step, a.rule, a.source, a.message) for a in merged] == [
        (1, "kl_ceiling_warning", "jsonl+tensorboard", "a"), (3, "entropy_floor", "jsonl+tensorboard", "b"),
    ]  # fmt: skip
    custom = collect_alerts({"run7/alerts/x": [(5, 1.0)], E: [(5, 1.0)]}, prefix="run7")
    assert [(a.step, a.rule, a.source) for a in custom] == [(5, "x", "tensorboard")]


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(("a", "b"), [(0.5, 0.5), (1.0, 3.0), (2.5, 0.5), (15.0, 0.5), (50.0, 50.0), (0.25, 7.0)])
def test_betainc_matches_scipy(a, b):
    for x in (0.0, 1e-12, 0.01, 0.2, 0.5, 0.77, 0.999, 1.0):
        assert betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("seed", range(6))
def test_welch_interval_matches_scipy_at_several_levels(seed):
    rng = np.random.default_rng(seed)
    ref = rng.normal(1.0, rng.uniform(0.1, 2.0), size=rng.integers(2, 8))
    other = rng.normal(1.5, rng.uniform(0.1, 2.0), size=rng.integers(2, 8))
    for level in (0.5, 0.9, 0.99):
        d = welch_interval(group_stats(dict(enumerate(ref))), group_stats(dict(enumerate(other))), level)
        res = stats.ttest_ind(other, ref, equal_var=False)
        ci = res.confidence_interval(level)
        assert d.diff == pytest.approx(other.mean() - ref.mean(), rel=1e-12)
        assert d.df == pytest.approx(res.df, rel=1e-10)
        assert (d.low, d.high) == (pytest.approx(ci.low, rel=1e-8), pytest.approx(ci.high, rel=1e-8))
        assert d.level == level and d.excludes_zero == (ci.low > 0 or ci.high < 0)


def test_t_quantile_at_the_median_and_far_in_the_tails():
    assert student_t_quantile(0.5, 3.0) == 0.0
    for p, df in ((0.001, 0.7), (0.2, 4.0), (0.999999, 2.5), (1e-8, 30.0)):  # df < 1, p near 0 and 1
        assert student_t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)


def test_welch_interval_degenerate_cases():
    one = group_stats({"a": 2.0})
    two = group_stats({"a": 1.0, "b": 3.0})
    d = welch_interval(one, two)
    assert (d.diff, d.low, d.high, d.df, d.excludes_zero) == (0.0, None, None, None, False)  # needs 2 runs each
    flat, flat_higher = group_stats({"a": 1.0, "b": 1.0}), group_stats({"c": 1.5, "d": 1.5})
    point = welch_interval(flat, flat_higher)  # no spread at all: the point [diff, diff]
    assert (point.diff, point.low, point.high, point.df, point.excludes_zero) == (0.5, 0.5, 0.5, None, True)
    same = welch_interval(flat, group_stats({"c": 1.0, "d": 1.0}))
    assert (same.low, same.high, same.excludes_zero) == (0.0, 0.0, False)
    assert welch_interval(group_stats({}), two) is None


def test_group_stats_leaves_out_non_finite_values():
    s = group_stats({"a": 1.0, "b": float("nan"), "c": 4.0, "d": float("inf"), "e": None, "f": 7.0})
    assert (s.n, s.mean, s.min, s.max) == (3, 4.0, 1.0, 7.0)
    assert s.std == pytest.approx(np.std([1.0, 4.0, 7.0], ddof=1)) and s.values == {"a": 1.0, "c": 4.0, "f": 7.0}
    assert group_stats({"a": float("nan")}) == group_stats({})


def test_value_at_interpolates_and_never_extrapolates():
    pts = [(0, 10.0), (100, 6.0), (300, 2.0), (400, float("nan"))]
    assert value_at(pts, 0) == 10.0 and value_at(pts, 100) == 6.0
    assert value_at(pts, 25) == 9.0  # 10 + (6 - 10) * 25 / 100
    assert value_at(pts, 250) == 3.0  # 6 + (2 - 6) * 150 / 200
    assert value_at(pts, -1) is None and value_at(pts, 401) is None and value_at([], 0) is None
    assert value_at(pts, 400) is None and value_at(pts, 350) is None  # NaN at an end: no value


def test_first_crossing_by_hand():
    pts = [(0, 5.0), (10, float("nan")), (20, 4.0), (40, 2.0), (60, 1.0), (80, 3.0)]
    assert first_crossing(pts, 5.0) == 0.0  # the first point already reaches it
    assert first_crossing(pts, 4.5) == 10.0  # NaN left out: between (0, 5) and (20, 4): 0 + 0.5 / 1 * 20
    assert first_crossing(pts, 3.0) == 30.0  # between (20, 4) and (40, 2), not the later 3.0 at 80
    assert first_crossing(pts, 0.5) is None
    assert common_loss_target({"a": pts, "b": [(0, 4.0), (5, 1.5)], "c": [(0, float("nan"))]}) == 1.5  # max of lows


def test_least_squares_slope_against_polyfit():
    rng = np.random.default_rng(0)
    x, y = np.cumsum(rng.integers(1, 9, 40)).astype(float), rng.normal(size=40)
    assert least_squares_slope(list(zip(x, y))) == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-10)
    assert least_squares_slope([(5.0, 1.0), (5.0, 3.0)]) is None  # all steps equal: no slope
    assert least_squares_slope([(5.0, 1.0)]) is None


def test_summary_of_a_series_ending_in_nan():
    pts = [(s, float(s)) for s in range(0, 90, 10)] + [(90, float("nan"))]
    s = summarize(pts)
    # last 10%: 1 point, the NaN: no mean; trend over the last 5 points, 4 finite: slope 1 per step
    assert math.isnan(s.final) and s.final_step == 90 and s.last10_mean is None
    assert s.trend_per_1k == pytest.approx(1000.0) and s.trend == "up"
    assert s.to_dict() == {"final": None, "last10_mean": None, "trend_per_1k": pytest.approx(1000.0), "trend": "up",
                           "steps": 10, "first_step": 0, "last_step": 90}


# --------------------------------------------------------------------------- grouped comparison


def curves(loss_points, entropy_points):
    return {"val_loss": loss_points, E: entropy_points}


def test_matched_loss_notes_runs_without_the_curve_and_runs_that_never_reach_it():
    groups = {
        "a": {"a1": curves([(0, 4.0), (100, 2.0)], [(0, 5.0), (100, 3.0)]),
              "a2": curves([(0, 4.0), (100, 3.0)], [(0, 6.0), (100, 4.0)])},
        "b": {"b1": {E: [(0, 1.0), (100, 1.0)]},  # no val_loss at all
              "b2": curves([(0, 4.0), (200, 2.0)], [(0, 5.0), (200, 1.0)])},
    }
    c = compare_groups(groups, [E], at_loss=2.5)
    # a1 reaches 2.5 at step 75 (4 -> 2 over 100), a2 never (its lowest is 3), b2 at 150 (4 -> 2 over 200)
    assert c.loss_steps == {"a1": 75.0, "a2": None, "b2": 150.0}
    assert c.notes == ["runs without 'val_loss', left out at matched loss: b1",
                       "runs whose 'val_loss' never reaches 2.5, left out at matched loss: a2"]
    (row,) = c.at_loss
    # entropy of a1 at step 75: 5 - 2 * 0.75 = 3.5; of b2 at 150: 5 - 4 * 0.75 = 2
    assert row.groups["a"].values == {"a1": 3.5} and row.groups["b"].values == {"b2": 2.0}
    assert row.diffs["b"].diff == -1.5 and row.diffs["b"].low is None
    # at matched step: the last common step of the entropy is 100 (a1, a2, b1 end there)
    (at_step,) = c.at_step
    assert at_step.step == 100 and at_step.groups["b"].values == {"b1": 1.0, "b2": 3.0}  # b2: 5 - 4 * 0.5


def test_an_explicit_step_outside_a_run_leaves_that_run_out():
    groups = {"a": {"a1": {E: [(0, 1.0), (50, 2.0)]}, "a2": {E: [(0, 1.0), (200, 3.0)]}},
              "b": {"b1": {E: [(0, 0.0), (200, 4.0)]}}}
    c = compare_groups(groups, [E], at_step=100)
    (row,) = c.at_step
    assert row.step == 100 and row.groups["a"].values == {"a2": 2.0} and row.groups["b"].values == {"b1": 2.0}
    assert c.step_rule == "step 100" and c.loss_tag is None
    assert c.notes == ["no run logged 'val_loss' or 'eval/loss': no comparison at matched loss (pass --loss-tag)"]
    with pytest.raises(HeadwatchError, match="--loss-tag 'my_loss': no run logged this tag"):
        compare_groups(groups, [E], loss_tag="my_loss")


def test_comparison_json_is_strict_and_names_the_method():
    groups = {"a": {"a1": {E: [(0, 1.0)]}}, "b": {"b1": {E: [(0, 2.0)]}, "b2": {"x": [(0, 1.0)]}}}
    data = json.loads(json.dumps(compare_groups(groups, [E, "missing"]).to_dict(), allow_nan=False))
    assert data["reference"] == "a" and data["interval"]["method"] == "welch-t" and data["interval"]["level"] == 0.95
    assert data["at_step"][0]["groups"]["b"]["n"] == 1 and data["at_step"][1]["diffs"] == {"b": None}
    assert data["at_step"][1]["step"] is None  # no run logged "missing": no common step
