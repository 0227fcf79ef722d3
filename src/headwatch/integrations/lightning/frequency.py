"""``TokenFrequency``: token counts of the training inputs, counted once and shared by every monitor (Lightning adapter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from headwatch.errors import HeadwatchError, check_every
from headwatch.model.batch import BatchFormat
from headwatch.core.frequency import TokenCounts
from headwatch.functional.frequency import FrequencySnapshot
from headwatch.integrations.lightning.callback import MonitorCallback

__all__ = ["TokenFrequency"]


class TokenFrequency(TokenCounts, MonitorCallback):
    """Count every token id in the training inputs, once per step, for all headwatch monitors.

    Monitors that need frequencies find the instance in ``trainer.callbacks`` (or add one
    with default settings), so tokens are counted once however many monitors read them.
    Counting is one ``index_add_`` of the batch's ids on the device per training batch
    (no host sync); reading sums the counts over every process and happens only on logging
    steps, cached per step (:class:`headwatch.core.TokenCounts`).

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
        batch_format: a :class:`~headwatch.core.BatchFormat` (its ``ids_fn`` / ``ids_key``).

    Buckets and "rare": :func:`headwatch.functional.frequency_buckets`, :func:`rare_tokens`.

    Logged metrics: ``headwatch/tokens/seen_fraction`` (seen valid / valid tokens),
    ``tokens/total`` (tokens counted, all processes), ``tokens/rare_count``,
    ``tokens/out_of_range`` (ids outside ``[0, V)``, not counted).
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
        batch_format: BatchFormat | None = None,
    ) -> None:
        check_every("log_every_n_steps", log_every_n_steps)  # the adapter's; the core checks the rest
        own = BatchFormat(ids_fn=ids_fn)
        fmt = batch_format if batch_format is not None else own  # ids_fn is checked even when it replaces it
        super().__init__(vocab_size, valid_token_mask, embedding, rare_max_count, rare_fraction, prefix, fmt)
        self.ids_fn = fmt.ids_fn
        self.log_every_n_steps = log_every_n_steps

    @classmethod
    def of_trainer(
        cls, trainer: pl.Trainer, pl_module: pl.LightningModule, embedding: str | nn.Module | None = None
    ) -> TokenFrequency:
        """The trainer's tracker: the one in ``trainer.callbacks``, or a new default one added there
        (following the calling monitor's ``embedding``, when it was told one).

        Raises:
            HeadwatchError: more than one ``TokenFrequency`` is attached.
        """
        trackers = [c for c in trainer.callbacks if isinstance(c, TokenFrequency)]
        if len(trackers) > 1:
            raise HeadwatchError(
                f"{len(trackers)} TokenFrequency callbacks are attached; keep one, every monitor shares it"
            )
        if trackers:
            tracker = trackers[0]
        else:
            tracker = cls(embedding=embedding)
            trainer.callbacks.append(tracker)
            rank_zero_info("headwatch: added a TokenFrequency tracker with default settings (counts token ids)")
        if tracker.num_rows == 0:
            tracker.setup(trainer, pl_module, "fit")
            if tracker.num_rows == 0:  # the model is not built yet: resolve it now (raises with the cause)
                tracker._attach(trainer, pl_module, "fit")
        return tracker

    def snapshot(self, trainer: pl.Trainer | None = None) -> FrequencySnapshot:
        """Counts summed over every process, with buckets and rare tokens (a collective: call on all ranks).

        ``trainer`` is accepted for the 0.1 signature and not needed.
        """
        return super().snapshot()
