"""TensorBoard event files read back: scalars by tag, the Custom Scalars layout."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2, metadata


def read_events(logdir: str) -> EventAccumulator:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def reload(path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0, "images": 0})
    acc.Reload()
    return acc


def layouts(path) -> list[layout_pb2.Layout]:
    """Every Custom Scalars layout written under ``path``, in order (none: ``[]``)."""
    acc = reload(path)
    if metadata.CONFIG_SUMMARY_TAG not in acc.Tags()["tensors"]:
        return []
    return [layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in acc.Tensors(metadata.CONFIG_SUMMARY_TAG)]
