"""What the examples print: one line per phase, a periodic training line, and no third-party noise.

Every line the examples print themselves starts with the phase in brackets, e.g.
``[tokenizer] training a byte-level BPE tokenizer ...``. The filters below live here, in the
examples, and never in the headwatch library: a user's own job keeps every message Lightning and
headwatch send.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.warnings import PossibleUserWarning

NOISE = (
    r"^GPU available: ",  # the accelerator lines: the summary says where the run ran
    r"^TPU available: ",
    r"^HPU available: ",
    r"^💡 Tip: ",  # Lightning's litlogger advertisement
    r"^`Trainer\(limit_\w+_batches=1(\.0)?\)` was configured so",  # restates our own argument
    r"^`Trainer.fit` stopped: `max_steps=\d+` reached",  # the [training] done line says it
    r"^LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES",
)
"""Lightning info messages the examples drop (regular expressions, matched at the start)."""

_NOISE_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",  # rank_zero_info of Lightning (headwatch's own lines too: kept)
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(re.search(pattern, message) for pattern in NOISE)


_FILTER = _DropNoise()


def quiet_third_party() -> None:
    """Drop the third-party messages a user of the example cannot act on (idempotent).

    - Lightning's info lines listed in :data:`NOISE` (headwatch's ``headwatch: ...`` lines stay);
    - the deprecation of ``LeafSpec`` raised inside Lightning by torch >= 2.10 (Lightning's code,
      not the user's);
    - "does not have many workers": the token windows live in memory, worker processes would
      only add start-up time.
    """
    for name in _NOISE_LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)  # the same instance is added once
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*", category=PossibleUserWarning)


def say(phase: str, message: str) -> None:
    """Print one line of phase ``phase``: ``[phase] message``."""
    print(f"[{phase}] {message}", flush=True)


class Clock:
    """Seconds since creation, for the ``(12.3 s)`` at the end of a phase's line."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"({time.perf_counter() - self.start:.1f} s)"


class TrainingLines(Callback):
    """Without the progress bar: a ``[training] step s/N  loss x nats  t s`` line every ``every_s`` seconds.

    The first optimizer step and the last one always print, so a run shows it started and ended
    even when it is shorter than ``every_s``. ``loss`` is the training loss of that step's batch
    (read from ``training_step``'s output: one host-device sync per printed line, none otherwise).
    """

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._start = self._last = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._last = -float("inf")  # the first step prints

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if now - self._last < self.every_s and not last:
            return
        self._last = now
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        shown = "n/a" if loss is None else f"{float(loss):.3f} nats"
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        say("training", f"step {trainer.global_step}{total}  loss {shown}  {now - self._start:.0f} s")
