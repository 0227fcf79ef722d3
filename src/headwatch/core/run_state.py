"""Restoring a run's state from a checkpoint: each monitor's part matched by class name, the self-check's, the RL
reference; every part checked, a missing or invalid one said once (``strict`` raises)."""

from __future__ import annotations

import math
from typing import Any


def restore_run(run: Any, state: dict[str, Any]) -> None:
    """Load ``state`` (:meth:`~headwatch.core.orchestrator.Orchestrator.state_dict`) into ``run``, an
    :class:`~headwatch.core.orchestrator.Orchestrator`: each monitor its part (matched by class name; a state
    without names, by position), checked by the monitor (an invalid part restarts that monitor from empty with one
    warning). A state that is not a dict of parts, or that lacks a monitor's part, is said once through
    ``run.state_problem`` (``strict`` raises :class:`~headwatch.errors.StateError`)."""
    strict = any(m.strict for m in run.all_monitors)
    run.check.load_state_dict(state.get("check") if isinstance(state, dict) else None)
    start = state.get("rl_start") if isinstance(state, dict) else None
    valid = isinstance(start, dict) and set(start) == {"entropy", "rare"} and all(
        isinstance(v, float) and math.isfinite(v) for v in start.values()
    )
    if start is not None and not valid:
        run.state_problem(strict, f"`rl_start` must be None or a dict of finite entropy and rare, got {start!r}")
    run.rl_start = start if valid else None
    problem = run.cost.load_state_dict(state.get("overhead") if isinstance(state, dict) else None)
    if problem is not None:
        run.state_problem(strict, problem)
    sinks = state.get("sinks") if isinstance(state, dict) else None
    for sink in run.sinks:  # a sink's state is its own (the summary's first figures); a state without it: empty
        load = getattr(sink, "load_sink_state", None)
        part = sinks.get(type(sink).__name__) if isinstance(sinks, dict) else None
        if callable(load) and part is not None and (problem := load(part)) is not None:
            run.state_problem(strict, problem)
    parts = state.get("monitors") if isinstance(state, dict) else None
    if not isinstance(parts, (list, tuple)):
        run.state_problem(strict, f"the state must be a dict with a `monitors` list, got {type(state).__name__}")
        return
    names = state.get("names")
    if isinstance(names, (list, tuple)) and len(names) == len(parts) and all(isinstance(n, str) for n in names):
        unused = list(zip(names, parts))
        for m in run.all_monitors:  # refused monitors too: their parts stay in the checkpoint
            found = next((i for i, (name, _) in enumerate(unused) if name == type(m).__name__), None)
            if found is None:
                run.state_problem(strict, f"it holds no {type(m).__name__} state; that monitor starts from empty")
                continue
            m.load_state_dict(unused.pop(found)[1])
        return
    if len(parts) != len(run.all_monitors):
        run.state_problem(strict, f"it holds {len(parts)} monitor states for {len(run.all_monitors)} monitors")
    for m, part in zip(run.all_monitors, parts):
        m.load_state_dict(part)
