"""``LogitStatsMonitor``: entropy and sharpness of the next-token distributions, live."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from headwatch._base import HeadwatchCallback, check_bool, check_module_or_name, check_positive_int, to_floats
from headwatch._capture import MaskFn, TargetsFn, find_output_head, logits_from_output, positions_from_batch
from headwatch._errors import HeadwatchError
from headwatch.figures import check_figure_argument, resolve_figure_interval
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.metrics import LogitStatsMetric

# Scalars written under ``<prefix>/logits/`` (train) and ``<prefix>/val/logits/`` (validation).
SCALAR_KEYS = (
    "entropy",
    "kl_to_uniform",
    "kl_from_uniform",
    "entropy_p05",
    "entropy_p50",
    "entropy_p95",
    "max_prob",
    "target_nll",
    "target_argmax_rate",
    "positions",
    "nonfinite_positions",
    "invalid_target_positions",
)


class LogitStatsMonitor(HeadwatchCallback):
    """Log the entropy and sharpness of the model's next-token distributions while it trains.

    Add it to a Trainer and change nothing else::

        trainer = Trainer(callbacks=[LogitStatsMonitor()])

    The monitor finds the output head (see :func:`headwatch.find_output_head`), registers
    one forward hook on it in ``setup`` (before the first forward, so a ``torch.compile``d
    model keeps it), and on logging steps only computes the statistics of the head's
    output ``(B, T, V)`` under ``no_grad`` in bounded memory. On other steps the hook
    returns at once: no host-device sync, no extra tensors.

    Positions measured: when the batch is a mapping or object with ``labels`` and/or
    ``attention_mask``, positions with ``attention_mask == 0`` or label ``ignore_index``
    are excluded; with ``shift_labels`` (the Hugging Face convention) logits at ``t``
    are scored against ``labels[t + 1]`` and the last position has no target.
    ``mask_fn(batch) -> (B, T) bool`` and ``targets_fn(batch) -> (B, T) int`` (aligned with
    the logits) override that. Other batches (e.g. tuples) are measured at every position.

    Args:
        head: the output head, a module or its dotted name; found automatically if None.
        log_every_n_steps: measure every this many optimizer steps, on the same steps as
            Lightning logs (``(step + 1) % n == 0``); None uses the Trainer's value.
        shift_labels: labels are those of the input positions (Hugging Face causal LMs).
        ignore_index: label value of positions that are not predictions.
        mask_fn: optional ``batch -> (B, T) bool`` of positions to measure.
        targets_fn: optional ``batch -> (B, T)`` integer targets aligned with the logits.
        validation: also measure every validation batch and log epoch values.
        log_histogram: with a ``TensorBoardLogger``, also write a histogram of
            per-position entropy at every logging step and validation epoch.
        max_chunk_bytes: bound on the working memory of the statistics (default 64 MiB).
        prefix: first component of every metric name.
        figure_every_n_steps: every this many steps, an image of the per-position entropy
            distribution at every logging step so far (``headwatch/logits/entropy_over_run``);
            ``"auto"``: ten logging intervals if matplotlib is installed, else off; 0/None: off.
        strict: raise on a failure to measure instead of warning once and skipping.

    Raises:
        HeadwatchError: in ``__init__`` for invalid arguments (an explicit figure interval
            without matplotlib says how to install it); in ``setup`` when the head cannot
            be found or is ambiguous (the message lists the candidates).

    Logged metrics (``<split>`` is ``logits`` for training steps, ``val/logits`` for
    validation epochs; means are over measured positions):

    - ``headwatch/<split>/entropy``: mean ``H(p) = -sum_v p_v log p_v``, nats;
    - ``headwatch/<split>/kl_to_uniform``: mean ``KL(p || U) = log V - H(p)``, nats;
    - ``headwatch/<split>/kl_from_uniform``: mean ``KL(U || p)``, nats;
    - ``headwatch/<split>/entropy_p05``, ``_p50``, ``_p95``: quantiles of ``H(p)``, nats;
    - ``headwatch/<split>/max_prob``: mean ``max_v p_v``, probability;
    - ``headwatch/<split>/target_nll``: mean ``-log p_target``, nats (needs targets);
    - ``headwatch/<split>/target_argmax_rate``: fraction of positions whose target has
      the largest logit (needs targets);
    - ``headwatch/<split>/positions``: number of measured positions;
    - ``headwatch/<split>/nonfinite_positions``: positions excluded for NaN/+inf logits;
    - ``headwatch/<split>/invalid_target_positions``: positions excluded for a target
      outside ``[0, V)`` (a vocabulary mismatch);
    - histogram ``headwatch/<split>/entropy_histogram`` (TensorBoard only).

    A measure with no valid position is NaN (and the counts say why).
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
    ) -> None:
        super().__init__(log_every_n_steps, prefix, strict)
        check_figure_argument(figure_every_n_steps)
        check_module_or_name("head", head)
        for name, value in (("shift_labels", shift_labels), ("validation", validation), ("log_histogram", log_histogram)):
            check_bool(name, value)
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise HeadwatchError(f"`ignore_index` must be an int, got {ignore_index!r}")
        for name, fn in (("mask_fn", mask_fn), ("targets_fn", targets_fn)):
            if fn is not None and not callable(fn):
                raise HeadwatchError(f"`{name}` must be None or a callable taking the batch, got {fn!r}")
        check_positive_int("max_chunk_bytes", max_chunk_bytes)

        self.head = head
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index
        self.mask_fn = mask_fn
        self.targets_fn = targets_fn
        self.validation = validation
        self.log_histogram = log_histogram
        self.max_chunk_bytes = max_chunk_bytes
        self.figure_every_n_steps = figure_every_n_steps
        self.max_figure_history = 1000
        self._figure_every = 0
        self._vocab_size = 0
        self._entropy_history: list[tuple[int, Tensor]] = []

        self._train = LogitStatsMetric(ignore_index=ignore_index, max_chunk_bytes=max_chunk_bytes)
        self._val = LogitStatsMetric(ignore_index=ignore_index, max_chunk_bytes=max_chunk_bytes)
        self._sink: LogitStatsMetric | None = None  # where the hook sends logits; None: do nothing
        self._positions: tuple[Tensor | None, Tensor | None] = (None, None)
        self._pending_step: int | None = None
        self._head_module: nn.Module | None = None
        self._head_name = ""
        self._hook_handle: Any = None
        # Run totals kept in checkpoints.
        self._logged_steps = 0
        self._total_positions = 0.0
        self._total_nonfinite = 0.0
        self._total_invalid_target = 0.0
        self._skipped_forwards = 0
        self._calls_this_batch = 0

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name, module = find_output_head(pl_module, self.head)
        if module is not self._head_module:
            self._remove_hook()
            self._hook_handle = module.register_forward_hook(self._on_head_forward)
            self._head_module, self._head_name = module, name
        self._resolve_every(trainer)
        self._figure_every = resolve_figure_interval(self.figure_every_n_steps, self._every)
        if not trainer.loggers:
            rank_zero_warn(
                "LogitStatsMonitor: the Trainer has no logger, so headwatch metrics go only to "
                "`trainer.callback_metrics`. Pass `logger=TensorBoardLogger(...)` to chart them."
            )
        self._info_once(
            f"headwatch: measuring the logits of `{name}` ({type(module).__name__}) every {self._every} steps"
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._sink = None
        self._positions = (None, None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._sink = None

    def _remove_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
            self._head_module = None

    # ------------------------------------------------------------------ capture
    def _on_head_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # The only work on steps that do not log: one attribute check.
        if self._sink is not None:
            self._capture(output)

    @torch.compiler.disable
    def _capture(self, output: Any) -> None:
        sink = self._sink
        if sink is None:
            return
        try:
            logits = logits_from_output(output)
            if logits is None:
                self._skip(f"the head returned {type(output).__name__}, not a floating-point logits tensor")
                return
            mask, targets = self._positions
            lead = logits.shape[:-1]
            for what, t in (("mask", mask), ("targets", targets)):
                if t is not None and t.shape != lead:
                    self._skip(
                        f"the batch's {what} has shape {tuple(t.shape)} but the logits have shape "
                        f"{tuple(logits.shape)}; pass mask_fn/targets_fn aligned with the logits"
                    )
                    return
            if mask is not None:
                mask = mask.to(logits.device, non_blocking=True)
            if targets is not None:
                targets = targets.to(logits.device, non_blocking=True)
            if sink.device != logits.device:
                sink.to(logits.device)
            self._vocab_size = logits.shape[-1]
            self._calls_this_batch += 1
            if self._calls_this_batch == 2 and sink is self._train:
                self._warn_once(
                    "twice",
                    f"LogitStatsMonitor: `{self._head_name}` ran more than once in one training batch; every "
                    "call is measured against the batch's labels and pooled (a second prediction head, or an "
                    "auxiliary pass, would need its own targets_fn). (warned once)",
                )
            sink.update(logits.detach(), mask, targets)
        except Exception as err:  # noqa: BLE001 - a monitoring failure must not stop training
            self._fail(err, "measuring the logits")

    def _skip(self, why: str) -> None:
        self._skipped_forwards += 1
        self._warn_once(
            f"skip:{why}", f"LogitStatsMonitor skipped a forward of `{self._head_name}`: {why}. (warned once)"
        )

    def _batch_positions(self, batch: Any) -> tuple[Tensor | None, Tensor | None]:
        try:
            mask, targets = positions_from_batch(batch, self.shift_labels, self.ignore_index)
            if self.mask_fn is not None:
                mask = self.mask_fn(batch)
                if not isinstance(mask, Tensor):
                    raise HeadwatchError(f"mask_fn must return a (B, T) bool tensor, got {type(mask).__name__}")
                mask = mask.bool()
            if self.targets_fn is not None:
                targets = self.targets_fn(batch)
                if not isinstance(targets, Tensor):
                    raise HeadwatchError(f"targets_fn must return a (B, T) tensor, got {type(targets).__name__}")
            if targets is None:
                self._warn_once(
                    "no_targets",
                    f"LogitStatsMonitor found no `labels` in a {type(batch).__name__} batch: target_nll and "
                    "target_argmax_rate are logged as NaN. For (inputs, targets) tuples pass "
                    "targets_fn=lambda batch: batch[1] (and shift_labels=False if they are already shifted). "
                    "(warned once)",
                )
            return mask, targets
        except Exception as err:  # noqa: BLE001
            self._fail(err, "reading the batch's labels/attention_mask")
            return None, None

    # ------------------------------------------------------------------ training
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self._calls_this_batch = 0
        if self._is_logging_step(step):
            self._pending_step = step
            self._positions = self._batch_positions(batch)
            self._sink = self._train
        else:
            self._sink = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sink = None
        self._positions = (None, None)
        # With gradient accumulation, several micro-batches make one step: log once it is taken.
        if self._pending_step is not None and trainer.global_step != self._pending_step:
            self._flush_train(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_step is not None:
            self._flush_train(trainer)

    def _flush_train(self, trainer: pl.Trainer) -> None:
        step = self._pending_step
        self._pending_step = None
        values = self._compute(self._train)
        if values is None or step is None:
            return
        self._logged_steps += 1
        self._publish_values(trainer, f"{self.prefix}/logits", values, step, direct=True)
        if self._figure_every > 0:
            self._entropy_figure(trainer, values.get("entropy_values"), step)

    def _entropy_figure(self, trainer: pl.Trainer, entropies: Tensor | None, step: int) -> None:
        """Keep a binned entropy distribution per logging step; draw them all every figure interval."""
        try:
            from headwatch import figures

            if entropies is None or self._vocab_size == 0:
                return
            top = figures.log_v(self._vocab_size)
            self._entropy_history.append((step, figures.entropy_histogram(entropies, top)))
            del self._entropy_history[: -self.max_figure_history]
            if (step + 1) % self._figure_every == 0:
                steps = [s for s, _ in self._entropy_history]
                hists = [h for _, h in self._entropy_history]
                figures.add_figure(trainer, f"{self.prefix}/logits/entropy_over_run", figures.entropy_over_run(steps, hists, top), step)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "drawing the entropy figure")

    # ------------------------------------------------------------------ validation
    def _measuring_validation(self, trainer: pl.Trainer) -> bool:
        return self.validation and not trainer.sanity_checking

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._measuring_validation(trainer):
            self._positions = self._batch_positions(batch)
            self._sink = self._val
        else:
            self._sink = None

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._sink = None
        self._positions = (None, None)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._measuring_validation(trainer):
            return
        values = self._compute(self._val)
        if values is not None:
            self._publish_values(
                trainer, f"{self.prefix}/val/logits", values, trainer.global_step, direct=False, pl_module=pl_module
            )

    # ------------------------------------------------------------------ logging
    def _compute(self, metric: LogitStatsMetric) -> dict[str, Tensor] | None:
        """Synchronised values (a collective: every rank calls it on the same steps)."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                values = metric.compute()
            return values
        except Exception as err:  # noqa: BLE001
            self._fail(err, "computing the statistics")
            return None
        finally:
            metric.reset()

    def _publish_values(
        self,
        trainer: pl.Trainer,
        group: str,
        values: dict[str, Tensor],
        step: int,
        direct: bool,
        pl_module: pl.LightningModule | None = None,
    ) -> None:
        try:
            scalars = {f"{group}/{k}": values[k] for k in SCALAR_KEYS if k in values}
            if direct:
                numbers = self._publish(trainer, scalars, step)
            else:
                numbers = to_floats(scalars)
                for k, v in numbers.items():
                    # identical on every rank already; sync_dist averages equal values (and silences Lightning's warning)
                    pl_module.log(k, v, on_step=False, on_epoch=True, sync_dist=True)  # type: ignore[union-attr]
            self._record_totals(group, numbers)
            entropies = values.get("entropy_values")
            if self.log_histogram and entropies is not None:
                self._write_histogram(trainer, f"{group}/entropy_histogram", entropies, step)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "logging the statistics")

    def _record_totals(self, group: str, scalars: dict[str, float]) -> None:
        positions = scalars.get(f"{group}/positions", 0.0)
        nonfinite = scalars.get(f"{group}/nonfinite_positions", 0.0)
        invalid = scalars.get(f"{group}/invalid_target_positions", 0.0)
        self._total_positions += positions
        self._total_nonfinite += nonfinite
        self._total_invalid_target += invalid
        if nonfinite > 0:
            self._warn_once(
                "nonfinite",
                f"headwatch: {int(nonfinite)} positions had NaN or +inf logits at this step; they are excluded "
                f"from the means and counted in {group}/nonfinite_positions. (warned once)",
            )
        if invalid > 0:
            self._warn_once(
                "invalid_target",
                f"headwatch: {int(invalid)} positions have a target id outside [0, vocab_size) of the head "
                f"`{self._head_name}`: the labels and the head disagree on the vocabulary. They are excluded and "
                f"counted in {group}/invalid_target_positions. (warned once)",
            )
        if positions == 0:
            self._warn_once(
                f"empty:{group}",
                f"headwatch: no valid position in {group} at this step (every position masked, ignored or "
                "non-finite); the means are logged as NaN. (warned once)",
            )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "logged_steps": self._logged_steps,
            "total_positions": self._total_positions,
            "total_nonfinite_positions": self._total_nonfinite,
            "total_invalid_target_positions": self._total_invalid_target,
            "failures": self._failures,
            "skipped_forwards": self._skipped_forwards,
            "entropy_history": [(step, hist.tolist()) for step, hist in self._entropy_history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._logged_steps = int(state_dict.get("logged_steps", 0))
        self._total_positions = float(state_dict.get("total_positions", 0.0))
        self._total_nonfinite = float(state_dict.get("total_nonfinite_positions", 0.0))
        self._total_invalid_target = float(state_dict.get("total_invalid_target_positions", 0.0))
        self._failures = int(state_dict.get("failures", 0))
        self._skipped_forwards = int(state_dict.get("skipped_forwards", 0))
        self._entropy_history = [
            (int(step), torch.tensor(hist, dtype=torch.float64)) for step, hist in state_dict.get("entropy_history", [])
        ]
