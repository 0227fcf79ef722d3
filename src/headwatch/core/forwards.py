"""Which forwards of a step headwatch measures: the ones the loss is computed from, written once for every door.

The rule (the capture contract, ``docs/capture.md``), applied by :class:`headwatch.core.LogitStats` and
:class:`headwatch.core.SynonymCollision` to every forward of the watched model, and by
:meth:`headwatch.core.orchestrator.Orchestrator.forward` to decide which forward starts a micro-batch:

- in a training step, a forward is measured when it runs with gradient enabled
  (``torch.is_grad_enabled()``): a loss that is backpropagated was computed from it. Passes run
  under ``torch.no_grad()`` / ``torch.inference_mode()`` (reference or old log-probabilities, a
  second pass for metrics such as TRL's fused-head pass, ``generate()``) feed no gradient and are
  never measured;
- in an evaluation batch there is no gradient to tell them apart: the first forward that is not
  part of a ``generate()`` call is the loss forward and is measured; the forwards of
  ``generate()`` (its prompt pass and every decoding step) and any later forward of the same
  batch (a second pass for a metric) are not.

A forward is "part of a ``generate()`` call" when it runs inside a method named ``generate`` of an
``nn.Module`` (Hugging Face ``GenerationMixin.generate``, nanoGPT's ``generate``, a PEFT model's).
headwatch wraps those of the watched model when it attaches
(:func:`headwatch.model.generation.watch_generate`), and its hooks record inside the forward whether one
runs, so the rule holds for compiled models too, whose forwards are replayed after they ran; a
``generate`` it did not wrap is found by walking the call stack from inside an eager forward
(:func:`headwatch.model.capture.in_generation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from headwatch.model.batch import BatchFormat
from headwatch.model.capture import in_generation

NOT_LOSS_REASONS = {
    "no_grad": "it ran without gradient (torch.no_grad / inference_mode) during a training step, so no loss that "
    "trains was computed from it (a reference or old log-probability pass, a second pass for metrics, generate())",
    "generation": "it is part of a generate() call (the prompt pass or a decoding step), not the loss's forward",
    "later": "it is not the first forward of the evaluation batch (a second pass, for a metric)",
}
"""Why a forward is not measured: key -> the sentence said once (info)."""


def not_loss_forward(training: bool, grad_enabled: bool, first: bool, generating: bool | None = None) -> str | None:
    """None when a forward is one the step's loss is computed from, else the reason (a key of :data:`NOT_LOSS_REASONS`).

    Args:
        training: the forward belongs to a training step (False: an evaluation batch).
        grad_enabled: ``torch.is_grad_enabled()`` while the forward ran.
        first: no forward of this evaluation batch was measured yet (ignored in training).
        generating: the forward ran inside a ``generate()`` call, as recorded while it ran (True or False);
            None: not recorded, then this must be called while the forward runs (a forward hook, eager):
            :func:`~headwatch.model.capture.in_generation` tests the call stack.

    In training the ``generate()`` test never runs (``generate()`` runs under ``no_grad``), so the
    per-forward cost there is one flag.
    """
    if training:
        return None if grad_enabled else "no_grad"
    if in_generation() if generating is None else generating:
        return "generation"
    return None if first else "later"


def skipped_in_training(training: bool, grad_enabled: bool) -> str | None:
    """During a training step: None when a forward can feed the loss (training mode, gradient enabled), else
    ``"generation"`` (part of a ``generate()`` call: an RL trainer sampling completions) or ``"no_grad"`` (a
    reference or old log-probability pass, a metrics pass). Walks the call stack for the first kind: call it
    on logging steps only (the self-check's ``debug/capture/generation_forwards``, ``debug/capture/no_grad_forwards``)."""
    if training and grad_enabled:
        return None
    return "generation" if in_generation() else "no_grad"


def keep_rows(batch: Any, rows: int, batch_format: BatchFormat) -> Any | None:
    """``batch`` with its rows from ``rows`` on marked as no prediction (``attention_mask`` 0, labels
    ``ignore_index``), for the monitors only (the model keeps its batch); None when ``batch`` is not a
    mapping holding ``input_ids`` (it cannot be marked)."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get(batch_format.ids_key), Tensor):
        return None
    ids = batch[batch_format.ids_key]
    if rows >= ids.shape[0]:
        return batch
    out = dict(batch)
    mask = batch.get(batch_format.mask_key)
    mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device) if not isinstance(mask, Tensor) else mask.clone()
    mask[rows:] = 0
    out[batch_format.mask_key] = mask
    labels = batch.get(batch_format.labels_key)
    if isinstance(labels, Tensor):
        labels = labels.clone()
        labels[rows:] = batch_format.ignore_index
        out[batch_format.labels_key] = labels
    return out
