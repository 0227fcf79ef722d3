"""The verdict panel of the headwatch tab: ``headwatch report``'s answer for the runs TensorBoard shows.

The answer is :func:`headwatch.report.verdicts` (a pure function of the runs' scalars, alerts, seeds and
shapes; ``headwatch report --json`` prints the same dict), called when this installation has it. The runs
are grouped as the report groups them: each run its own side, or sides over seeds when every run records
a seed and the runs' names without their ``seed<N>``/``version_<N>`` parts fall into groups. The scalars
come through TensorBoard's data provider; the two things the provider does not serve are read from the run
directory as the report reads them: ``hparams.yaml`` (the seed, the shapes) and ``headwatch_alerts.jsonl``.
"""

from __future__ import annotations

import importlib
from pathlib import Path, PurePosixPath
from typing import Any

from headwatch.tensorboard.plugin import data

MISSING = ("this headwatch has no headwatch.report.verdicts (the report's answer as data): the verdict panel "
           "needs a headwatch release with `headwatch report --json`")  # fmt: skip


def _report() -> Any:
    """The ``headwatch.report`` module when it has ``verdicts`` (imported here, on first use: the report is a
    sibling layer, read by name), else None."""
    try:
        report = importlib.import_module("headwatch.report")
    except ImportError:
        return None
    return report if callable(getattr(report, "verdicts", None)) else None


def available() -> bool:
    """Whether :func:`headwatch.report.verdicts` exists in this installation."""
    return _report() is not None


def report_order(runs: list[str]) -> list[str]:
    """Run names in the order ``headwatch report LOGDIR`` lists the runs under LOGDIR (sorted paths)."""
    return sorted(runs, key=lambda name: PurePosixPath(name).parts)


def verdicts(provider: Any, ctx: Any, experiment_id: str, logdir: str | None, runs: list[str]) -> dict[str, Any]:
    """``headwatch report``'s verdicts for ``runs`` (TensorBoard run names under ``logdir``).

    Returns:
        ``{"available": False, "note": ...}`` when the report has no ``verdicts``; else ``{"available": True,
        "verdicts": <the dict headwatch.report.verdicts returns>, "notes": [...]}``. The dict is the one
        ``headwatch report LOGDIR --json`` prints for the same runs (without its ``notes``), NaN as None.
    """
    report = _report()
    if report is None:
        return {"available": False, "note": MISSING}
    notes: list[str] = []
    loaded: dict[str, Any] = {}
    prefix = "headwatch"
    for run in report_order(runs):
        scalars = data.all_points(provider, ctx, experiment_id, run)
        found = data.run_prefix(scalars) or "headwatch"
        prefix = found[len("train/") :] if found.startswith("train/") else found
        scalars = report.strip_trainer_namespace(scalars, prefix)
        path = Path(logdir, run) if logdir and "://" not in logdir else None
        records, hparams = [], None
        if path is not None and path.is_dir():
            jsonl = report.find_alerts_file(path, logdir)
            records = report.read_alerts_jsonl(jsonl, notes) if jsonl is not None else []
            hparams = report.read_hparams(path, notes)
        alerts = report.collect_alerts(scalars, records, prefix=prefix)
        seed = report.run_seed(path, hparams) if path is not None else None
        loaded[run] = report.RunData(scalars, alerts=len(alerts), seed=seed, shapes=report.model_shapes(hparams))
    if not loaded:
        return {"available": True, "verdicts": None, "notes": ["no run with headwatch tags"]}
    sides = {name: [name] for name in loaded}
    group_by_seed = getattr(importlib.import_module("headwatch.report.cli"), "group_by_seed", None)
    by_seed = group_by_seed(list(loaded), {n: r.seed for n, r in loaded.items()}) if group_by_seed else None
    if by_seed is not None:
        sides = by_seed
        notes.insert(0, "sides: the runs grouped by their paths without seed<N> and version_<N> (headwatch report --group chooses others)")
    answer = report.verdicts({s: {n: loaded[n] for n in members} for s, members in sides.items()}, prefix=prefix)
    return {"available": True, "verdicts": data.json_safe(answer), "notes": notes}
