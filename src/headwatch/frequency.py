"""``TokenFrequency``: token counts of the training inputs, counted once and shared by every monitor."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from headwatch._base import HeadwatchCallback
from headwatch._capture import find_input_embedding
from headwatch._errors import HeadwatchError

BUCKETS = ("top1", "top10", "top50", "tail", "unseen")
"""Frequency buckets by count rank among the seen valid tokens (see :class:`TokenFrequency`)."""

_BUCKET_EDGES = (0.01, 0.10, 0.50)


class FrequencySnapshot(NamedTuple):
    """Token counts summed over every process, with the derived masks; all tensors ``(V,)``."""

    counts: Tensor
    """int64, occurrences of each token id in the training inputs so far."""
    valid: Tensor
    """bool, rows that can occur (not padded vocabulary, not ``padding_idx``)."""
    bucket: Tensor
    """int64 index into :data:`BUCKETS`; -1 for rows that are not valid."""
    rare: Tensor
    """bool, the rare tokens (seen, and rare by the tracker's one definition)."""

    @property
    def seen(self) -> Tensor:
        return self.valid & (self.counts > 0)


def _count_order(counts: Tensor, seen: Tensor) -> Tensor:
    """Token ids by count, highest first, ties by ascending id; unseen last."""
    # float64 keys are exact for counts below 2**53, and sort far faster than int64 on the CPU
    key = torch.where(seen, counts.double(), torch.full_like(counts, -1, dtype=torch.float64))
    return torch.sort(-key, stable=True).indices


def _rank_of(order: Tensor) -> Tensor:
    """Inverse permutation: ``rank[order[i]] = i``."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def frequency_buckets(counts: Tensor, valid: Tensor, order: Tensor | None = None) -> Tensor:
    """Bucket of every row by count rank among seen valid tokens.

    Seen valid tokens are ranked by count, highest first (ties by token id); with ``n`` of
    them, ranks ``r = 0..n-1`` go to ``top1`` for ``r < ceil(0.01 n)``, ``top10`` for
    ``r < ceil(0.10 n)``, ``top50`` for ``r < ceil(0.50 n)``, else ``tail``; valid tokens
    never seen go to ``unseen``; rows that are not valid get -1.

    Args:
        counts: ``(V,)`` integer counts.
        valid: ``(V,)`` bool.

    Returns:
        ``(V,)`` int64 indices into :data:`BUCKETS`.
    """
    if counts.shape != valid.shape or counts.ndim != 1:
        raise HeadwatchError(f"expected counts and valid of shape (V,), got {tuple(counts.shape)} and {tuple(valid.shape)}")
    V = counts.numel()
    seen = valid & (counts > 0)
    rank = _rank_of(order if order is not None else _count_order(counts, seen))
    n = int(seen.sum())
    bucket = torch.full((V,), BUCKETS.index("tail"), dtype=torch.long, device=counts.device)
    for index in reversed(range(len(_BUCKET_EDGES))):
        bucket = torch.where(rank < math.ceil(_BUCKET_EDGES[index] * n), torch.tensor(index, device=counts.device), bucket)
    bucket = torch.where(seen, bucket, torch.tensor(BUCKETS.index("unseen"), device=counts.device))
    return torch.where(valid, bucket, torch.tensor(-1, device=counts.device))


def rare_tokens(
    counts: Tensor, valid: Tensor, max_count: int | None = None, fraction: float = 0.5, order: Tensor | None = None
) -> Tensor:
    """The one definition of "rare" used by every headwatch monitor.

    A token is rare when it is valid, has been seen (count >= 1), and either its count is
    at most ``max_count`` (when given) or, by default, it is in the bottom ``fraction`` of
    seen tokens by count rank (ranked as in :func:`frequency_buckets`: with the default 0.5
    the rare tokens are exactly the ``tail`` bucket). Never-seen tokens are not rare: they
    are reported separately (``unseen``).

    Returns:
        ``(V,)`` bool.
    """
    seen = valid & (counts > 0)
    if max_count is not None:
        return seen & (counts <= max_count)
    n = int(seen.sum())
    rank = _rank_of(order if order is not None else _count_order(counts, seen))
    return seen & (rank >= math.ceil((1.0 - fraction) * n))


def _field(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key)
    if isinstance(batch, (tuple, list)):
        return batch[0] if key == "input_ids" and batch and isinstance(batch[0], Tensor) else None
    return getattr(batch, key, None)


class TokenFrequency(HeadwatchCallback):
    """Count every token id in the training inputs, once per step, for all headwatch monitors.

    Monitors that need frequencies find the instance in ``trainer.callbacks`` (or add one
    with default settings), so tokens are counted once however many monitors read them.
    Counting is one ``index_add_`` of the batch's ids on the device per training batch
    (no host sync); reading sums the counts over every process (``trainer.strategy.reduce``)
    and happens only on logging steps, cached per step.

    Args:
        vocab_size: the tokenizer's vocabulary size; rows ``>= vocab_size`` of a padded
            embedding can never occur and are excluded. None: every row is valid.
        valid_token_mask: ``(V,)`` bool of rows that can occur; overrides ``vocab_size``.
        embedding: the input embedding (module or dotted name); found automatically if None.
            Its ``padding_idx`` row is excluded.
        ids_fn: ``batch -> (B, T)`` token ids; default ``batch["input_ids"]`` (mapping or
            attribute) or the first element of a tuple batch. Positions with
            ``attention_mask == 0`` are not counted.
        rare_max_count: a token is rare when seen at most this many times; None: use
            ``rare_fraction``.
        rare_fraction: a token is rare when its count rank is in the bottom ``rare_fraction``
            of the seen tokens (default 0.5: the ``tail`` bucket).

    Buckets (by count rank among seen valid tokens, highest first): ``top1`` (top 1%),
    ``top10`` (1-10%), ``top50`` (10-50%), ``tail`` (the rest), ``unseen`` (count 0).

    Logged metrics (every ``log_every_n_steps`` training steps):

    - ``headwatch/tokens/seen_fraction``: seen valid tokens / valid tokens;
    - ``headwatch/tokens/total``: tokens counted so far (all processes);
    - ``headwatch/tokens/rare_count``: number of rare tokens;
    - ``headwatch/tokens/out_of_range``: ids outside ``[0, V)`` seen so far (not counted).
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        valid_token_mask: Tensor | None = None,
        embedding: str | nn.Module | None = None,
        ids_fn: Callable[[Any], Tensor] | None = None,
        rare_max_count: int | None = None,
        rare_fraction: float = 0.5,
        log_every_n_steps: int | None = None,
        prefix: str = "headwatch",
    ) -> None:
        super().__init__(log_every_n_steps, prefix, strict=False)
        if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1):
            raise HeadwatchError(f"`vocab_size` must be None or an int >= 1, got {vocab_size!r}")
        if valid_token_mask is not None and (
            not isinstance(valid_token_mask, Tensor) or valid_token_mask.dtype != torch.bool or valid_token_mask.ndim != 1
        ):
            raise HeadwatchError("`valid_token_mask` must be None or a 1-D bool tensor of shape (V,)")
        if ids_fn is not None and not callable(ids_fn):
            raise HeadwatchError(f"`ids_fn` must be None or a callable taking the batch, got {ids_fn!r}")
        if rare_max_count is not None and (not isinstance(rare_max_count, int) or rare_max_count < 1):
            raise HeadwatchError(f"`rare_max_count` must be None or an int >= 1, got {rare_max_count!r}")
        if not isinstance(rare_fraction, (int, float)) or not 0.0 < rare_fraction <= 1.0:
            raise HeadwatchError(f"`rare_fraction` must be in (0, 1], got {rare_fraction!r}")
        self.vocab_size = vocab_size
        self.valid_token_mask = valid_token_mask
        self.embedding = embedding
        self.ids_fn = ids_fn
        self.rare_max_count = rare_max_count
        self.rare_fraction = float(rare_fraction)

        self.num_rows = 0
        self.padding_idx: int | None = None
        self._local: Tensor | None = None  # (V,) int64 on the device: this process's counts since start/restore
        self._out_of_range: Tensor | None = None  # int64 scalar on the device
        self._restored = torch.zeros(0, dtype=torch.long)  # (V,) global counts from a checkpoint
        self._restored_out_of_range = 0
        self._batches = 0
        self._cache: tuple[tuple[int, int], FrequencySnapshot] | None = None
        self._trainer: pl.Trainer | None = None
        self._step_at_start = 0

    # ----------------------------------------------------------- sharing
    @classmethod
    def attach(cls, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> TokenFrequency:
        """The trainer's tracker: the one in ``trainer.callbacks``, or a new default one added there."""
        trackers = [c for c in trainer.callbacks if isinstance(c, TokenFrequency)]
        if len(trackers) > 1:
            raise HeadwatchError(
                f"{len(trackers)} TokenFrequency callbacks are attached; keep one, every monitor shares it"
            )
        if trackers:
            tracker = trackers[0]
        else:
            tracker = cls()
            trainer.callbacks.append(tracker)
            rank_zero_info("headwatch: added a TokenFrequency tracker with default settings (counts token ids)")
        if tracker.num_rows == 0:
            tracker.setup(trainer, pl_module, stage)
        return tracker

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name, module = find_input_embedding(pl_module, self.embedding)
        rows = module.weight.shape[0]
        if self.num_rows and rows != self.num_rows:
            raise HeadwatchError(f"the input embedding `{name}` has {rows} rows, but counts were kept for {self.num_rows}")
        if self.vocab_size is not None and self.vocab_size > rows:
            raise HeadwatchError(
                f"`vocab_size={self.vocab_size}` is larger than the input embedding `{name}` ({rows} rows): "
                "the tokenizer and the model disagree on the vocabulary"
            )
        if self.valid_token_mask is not None and self.valid_token_mask.numel() != rows:
            raise HeadwatchError(
                f"`valid_token_mask` has {self.valid_token_mask.numel()} entries but the input embedding "
                f"`{name}` has {rows} rows"
            )
        self.num_rows = rows
        self._fit_restored()
        self._trainer = trainer
        pad = getattr(module, "padding_idx", None)
        self.padding_idx = int(pad) if isinstance(pad, int) else None
        self._resolve_every(trainer)

    def valid_rows(self, device: torch.device | None = None) -> Tensor:
        """``(V,)`` bool: rows that can occur."""
        if self.valid_token_mask is not None:
            valid = self.valid_token_mask.clone()
        else:
            valid = torch.ones(self.num_rows, dtype=torch.bool)
            if self.vocab_size is not None:
                valid[self.vocab_size :] = False
        if self.padding_idx is not None:
            valid[self.padding_idx] = False
        return valid.to(device) if device is not None else valid

    # ----------------------------------------------------------- counting
    def _batch_ids(self, batch: Any) -> tuple[Tensor | None, Tensor | None]:
        ids = self.ids_fn(batch) if self.ids_fn is not None else _field(batch, "input_ids")
        if not isinstance(ids, Tensor) or ids.is_floating_point():
            return None, None
        attention = _field(batch, "attention_mask") if self.ids_fn is None else None
        if isinstance(attention, Tensor) and attention.shape != ids.shape:
            self._warn_once(
                "attention_shape",
                f"TokenFrequency: the batch's attention_mask has shape {tuple(attention.shape)} but input_ids "
                f"{tuple(ids.shape)}; it is ignored and every id is counted. (warned once)",
            )
            attention = None
        return ids, attention

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step
        self._batches += 1
        try:
            ids, attention = self._batch_ids(batch)
            if ids is None:
                self._warn_once(
                    "no_ids",
                    "TokenFrequency found no integer `input_ids` in the batch; pass ids_fn=lambda batch: ... "
                    "to count tokens. Frequencies stay empty for such batches. (warned once)",
                )
                return
            self.count(ids, attention)
        except Exception as err:  # noqa: BLE001 - counting must not stop training
            self._fail(err, "counting the batch's token ids")

    @torch.no_grad()
    def count(self, ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """Add ``ids`` (any shape) to the counts; positions with ``attention_mask == 0`` are skipped."""
        V = self.num_rows
        if V == 0:
            raise HeadwatchError("TokenFrequency.count called before setup: the vocabulary size is unknown")
        flat = ids.reshape(-1).long()
        if self._local is None or self._local.device != flat.device:
            self._local = torch.zeros(V, dtype=torch.long, device=flat.device)
            self._out_of_range = torch.zeros((), dtype=torch.long, device=flat.device)
        in_range = (flat >= 0) & (flat < V)
        weight = in_range
        if attention_mask is not None:
            keep = attention_mask.reshape(-1).to(flat.device) != 0
            weight = weight & keep
            self._out_of_range += (~in_range & keep).sum()
        else:
            self._out_of_range += (~in_range).sum()
        # index_add_ instead of bincount: bincount syncs on CUDA to size its output
        self._local.index_add_(0, flat.clamp(0, V - 1), weight.long())

    # ----------------------------------------------------------- reading
    def snapshot(self, trainer: pl.Trainer) -> FrequencySnapshot:
        """Counts summed over every process, with buckets and rare tokens (a collective: call on all ranks)."""
        key = (trainer.global_step, self._batches)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        device = self._local.device if self._local is not None else torch.device("cpu")
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long, device=device)
        total = trainer.strategy.reduce(local.clone(), reduce_op="sum")
        if self._restored.numel():
            total = total + self._restored.to(device)
        snap = self._derive(total)
        self._cache = (key, snap)
        return snap

    def latest_snapshot(self) -> FrequencySnapshot:
        """The last snapshot summed over processes; before the first one, this process's counts.

        Not a collective: safe inside a forward hook.
        """
        if self._cache is not None:
            return self._cache[1]
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long)
        return self._derive(local + self._restored.to(local.device) if self._restored.numel() else local)

    def _derive(self, counts: Tensor) -> FrequencySnapshot:
        valid = self.valid_rows(counts.device)
        order = _count_order(counts, valid & (counts > 0))  # one sort for both
        return FrequencySnapshot(
            counts=counts,
            valid=valid,
            bucket=frequency_buckets(counts, valid, order),
            rare=rare_tokens(counts, valid, self.rare_max_count, self.rare_fraction, order),
        )

    def _out_of_range_total(self, trainer: pl.Trainer) -> int:
        local = self._out_of_range if self._out_of_range is not None else torch.zeros((), dtype=torch.long)
        return int(trainer.strategy.reduce(local.clone(), reduce_op="sum")) + self._restored_out_of_range

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step_at_start
        if trainer.global_step == step or not self._is_logging_step(step):
            return  # still accumulating, or not a logging step
        try:
            snap = self.snapshot(trainer)
            t = f"{self.prefix}/tokens"
            scalars = {
                f"{t}/seen_fraction": snap.seen.sum(dtype=torch.float64) / snap.valid.sum(dtype=torch.float64).clamp(min=1),
                f"{t}/total": snap.counts.sum(dtype=torch.float64),
                f"{t}/rare_count": snap.rare.sum(dtype=torch.float64),
                f"{t}/out_of_range": float(self._out_of_range_total(trainer)),
            }
            self._publish(trainer, scalars, step)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "logging token counts")

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Global counts: Lightning calls this on every process when saving, so the sum is taken here."""
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long)
        oor = self._out_of_range if self._out_of_range is not None else torch.zeros((), dtype=torch.long)
        both = torch.cat([local, oor.reshape(1).to(local.device)])
        if self._trainer is not None:
            both = self._trainer.strategy.reduce(both.clone(), reduce_op="sum")
        both = both.cpu()
        counts = both[:-1] + self._restored if self._restored.numel() else both[:-1]
        return {
            "version": 1,
            "counts": counts.clone(),
            "out_of_range": int(both[-1]) + self._restored_out_of_range,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        counts = state_dict.get("counts")
        self._restored = counts.long().cpu().clone() if isinstance(counts, Tensor) else torch.zeros(0, dtype=torch.long)
        self._restored_out_of_range = int(state_dict.get("out_of_range", 0))
        self._local = None
        self._out_of_range = None
        self._cache = None
        self._fit_restored()

    def _fit_restored(self) -> None:
        """Restored counts for a vocabulary resized since the checkpoint: an explicit, logged policy.

        Grown (tokens added at the end, as ``resize_token_embeddings`` does): the new rows start at 0.
        Shrunk: the counts cannot be mapped, so counting starts afresh (they stay in the checkpoint).
        """
        have, want = self._restored.numel(), self.num_rows
        if have == 0 or want == 0 or have == want:
            return
        if have < want:
            self._restored = torch.cat([self._restored, torch.zeros(want - have, dtype=torch.long)])
            self._warn_once(
                "resized",
                f"TokenFrequency: the checkpoint counted {have} token ids, the embedding now has {want} rows; "
                "the added rows start at count 0. (warned once)",
            )
        else:
            self._restored = torch.zeros(0, dtype=torch.long)
            self._warn_once(
                "resized",
                f"TokenFrequency: the checkpoint counted {have} token ids but the embedding now has only {want} "
                "rows; the restored counts cannot be mapped and counting starts afresh (the checkpoint keeps "
                "them). (warned once)",
            )
