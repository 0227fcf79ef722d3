"""One batch contract for every monitor: where the ids, labels and attention mask are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError, argument_error, check_bool, check_callable, check_int, check_optional, check_str


def field(batch: Any, key: str | None) -> Any:
    """``batch[key]`` for a mapping (dict, ``BatchEncoding``), ``batch.key`` for an object, None for a tuple."""
    if key is None:
        return None
    if isinstance(batch, Mapping):
        return batch.get(key)
    if isinstance(batch, (tuple, list)):
        return None
    return getattr(batch, key, None)


@dataclass(frozen=True)
class BatchFormat:
    """Where a training batch keeps its token ids, labels and attention mask.

    Args:
        ids_key: field name (in a mapping) or attribute of the token ids.
        labels_key: field name or attribute of the labels.
        mask_key: field name or attribute of the attention mask.
        shift_labels: labels are those of the input positions (Hugging Face causal LMs:
            logits at ``t`` are scored against ``labels[t + 1]``); False: labels are aligned
            with the logits (seq2seq models, ``(inputs, targets)`` tuples).
        ignore_index: target value of positions that are not predictions.
        ids_fn: ``batch -> (B, T)`` token ids; default ``ids_key``, or the first element of a
            tuple batch.
        mask_fn: ``batch -> (B, T) bool`` of logits positions to measure; default
            ``attention_mask != 0``.
        targets_fn: ``batch -> (B, T)`` integer targets aligned with the logits (no shift is
            applied); default from ``labels_key``.

    ``read(batch)`` gives a :class:`BatchView`; every monitor reads batches through it.

    Raises:
        HeadwatchError: a key that is not a non-empty string, ``shift_labels`` not a bool,
            ``ignore_index`` not an int, a ``*_fn`` that is neither None nor callable.
    """

    ids_key: str = "input_ids"
    labels_key: str = "labels"
    mask_key: str = "attention_mask"
    shift_labels: bool = True
    ignore_index: int = -100
    ids_fn: Callable[[Any], Tensor] | None = None
    mask_fn: Callable[[Any], Tensor] | None = None
    targets_fn: Callable[[Any], Tensor] | None = None

    def __post_init__(self) -> None:
        for name in ("ids_key", "labels_key", "mask_key"):
            check_str(name, getattr(self, name))
        check_bool("shift_labels", self.shift_labels)
        check_int("ignore_index", self.ignore_index)
        for name in ("ids_fn", "mask_fn", "targets_fn"):
            check_optional(check_callable, name, getattr(self, name), "a callable taking the batch")

    def for_alignment(self, alignment: str) -> BatchFormat:
        """This format adapted to the model kind (:data:`headwatch.model.sources.ALIGNMENTS`).

        ``"causal"``: unchanged. ``"aligned"``: labels as given (``shift_labels=False``).
        ``"seq2seq"`` (T5): labels as given and, unless ``mask_fn``/``targets_fn`` say
        otherwise, the mask is ``decoder_attention_mask`` (the batch's ``attention_mask`` is the
        encoder's and never masks decoder positions).
        """
        if alignment == "seq2seq" and self.mask_fn is None and self.targets_fn is None:
            return replace(self, shift_labels=False, mask_key="decoder_attention_mask")
        if alignment in ("seq2seq", "aligned"):
            return replace(self, shift_labels=False)
        return self

    def read(self, batch: Any) -> BatchView:
        """A lazy view of ``batch``: each field is read on first access only."""
        return BatchView(self, batch)


class BatchView:
    """``ids``, ``ids_mask``, ``mask`` and ``targets`` of one batch, read on first access.

    Raises (on access):
        HeadwatchError: a ``*_fn`` returned something other than a tensor.
    """

    def __init__(self, fmt: BatchFormat, batch: Any) -> None:
        self.format = fmt
        self.batch = batch

    @cached_property
    def ids(self) -> Tensor | None:
        """``(B, T)`` integer token ids, or None."""
        f, batch = self.format, self.batch
        named = True
        if f.ids_fn is not None:
            ids = f.ids_fn(batch)
        elif isinstance(batch, (tuple, list)):
            ids, named = (batch[0] if batch else None), False
        else:
            ids = field(batch, f.ids_key)
        if not isinstance(ids, Tensor):
            return None
        integer = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
        if not integer and (named or ids.dtype == torch.bool):  # a tuple's first float tensor is not ids
            where = "what `ids_fn` returns" if f.ids_fn is not None else f"the batch's `{f.ids_key}`"
            raise argument_error(where, "an integer tensor of token ids (int64, int32, ...; not bool or float)", ids)
        return ids if integer else None

    @cached_property
    def ids_mask(self) -> Tensor | None:
        """``attention_mask`` of the ids (same shape), when the ids come from the batch's own field."""
        if self.format.ids_fn is not None:
            return None
        attention = field(self.batch, self.format.mask_key)
        return attention if isinstance(attention, Tensor) else None

    def _read(self, fn: str, key: str, expected: str) -> tuple[Any, bool]:
        """``(value, from_fn)``: what the format's ``fn`` (``mask_fn``, ``targets_fn``) returns for this batch,
        checked to be a tensor, when it is set; else the batch's field named by the format's ``key``."""
        user = getattr(self.format, fn)
        if user is None:
            return field(self.batch, getattr(self.format, key)), False
        value = user(self.batch)
        if not isinstance(value, Tensor):
            raise HeadwatchError(f"{fn} must return a {expected}, got {type(value).__name__}")
        return value, True

    @cached_property
    def mask(self) -> Tensor | None:
        """``(B, T)`` bool: logits positions to measure; None: every position."""
        value, from_fn = self._read("mask_fn", "mask_key", "(B, T) bool tensor")
        if from_fn:
            return value.bool()
        return value != 0 if isinstance(value, Tensor) else None

    @cached_property
    def targets(self) -> Tensor | None:
        """``(B, T)`` long targets aligned with the logits (``ignore_index`` where none), or None."""
        f = self.format
        labels, from_fn = self._read("targets_fn", "labels_key", "(B, T) tensor")
        if from_fn:
            return labels.long()
        if not isinstance(labels, Tensor) or labels.ndim < 1 or labels.is_floating_point():
            return None
        labels = labels.long()
        if not f.shift_labels:
            return labels
        pad = torch.full_like(labels[..., :1], f.ignore_index)
        return torch.cat([labels[..., 1:], pad], dim=-1)

    def masked_targets(self) -> Tensor | None:
        """``targets`` with ``ignore_index`` where ``mask`` is False."""
        targets, mask = self.targets, self.mask
        if targets is None or mask is None or mask.shape != targets.shape:
            return targets
        return torch.where(mask.to(targets.device), targets, torch.full_like(targets, self.format.ignore_index))
