"""The headline questions ``headwatch report`` answers, and :func:`verdicts`: sides of runs in, a plain dict out.

*Did untying (or warm-up, or the projection) help, on what, and how sure are we?* Each headline
reads one number per run (:data:`HEADLINES`); its good direction is the ``better`` of the metric's
declaration in :mod:`headwatch.names` (read here, declared there once). A side is one run or a
group of runs (seeds); every side is compared with the first, the reference:

* one run a side: the difference only (one run cannot separate the setting from the seed);
* two or more runs a side: a paired t-test over the seeds when both sides have the same set of
  seeds (runs of one seed share data and order), else Welch's; the headlines with a good direction
  form one family, tested with Holm's step-down at family-wise error 5%
  (:mod:`headwatch.report.verdict`); a verdict needs the adjusted test to reject *and* the direction.

The dict :func:`verdicts` returns is what ``--json`` prints, what the text and HTML reports show,
and what any other view (a TensorBoard plugin) must show; its schema is in ``docs/report.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from headwatch import names
from headwatch.errors import HeadwatchError
from headwatch.report.compare import value_at
from headwatch.report.events import Points
from headwatch.report.verdict import ALPHA, LEVEL, TTest, detectable_gap, holm, paired_test, verdict_word, welch_test

SCHEMA = 1
"""The version of the dict :func:`verdicts` returns (raised when a key changes meaning)."""

TRAINING_BYTES = 4 + 4 + 8
"""Bytes a trained fp32 parameter takes with AdamW: weight, gradient, two moments (:mod:`headwatch.remedies.cost`)."""


@dataclass(frozen=True)
class Headline:
    """One question of the report, read as one number per run."""

    key: str
    """Its key in the JSON."""
    question: str
    """The row's label."""
    unit: str
    candidates: tuple[tuple[str, str], ...]
    """``(name, where)`` pairs tried in order; a name is after ``<prefix>/``, or a whole tag after ``=``."""
    declared: str
    """The declared name (after the prefix) whose ``better`` gives the good direction."""
    read: str
    """How a run's number is read: ``end`` (the value at the last step every run logged, interpolated),
    ``probe`` (the last step every run measured), ``late_mean`` (the mean over the last 10% of the steps
    up to the last common one), ``fall`` (each run's value at the midpoint of its own logged steps minus its
    value at its own last step: the second half of that run), ``alerts`` (alerts fired), ``cost`` (from the
    run's shapes and tie)."""


HEADLINES: tuple[Headline, ...] = (
    Headline("validation_loss", "validation loss", "nats",
             (("val/logits/target_nll", ""), ("=val_loss", ""), ("=eval/loss", ""), ("logits/target_nll", "train")),
             "val/logits/target_nll", "end"),
    Headline("rare_token_nll", "rare-token NLL", "nats",
             (("val/logits/rare/target_nll", "val"), ("logits/rare/target_nll", "train")), "val/logits/rare/target_nll", "end"),
    Headline("calibration_ece", "calibration ECE", "",
             (("val/logits/ece", "val"), ("logits/ece", "train")), "val/logits/ece", "end"),
    Headline("collision", "collision beyond drift", "",
             (("collision/rare_rate_head", ""),), "collision/rare_rate_head", "probe"),
    Headline("tied_flow_conflict", "tied-flow conflict", "",
             (("grad/tied_flow_conflict_fraction", ""),), "grad/tied_flow_conflict_fraction", "late_mean"),
    Headline("final_entropy", "final entropy", "nats",
             (("val/logits/entropy", "val"), ("logits/entropy", "train")), "val/logits/entropy", "end"),
    Headline("entropy_fall", "entropy fall, 2nd half", "nats",
             (("val/logits/entropy", "val"), ("logits/entropy", "train")), "val/logits/entropy", "fall"),
    Headline("alerts_fired", "alerts fired", "", (), "alerts/entropy_floor", "alerts"),
    Headline("untying_cost", "untying cost", "parameters", (), "grad/tied", "cost"),
    Headline("step_time", "step time", "s", (("=train/train_steps_per_second", ""),), "grad/tied", "end"),
)  # fmt: skip
"""The headlines, in display order. ``step_time`` is ``1 / train_steps_per_second`` (the Hugging Face
Trainer logs it; Lightning logs no step time), part of what untying costs."""


def direction(headline: Headline, prefix: str = "headwatch") -> str | None:
    """A headline's good direction, from its metric's declaration (:attr:`headwatch.names.Metric.better`).

    Raises:
        HeadwatchError: the declared name is not in :mod:`headwatch.names` (a broken table).
    """
    metric = names.declaration(f"{prefix}/{headline.declared}", prefix)
    if metric is None:
        raise HeadwatchError(f"headline {headline.key!r}: {headline.declared!r} is not a declared metric")
    return metric.better


@dataclass(frozen=True)
class RunData:
    """What one run recorded, as :func:`verdicts` reads it.

    Args:
        scalars: tag -> ``(step, value)`` points sorted by step (the report's ``read_run``).
        alerts: alerts the run fired; None: counted from its markers (``<prefix>/alerts/...`` at value 1).
        seed: the run's seed (``hparams.yaml``, or ``seed<N>`` in its path); None when unknown.
        shapes: ``vocab_size``, ``d_model`` and ``tied`` when the run records them (``hparams.yaml``).
    """

    scalars: Mapping[str, Points]
    alerts: int | None = None
    seed: int | None = None
    shapes: Mapping[str, Any] = field(default_factory=dict)


Sides = Mapping[str, Mapping[str, RunData]]
"""Side name -> run name -> :class:`RunData`; the first side is the reference."""


def _finite(points: Points | None) -> Points:
    return [(s, v) for s, v in points or () if math.isfinite(v)]


def _tag(name: str, prefix: str) -> str:
    return name[1:] if name.startswith("=") else f"{prefix}/{name}"


def _choose(headline: Headline, runs: Mapping[str, RunData], prefix: str) -> tuple[str, str] | None:
    """The first candidate every run has a finite value of, else the first any run has."""
    have = [(c, [bool(_finite(r.scalars.get(_tag(c[0], prefix)))) for r in runs.values()]) for c in headline.candidates]
    for c, flags in have:
        if flags and all(flags):
            return c
    return next((c for c, flags in have if any(flags)), None)


def _gap(pts: Points, step: float, ended: str = "another run") -> str:
    """Why a run that logged ``pts`` has no value at ``step`` (its logged range does not reach it); ``ended``: the
    run whose last point is ``step``."""
    if not pts:
        return "not recorded"
    if step > pts[-1][0]:
        return f"ended at step {pts[-1][0]:g}, before step {step:g}"
    if step < pts[0][0]:
        return f"first logged at step {pts[0][0]:g}, after {ended} ended (step {step:g})"
    if len(pts) == 1:
        return f"logged one step only (step {pts[0][0]:g})"
    return f"no finite value at step {step:g}"


END_FIRST = "the end of the run that ended first (the runs share no logged step)"
"""The anchor's rule when a run began logging after another had ended."""


def _read_series(
    headline: Headline, series: Mapping[str, Points], ends: Mapping[str, float | None] | None = None
) -> tuple[dict[str, float | None], dict[str, Any], dict[str, str]]:
    """Run -> its number, the anchor (``{"rule", "step", ...}``), and run -> why it has no number although it logged
    the tag, for the series of one tag. ``ends``: run -> the last step it logged anything at (its end of training)."""
    ends = ends or {}
    logged = {run: pts for run, pts in series.items() if pts}
    if not logged:
        return {run: None for run in series}, {}, {}
    last = min(pts[-1][0] for pts in logged.values())
    ends_together = all(pts[-1][0] == last for pts in logged.values())
    shortest = min(logged, key=lambda run: logged[run][-1][0])
    out: dict[str, float | None] = {}
    gaps: dict[str, str] = {}
    if headline.read == "probe":
        common = set.intersection(*(set(s for s, _ in pts) for pts in logged.values()))
        if common:
            step = max(common)
            for run, pts in series.items():
                out[run] = dict(pts).get(step) if pts else None
            if all(ends.get(run, pts[-1][0]) == step for run, pts in logged.items()):
                return out, {"rule": "the end-of-training probe", "step": step}, gaps
            rule = "the last probe every run has" if len(logged) > 1 else "the last probe"
            of = sorted({float(ends.get(run, pts[-1][0])) for run, pts in logged.items()})  # type: ignore[arg-type]
            return out, {"rule": rule, "step": step, "of": of}, gaps
        # no step every run measured: the values at the last common step, interpolated
    if headline.read == "late_mean":
        first = max(pts[0][0] for pts in logged.values())
        lo = last - 0.1 * max(0, last - first)
        for run, pts in series.items():
            window = [v for s, v in pts if lo <= s <= last]
            out[run] = math.fsum(window) / len(window) if window else None
            if out[run] is None and pts:
                gaps[run] = _gap(pts, last, shortest)
        return out, {"rule": "the mean over the last 10% of the steps", "step": last}, gaps
    if headline.read == "fall":
        ranges: dict[str, list[float]] = {}
        for run, pts in series.items():
            out[run] = None
            if len(pts) < 2:  # one point has no fall
                if pts:
                    gaps[run] = _gap(pts, pts[0][0])
                continue
            start, end = pts[0][0], pts[-1][0]
            mid = start + 0.5 * (end - start)  # the midpoint of the run's own logged steps
            a, b = value_at(pts, mid), value_at(pts, end)
            out[run] = None if a is None or b is None else a - b
            ranges[run] = [mid, end]
        spans = {tuple(r) for r in ranges.values()}
        mid, end = next(iter(spans)) if len(spans) == 1 else (None, None)
        return out, {"rule": "the value at the midpoint of each run's logged steps minus the value at its last step",
                     "step": end, "from_step": mid, "ranges": ranges}, gaps  # fmt: skip
    for run, pts in series.items():
        out[run] = value_at(pts, last) if pts else None
        if out[run] is None and pts:
            gaps[run] = _gap(pts, last, shortest)
    apart = any(pts[0][0] > last for pts in logged.values())  # a run began after another ended: no common step
    rule = "the end of training" if ends_together else (END_FIRST if apart else "the last step every run logged")
    return out, {"rule": rule, "step": last}, gaps


def _end(run: RunData) -> float | None:
    """The last step ``run`` logged anything at: its end of training as the report sees it."""
    steps = [pts[-1][0] for pts in run.scalars.values() if pts]
    return max(steps) if steps else None


def _alerts(run: RunData, prefix: str) -> int:
    if run.alerts is not None:
        return int(run.alerts)
    head = f"{prefix}/alerts/"
    return sum(1 for tag, pts in run.scalars.items() if tag.startswith(head) for _, v in pts if v == 1.0)


def _tied(run: RunData, prefix: str) -> bool | None:
    pts = _finite(run.scalars.get(f"{prefix}/grad/tied"))
    if pts:
        return pts[-1][1] == 1.0
    tied = run.shapes.get("tied")
    return tied if isinstance(tied, bool) else None


def read_headline(headline: Headline, runs: Mapping[str, RunData], prefix: str = "headwatch") -> dict[str, Any]:
    """One headline's number for every run: ``{"tag", "where", "anchor", "values": {run: number or None}, "gaps"}``,
    ``gaps``: run -> why a run that logged the tag has no number (it ended before the anchor step, ...).

    ``step_time`` is ``1 / train_steps_per_second``; ``untying_cost`` gives each run's tie (1 tied, 0 not).
    """
    if headline.read == "alerts":
        return {"tag": f"{prefix}/alerts/*", "where": "", "anchor": {"rule": "the whole run"},
                "values": {r: float(_alerts(d, prefix)) for r, d in runs.items()}}
    if headline.read == "cost":
        tied = {r: _tied(d, prefix) for r, d in runs.items()}
        return {"tag": f"{prefix}/grad/tied", "where": "", "anchor": {"rule": "the model"},
                "values": {r: (None if t is None else float(t)) for r, t in tied.items()}}
    chosen = _choose(headline, runs, prefix)
    if chosen is None:
        return {"tag": None, "where": "", "anchor": {}, "values": {r: None for r in runs}}
    tag = _tag(chosen[0], prefix)
    series = {r: _finite(d.scalars.get(tag)) for r, d in runs.items()}
    values, anchor, gaps = _read_series(headline, series, {r: _end(d) for r, d in runs.items()})
    if headline.key == "step_time":
        values = {r: (1.0 / v if v else None) for r, v in values.items()}
    return {"tag": tag, "where": chosen[1], "anchor": anchor, "values": values, "gaps": gaps}


# --------------------------------------------------------------------------- sides and tests


def pairing(reference: Mapping[str, RunData], other: Mapping[str, RunData]) -> tuple[bool, str]:
    """Whether two sides pair by seed, and why (or why not).

    They pair when every run of both has a seed, no seed appears twice on a side, and both sides
    have the same set of seeds.
    """
    seeds = [[r.seed for r in side.values()] for side in (reference, other)]
    if any(s is None for side in seeds for s in side):
        return False, "a run records no seed"
    if any(len(set(side)) != len(side) for side in seeds):
        return False, "a seed appears twice on a side"
    if set(seeds[0]) != set(seeds[1]):
        return False, "the sides have different seeds"
    return True, "the same seeds on both sides"


def _compare(values: Mapping[str, Mapping[str, float | None]], sides: Sides, ref: str, other: str,
             paired: bool, gaps: Mapping[str, str] | None = None) -> tuple[float | None, TTest | None, str | None]:
    """``(difference of means, test, why there is no test)`` for one headline, one side against the reference;
    ``gaps``: run -> why a run that logged the tag has no number (said instead of "not recorded")."""
    r = {run: v for run, v in values[ref].items() if v is not None and math.isfinite(v)}
    o = {run: v for run, v in values[other].items() if v is not None and math.isfinite(v)}
    if not r or not o:
        side = ref if not r else other
        said = [f"{run} {gaps[run]}" for run in sides[side] if gaps and run in gaps]
        return None, None, "; ".join(said) if said else f"not recorded by {side}"
    diff = math.fsum(o.values()) / len(o) - math.fsum(r.values()) / len(r)
    if len(sides[ref]) == 1 and len(sides[other]) == 1:
        return diff, None, "one run a side"
    if paired:
        test = paired_test({sides[ref][run].seed: v for run, v in r.items()}, {sides[other][run].seed: v for run, v in o.items()})
        return (diff if test is None else test.difference), test, (None if test else "fewer than 2 seeds with a value on both sides")
    test = welch_test(list(r.values()), list(o.values()))
    return diff, test, (None if test else "fewer than 2 runs with a value on a side")


def _cost(runs_by_side: Mapping[str, Mapping[str, RunData]], read: Mapping[str, Any], ref: str, other: str,
          prefix: str) -> dict[str, Any]:
    """What the other side's tie costs against the reference's: parameters and bytes (exact, no test)."""
    def side_tie(side: str) -> bool | None:
        ties = {read["values"][r] for r in runs_by_side[side]}
        return None if None in ties or len(ties) != 1 else ties.pop() == 1.0

    shapes = {(d.shapes.get("vocab_size"), d.shapes.get("d_model")) for side in (ref, other) for d in runs_by_side[side].values()}
    shapes.discard((None, None))
    vocab, width = next(iter(shapes)) if len(shapes) == 1 else (None, None)
    t_ref, t_other = side_tie(ref), side_tie(other)
    out: dict[str, Any] = {"tied": {ref: t_ref, other: t_other}, "vocab_size": vocab, "d_model": width,
                           "parameters": None, "bytes": None, "why": None}
    if t_ref is None or t_other is None:
        out["why"] = f"{prefix}/grad/tied not recorded by every run (GradientDensityMonitor publishes it)"
        return out
    sign = int(t_ref) - int(t_other)  # tied -> untied adds the head's matrix
    if sign == 0:
        out.update(parameters=0, bytes={"weights_fp32": 0, "weights_bf16": 0, "training_fp32_adamw": 0})
        return out
    if vocab is None or width is None:
        why = "different shapes on the runs" if len(shapes) > 1 else "no run records its shapes (vocab_size, d_model)"
        out["why"] = f"{why}: headwatch cost --vocab-size V --d-model D says it"
        return out
    p = sign * vocab * width
    out.update(parameters=p, bytes={"weights_fp32": 4 * p, "weights_bf16": 2 * p, "training_fp32_adamw": TRAINING_BYTES * p})
    return out


def verdicts(sides: Sides, *, prefix: str = "headwatch", alpha: float = ALPHA) -> dict[str, Any]:
    """Answer the headline questions for ``sides``: every side against the first, with verdicts.

    Args:
        sides: side name -> run name -> :class:`RunData`, the reference first; a side of one run is a
            run, a side of several is a group (seeds). Run names must differ across sides. One side alone
            gets its values and no comparison.
        prefix: the headwatch tag prefix.
        alpha: the family-wise error rate of the verdicts (Holm).

    Returns:
        A JSON-ready dict (numbers finite or None); its keys are documented in ``docs/report.md``.

    Raises:
        HeadwatchError: no side, an empty side, a run name on two sides, or ``alpha`` outside (0, 1).
    """
    if not sides:
        raise HeadwatchError("verdicts need at least one side (two to compare), got none")
    empty = [s for s, runs in sides.items() if not runs]
    if empty:
        raise HeadwatchError(f"the side(s) {empty} hold no run")
    every = [run for runs in sides.values() for run in runs]
    if len(set(every)) != len(every):
        raise HeadwatchError("run names must differ across sides")
    if not 0.0 < alpha < 1.0:
        raise HeadwatchError(f"`alpha` must be in (0, 1), got {alpha!r}")
    ref, *others = list(sides)
    all_runs = {run: data for runs in sides.values() for run, data in runs.items()}
    pairs = {o: pairing(sides[ref], sides[o]) for o in others}
    rows = []
    for h in HEADLINES:
        better = direction(h, prefix)
        read = read_headline(h, all_runs, prefix)
        values = {s: {run: read["values"][run] for run in runs} for s, runs in sides.items()}
        # without validation the row reads the training target NLL: named for what it is
        question = "target NLL" if h.key == "validation_loss" and read["where"] == "train" else h.question
        row: dict[str, Any] = {"key": h.key, "question": question, "unit": h.unit, "better": better,
                               "tag": read["tag"], "where": read["where"], "anchor": read["anchor"],
                               "values": values, "means": {}, "comparisons": {}}
        for s, vals in values.items():
            finite = [v for v in vals.values() if v is not None and math.isfinite(v)]
            row["means"][s] = math.fsum(finite) / len(finite) if finite else None
        for o in others:
            if h.read == "cost":
                row["comparisons"][o] = {"cost": _cost(sides, read, ref, o, prefix), "method": "exact", "verdict": None}
                continue
            diff, test, why = _compare(values, sides, ref, o, pairs[o][0], read.get("gaps"))
            row["comparisons"][o] = {
                "difference": diff, "method": None if test is None else test.method, "n": None if test is None else
                [test.n_reference, test.n_other], "df": None if test is None else test.df,
                "se": None if test is None else test.se, "p": None if test is None else test.p, "p_adjusted": None,
                "interval": None, "detectable": None, "verdict": None, "why": why, "_test": test,
            }
        rows.append(row)
    family = [(row, o) for row in rows for o, c in row["comparisons"].items() if c.get("_test") is not None and row["better"]]
    adjusted = holm([c["comparisons"][o]["p"] for c, o in family]) if family else []
    m = len(family)
    for (row, o), q in zip(family, adjusted):
        c = row["comparisons"][o]
        c["p_adjusted"] = q
        c["verdict"] = verdict_word(c["difference"], q, row["better"], alpha)
        c["detectable"] = detectable_gap(c["_test"], m, alpha)
    for row in rows:
        for c in row["comparisons"].values():
            test = c.pop("_test", None)
            if test is None:
                continue
            level = 1.0 - alpha / m if c["p_adjusted"] is not None else LEVEL
            low, high = test.interval(level)
            c["interval"] = {"low": low, "high": high, "level": level}
            if row["better"] is None:
                c["why"] = "no preferred direction"
    return {
        "schema": SCHEMA,
        "reference": ref,
        "sides": {s: {"runs": list(runs), "seeds": [d.seed for d in runs.values()]} for s, runs in sides.items()},
        "pairing": {o: {"paired": p, "why": why} for o, (p, why) in pairs.items()},
        "alpha": alpha,
        "family": {"rule": "holm", "size": m, "level": (1.0 - alpha / m) if m else None},
        "one_run_a_side": all(len(runs) == 1 for runs in sides.values()),
        "headlines": rows,
    }


def headline_table() -> list[tuple[str, str, str | None]]:
    """``(question, unit, good direction)`` of every headline, for ``--help`` and the docs."""
    return [(h.question, h.unit, direction(h)) for h in HEADLINES]


__all__: Sequence[str] = (
    "HEADLINES", "Headline", "RunData", "SCHEMA", "Sides", "direction", "headline_table", "pairing",
    "read_headline", "verdicts",
)  # fmt: skip
