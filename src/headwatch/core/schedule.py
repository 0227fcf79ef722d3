"""The one step schedule: which steps a monitor measures."""

from __future__ import annotations

from dataclasses import dataclass

from headwatch.errors import check_int


@dataclass(frozen=True)
class Schedule:
    """Measure on step ``s`` (0-based, the engine's logging x axis) when ``(s + 1) % every == 0``.

    This is Lightning's rule for its own logging steps and the Hugging Face Trainer's
    (``global_step % logging_steps == 0`` with ``global_step = s + 1``). ``every == 0``:
    never.

    Raises:
        HeadwatchError: ``every`` is not an int >= 0.
    """

    every: int

    def __post_init__(self) -> None:
        check_int("every", self.every, minimum=0)

    def is_logging_step(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def scaled(self, factor: int) -> Schedule:
        return Schedule(self.every * factor)
