"""The self-check's tolerances: how far a figure headwatch measured may be from the trainer's own, by the dtype
the loss scored (``docs/self_check.md``, :class:`~headwatch.core.self_check.SelfCheck`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["EPS", "TOLERANCES", "Tolerance", "dtype_tolerance", "scored_dtype"]


class Tolerance(NamedTuple):
    """``|gap| <= atol + rtol * |reference|``."""

    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    "nll": Tolerance(1e-3, 1e-2),
    "entropy": Tolerance(1e-3, 1e-2),
    "accuracy": Tolerance(2e-2, 0.0),
}
"""Per compared figure, when the dtype the loss scored is not known (about bf16's at ``V = 2^16``). A near-tie
argmax flips under bf16 (2 points of accuracy). A broken capture (other positions, other labels, another forward)
moves NLL and entropy by tenths of a nat. With the dtype known, :func:`dtype_tolerance` (``docs/self_check.md``)."""

EPS: dict[torch.dtype, float] = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
"""Machine epsilon (the gap from 1 to the next number) of each floating dtype a loss can score in."""


def dtype_tolerance(key: str, dtype: torch.dtype | None, vocab_size: int) -> Tolerance:
    """The tolerance of ``key`` (``"nll"``, ``"entropy"``, ``"accuracy"``) for a loss that scored logits of ``dtype``
    over ``vocab_size`` columns: ``atol = max(eps log V / 8, floor)``, ``rtol = max(1.28 eps, 1e-4)``, ``floor``
    ``1e-5`` nats for NLL, ``5e-4`` for entropy (TRL's chunked kernel); ``eps`` of :data:`EPS`. Derivation in
    ``docs/self_check.md``. Accuracy, an unknown dtype or ``vocab_size < 2``: :data:`TOLERANCES`.

    Raises:
        KeyError: ``key`` is not a compared figure.
    """
    base = TOLERANCES[key]
    eps = EPS.get(dtype) if dtype is not None else None
    if key == "accuracy" or eps is None or vocab_size < 2:
        return base
    floor = 1e-5 if key == "nll" else 5e-4
    return Tolerance(max(eps * math.log(vocab_size) / 8, floor), max(1.28 * eps, 1e-4))


def scored_dtype(captured: Any) -> torch.dtype | None:
    """The dtype of the logits the loss scored, for its tolerance: the captured logits' own (the loss's tensor), or the
    coarser of a reproduced projection's ``precision``; None where the hidden path recomputes them in float32 (the
    model's own rounding is not known)."""
    if getattr(captured, "logits", None) is not None:
        return captured.logits.dtype
    precision = getattr(captured, "precision", None)
    return max(precision, key=lambda d: EPS.get(d, 0.0)) if precision else None
