"""TensorBoard output: scalars, media and the Custom Scalars layout (:mod:`headwatch.tensorboard.layout`)."""

from headwatch.tensorboard.writer import (
    WriterSink,
    flush,
    prefixed,
    write_histogram,
    write_layout,
    write_media,
    write_scalars,
    write_text,
)

__all__ = ["WriterSink", "flush", "prefixed", "write_histogram", "write_layout", "write_media", "write_scalars", "write_text"]
