"""The first screen of ``headwatch report``: headline questions, differences, intervals and verdicts.

Runs are event files written here with ``SummaryWriter`` (every value a dyadic rational, exact in
float32) and ``hparams.yaml`` files as Lightning writes them; every expected number comes from
``scipy.stats`` (``ttest_rel``, ``ttest_ind(equal_var=False)``) and Holm's rule written out here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from torch.utils.tensorboard import SummaryWriter

from headwatch import names
from headwatch.report import HEADLINES, RunData, main, verdicts
from headwatch.report.headlines import direction, headline_table

P = "headwatch/"
VAL, RARE, ECE, COLL = P + "val/logits/target_nll", P + "val/logits/rare/target_nll", P + "val/logits/ece", P + "collision/rare_rate_head"
ENT, CONFLICT, TIED = P + "val/logits/entropy", P + "grad/tied_flow_conflict_fraction", P + "grad/tied"

# seed -> final values; the untied runs are 0.5-0.625 nats better on validation loss at every seed
FINAL = {
    "tied": {0: dict(val=6.0, rare=8.5, ece=0.0625, coll=0.25, ent=6.0, alerts=1),
             1: dict(val=6.25, rare=8.25, ece=0.03125, coll=0.125, ent=6.125, alerts=0),
             2: dict(val=5.75, rare=8.75, ece=0.046875, coll=0.1875, ent=5.875, alerts=2)},
    "untied": {0: dict(val=5.5, rare=8.625, ece=0.0625, coll=0.0625, ent=5.75, alerts=0),
               1: dict(val=5.625, rare=8.0, ece=0.0390625, coll=0.25, ent=6.0, alerts=0),
               2: dict(val=5.1875, rare=8.5, ece=0.0546875, coll=0.125, ent=5.625, alerts=0)},
}  # fmt: skip
STEPS = (0, 50, 100)


def write_run(path: Path, v: dict, tied: bool, seed_in_hparams: int | None = None, vocab: int = 2048) -> None:
    writer = SummaryWriter(log_dir=str(path))
    for step in STEPS:
        late = step / STEPS[-1]  # every value moves to its final one over the run
        writer.add_scalar(VAL, 7.5 + (v["val"] - 7.5) * late, step)
        writer.add_scalar(RARE, 9.0 + (v["rare"] - 9.0) * late, step)
        writer.add_scalar(ECE, v["ece"] * late, step)
        writer.add_scalar(ENT, 7.5 + (v["ent"] - 7.5) * late, step)
        writer.add_scalar(P + "logits/padded_mass", 0.0, step)  # a constant counter: never a headline
        if step:
            writer.add_scalar(COLL, v["coll"] * late, step)
    for step in range(10, 101, 10):
        writer.add_scalar(TIED, 1.0 if tied else 0.0, step)
        if tied:
            writer.add_scalar(CONFLICT, 0.5, step)
    for k in range(v["alerts"]):
        writer.add_scalar(P + "alerts/entropy_floor", 1.0, 20 * (k + 1))
    writer.close()
    lines = ["config:", "  d_model: 64", f"  tie_weights: {'true' if tied else 'false'}", f"  vocab_size: {vocab}"]
    if seed_in_hparams is not None:
        lines.append(f"seed: {seed_in_hparams}")
    (path / "hparams.yaml").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("answer") / "runs"
    for side, seeds in FINAL.items():
        for seed, v in seeds.items():
            write_run(root / side / f"seed{seed}" / "version_0", v, side == "tied")
    return root


def values(side: str, key: str) -> list[float]:
    return [float(FINAL[side][s][key]) for s in sorted(FINAL[side])]


def holm_reference(p: list[float]) -> list[float]:
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * np.asarray(p)[order]))
    out = np.empty(m)
    out[order] = adjusted
    return list(out)


def report(args: list[str], capsys) -> tuple[int, str]:
    status = main(["report", *args])
    return status, capsys.readouterr().out


# --------------------------------------------------------------------------- the declarations


def test_every_headline_takes_its_direction_from_the_metric_declaration():
    for h in HEADLINES:
        metric = names.declaration(P + h.declared)
        assert metric is not None, h.key
        assert direction(h) == metric.better and metric.better in ("lower", "higher", None)
    better = {h.key: direction(h) for h in HEADLINES}
    assert better["validation_loss"] == better["rare_token_nll"] == better["calibration_ece"] == "lower"
    assert better["collision"] == better["alerts_fired"] == "lower"
    assert better["final_entropy"] is better["tied_flow_conflict"] is better["untying_cost"] is None


# --------------------------------------------------------------------------- two groups paired by seed


def test_paired_verdicts_match_scipy_and_holm(runs, capsys):
    status, out = report([str(runs), "--json"], capsys)
    assert status == 0
    data = json.loads(out)
    assert data["schema"] == 1 and data["reference"] == "tied" and list(data["sides"]) == ["tied", "untied"]
    assert data["sides"]["tied"]["seeds"] == [0, 1, 2] and data["pairing"]["untied"]["paired"] is True
    assert any("grouped by their paths" in n for n in data["notes"])
    rows = {r["key"]: r for r in data["headlines"]}
    family = ["validation_loss", "rare_token_nll", "calibration_ece", "collision", "alerts_fired"]
    keys = {"validation_loss": "val", "rare_token_nll": "rare", "calibration_ece": "ece", "collision": "coll", "alerts_fired": "alerts"}
    p = [stats.ttest_rel(values("untied", keys[k]), values("tied", keys[k])).pvalue for k in family]
    q = holm_reference(p)
    assert data["family"] == {"rule": "holm", "size": 5, "level": 0.99}
    for k, pk, qk in zip(family, p, q):
        c = rows[k]["comparisons"]["untied"]
        t, u = values("tied", keys[k]), values("untied", keys[k])
        assert c["method"] == "paired-t" and c["n"] == [3, 3]
        assert c["difference"] == pytest.approx(np.mean(u) - np.mean(t), abs=1e-12)
        assert c["p"] == pytest.approx(pk, rel=1e-9) and c["p_adjusted"] == pytest.approx(qk, rel=1e-9)
        ci = stats.ttest_rel(u, t).confidence_interval(0.99)
        assert (c["interval"]["low"], c["interval"]["high"]) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
        assert c["detectable"] == pytest.approx((ci.high - ci.low) / 2, rel=1e-9)
        expected = "no difference at this evidence" if qk >= 0.05 else ("better" if c["difference"] < 0 else "worse")
        assert c["verdict"] == expected, k
    assert rows["validation_loss"]["comparisons"]["untied"]["verdict"] == "better"  # 0.5-0.625 nats at every seed
    assert rows["rare_token_nll"]["comparisons"]["untied"]["verdict"] == "no difference at this evidence"
    # no preferred direction: the difference and a 95% interval, no verdict word
    ent = rows["final_entropy"]["comparisons"]["untied"]
    assert ent["verdict"] is None and ent["why"] == "no preferred direction" and ent["interval"]["level"] == 0.95
    assert ent["p_adjusted"] is None
    # the collision headline is read at the end-of-training probe every run has
    assert rows["collision"]["anchor"] == {"rule": "the end-of-training probe", "step": 100}
    assert rows["tied_flow_conflict"]["comparisons"]["untied"]["why"] == "not recorded by untied"
    cost = rows["untying_cost"]["comparisons"]["untied"]["cost"]
    assert cost["parameters"] == 2048 * 64 and cost["bytes"]["weights_fp32"] == 4 * 2048 * 64
    assert cost["bytes"]["training_fp32_adamw"] == 16 * 2048 * 64 and cost["tied"] == {"tied": True, "untied": False}


def test_the_default_screen_answers_in_at_most_40_lines(runs, capsys):
    status, out = report([str(runs)], capsys)
    lines = out.splitlines()
    assert status == 0 and len(lines) <= 40, out
    assert max(len(line) for line in lines) <= 160
    assert lines[0] == "headwatch report: untied against tied; 3 runs a side, paired by seed (0, 1, 2)"
    row = next(line for line in lines if line.startswith("validation loss, nats"))
    assert row.split()[3:6] == ["6", "5.438", "-0.5625"] and row.endswith("better")  # means 6, 5.4375
    rare = next(line for line in lines if line.startswith("rare-token NLL (val), nats"))
    assert "no difference at this evidence (could show ±" in rare
    assert "+131,072 parameters (2,048 x 64)" in out and "Holm's step-down over the 5 comparisons" in out
    assert "With 3 runs a side only a large gap can clear a family-wise rule" in out
    # constant and NaN rows never appear: a counter, the per-bucket names, nothing that reads "nan"
    assert "padded_mass" not in out and "nan" not in out.lower().replace("nanc", "")
    assert "top1" not in out and "capture/" not in out


def test_help_matches_the_screen(runs, capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = capsys.readouterr().out
    help_rows = {}
    for question, unit, better in headline_table():
        label = question + (", " + unit if unit and unit != "parameters" else "")
        line = next(line for line in text.splitlines() if line.strip().startswith(label + " "))
        help_rows[question] = line
        words = {"lower": "lower is better", "higher": "higher is better", None: "no preferred direction"}[better]
        assert words in line, line
    _, out = report([str(runs)], capsys)
    header = next(line for line in out.splitlines() if line.startswith("headline "))
    for column in ("headline", "verdict", "interval]"):
        assert column in header and column in text
    table = out.split(header, 1)[1].split("\n\n", 1)[0].splitlines()
    for line in table:  # every row of the table is one of the headlines --help lists
        if line.startswith(("The same", "Recorded by", "Values at")):  # the prose after the table
            break
        if not line or line.startswith(" "):
            continue
        assert any(line.startswith(q) for q in help_rows), line
    for word in ("better", "worse", "no difference at this evidence", "could show", "paired", "Welch", "Holm", "--all"):
        assert word in text


def test_html_opens_with_the_same_verdicts(runs, tmp_path, capsys):
    page = tmp_path / "r.html"
    status, out = report([str(runs), "--json", "--html", str(page), "--charts", "none"], capsys)
    data = json.loads(out)
    text = page.read_text(encoding="utf-8")
    answer = text.index('<section class="answer">')
    assert answer < text.index("<h2>Runs</h2>") and text.index("<h1>") < answer
    section = text[answer : text.index("</section>")]
    for row in data["headlines"]:
        verdict = row["comparisons"]["untied"].get("verdict")
        if verdict:
            assert f"<td>{verdict}" in section, row["key"]
    assert "better</td>" in section


# --------------------------------------------------------------------------- Welch, one run a side, more sides


def test_different_seeds_are_compared_by_welch_and_say_so(runs, capsys):
    # tied seeds 0, 1, 2 against untied seeds 1, 2: not the same seeds, so not paired
    status, out = report(["--group", f"t={runs}/tied/seed*", f"u={runs}/untied/seed[12]", "--json"], capsys)
    data = json.loads(out)
    assert data["pairing"]["u"] == {"paired": False, "why": "the sides have different seeds"}
    c = next(r for r in data["headlines"] if r["key"] == "validation_loss")["comparisons"]["u"]
    res = stats.ttest_ind(values("untied", "val")[1:], values("tied", "val"), equal_var=False)
    assert c["method"] == "welch-t" and c["p"] == pytest.approx(res.pvalue, rel=1e-9) and c["df"] == pytest.approx(res.df)
    status, out = report(["--group", f"t={runs}/tied/seed*", f"u={runs}/untied/seed[12]"], capsys)
    assert "Welch, not paired: the sides have different seeds" in out.splitlines()[0]
    assert "Welch's t (unequal variances)" in out


def test_one_run_a_side_says_it_cannot_separate_setting_from_seed(runs, capsys):
    status, out = report([str(runs / "tied" / "seed0"), str(runs / "untied" / "seed0")], capsys)
    lines = out.splitlines()
    assert status == 0 and len(lines) <= 40
    assert lines[0] == "headwatch report: 2 runs, one a side; reference tied/seed0/version_0"
    assert "One run a side cannot separate the setting from the seed: no verdict without seeds." in out
    assert "python examples/train_tiny_lm.py --seed $s --no-tie-weights --run-name untied/seed$s" in out
    assert "better" not in out and "no difference at this evidence" not in out
    row = next(line for line in lines if line.startswith("validation loss, nats"))
    assert row.split()[-1] == "-0.5000"  # 5.5 - 6.0, the difference and nothing more


def test_three_sides_one_column_each(runs, tmp_path, capsys):
    for seed, v in FINAL["untied"].items():  # a third setting: 1 nat worse than untied everywhere
        write_run(tmp_path / "proj" / f"seed{seed}", {**v, "val": v["val"] + 1.0}, True)
    status, out = report(["--group", f"tied={runs}/tied/seed*", f"untied={runs}/untied/seed*", f"proj={tmp_path}/proj/*"], capsys)
    header = next(line for line in out.splitlines() if line.startswith("headline "))
    assert re.search(r"untied − tied +proj − tied", header)
    row = next(line for line in out.splitlines() if line.startswith("validation loss"))
    assert "better" in row and "no diff" in row  # untied better; proj +0.44 nats: not called at 3 seeds
    data = json.loads(report(["--group", f"tied={runs}/tied/seed*", f"untied={runs}/untied/seed*",
                              f"proj={tmp_path}/proj/*", "--json"], capsys)[1])
    assert data["family"]["size"] == 10  # 5 headlines with a direction, 2 sides against the reference


def test_verdicts_is_a_pure_function_of_the_runs():
    def run(seed, val):
        return RunData({VAL: [(0, 7.0), (100, val)]}, seed=seed)

    data = verdicts({"a": {"a0": run(0, 6.0), "a1": run(1, 6.5)}, "b": {"b0": run(0, 5.0), "b1": run(1, 5.75)}})
    c = next(r for r in data["headlines"] if r["key"] == "validation_loss")["comparisons"]["b"]
    assert c["method"] == "paired-t" and c["difference"] == pytest.approx(-0.875)
    assert c["p"] == pytest.approx(stats.ttest_rel([5.0, 5.75], [6.0, 6.5]).pvalue, rel=1e-9)
    assert json.loads(json.dumps(data, allow_nan=False)) == data  # plain JSON, nothing else
    # the headlines these runs recorded with a direction: validation loss, and alerts (no marker: none fired)
    assert data["family"]["size"] == 2


def test_the_cost_reads_the_shapes_a_run_published_before_its_hparams(tmp_path, capsys):
    """A Hugging Face or plain-loop run has no ``hparams.yaml``: the shapes its gradient statistics published
    (``model/vocab_size``, ``model/hidden_size``) give the cost; they win over an ``hparams.yaml`` that says other."""
    for side, tied in (("tied", True), ("untied", False)):
        path = tmp_path / "runs" / side
        write_run(path, FINAL[side][0], tied, vocab=999)  # an hparams.yaml that disagrees with what the run published
        writer = SummaryWriter(log_dir=str(path))
        for step in range(10, 101, 10):
            writer.add_scalar(P + "model/vocab_size", 32000.0, step)
            writer.add_scalar(P + "model/hidden_size", 256.0, step)
        writer.close()
    status, out = report([str(tmp_path / "runs"), "--json"], capsys)
    cost = next(r for r in json.loads(out)["headlines"] if r["key"] == "untying_cost")["comparisons"]["untied"]["cost"]
    assert status == 0 and (cost["vocab_size"], cost["d_model"], cost["parameters"]) == (32000, 256, 32000 * 256)
