"""The Hugging Face Trainer's checkpoint folders as its front door sees them: which folder a resumed ``train``
starts from, and headwatch's state file in the folder the Trainer saves (``<checkpoint folder>/headwatch_state.pt``;
failures follow the door's failure policy: warn once and go on, ``strict`` raises)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

__all__ = ["STATE_NAME", "load_state_file", "restore_state", "resume_dir", "save_state", "save_state_file"]

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


def resume_dir(callback: TrainerCallback, args: Any, state: Any) -> str | None:
    """The checkpoint folder a resumed ``train`` started from, or None for a fresh run.

    ``Trainer.train(resume_from_checkpoint=...)`` is read on the call stack (the callback is not
    handed it; ``True`` is already the resolved folder there), else ``args.resume_from_checkpoint``;
    a run whose state starts past step 0 without either resumed from
    ``<output_dir>/checkpoint-<global_step>``.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner, path = frame.f_locals.get("self"), frame.f_locals.get("resume_from_checkpoint")
            if isinstance(owner, Trainer) and isinstance(path, str) and any(cb is callback for cb in owner.callback_handler.callbacks):
                return path
            frame = frame.f_back
    finally:
        del frame
    if isinstance(getattr(args, "resume_from_checkpoint", None), str):
        return args.resume_from_checkpoint
    if state.global_step > 0:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    return None


def restore_state(callback: Any, args: Any, state: Any) -> None:
    """On a resumed run, load into ``callback`` the state its ``on_save`` wrote in the checkpoint folder
    the run resumes from (:func:`load_state_file`: warn once when it holds none)."""
    folder = resume_dir(callback, args, state)
    if folder is not None:
        load_state_file(callback.run, callback.load_state_dict, folder)


def save_state(callback: Any, args: Any, state: Any) -> None:
    """Write the callback's state to ``<output_dir>/checkpoint-<step>/headwatch_state.pt``: every rank takes the
    (collective) state, the process that saves the Trainer's state (``args.should_save``) writes."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    save_state_file(callback.run, callback.state_dict, folder, bool(args.should_save))
