"""The Hugging Face Trainer's checkpoint folders as its front door sees them: which folder a resumed ``train``
starts from, and headwatch's state file in the folder the Trainer saves (:mod:`headwatch.core.checkpoint`)."""

from __future__ import annotations

import inspect
import os
from typing import Any

from transformers import Trainer, TrainerCallback

from headwatch.core.checkpoint import STATE_NAME, load_state_file, save_state_file

__all__ = ["STATE_NAME", "restore_state", "resume_dir", "save_state"]


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
    the run resumes from (:func:`headwatch.core.checkpoint.load_state_file`: warn once when it holds none)."""
    folder = resume_dir(callback, args, state)
    if folder is not None:
        load_state_file(callback.run, callback.load_state_dict, folder)


def save_state(callback: Any, args: Any, state: Any) -> None:
    """Write the callback's state to ``<output_dir>/checkpoint-<step>/headwatch_state.pt``: every rank takes the
    (collective) state, the process that saves the Trainer's state (``args.should_save``) writes."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    save_state_file(callback.run, callback.state_dict, folder, bool(args.should_save))
