"""The verdict panel of the headwatch tab: ``headwatch report``'s answer for the runs TensorBoard shows.

The answer is :func:`headwatch.report.verdicts` (a pure function of the runs' scalars, alerts, seeds and
shapes; ``headwatch report --json`` prints the same dict), each run read as the report reads it
(:func:`headwatch.report.cli.run_data`). The runs
are grouped as the report groups them: each run its own side, or sides over seeds when every run records
a seed and the runs' names without their ``seed<N>``/``version_<N>`` parts fall into groups. The scalars
come through TensorBoard's data provider; the two things the provider does not serve are read from the run
directory as the report reads them: ``hparams.yaml`` (the seed, the shapes) and ``headwatch_alerts.jsonl``.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from headwatch.integrations.tensorboard_plugin import data
from headwatch.report import strip_trainer_namespace, verdicts as report_verdicts
from headwatch.report.cli import group_by_seed, run_data


def report_order(runs: list[str]) -> list[str]:
    """Run names in the order ``headwatch report LOGDIR`` lists the runs under LOGDIR (sorted paths)."""
    return sorted(runs, key=lambda name: PurePosixPath(name).parts)


def verdicts(provider: Any, ctx: Any, experiment_id: str, logdir: str | None, runs: list[str]) -> dict[str, Any]:
    """``headwatch report``'s verdicts for ``runs`` (TensorBoard run names under ``logdir``).

    Returns:
        ``{"available": True, "verdicts": <the dict headwatch.report.verdicts returns>, "notes": [...]}``: the dict
        ``headwatch report LOGDIR --json`` prints for the same runs (without its ``notes``), NaN as None.
    """
    notes: list[str] = []
    loaded: dict[str, Any] = {}
    prefix = "headwatch"
    for run in report_order(runs):
        scalars = data.all_points(provider, ctx, experiment_id, run)
        found = data.run_prefix(scalars) or "headwatch"
        prefix = found[len("train/") :] if found.startswith("train/") else found
        scalars = strip_trainer_namespace(scalars, prefix)
        path = Path(logdir, run) if logdir and "://" not in logdir else None
        loaded[run] = run_data(scalars, path, logdir, prefix, notes)[0]
    if not loaded:
        return {"available": True, "verdicts": None, "notes": ["no run with headwatch tags"]}
    sides = {name: [name] for name in loaded}
    by_seed = group_by_seed(list(loaded), {n: r.seed for n, r in loaded.items()})
    if by_seed is not None:
        sides = by_seed
        notes.insert(0, "sides: the runs grouped by their paths without seed<N> and version_<N> (headwatch report --group chooses others)")
    answer = report_verdicts({s: {n: loaded[n] for n in members} for s, members in sides.items()}, prefix=prefix)
    return {"available": True, "verdicts": data.json_safe(answer), "notes": notes}
