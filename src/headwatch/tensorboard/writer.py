"""Everything headwatch writes to TensorBoard: scalars, histograms, text, images, the layout, flushes.

Works on ``torch.utils.tensorboard.SummaryWriter`` objects; the front doors give it theirs
(Lightning's ``TensorBoardLogger.experiment``, the Hugging Face Trainer's writer, or the
writer a plain loop passes). Call it on rank zero only.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor

from headwatch.core.monitor import Media
from headwatch.functional.rows import finite_histogram_values
from headwatch.tensorboard.guard import guard, torch_writer_class

_layout_written: "weakref.WeakKeyDictionary[Any, set[tuple[str, str | None]]]" = weakref.WeakKeyDictionary()
"""Writers without a guard that were given the whole layout, with the (prefix, category) pairs they got."""


def guarded(writers: Iterable[Any]) -> list[Any]:
    """``writers`` as a list, each made to survive storage faults (:func:`headwatch.tensorboard.guard.guard`)."""
    return [guard(w) for w in writers]


def write_layout(writers: Iterable[Any], prefix: str = "headwatch", category: str | None = None) -> None:
    """Give each writer the headwatch CUSTOM SCALARS layout of its run (:mod:`headwatch.tensorboard.layout`).

    A ``torch.utils.tensorboard.SummaryWriter`` gets a :class:`~headwatch.tensorboard.layout.LayoutWriter`
    on its guarded file writer: the layout holds the charts whose tags the writer wrote (since headwatch first
    wrote to it), and is rewritten at the first flush after a chart gets its first tag (nothing is written
    before the first such tag). Other
    writers (``tensorboardX``, stand-ins with ``add_custom_scalars``) get the layout of every chart once, in
    the dict form their ``add_custom_scalars`` takes (every category open). Idempotent per writer, prefix and
    category.

    Args:
        writers: the run's writers.
        prefix: the prefix of the tags the charts read (``train/headwatch`` for the Hugging Face Trainer).
        category: the page name (default ``prefix``).
    """
    from headwatch.tensorboard.guard import GuardedFileWriter
    from headwatch.tensorboard.layout import LayoutWriter, build_layout

    for writer in guarded(writers):
        file_writer = getattr(writer, "file_writer", None)
        if isinstance(file_writer, GuardedFileWriter):
            observer = next((o for o in file_writer.observers if isinstance(o, LayoutWriter)), None)
            if observer is None:
                observer = LayoutWriter()
                file_writer.observers.append(observer)
            observer.track(prefix, category).observe(file_writer.tags)  # the tags written before it was asked for
            continue
        given = _layout_written.setdefault(writer, set())
        if (prefix, category) in given:
            continue
        writer.add_custom_scalars(_dict_layout(build_layout(prefix, category)))
        writer.flush()
        given.add((prefix, category))


def _dict_layout(layout: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """A layout as ``add_custom_scalars(layout)`` takes it: ``{category: {chart: [kind, tags]}}``."""
    out: dict[str, dict[str, list[Any]]] = {}
    for category in layout.get("category", []):
        charts = out.setdefault(category["title"], {})
        for chart in category.get("chart", []):
            if "margin" in chart:
                s = chart["margin"]["series"][0]
                charts[chart["title"]] = ["Margin", [s["value"], s["lower"], s["upper"]]]
            else:
                charts[chart["title"]] = ["Multiline", list(chart["multiline"]["tag"])]
    return out


@contextmanager
def batched_scalars(writers: Iterable[Any]) -> Iterator[None]:
    """Inside, the ``add_scalar`` calls on each of ``writers`` are collected and written as one event per writer and
    step (one summary value per tag, as ``tf.summary.merge_all`` wrote them; TensorBoard reads each value as
    ``add_scalar``'s) when the block ends or the writer's ``flush()`` is called in it.

    For a ``torch.utils.tensorboard.SummaryWriter``: its ``add_scalar`` makes one event per scalar, a hand-over to
    its writing thread each (0.13 ms on a CPU: 20 ms for the 150 scalars of a logging step, against 2 ms for one
    event). Other writers (``tensorboardX``, stand-ins) and None are left as they are. Each writer's methods are
    its own again after the block, whatever happened in it.
    """
    with ExitStack() as stack:
        for writer in guarded(w for w in writers if isinstance(w, torch_writer_class())):
            stack.enter_context(_batched(writer))
        yield


@contextmanager
def _batched(writer: Any) -> Iterator[None]:
    """:func:`batched_scalars` of one ``torch.utils.tensorboard.SummaryWriter``."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import scalar

    pending: dict[tuple[Any, Any], list[Any]] = {}
    own = {name: writer.__dict__[name] for name in ("add_scalar", "flush") if name in writer.__dict__}

    def add_scalar(tag: str, scalar_value: Any, global_step: Any = None, walltime: Any = None,
                   new_style: bool = False, double_precision: bool = False) -> None:  # fmt: skip
        summary = scalar(tag, scalar_value, new_style=new_style, double_precision=double_precision)
        pending.setdefault((global_step, walltime), []).extend(summary.value)

    def emit() -> None:
        for (step, walltime), values in pending.items():
            writer._get_file_writer().add_summary(Summary(value=values), step, walltime)  # noqa: SLF001 - as add_scalar
        pending.clear()

    def flush() -> None:
        emit()
        (own.get("flush") or type(writer).flush.__get__(writer))()

    writer.add_scalar, writer.flush = add_scalar, flush
    try:
        yield
    finally:
        for name in ("add_scalar", "flush"):
            if name in own:
                setattr(writer, name, own[name])
            else:
                delattr(writer, name)
        emit()


def write_scalars(writers: Iterable[Any], scalars: Mapping[str, float], step: int) -> None:
    """Every scalar of ``scalars`` at ``step``, into each writer (one event per writer: :func:`batched_scalars`)."""
    writers = guarded(writers)
    with batched_scalars(writers):
        for writer in writers:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, global_step=step)


def write_histogram(writers: Iterable[Any], tag: str, values: Tensor, step: int) -> None:
    """A histogram of the finite entries of ``values``, in float64 (any finite value is kept).

    TensorBoard refuses NaN/inf (it would drop the whole histogram): they are left out, with a
    warning naming the tag (shown once per tag by Python's default warning filter).
    """
    values, skipped = finite_histogram_values(values.detach().double().cpu())
    if skipped:
        warnings.warn(
            f"headwatch: the histogram {tag!r} left out non-finite values (NaN or inf); the finite ones are written",
            UserWarning,
            stacklevel=2,
        )
    if values.numel() == 0:
        return
    # TensorBoard's default ("tensorflow") buckets end at 1e20 and drop larger values (an empty
    # histogram error); beyond that, numpy's automatic bins
    bins = "tensorflow" if float(values.abs().max()) < 1e20 else "auto"
    for writer in writers:
        writer.add_histogram(tag, values, global_step=step, bins=bins)


def write_text(writers: Iterable[Any], tag: str, text: str, step: int) -> None:
    for writer in guarded(writers):
        writer.add_text(tag, text, global_step=step)


def write_figure(writers: Iterable[Any], tag: str, figure: Any, step: int) -> None:
    """A ``matplotlib`` figure as an image, then the figure is cleared."""
    for writer in writers:
        writer.add_figure(tag, figure, global_step=step, close=False)
    figure.clear()


def write_media(writers: Iterable[Any], media: Media, step: int, histograms: bool = True) -> None:
    """A monitor's histograms, texts and figures of one measurement (the caller flushes once).

    Every item is tried: one that fails (a figure matplotlib cannot draw) does not keep the others
    from being written.

    Raises:
        Exception: the first item's error, once every item was tried.
    """
    writers = guarded(writers)
    if not writers:
        return
    calls = [(write_histogram, tag, values) for tag, values in (media.histograms.items() if histograms else ())]
    calls += [(write_text, tag, text) for tag, text in media.texts.items()]
    calls += [(write_figure, tag, figure) for tag, figure in media.figures.items()]
    first: Exception | None = None
    for write, tag, item in calls:
        try:
            write(writers, tag, item, step)
        except Exception as err:  # noqa: BLE001 - raised below, after the other items
            first = first or err
    if first is not None:
        raise first


def flush(writers: Iterable[Any]) -> None:
    """Flush now: TensorBoard reloads every 5 s, Lightning's logger flushes only every 120 s."""
    for writer in guarded(writers):
        writer.flush()


class WriterSink:
    """A :class:`~headwatch.core.publish.Sink` over ``SummaryWriter`` objects: scalars and media at
    ``step``, then one flush. ``writers``: a list, or a callable returning the writers of this moment
    (empty on ranks that do not write). ``tag_prefix`` goes before every tag (the Hugging Face Trainer's
    ``train/``)."""

    def __init__(self, writers: Any, tag_prefix: str = "", scalars: bool = True) -> None:
        self.writers, self.tag_prefix, self.scalars = writers, tag_prefix, scalars

    def current(self) -> list[Any]:
        return guarded(self.writers() if callable(self.writers) else self.writers)

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        writers = self.current()
        if not writers or not (numbers or media):
            return
        try:
            if self.scalars:
                write_scalars(writers, {self.tag_prefix + k: v for k, v in numbers.items()}, step)
            for m in media:
                write_media(writers, prefixed(m, self.tag_prefix) if self.tag_prefix else m, step)
        finally:
            flush(writers)  # what was written reaches the disk, whatever failed


class MarkerSink:
    """Where an alert writes its marker and message (:class:`headwatch.alerts.AlertSink`): scalars and texts into
    the writers of this moment (``writers``: a list, or a callable returning them; empty on ranks that do not
    write), each tag under ``tag_prefix``, flushed at once so the marker shows live."""

    def __init__(self, writers: Any, tag_prefix: str = "") -> None:
        self.writers, self.tag_prefix = writers, tag_prefix

    def current(self) -> list[Any]:
        return guarded(self.writers() if callable(self.writers) else self.writers)

    def scalar(self, tag: str, value: float, step: int) -> None:
        writers = self.current()
        write_scalars(writers, {self.tag_prefix + tag: value}, step)
        flush(writers)

    def text(self, tag: str, text: str, step: int) -> None:
        writers = self.current()
        write_text(writers, self.tag_prefix + tag, text, step)
        flush(writers)


def prefixed(media: Media, prefix: str) -> Media:
    """``media`` with every tag under ``prefix``."""
    return Media(
        {prefix + k: v for k, v in media.histograms.items()},
        {prefix + k: v for k, v in media.texts.items()},
        {prefix + k: v for k, v in media.figures.items()},
    )
