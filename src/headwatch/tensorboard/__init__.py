"""TensorBoard output: scalars, media and the Custom Scalars layout (:mod:`headwatch.tensorboard.layout`)."""

from headwatch.tensorboard.guard import GuardedFileWriter, guard, storage_status
from headwatch.tensorboard.writer import (
    WriterSink,
    flush,
    guarded,
    prefixed,
    write_histogram,
    write_layout,
    write_media,
    write_scalars,
    write_text,
)

__all__ = ["GuardedFileWriter", "WriterSink", "guard", "guarded", "storage_status", "flush", "prefixed", "write_histogram", "write_layout", "write_media", "write_scalars", "write_text"]
