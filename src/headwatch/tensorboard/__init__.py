"""TensorBoard output: scalars, media and the Custom Scalars layout (:mod:`headwatch.tensorboard.layout`)."""

from headwatch.tensorboard.guard import GuardedFileWriter, guard, storage_status
from headwatch.tensorboard.writer import (
    MarkerSink,
    WriterSink,
    flush,
    guarded,
    prefixed,
    write_histogram,
    write_layout,
    write_media,
    batched_scalars,
    write_scalars,
    write_text,
)

__all__ = ["GuardedFileWriter", "MarkerSink", "batched_scalars", "SummaryWriter", "guarded_writer_class", "WriterSink", "guard", "guarded", "storage_status", "flush", "prefixed", "write_histogram", "write_layout", "write_media", "write_scalars", "write_text"]


def __getattr__(name: str):  # imported on first use: torch.utils.tensorboard is slow to import
    if name in ("SummaryWriter", "guarded_writer_class"):
        from headwatch.tensorboard import summary_writer

        return getattr(summary_writer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
