"""The headwatch pages of TensorBoard's CUSTOM SCALARS dashboard, one layout a run.

The charts are declared in :mod:`headwatch.tensorboard.charts`: categories in page order (the vital signs first and
open, the others closed), each chart one series a run or one margin band. A run's layout holds only the
charts whose tags the run wrote: :class:`LayoutTracker` watches the tags going into the run's
``SummaryWriter`` and :func:`headwatch.tensorboard.write_layout` rewrites the layout at the next flush
after a chart gets its first tag (TensorBoard reads the last layout a run wrote). So an RL category appears
with the first ``rl/`` value, a synonym chart with the first synonym measurement, an alert chart with the
first alert of its rule, and a plain run shows no empty chart.

``dashboards/headwatch.json`` holds the layout of every chart, as TensorBoard's
``/data/plugin/custom_scalars/layout`` serves it: ``python -m headwatch.tensorboard.layout --json``
regenerates it; ``--write LOGDIR`` writes the layout of the charts whose tags LOGDIR's event files hold
(every chart with ``--all``) into LOGDIR as one more event file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from headwatch.tensorboard.charts import CATEGORIES, CHARTS, Chart, chart_tag

CONFIG_TAG = "custom_scalars__config__"
"""The tag TensorBoard's custom-scalars plugin reads the layout from (``metadata.CONFIG_SUMMARY_TAG``)."""


def category_title(category: str, page: str) -> str:
    """The title of a category on the page: ``"headwatch: vital signs"`` for ``page="headwatch"``."""
    title = next(c.title for c in CATEGORIES if c.key == category)
    return f"{page}: {title}"


def layout_proto(prefix: str = "headwatch", category: str | None = None, charts: Iterable[Chart] | None = None) -> Any:
    """The layout as TensorBoard's ``layout_pb2.Layout``: ``charts`` (default every chart of
    :data:`headwatch.tensorboard.charts.CHARTS`) in their categories, in declaration order, empty categories left out.

    The charts read the tags under ``prefix``; the page is named ``category`` (default ``prefix``: the
    Hugging Face door reads ``train/headwatch/...`` on pages named ``headwatch``)."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    page = category or prefix
    chosen = set(CHARTS if charts is None else charts)
    layout = layout_pb2.Layout()
    for cat in CATEGORIES:
        members = [c for c in CHARTS if c.category == cat.key and c in chosen]
        if not members:
            continue
        out = layout.category.add(title=category_title(cat.key, page), closed=cat.closed)
        for chart in drawn_order(members):  # written so that TensorBoard draws them in the declared order
            tags = [chart_tag(s, chart.kind, prefix) for s in chart.series]
            if chart.kind in ("Margin", "Line"):
                value, lower, upper = tags if chart.kind == "Margin" else tags * 3  # a Line: a band of no width
                out.chart.add(title=chart.title).margin.series.add(value=value, lower=lower, upper=upper)
            else:
                out.chart.add(title=chart.title).multiline.tag.extend(tags)
    return layout


def drawn_order(charts: list[Any]) -> list[Any]:
    """Charts of one category in the order TensorBoard 2.21's CUSTOM SCALARS page draws them, given their
    order in the layout: the Multiline charts in order, then the margin charts in reverse order (measured in
    Chromium: ``tests/tensorboard/test_browser.py`` checks it). Its own inverse: :func:`layout_proto` writes
    ``drawn_order(declared)``, so the page draws the declared order. ``charts``: :class:`Chart` objects or
    the layout's charts (``layout_pb2.Chart`` or their JSON)."""

    def multiline(c: Any) -> bool:
        if isinstance(c, Chart):
            return c.kind == "Multiline"
        return c.HasField("multiline") if hasattr(c, "HasField") else "multiline" in c

    return [c for c in charts if multiline(c)] + [c for c in charts if not multiline(c)][::-1]


def build_layout(prefix: str = "headwatch", category: str | None = None, charts: Iterable[Chart] | None = None) -> dict[str, Any]:
    """:func:`layout_proto` as JSON-able data, the form TensorBoard's ``/data/plugin/custom_scalars/layout``
    serves (a ``closed`` that is false is left out, as protobuf's JSON leaves default values out)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(layout_proto(prefix, category, charts))


def layout_summary(layout: Any) -> Any:
    """A ``Summary`` holding ``layout`` (a ``layout_pb2.Layout``) as TensorBoard's custom-scalars plugin reads it.

    (``torch.utils.tensorboard``'s ``add_custom_scalars`` takes a dict and drops ``Category.closed``.)"""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    return Summary(value=[Summary.Value(tag=CONFIG_TAG, tensor=tensor, metadata=metadata)])


class LayoutTracker:
    """The charts one run has: a chart joins when the first tag it draws is written.

    Args:
        prefix: the tags' prefix (``headwatch``, ``train/headwatch``).
        category: the page name (default ``prefix``).
        charts: the charts a run can get (default every chart of :data:`headwatch.tensorboard.charts.CHARTS`).

    Checking a tag costs a set lookup once the tag was seen: each new tag is matched against the charts
    not yet present once.
    """

    def __init__(self, prefix: str = "headwatch", category: str | None = None, charts: Iterable[Chart] | None = None) -> None:
        self.prefix, self.category = prefix, category
        self._tests: list[tuple[Chart, re.Pattern[str] | str]] = []
        for chart in CHARTS if charts is None else charts:
            first = chart_tag(chart.series[0], chart.kind, prefix)
            self._tests.append((chart, re.compile(first) if chart.kind == "Multiline" else first))
        self.present: list[Chart] = []
        self.changed = False
        """True when a chart joined since :meth:`layout` was last called."""
        self._seen: set[str] = set()

    def observe(self, tags: Iterable[str]) -> bool:
        """Note ``tags`` as written; True when a chart joined the layout."""
        joined = False
        for tag in tags:
            if tag in self._seen:
                continue
            self._seen.add(tag)
            hits = [c for c, test in self._tests if ((tag == test) if isinstance(test, str) else test.match(tag) is not None)]
            if hits:
                self.present += hits
                self._tests = [(c, t) for c, t in self._tests if c not in hits]
                joined = True
        self.changed |= joined
        return joined

    def layout(self) -> Any:
        """The ``layout_pb2.Layout`` of the charts present (in page order); clears :attr:`changed`."""
        self.changed = False
        return layout_proto(self.prefix, self.category, self.present)


class LayoutWriter:
    """An observer of a :class:`~headwatch.tensorboard.guard.GuardedFileWriter`: feeds every written tag to
    its :class:`LayoutTracker` objects and, at each flush after a chart joined, writes the run's layout (the
    charts of every tracker) at the step of the last event."""

    def __init__(self) -> None:
        self.trackers: dict[tuple[str, str | None], LayoutTracker] = {}

    def track(self, prefix: str, category: str | None) -> LayoutTracker:
        return self.trackers.setdefault((prefix, category), LayoutTracker(prefix, category))

    def observe(self, event: Any) -> None:
        if event.HasField("summary"):
            tags = [v.tag for v in event.summary.value]
            for tracker in self.trackers.values():
                tracker.observe(tags)

    def before_flush(self, file_writer: Any) -> None:
        if not any(t.changed for t in self.trackers.values()):
            return
        layouts = [t.layout() for t in self.trackers.values()]
        merged = layouts[0]
        for other in layouts[1:]:
            merged.category.extend(other.category)
        from tensorboard.compat.proto.event_pb2 import Event

        file_writer.add_event(Event(summary=layout_summary(merged)), file_writer.last_step)


def charts_in(tags: Iterable[str], prefix: str = "headwatch") -> list[Chart]:
    """The charts, in page order, that draw at least one of ``tags``."""
    tracker = LayoutTracker(prefix)
    tracker.observe(tags)
    return [c for c in CHARTS if c in set(tracker.present)]


def _logdir_tags(logdir: str) -> set[str]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 1, "tensors": 1, "histograms": 1, "images": 1})
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    return {tag for run in multiplexer.Runs().values() for tag in run.get("scalars", [])}


def layout_json(layout: dict[str, Any]) -> str:
    """``layout`` (:func:`build_layout`) as JSON text, one chart a line (``dashboards/headwatch.json``)."""
    categories = []
    for category in layout.get("category", []):
        head = {k: v for k, v in category.items() if k != "chart"}
        charts = ",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in category.get("chart", []))
        categories.append("  " + json.dumps(head, ensure_ascii=False)[:-1] + ', "chart": [\n' + charts + "\n  ]}")
    return '{"category": [\n' + ",\n".join(categories) + "\n]}\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m headwatch.tensorboard.layout --json`` or ``--write LOGDIR [--all]``; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m headwatch.tensorboard.layout", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="headwatch", help="the tags' prefix (train/headwatch: the Hugging Face Trainer)")
    parser.add_argument("--category", default=None, help="the page name (default: the prefix)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--json", action="store_true", help="print the layout of every chart as JSON (dashboards/headwatch.json)")
    group.add_argument("--write", metavar="LOGDIR", help="write the layout into LOGDIR as a TensorBoard event file")
    parser.add_argument("--all", action="store_true", help="with --write: every chart, not only those whose tags LOGDIR holds")
    args = parser.parse_args(argv)
    if args.json:
        sys.stdout.write(layout_json(build_layout(args.prefix, args.category)))
        return 0
    charts = None if args.all else charts_in(_logdir_tags(args.write), args.prefix)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(args.write)
    writer.file_writer.add_summary(layout_summary(layout_proto(args.prefix, args.category, charts)))
    writer.close()
    count = len(CHARTS) if charts is None else len(charts)
    print(f"wrote the headwatch layout ({count} charts) into {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
