"""``CaptureTally``: what :class:`~headwatch.core.logits.LogitStats` measured on a training logging step, for the
self-check (:class:`~headwatch.core.self_check.SelfCheck`, ``docs/self_check.md``)."""

from __future__ import annotations

import torch
from torch import Tensor

from headwatch.core.tolerance import EPS


class CaptureTally:
    """What :class:`~headwatch.core.logits.LogitStats` measured on the current training logging step.

    ``forwards``: measured forwards on this process (a Python int); ``labelled``: positions of their
    targets ``(B, T)`` that predict a label (``target != ignore_index``), summed on the device (no sync);
    ``dtype``: the coarsest dtype the measured forwards' logits were scored in (None: unknown); ``vocab_size``:
    their columns ``V``.
    """

    def __init__(self) -> None:
        self.forwards = 0
        self.labelled: Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.vocab_size = 0

    def add(self, targets: Tensor | None, ignore_index: int, dtype: torch.dtype | None = None, vocab_size: int = 0) -> None:
        """One measured forward with its (aligned) ``targets`` ``(B, T)`` or None (no labels), scored in ``dtype``
        over ``vocab_size`` columns."""
        self.forwards += 1
        if dtype is not None and (self.dtype is None or EPS.get(dtype, 0.0) > EPS.get(self.dtype, 0.0)):
            self.dtype = dtype
        self.vocab_size = max(self.vocab_size, vocab_size)
        if targets is not None:
            n = (targets.long() != ignore_index).sum()  # int64: -100 wraps in a uint8 compare
            self.labelled = n if self.labelled is None else self.labelled + n.to(self.labelled.device)

    def take(self) -> tuple[int, Tensor | None]:
        """``(forwards, labelled)`` of the step, and reset (read ``dtype`` and ``vocab_size`` before)."""
        out = (self.forwards, self.labelled)
        self.forwards, self.labelled, self.dtype, self.vocab_size = 0, None, None, 0
        return out
