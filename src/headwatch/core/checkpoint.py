"""The monitors' state as a file beside a trainer's checkpoint (``<checkpoint folder>/headwatch_state.pt``).

Trainer-free: a front door says which folder a checkpoint is written to or resumed from, and whether this
process writes; failures follow the door's failure policy (warn once and go on; ``strict`` raises).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

STATE_NAME = "headwatch_state.pt"
"""The monitors' state in each checkpoint folder (the Hugging Face Trainer's ``<output_dir>/checkpoint-<step>/``)."""


def save_state_file(policy: Any, state_dict: Callable[[], dict[str, Any]], folder: str, write: bool) -> None:
    """Take ``state_dict()`` (on every process: a collective) and, where ``write`` (the process that saves the
    checkpoint), save it as ``<folder>/headwatch_state.pt``. A failure: ``policy.fail`` (warns once, or raises
    when strict)."""
    try:
        state = state_dict()
        if write:
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, STATE_NAME))
    except Exception as err:  # noqa: BLE001
        policy.fail(err, "saving the monitors' state in the checkpoint")


def load_state_file(policy: Any, load_state_dict: Callable[[Any], None], folder: str, who: str = "HeadwatchCallback") -> None:
    """Load ``<folder>/headwatch_state.pt`` (on the CPU, weights only) into ``load_state_dict``. A folder that holds
    none is warned about once (``policy.warn_once``: the monitors' counts start afresh); a file that cannot be
    read is a failure (``policy.fail``)."""
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        policy.warn_once(
            "no_state",
            f"{who}: the run resumes from {folder!r}, which holds no {STATE_NAME}; the monitors' "
            "counts start afresh. (warned once)",
        )
        return
    try:
        load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as err:  # noqa: BLE001
        policy.fail(err, f"restoring the monitors' state from {path}")
