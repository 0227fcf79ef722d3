"""``LogitStats``: entropy and sharpness of the next-token distributions, trainer-free."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.core.forwards import NOT_LOSS_REASONS, not_loss_forward
from headwatch.core.frequency import TokenCounts
from headwatch.core.logit_split import SplitSums
from headwatch.core.metrics import SCALAR_KEYS
from headwatch.core.monitor import Monitor
from headwatch.core.self_check import CaptureTally, scored_dtype
from headwatch.distributed.reduce import Values
from headwatch.errors import (
    HeadwatchError,
    StateReader,
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_module_or_name,
    check_optional,
    check_positive_int,
    check_range,
)
from headwatch.functional.calibration import ECE_BINS, MAX_ECE_BINS
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.model.at_loss import SOURCES
from headwatch.model.batch import BatchFormat, BatchView
from headwatch.model.capture import PATHS, Captured, LogitsCapture
from headwatch.model.captured import REPRODUCTION_RTOL, captured_statistics
from headwatch.model.sources import ALIGNMENTS, LogitsSource, resolve_logits_source

__all__ = ["SCALAR_KEYS", "LogitStats"]  # SCALAR_KEYS: the scalars of LogitStatsMetric, published under
# ``<prefix>/logits/`` and ``<prefix>/val/logits/`` (derived from the fields of LogitStatistics)


class LogitStats(Monitor):
    """Logit statistics of the logits the model returns, on logging steps (see :class:`headwatch.LogitStatsMonitor`).

    Which tensor: :func:`headwatch.model.sources.resolve_logits_source` (a Hugging Face model's
    ``outputs.logits``, after any post-head transform; else the head's output, or
    ``logits_module=``); the final hidden states and the head's weight when the logits are not
    there (fused loss, ``logits_to_keep``): :class:`headwatch.model.capture.LogitsCapture`.
    Off logging steps each hook returns after one attribute check. Under ``torch.compile``
    the hooks only keep detached references (no graph break, so ``fullgraph=True`` works) and
    they are measured in :meth:`batch_end`.

    From the same per-position statistics (no second pass): ECE and over-confidence, and with
    ``frequency`` (the shared :class:`TokenCounts`) loss, accuracy and confidence by target
    bucket (:mod:`headwatch.core.logit_split`). Validation is kept per dataloader; with more than
    one, names carry Lightning's ``/dataloader_idx_<k>`` suffix.

    Args: see :class:`headwatch.LogitStatsMonitor`; ``figure_every``: steps between entropy
    figures (0: none); ``frequency``: the shared :class:`TokenCounts` (target buckets);
    ``temperature``: ``T`` > 0, the statistics are of ``softmax(logits / T)`` (an RL policy's sampling
    distribution, ``docs/rl.md``); ``ece_bins``: ``M``, the equal-width bins of the ECE (default 15, at most ``2**22``; the last
    bin ``[1 - 1/M, 1]`` is closed: ``docs/calibration.md``). The Hugging Face and plain-loop doors
    take a configured object in ``monitors=[LogitStats(ece_bins=...)]``.

    Raises:
        HeadwatchError: an invalid argument (checked here, whatever the front door).
    """

    validation_media = True  # the validation entropy histogram

    name = "logits"

    def __init__(
        self,
        head: str | nn.Module | None = None,
        batch_format: BatchFormat | None = None,
        log_histogram: bool = True,
        figure_every: int = 0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        prefix: str = "headwatch",
        strict: bool = False,
        logits_module: str | nn.Module | None = None,
        hidden_module: str | nn.Module | None = None,
        alignment: str | None = None,
        path: str = "auto",
        vocab_size: int | None = None,
        frequency: TokenCounts | None = None,
        ece_bins: int = ECE_BINS,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(prefix, strict, batch_format)
        for name, module in (("head", head), ("logits_module", logits_module), ("hidden_module", hidden_module)):
            check_module_or_name(name, module)
        check_bool("log_histogram", log_histogram)
        check_int("figure_every", figure_every, minimum=0)
        check_positive_int("max_chunk_bytes", max_chunk_bytes)
        check_optional(check_choice, "alignment", alignment, ALIGNMENTS)
        check_choice("path", path, PATHS)
        check_optional(check_int, "vocab_size", vocab_size, minimum=1)
        check_optional(check_instance, "frequency", frequency, TokenCounts)
        self.ece_bins = check_int("ece_bins", ece_bins, minimum=1, maximum=MAX_ECE_BINS)
        self.temperature = temperature  # checked by the setter
        """The sampling temperature ``T``: every statistic is of ``softmax(logits / T)`` (RL policies, ``docs/rl.md``;
        the Hugging Face door sets it from TRL's ``GRPOTrainer`` / ``RLOOTrainer``). 1: the logits as they are."""
        self.head = head
        self.logits_module, self.hidden_module, self.alignment, self.path = logits_module, hidden_module, alignment, path
        self.tokenizer_vocab_size = vocab_size
        self.frequency = frequency
        self.val_dataloaders = 1  # a front door that knows sets it (Lightning: len(trainer.num_val_batches))
        self._buckets: tuple[Tensor, Tensor] | None = None  # (bucket, rare) of the armed batch
        self.source: LogitsSource | None = None
        self._capturer: LogitsCapture | None = None
        self._format = self.batch_format
        self._capture_problem = False
        self.log_histogram = log_histogram
        self.figure_every = figure_every
        self.max_figure_history = 1000
        self._train = SplitSums(self.batch_format.ignore_index, max_chunk_bytes, self.ece_bins)
        self._val: dict[int, SplitSums] = {}  # per validation dataloader
        self._val_buckets: tuple[Tensor, Tensor] | None = None  # frequencies of this validation epoch
        self._sink: SplitSums | None = None  # where the capture sends statistics; None: do nothing
        self._view: BatchView | None = None
        self._max_chunk_bytes = max_chunk_bytes
        self._step: int | None = None
        self._computing: int | None = None  # the step whose sums are being reduced
        self._head_module: nn.Module | None = None
        self.head_name = ""
        self.vocab_size = 0
        self._calls = 0
        self._accepted = 0
        self.entropy_history: list[tuple[int, Tensor]] = []
        self._history_on_device = 0  # the last entries of entropy_history, still on the device
        self._gaps: dict[int, list[Tensor]] = {}  # per split (id of its sums): each forward's reproduction gap
        self.logged_steps = 0
        self.totals = {"positions": 0.0, "nonfinite_positions": 0.0, "invalid_target_positions": 0.0}
        self.skipped_forwards = 0
        self.fused_head_in_float32 = False
        """TRL's fused LM head projects in float32 outside autocast (``cast_lm_head_to_fp32``): the reproduction of
        what its values lack follows it (the Hugging Face door sets it from the trainer's arguments)."""
        self.capture_tally = CaptureTally()
        self.val_tally = CaptureTally()  # the first validation dataloader's, for the evaluation's self-check
        """The forwards and labelled positions measured on the current training logging step (the self-check's)."""

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_range("temperature", value, 0, low_open=True)

    # ------------------------------------------------------------------ wiring
    def attach(self, model: nn.Module) -> None:
        source = resolve_logits_source(model, self.head, self.logits_module, self.hidden_module, self.alignment)
        if self.source is None or source.owner is not self.source.owner or source.head is not self.source.head:
            self.detach()
            self._capturer = LogitsCapture(source, self._timed_consume, self.path, model, self.strict, accept=self._accept_forward)
            self._capturer.timer = lambda: self.clock  # its hooks' work counted by the overhead budget
            self._capturer.attach()
            self.source, self._head_module, self.head_name = source, source.head, source.head_name
        self.model = model
        self._format = self.batch_format.for_alignment(source.alignment)
        weight = getattr(source.head, "weight", None)
        if isinstance(weight, Tensor) and weight.dim() == 2:
            self._check_vocab_size(weight.shape[0], f"the head `{source.head_name}`")
        self.info_once(f"headwatch: LogitStats measures {source.describe()}")

    def _check_vocab_size(self, rows: int, what: str) -> None:
        """A tokenizer vocabulary larger than the head's ``rows`` is refused: no column of the head would be padding
        (``padded_mass`` a false 0), and the labels and the head disagree on the vocabulary.

        Raises:
            HeadwatchError: ``vocab_size`` is larger than ``rows``.
        """
        known = self._known_vocab_size()
        if known is not None and known > rows:
            raise HeadwatchError(
                f"`vocab_size={known}` is larger than {what} ({rows} rows): the tokenizer and the model disagree on "
                "the vocabulary; pass the tokenizer's vocabulary size (at most the head's rows)"
            )

    def detach(self) -> None:
        if self._capturer is not None:
            self._capturer.detach()
        self._capturer, self.source, self._head_module, self.model = None, None, None, None
        self._sink, self._view = None, None

    # ------------------------------------------------------------------ capture
    def _arm(self, batch: Any, sink: SplitSums, buckets: tuple[Tensor, Tensor] | None) -> None:
        self._view, self._sink, self._buckets = self._format.read(batch), sink, buckets
        self._accepted = 0  # forwards measured in this (micro-)batch
        if self._capturer is None:
            return
        try:
            ref = self._view.targets if self._view.targets is not None else self._view.mask
        except Exception as err:  # noqa: BLE001
            self.fail(err, "reading the batch's labels/attention_mask")
            ref = None
        self._capturer.fused_head_in_float32 = self.fused_head_in_float32
        self._capturer.begin(ref.shape if ref is not None else None)

    def _accept_forward(self, grad_enabled: bool, generating: bool | None = None) -> bool:
        """The capture contract (:func:`headwatch.core.forwards.not_loss_forward`): measure this forward of the
        armed batch or not; called by the capture once per forward of the model (inside it, or at the batch's
        end for compiled code, with what was recorded inside it)."""
        training = self._sink is self._train
        why = not_loss_forward(training, grad_enabled, first=self._accepted == 0, generating=generating)
        if why is None:
            self._accepted += 1
            return True
        where = "a training step" if training else "an evaluation batch"
        self.info_once(f"headwatch: LogitStats does not measure a forward of {where}: {NOT_LOSS_REASONS[why]}. (said once)")
        return False

    def _timed_consume(self, captured: Captured) -> None:
        with self.timed():  # inside the model's forward: the overhead budget counts it as logging statistics
            self._consume(captured)

    def _consume(self, captured: Captured) -> None:
        """Called by the capture inside the forward (or at batch end under torch.compile)."""
        sink, view = self._sink, self._view
        if sink is None or view is None:
            return
        mask, targets = view.mask, view.targets
        if captured.targets is not None:  # taken at the loss: its own labels and positions (docs/sources.md)
            given, targets = mask, captured.targets
            mask = None
            if captured.ignore_index != self.batch_format.ignore_index:
                targets = torch.where(targets == captured.ignore_index, self.batch_format.ignore_index, targets)
            if given is not None and given.dim() >= 2 and targets.dim() >= 2 and given.shape[0] == targets.shape[0]:
                # rows the door marked as no prediction (the repeats of an even distributed split, keep_rows)
                dead = ~given.bool().flatten(1).any(-1)
                targets = targets.masked_fill(dead.view(-1, *([1] * (targets.dim() - 1))), self.batch_format.ignore_index)
        if targets is None:
            split = "training" if sink is self._train else "evaluation"
            self.warn_once(
                f"no_targets:{split}",
                f"LogitStatsMonitor found no `labels` in a {split} {type(view.batch).__name__} batch: target_nll, "
                "target_argmax_rate and the calibration are logged as NaN, and the entropy is averaged over every "
                "attended position (each row's last too). For (inputs, targets) tuples pass "
                "targets_fn=lambda batch: batch[1] (and shift_labels=False if they are already shifted). (warned once)",
            )
        sink.labelled.add(targets is not None)
        if len(sink.labelled) == 2:
            self.warn_once(
                "mixed_labels",
                "LogitStatsMonitor pooled batches with labels and batches without into one value: the entropy of "
                "the unlabelled ones covers every attended position, the target statistics only the labelled ones. "
                "Give every batch its labels (or none). (warned once)",
            )
        if captured.kept is not None:  # logits_to_keep: the last `kept` positions of each row
            k = captured.kept
            mask = mask[..., -k:] if mask is not None else None
            targets = targets[..., -k:] if targets is not None else None
        x = captured.logits if captured.path == "logits" else captured.hidden
        if x is None:
            raise HeadwatchError(f"the capture on the {captured.path} path holds no tensor")
        for what, t in (("mask", mask), ("targets", targets)):
            if t is not None and t.shape != x.shape[:-1]:
                raise HeadwatchError(
                    f"the batch's {what} has shape {tuple(t.shape)} but the measured positions have shape "
                    f"{tuple(x.shape[:-1])}; pass mask_fn/targets_fn aligned with the logits"
                )
        V = captured.logits.shape[-1] if captured.logits is not None else captured.weight.shape[0]  # type: ignore[union-attr]
        self.vocab_size = V
        self._check_vocab_size(V, "the measured logits' columns")  # a source whose head holds no weight
        known = self._known_vocab_size()
        padded_v = known if known is not None and known < V else None
        out = captured_statistics(
            captured, mask, targets, self.batch_format.ignore_index, padded_v, self._max_chunk_bytes, self.temperature
        )
        if out.reproduction_gap is not None:  # no reproduction (NaN) counts as beyond the tolerance
            self._gaps.setdefault(id(sink), []).append(torch.nan_to_num(out.reproduction_gap.float(), nan=float("inf")))
        padded = out.padded_mass if padded_v is not None else None
        if known is not None and padded is None:  # no column beyond the vocabulary: exactly 0
            padded = torch.zeros_like(out.statistics.max_prob)
        buckets = self._buckets
        if buckets is not None and buckets[0].numel() != V:
            self.warn_once(
                "bucket_rows",
                f"LogitStatsMonitor: the token counts have {buckets[0].numel()} rows but the logits {V} columns; "
                "calibration is logged overall only, not by target frequency. (warned once)",
            )
            buckets = None
        sink.update(out.statistics, targets, buckets, padded, V)
        if sink is self._train or sink is self._val.get(0):
            tally = self.capture_tally if sink is self._train else self.val_tally
            tally.add(targets, self.batch_format.ignore_index, scored_dtype(captured), V)
        self._calls += 1
        if self._calls == 2 and sink is self._train:
            self.warn_once(
                "twice",
                "LogitStatsMonitor: the model ran more than once with gradient in one training batch; every such "
                "forward feeds the loss and is measured against its own labels (those of its loss call, else of "
                "its inputs, else of the batch) and pooled. (warned once)",
            )

    def _disarm(self) -> None:
        if self._capturer is not None and self._sink is not None:
            report = self._capturer.end()
            if report.problem is not None and report.message is not None:
                self.skipped_forwards += 1
                self._capture_problem = True  # the cause is said: no "every position masked" warning
                self.warn_once(f"capture:{report.problem}", f"{report.message} (warned once)")
            elif report.note is not None and "forward" in report.sources:
                self.note_once(f"path:{report.reason}", f"{report.note} (said once)")
            for source in report.sources:
                if source != "forward":
                    self.info_once(
                        f"headwatch: LogitStats measures at the loss, for the forwards whose loss call it reads (in "
                        f"place of the tensor said when it attached): {SOURCES.get(source, source)}."
                    )
        self._sink, self._view = None, None

    def forward_batch(self, batch: Any) -> None:
        """A later forward with gradient of the armed training micro-batch, with its own inputs (``labels`` of its
        own, or those of the loss's inputs): it is measured against those (:meth:`Orchestrator.forward`)."""
        if self._sink is self._train and self._capturer is not None:
            self._view = self._format.read(batch)

    def _gap_to_host(self, sink: SplitSums) -> None:
        """The largest reproduction gap of the split's forwards (:mod:`headwatch.model.captured`), moved with the
        step's one transfer and read in :meth:`published`."""
        gaps = self._gaps.pop(id(sink), None)
        if gaps:
            self.media.host["reproduction_gap"] = torch.stack([g.to(gaps[0].device) for g in gaps]).max()

    # ------------------------------------------------------------------ training
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        self._calls = 0
        if logging:
            self._step = step
            self._arm(batch, self._train, self._frequency_tables())
        else:
            self._view, self._sink = None, None

    def gradients_ready(self, loss_scale: float | Tensor | None = None) -> None:
        """Close the step's capture before the optimizer moves the weights: a head that never ran (fused
        loss) is measured from the hidden states and the head's weight as the forward used them."""
        self._disarm()

    def batch_end(self) -> None:
        self._disarm()

    # ------------------------------------------------------------------ the step's sums (two phases)
    def _flags(self) -> tuple[bool, bool]:
        """``(by_frequency, padded)`` of every split: the same on every process (configuration)."""
        return self.frequency is not None, self._known_vocab_size() is not None

    def empty_sums(self, val: bool = False) -> dict[str, Tensor | Values]:
        """The training split's sums (``train/``), or each validation dataloader's (``val<k>/``), empty."""
        splits = {"train": self._train} if not val else {f"val{k}": self._val[k] for k in sorted(self._val)}
        return {f"{name}/{key}": v for name, split in splits.items() for key, v in split.empty_sums(*self._flags()).items()}

    def local_sums(self, val: bool = False) -> dict[str, Tensor | Values]:
        """This process's sums of the step (or of the validation epoch), handed over: the splits start empty."""
        if not val:
            self._computing, self._step = self._step, None
            return {f"train/{k}": v for k, v in self._train.local_sums(*self._flags()).items()}
        self._val_buckets = None
        return {f"val{k}/{key}": v for k in sorted(self._val) for key, v in self._val[k].local_sums(*self._flags()).items()}

    def skip_sums(self, val: bool = False) -> None:
        """The step's sums are dropped: the splits start empty."""
        if not val:
            self._computing, self._step = None, None
        splits = [self._train] if not val else list(self._val.values())
        for split in splits:
            split.local_sums(*self._flags())

    def from_sums(self, total: dict[str, Tensor], val: bool = False) -> dict[str, Tensor]:
        """The step's scalars (``<prefix>/logits/``), or every validation dataloader's (``<prefix>/val/logits/``, with
        ``/dataloader_idx_<k>`` when there are several), from the sums over every process."""
        self.media.histograms.clear()
        self.media.figures.clear()
        if val:
            several = self.val_dataloaders > 1 or any(k != 0 for k in self._val)
            out: dict[str, Tensor] = {}
            for k in sorted(self._val):
                self._gap_to_host(self._val[k])
                values = self._val[k].from_sums(_part(total, f"val{k}/"), *self._flags())
                out.update(self._scalars_and_media(f"{self.prefix}/val/logits", values, None, f"/dataloader_idx_{k}" if several else ""))
            return out
        step, self._computing = self._computing, None
        self.media.host.clear()
        self._figure_top = None
        self._gap_to_host(self._train)
        if step is None:
            return {}
        values = self._train.from_sums(_part(total, "train/"), *self._flags())
        self.logged_steps += 1
        return self._scalars_and_media(f"{self.prefix}/logits", values, step)

    def pending(self) -> bool:
        """A logging step was started and not computed yet."""
        return self._step is not None

    # ------------------------------------------------------------------ validation
    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        sink = self._val.get(dataloader_idx)
        if sink is None:
            sink = self._val[dataloader_idx] = SplitSums(self.batch_format.ignore_index, self._max_chunk_bytes, self.ece_bins)
        if self._val_buckets is None:  # once per validation epoch: a collective on the first batch
            self._val_buckets = self._frequency_tables()
        self._arm(batch, sink, self._val_buckets)

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        self.batch_end()

    def _known_vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size: ``vocab_size=``, else the shared token counts' when set."""
        if self.tokenizer_vocab_size is not None:
            return self.tokenizer_vocab_size
        return self.frequency.vocab_size if self.frequency is not None else None

    def _frequency_tables(self) -> tuple[Tensor, Tensor] | None:
        """``(bucket (V,), rare (V,))`` of the shared token counts, or None without them.

        The snapshot summed over processes (a collective: every rank calls it on the same steps,
        logging steps and the first validation batch of an epoch), so buckets agree across ranks.
        """
        counts = self.frequency
        if counts is None or counts.num_rows == 0:
            return None
        try:
            snap = counts.snapshot()
            return snap.bucket, snap.rare
        except Exception as err:  # noqa: BLE001
            self.fail(err, "reading the token frequencies")
            return None

    # ------------------------------------------------------------------ values
    def _scalars_and_media(self, group: str, values: dict[str, Tensor], step: int | None, suffix: str = "") -> dict[str, Tensor]:
        entropies = values.pop("entropy_values", None)  # NaN-padded: the NaNs are dropped on the host (published)
        if self.log_histogram and entropies is not None:
            self.media.histograms[f"{group}/entropy_histogram{suffix}"] = entropies
        if step is not None and self.figure_every > 0:
            self._entropy_figure(entropies, step)
        return {f"{group}/{k}{suffix}": v for k, v in values.items()}

    def _entropy_figure(self, entropies: Tensor | None, step: int) -> None:
        """Keep a binned entropy distribution per logging step (on the device); draw them all every figure
        interval (their one move to the host)."""
        try:
            from headwatch.core import figures

            if entropies is None or self.vocab_size == 0:
                return
            top = figures.log_v(self.vocab_size)
            self.entropy_history.append((step, figures.entropy_histogram(entropies, top)))
            self._history_on_device += 1
            del self.entropy_history[: -self.max_figure_history]
            if (step + 1) % self.figure_every == 0 and self.reducer.rank == 0:
                # the histograms still on the device go to the host in the step's one transfer; drawn in published()
                n = min(self._history_on_device, len(self.entropy_history))
                if n:
                    self.media.host["entropy_history"] = torch.stack([h for _, h in self.entropy_history[-n:]])
                self._figure_top = top
        except Exception as err:  # noqa: BLE001
            self.fail(err, "drawing the entropy figure")

    def _draw_entropy_figure(self) -> None:
        """The entropy figure of a figure step, from the histories moved to the host with the step's values."""
        top, self._figure_top = getattr(self, "_figure_top", None), None
        moved = self.media.host.pop("entropy_history", None)
        if moved is not None:
            n = moved.shape[0]
            self.entropy_history[-n:] = [(step, h) for (step, _), h in zip(self.entropy_history[-n:], moved.unbind(0))]
            self._history_on_device = 0
        if top is None:
            return
        try:
            from headwatch.core import figures

            self._history_to_host()  # nothing left on the device unless the transfer was skipped
            steps, hists = [s for s, _ in self.entropy_history], [h for _, h in self.entropy_history]
            self.media.figures[f"{self.prefix}/logits/entropy_over_run"] = figures.entropy_over_run(steps, hists, top)
        except Exception as err:  # noqa: BLE001
            self.fail(err, "drawing the entropy figure")

    def _history_to_host(self) -> None:
        """Move the entropy histograms still on the device (the last ``_history_on_device``) to the host, in one transfer."""
        n, self._history_on_device = min(self._history_on_device, len(self.entropy_history)), 0
        if n == 0:
            return
        recent = self.entropy_history[-n:]
        moved = torch.stack([h for _, h in recent]).cpu().unbind(0)
        self.entropy_history[-n:] = [(step, h) for (step, _), h in zip(recent, moved)]

    def published(self, numbers: dict[str, float]) -> None:
        """Totals and warnings from the values a front door published (floats, no extra sync); the entropy
        histograms (on the host now) lose their NaNs, the positions that were not valid; the entropy figure
        of a figure step is drawn (from the histories moved with the values)."""
        self._draw_entropy_figure()
        gap = self.media.host.pop("reproduction_gap", None)
        if gap is not None and not float(gap) <= REPRODUCTION_RTOL:  # on the host now: no sync
            why = ("the final hidden states of the loss's positions were not found" if math.isinf(float(gap)) else
                   f"a reproduction from the final hidden states at the loss's precision differs from the loss's own "
                   f"NLL by {float(gap):.2g} (relative; at most {REPRODUCTION_RTOL:g} is the loss's tensor): another "
                   "transform, precision or temperature than the loss's")  # fmt: skip
            self.warn_once(
                "reproduction",
                f"headwatch: the loss (TRL's fused LM head) gave its own per-token NLL, entropy and top-1 flag, used as "
                f"they are, but not the top-1 probability: max_prob and its quantiles, the calibration (ece, "
                f"overconfidence, confidence by bucket), renyi2_entropy, kl_from_uniform and padded_mass are "
                f"published as NaN because {why}. (warned once)",
            )
        for tag, values in self.media.histograms.items():
            if values.device.type == "cpu":
                self.media.histograms[tag] = values[~torch.isnan(values)]
        for name in numbers:
            group, key, suffix = name.rpartition("/positions")
            if key != "/positions" or group not in (f"{self.prefix}/logits", f"{self.prefix}/val/logits"):
                continue  # a bucket's positions, or another monitor's
            if suffix and not suffix.startswith("/dataloader_idx_"):
                continue
            got = {k: numbers.get(f"{group}/{k}{suffix}", 0.0) for k in self.totals}
            for k, v in got.items():
                self.totals[k] += v
            self._warn_counts(group, got)

    def _warn_counts(self, group: str, got: dict[str, float]) -> None:
        if got["nonfinite_positions"] > 0:
            self.warn_once(
                "nonfinite",
                f"headwatch: {int(got['nonfinite_positions'])} positions had NaN or +inf logits at this step; they "
                f"are excluded from the means and counted in {group}/nonfinite_positions. (warned once)",
            )
        if got["invalid_target_positions"] > 0:
            self.warn_once(
                "invalid_target",
                f"headwatch: {int(got['invalid_target_positions'])} positions have a target id outside [0, "
                f"vocab_size) of the head `{self.head_name}`: the labels and the head disagree on the vocabulary. "
                f"They are excluded and counted in {group}/invalid_target_positions. (warned once)",
            )
        problem, self._capture_problem = self._capture_problem, False
        if got["positions"] == 0 and not problem:
            self.warn_once(
                f"empty:{group}",
                f"headwatch: no valid position in {group} at this step (every position masked, ignored or "
                "non-finite); the means are logged as NaN. (warned once)",
            )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        self._history_to_host()
        return {
            "version": 1,
            "logged_steps": self.logged_steps,
            "total_positions": self.totals["positions"],
            "total_nonfinite_positions": self.totals["nonfinite_positions"],
            "total_invalid_target_positions": self.totals["invalid_target_positions"],
            "failures": self.failures,
            "skipped_forwards": self.skipped_forwards,
            "entropy_history": [(step, hist.tolist()) for step, hist in self.entropy_history],
        }

    def reset(self) -> None:
        """A new run: totals, the entropy history, the training and validation sums and the step in progress emptied."""
        super().reset()
        self._train = SplitSums(self.batch_format.ignore_index, self._max_chunk_bytes, self.ece_bins)
        self._val, self._val_buckets, self._step, self._calls, self._accepted = {}, None, None, 0, 0
        self._computing = None
        self._sink, self._view, self._buckets, self._capture_problem = None, None, None, False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values, each checked (see ``FailurePolicy.restore``)."""

        def histogram(entry: Any) -> bool:
            return (
                isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], int) and entry[0] >= 0
                and isinstance(entry[1], (list, tuple)) and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in entry[1])
            )  # fmt: skip

        def read(r: StateReader) -> Callable[[], None]:
            logged, failures, skipped = r.count("logged_steps"), r.count("failures"), r.count("skipped_forwards")
            totals = {k: r.number(f"total_{k}") for k in self.totals}
            history = r.items("entropy_history", histogram, "a list of (step >= 0, [counts >= 0]) pairs")
            if len({len(h) for _, h in history}) > 1:
                raise r.fail("entropy_history", "histograms of one length", sorted({len(h) for _, h in history}))

            def apply() -> None:
                self.logged_steps, self.failures, self.skipped_forwards = logged, failures, skipped
                self.totals.update(totals)
                self.entropy_history = [(int(step), torch.tensor(h, dtype=torch.float64)) for step, h in history]

            return apply

        self.restore(state_dict, read)
        self._history_on_device = 0


def _part(total: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``total`` under ``prefix``, without it."""
    return {k[len(prefix) :]: v for k, v in total.items() if k.startswith(prefix)}
