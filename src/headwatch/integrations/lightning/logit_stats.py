"""``LogitStatsMonitor``: entropy and sharpness of the next-token distributions, live (Lightning adapter)."""

from __future__ import annotations


import lightning.pytorch as pl
from torch import nn

from headwatch.model.find import MaskFn, TargetsFn
from headwatch.errors import HeadwatchError, check_bool, check_every, check_optional, check_str
from headwatch.model.batch import BatchFormat
from headwatch.core.logits import SCALAR_KEYS, LogitStats
from headwatch.core.figures import check_figure_argument, resolve_figure_interval
from headwatch.integrations.lightning.frequency import TokenFrequency
from headwatch.functional.calibration import ECE_BINS
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.integrations.lightning.callback import MonitorCallback
from headwatch.names import logged_metrics

__all__ = ["SCALAR_KEYS", "LogitStatsMonitor"]


class LogitStatsMonitor(LogitStats, MonitorCallback):
    """Log the entropy and sharpness of the model's next-token distributions while it trains.

    Add it to a Trainer and change nothing else: ``Trainer(callbacks=[LogitStatsMonitor()])``.
    The monitor finds the logits the model returns (:func:`headwatch.model.sources.resolve_logits_source`:
    a Hugging Face model's ``outputs.logits``, after any post-head transform; else the output
    head's), hooks them before the first forward, and on logging steps only computes their
    statistics ``(B, T, V)`` under ``no_grad``, outside autocast, in bounded memory
    (:class:`headwatch.core.LogitStats`); from the final hidden states and the head's weight
    when the model never computes the full logits (fused loss, ``logits_to_keep``). Positions are read with one
    :class:`~headwatch.core.BatchFormat`: ``attention_mask == 0`` and ``ignore_index``
    targets are excluded; with ``shift_labels`` logits at ``t`` are scored against
    ``labels[t + 1]``; ``mask_fn`` / ``targets_fn`` (aligned with the logits) override.

    Args:
        head: the output head, a module or its dotted name; found automatically if None.
        log_every_n_steps: measure on the steps Lightning logs (``(step + 1) % n == 0``);
            None uses the Trainer's value.
        shift_labels: see :class:`~headwatch.core.BatchFormat`.
        ignore_index: see :class:`~headwatch.core.BatchFormat`.
        mask_fn: see :class:`~headwatch.core.BatchFormat`.
        targets_fn: see :class:`~headwatch.core.BatchFormat`.
        validation: also measure every validation batch and log epoch values.
        log_histogram: with a ``TensorBoardLogger``, a histogram of per-position entropy.
        max_chunk_bytes: bound on the working memory of the statistics (default 64 MiB).
        figure_every_n_steps: every this many steps, an image of the entropy distribution over
            the run; ``"auto"``: ten logging intervals if matplotlib is installed; 0/None: off.
        prefix: first component of every metric name.
        strict: raise on a failure to measure instead of warning once and skipping.
        batch_format: a :class:`~headwatch.core.BatchFormat` replacing the four batch arguments.
        logits_module: a module whose output holds the logits to measure, instead of the
            automatic choice (a Hugging Face model's ``outputs.logits``, else the head's output).
        hidden_module: a module whose first input is the final hidden states (a fused loss),
            for models that never compute the logits of every position.
        alignment: ``"causal"``, ``"seq2seq"`` or ``"aligned"`` targets; None: from the model
            (``config.is_encoder_decoder``) and ``shift_labels``.
        path: ``"auto"``, ``"logits"`` or ``"hidden"`` (force the hidden-state path).
        vocab_size: the tokenizer's vocabulary size; with wider logits, ``padded_mass`` is logged.
        compare_loss: the key of a metric the LightningModule logs with ``on_step=True`` (e.g. ``"train_loss"``):
            its token-mean cross-entropy, compared on logging steps with ``target_nll`` by the self-check
            (``check/nll_gap``, ``docs/self_check.md``); read from ``trainer.callback_metrics`` on logging
            steps only. None: no comparison.
        ece_bins: ``M``, the equal-width confidence bins of ``ece`` (default 15): ``[m/M, (m+1)/M)``,
            the last one ``[1 - 1/M, 1]`` closed, so a confidence of exactly 1 is in it (``docs/calibration.md``).

    Raises:
        HeadwatchError: in ``__init__`` for invalid arguments; at set-up when the head cannot
            be found or is ambiguous (the message lists the candidates).

    Logged metrics (``<split>`` is ``logits`` for training steps, ``val/logits`` for
    validation epochs, each name under ``prefix``; NaN when no valid position; with several
    validation dataloaders each validation name ends in ``/dataloader_idx_<k>``). ``padded_mass``
    needs ``vocab_size=`` or the shared ``TokenFrequency``'s ``vocab_size``; the per-bucket values
    (``<bucket>``: ``top1``, ``top10``, ``top50``, ``tail``, ``unseen``, ``rare``) need the shared
    :class:`~headwatch.TokenFrequency`, added with defaults if absent. The list that follows
    (``help(LogitStatsMonitor)``) is appended at import from :data:`headwatch.names.METRICS`,
    where the formulas are (and in the metric reference, ``docs/reference/metrics.md``):
    """

    def __init__(
        self,
        head: str | nn.Module | None = None,
        log_every_n_steps: int | None = None,
        shift_labels: bool = True,
        ignore_index: int = -100,
        mask_fn: MaskFn | None = None,
        targets_fn: TargetsFn | None = None,
        validation: bool = True,
        log_histogram: bool = True,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        figure_every_n_steps: int | str | None = "auto",
        prefix: str = "headwatch",
        strict: bool = False,
        batch_format: BatchFormat | None = None,
        logits_module: str | nn.Module | None = None,
        hidden_module: str | nn.Module | None = None,
        alignment: str | None = None,
        path: str = "auto",
        vocab_size: int | None = None,
        ece_bins: int = ECE_BINS,
        compare_loss: str | None = None,
    ) -> None:
        # the core checks its own arguments (LogitStats, BatchFormat); these are the adapter's
        check_every("log_every_n_steps", log_every_n_steps)
        check_figure_argument(figure_every_n_steps)
        check_bool("validation", validation)
        self.compare_loss = check_optional(check_str, "compare_loss", compare_loss)
        own = BatchFormat(shift_labels=shift_labels, ignore_index=ignore_index, mask_fn=mask_fn, targets_fn=targets_fn)
        fmt = batch_format if batch_format is not None else own  # the four are checked even when it replaces them
        super().__init__(
            head, fmt, log_histogram, 0, max_chunk_bytes, prefix, strict,
            logits_module=logits_module, hidden_module=hidden_module, alignment=alignment, path=path,
            vocab_size=vocab_size, ece_bins=ece_bins,
        )  # fmt: skip
        self.log_every_n_steps = log_every_n_steps
        self.shift_labels, self.ignore_index = fmt.shift_labels, fmt.ignore_index
        self.mask_fn, self.targets_fn = fmt.mask_fn, fmt.targets_fn
        self.validation = validation
        self.max_chunk_bytes = max_chunk_bytes
        self.figure_every_n_steps = figure_every_n_steps

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super()._attach(trainer, pl_module, stage)
        if self.frequency is None:
            self.frequency = self._shared_frequency(trainer, pl_module)
        self.figure_every = resolve_figure_interval(self.figure_every_n_steps, self.schedule.every)
        if not trainer.loggers:
            self.warn_once(
                "no_logger",
                "LogitStatsMonitor: the Trainer has no logger, so headwatch metrics go only to "
                "`trainer.callback_metrics`. Pass `logger=TensorBoardLogger(...)` to chart them.",
            )
        what = self.source.describe() if self.source is not None else f"the logits of `{self.head_name}`"
        self._info_once(f"headwatch: measuring the logits every {self.schedule.every} steps: {what}")

    def _shared_frequency(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TokenFrequency | None:
        """The trainer's shared ``TokenFrequency`` (added with defaults if absent), for the target buckets.

        A model whose input embedding cannot be resolved keeps the logit statistics and overall
        calibration; only the per-bucket values are not logged (said once).
        """
        before = len(trainer.callbacks)
        try:
            return TokenFrequency.of_trainer(trainer, pl_module)
        except HeadwatchError as err:
            del trainer.callbacks[before:]  # a default tracker that cannot count this model
            self.warn_once(
                "no_frequency",
                f"LogitStatsMonitor: no token frequencies ({err}); loss, accuracy and calibration are logged "
                "overall, not by target frequency. Pass a TokenFrequency(embedding=...) in callbacks. (warned once)",
            )
            return None

    # ------------------------------------------------------------------ validation
    def _measuring_validation(self, trainer: pl.Trainer) -> bool:
        return self.validation and not trainer.sanity_checking and self.model is not None


if LogitStatsMonitor.__doc__ is not None:  # None under python -OO
    LogitStatsMonitor.__doc__ = LogitStatsMonitor.__doc__.rstrip() + "\n\n" + logged_metrics("LogitStatsMonitor") + "\n"
