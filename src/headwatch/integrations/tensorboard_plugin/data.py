"""What the headwatch tab shows, read through the ``DataProvider`` TensorBoard hands its plugins.

Pure functions of a provider (``list_scalars``, ``read_scalars``, ``list_tensors``, ``read_tensors``), a
request context and an experiment id: no event file is opened here. Every function returns JSON-able
data (NaN and infinities as ``None``), and raises nothing for a run without headwatch tags (it answers
with empty lists).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from headwatch import names
from headwatch.tensorboard.charts import PANELS, Series

SCALARS, TEXT = "scalars", "text"
"""The plugin names TensorBoard files scalars (``add_scalar``) and texts (``add_text``) under."""
DOWNSAMPLE = 100_000
"""Points asked of the provider per series: every point it keeps (TensorBoard's own reservoir holds at most
10,000 scalars a tag by default, ``--samples_per_plugin`` to change)."""
TEXT_SUFFIX = "/text_summary"
"""What ``SummaryWriter.add_text`` appends to its tag."""

_CONCRETE = frozenset(n for m in names.METRICS for n in names.expand(m))


def finite(value: float) -> float | None:
    """``value``, or None for NaN and infinities (JSON has neither)."""
    return value if math.isfinite(value) else None


def run_prefix(tags: Iterable[str]) -> str | None:
    """The headwatch prefix of a run (``headwatch``; ``train/headwatch`` for the Hugging Face Trainer): the
    part before a declared name that most of the run's tags share; None when no tag is a declared name."""
    counts: dict[str, int] = {}
    for tag in tags:
        parts = tag.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[i:]) in _CONCRETE:
                prefix = "/".join(parts[:i])
                counts[prefix] = counts.get(prefix, 0) + 1
    return max(counts, key=lambda p: (counts[p], -len(p))) if counts else None


def list_runs(provider: Any, ctx: Any, experiment_id: str) -> list[dict[str, Any]]:
    """The runs with headwatch tags, sorted by name: ``{"run", "prefix", "rl", "synonyms", "alerts", "collision"}``
    (the last four: whether the run has ``rl/``, synonym, alert-marker and collision-table tags)."""
    scalars = provider.list_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS)
    texts = provider.list_tensors(ctx, experiment_id=experiment_id, plugin_name=TEXT)
    out = []
    for run in sorted(scalars):
        prefix = run_prefix(scalars[run])
        if prefix is None:
            continue
        tags, text_tags = set(scalars[run]), set(texts.get(run, {}))
        out.append({
            "run": run,
            "prefix": prefix,
            "rl": f"{prefix}/rl/temperature" in tags,
            "synonyms": any(t.startswith(f"{prefix}/collision/synonym_") for t in tags),
            "alerts": bool(_marker_tags(tags, prefix)),
            "collision": any(t.startswith(f"{prefix}/collision/top_pairs_") for t in text_tags),
        })  # fmt: skip
    return out


def read_points(provider: Any, ctx: Any, experiment_id: str, run: str, tags: Iterable[str]) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` sorted by step, for the ``tags`` the run has (every point the provider keeps)."""
    wanted = sorted(set(tags))
    if not wanted:
        return {}
    from tensorboard.data import provider as tb_provider

    data = provider.read_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS, downsample=DOWNSAMPLE,
                                 run_tag_filter=tb_provider.RunTagFilter(runs=[run], tags=wanted))  # fmt: skip
    return {tag: sorted((int(d.step), float(d.value)) for d in data_) for tag, data_ in data.get(run, {}).items()}


def _run_tags(provider: Any, ctx: Any, experiment_id: str, run: str) -> set[str]:
    from tensorboard.data import provider as tb_provider

    listed = provider.list_scalars(ctx, experiment_id=experiment_id, plugin_name=SCALARS,
                                   run_tag_filter=tb_provider.RunTagFilter(runs=[run]))  # fmt: skip
    return set(listed.get(run, {}))


def _series_tags(series: Series, tags: set[str], prefix: str) -> list[tuple[str, str]]:
    """``(tag, label)`` pairs a series draws in a run: its first name the run has; a validation name also under
    each evaluation's suffix (Lightning's ``/dataloader_idx_<k>``, the HF Trainer's ``/<metric_key_prefix>``)."""
    for name in series.names:
        if name.startswith("^"):
            found = sorted(t for t in tags if re.match(name, t))
            if found:
                return [(found[0], series.label)]
            continue
        tag = f"{prefix}/{name}"
        if tag in tags:
            return [(tag, series.label)]
        if name.startswith("val/"):
            found = sorted(t for t in tags if t.startswith(tag + "/") and "/" not in t[len(tag) + 1 :])
            if found:
                return [(t, f"{series.label} ({t[len(tag) + 1:]})") for t in found]
    return []


def vitals(provider: Any, ctx: Any, experiment_id: str, run: str) -> dict[str, Any]:
    """The vital-sign panels of one run (:data:`headwatch.tensorboard.charts.PANELS`), every point unsmoothed.

    Returns:
        ``{"run", "prefix", "panels": [{"key", "title", "unit", "note", "reference": {"value", "label"} | None,
        "series": [{"label", "tag", "style", "points": [[step, value | None], ...]}]}]}``; a series the run does
        not have is left out; a ``plus`` series holds the sum of its names' values at the steps they share.
    """
    tags = _run_tags(provider, ctx, experiment_id, run)
    prefix = run_prefix(tags)
    if prefix is None:
        return {"run": run, "prefix": None, "panels": []}
    chosen = {p.key: [(s, _series_tags(s, tags, prefix)) for s in p.series] for p in PANELS}
    wanted = {tag for found in chosen.values() for _, pairs in found for tag, _ in pairs}
    wanted |= {f"{prefix}/{n}" for p in PANELS for s in p.series for n in s.plus if f"{prefix}/{n}" in tags}
    points = read_points(provider, ctx, experiment_id, run, wanted)
    panels = []
    for panel in PANELS:
        series = []
        for spec, pairs in chosen[panel.key]:
            for tag, label in pairs:
                values = dict(points.get(tag, []))
                for extra in spec.plus:  # log V = entropy + KL(p || U), at the steps both have
                    other = dict(points.get(f"{prefix}/{extra}", []))
                    values = {s: v + other[s] for s, v in values.items() if s in other}
                if not values:
                    continue
                series.append({"label": label, "tag": tag if not spec.plus else "+".join([tag, *(f"{prefix}/{e}" for e in spec.plus)]),
                               "style": spec.style, "points": [[s, finite(v)] for s, v in sorted(values.items())]})  # fmt: skip
        panels.append({
            "key": panel.key, "title": panel.title, "unit": panel.unit, "note": panel.note,
            "reference": {"value": panel.reference[0], "label": panel.reference[1]} if panel.reference else None,
            "series": series,
        })  # fmt: skip
    return {"run": run, "prefix": prefix, "panels": panels}


def _marker_tags(tags: Iterable[str], prefix: str) -> dict[str, tuple[str, str]]:
    """Alert-marker tag -> ``(rule, severity)``: ``<prefix>/alerts/<rule>`` (critical) and ``..._<severity>``."""
    out = {}
    for tag in tags:
        if not tag.startswith(f"{prefix}/alerts/"):
            continue
        marker = tag[len(prefix) + len("/alerts/") :]
        for rule in names.ALERT_RULES:
            if marker == rule:
                out[tag] = (rule, "critical")
            elif marker.startswith(rule + "_") and marker[len(rule) + 1 :].isidentifier():
                out[tag] = (rule, marker[len(rule) + 1 :])
    return out


def _texts(provider: Any, ctx: Any, experiment_id: str, run: str, tags: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """``{tag: [(step, text), ...]}`` of ``add_text`` summaries (tags with their ``/text_summary``), sorted by step."""
    from tensorboard.data import provider as tb_provider

    wanted = sorted(set(tags))
    if not wanted:
        return {}
    data = provider.read_tensors(ctx, experiment_id=experiment_id, plugin_name=TEXT, downsample=DOWNSAMPLE,
                                 run_tag_filter=tb_provider.RunTagFilter(runs=[run], tags=wanted))  # fmt: skip
    out = {}
    for tag, datums in data.get(run, {}).items():
        rows = []
        for d in datums:
            value = d.numpy.reshape(-1)[0] if d.numpy.size else b""
            rows.append((int(d.step), value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)))
        out[tag] = sorted(rows, key=lambda r: r[0])
    return out


_SEVERITY = re.compile(r"^\[(\w+)\]\s*")
LOST_TEXT = ("another alert's message holds this step: TensorBoard's default data server keeps one text per tag and "
             "step (`tensorboard --load_fast=false` keeps both); the message is in the run's headwatch_alerts.jsonl")


def alerts(provider: Any, ctx: Any, experiment_id: str, run: str) -> dict[str, Any]:
    """The alerts of one run on a timeline: the markers (``<prefix>/alerts/<rule>[_<severity>]`` at 1) with the
    messages the alert wrote as text at the same step (``[<severity>] <message>`` under ``<prefix>/alerts``).

    Returns:
        ``{"run", "prefix", "last_step", "alerts": [{"step", "rule", "severity", "message", "note"}]}`` sorted by
        step, then rule; ``message`` is None for a marker without a message (``note`` says why: two alerts at one
        step write two texts under one tag, and TensorBoard's default data server keeps the last); a message
        without a marker is listed with ``rule`` None. ``last_step``: the run's last step of ``<prefix>/logits/entropy`` (the timeline's end).
    """
    tags = _run_tags(provider, ctx, experiment_id, run)
    prefix = run_prefix(tags)
    if prefix is None:
        return {"run": run, "prefix": None, "last_step": None, "alerts": []}
    markers = _marker_tags(tags, prefix)
    entropy = f"{prefix}/logits/entropy"
    points = read_points(provider, ctx, experiment_id, run, [*markers, *([entropy] if entropy in tags else [])])
    fired = sorted((s, *markers[tag]) for tag in markers for s, v in points.get(tag, []) if v == 1.0)
    text_tag = f"{prefix}/alerts{TEXT_SUFFIX}"
    messages = _texts(provider, ctx, experiment_id, run, [text_tag]).get(text_tag, [])
    by_step: dict[int, list[tuple[str, str]]] = {}
    for step, text in messages:
        found = _SEVERITY.match(text)
        by_step.setdefault(step, []).append((found.group(1) if found else "", text[found.end():] if found else text))
    out = []
    for step, rule, severity in fired:
        pending = by_step.get(step, [])
        same = [m for m in pending if m[0] == severity]
        pick = next((m for m in same if rule in m[1]), same[0] if len(same) == 1 else None)
        if pick is not None:
            pending.remove(pick)
        out.append({"step": step, "rule": rule, "severity": severity, "message": pick[1] if pick else None, "note": None})
    for step, pending in by_step.items():
        out += [{"step": step, "rule": None, "severity": sev or None, "message": text, "note": None} for sev, text in pending]
    texts_at = {step for step, _ in messages}
    for a in out:
        if a["message"] is None:
            a["note"] = (LOST_TEXT if a["step"] in texts_at else "no message was written with this marker")
    out.sort(key=lambda a: (a["step"], a["rule"] or ""))
    last = points.get(entropy, [])
    return {"run": run, "prefix": prefix, "last_step": last[-1][0] if last else None, "alerts": out}


_STR = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|nan|inf)(?:e[-+]?\d+)?)"
_ROW = re.compile(rf"^\| (\d+) `{_STR}` \| (\d+) \| (\d+) `{_STR}` \| (\d+) \| {_NUMBER} \| {_NUMBER} \|$")
_NONE = re.compile(r"^no rare token collides at tau = (\S+)")


def parse_pairs_table(text: str) -> dict[str, Any]:
    """Read the collision monitor's text table (``collision/top_pairs_<m>``) back into rows.

    Returns:
        ``{"pairs": [{"token", "text", "count", "neighbour", "neighbour_text", "neighbour_count", "cosine",
        "raw_cosine"}], "tau": float | None, "note": str}``: ``text``/``neighbour_text`` are the decoded tokens
        (the table holds their Python ``repr``); ``tau`` is given when no pair collides; ``note`` is the line
        under the table (the rows left out of the search).
    """
    table, _, note = text.partition("\n\n")
    pairs = []
    for line in table.splitlines():
        found = _ROW.match(line.strip())
        if found is None:
            continue
        r, r_text, r_count, j, j_text, j_count, cos, raw = found.groups()
        pairs.append({
            "token": int(r), "text": ast.literal_eval(r_text), "count": int(r_count),
            "neighbour": int(j), "neighbour_text": ast.literal_eval(j_text), "neighbour_count": int(j_count),
            "cosine": finite(float(cos)), "raw_cosine": finite(float(raw)),
        })  # fmt: skip
    none = _NONE.match(table.strip())
    return {"pairs": pairs, "tau": float(none.group(1)) if none else None, "note": note.strip()}


def collisions(provider: Any, ctx: Any, experiment_id: str, run: str) -> dict[str, Any]:
    """The collision tables of one run, every measurement, newest first.

    Returns:
        ``{"run", "prefix", "tables": [{"matrix": "head" | "embedding", "step", "tau", "note", "pairs": [...]}]}``
        (:func:`parse_pairs_table` gives the pairs: rare token, its decoded text and count, its nearest row,
        that row's text and count, the cosine with the drift removed and the raw cosine).
    """
    from tensorboard.data import provider as tb_provider

    listed = provider.list_tensors(ctx, experiment_id=experiment_id, plugin_name=TEXT,
                                   run_tag_filter=tb_provider.RunTagFilter(runs=[run]))  # fmt: skip
    text_tags = set(listed.get(run, {}))
    prefix = run_prefix(_run_tags(provider, ctx, experiment_id, run))
    if prefix is None:
        return {"run": run, "prefix": None, "tables": []}
    wanted = {f"{prefix}/collision/top_pairs_{m}{TEXT_SUFFIX}": m for m in ("head", "embedding")}
    texts = _texts(provider, ctx, experiment_id, run, [t for t in wanted if t in text_tags])
    tables = [{"matrix": wanted[tag], "step": step, **parse_pairs_table(text)} for tag, rows in texts.items() for step, text in rows]
    tables.sort(key=lambda t: (-t["step"], t["matrix"] != "head"))
    return {"run": run, "prefix": prefix, "tables": tables}


def all_points(provider: Any, ctx: Any, experiment_id: str, run: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of one run, ``{tag: [(step, value)]}`` (what a report of the run reads)."""
    return read_points(provider, ctx, experiment_id, run, _run_tags(provider, ctx, experiment_id, run))


def json_safe(data: Any) -> Any:
    """``data`` with every float that is NaN or infinite replaced by None (``json.dumps`` would write ``NaN``)."""
    if isinstance(data, float):
        return finite(data)
    if isinstance(data, Mapping):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    return data
