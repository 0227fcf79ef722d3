"""``LogitStats``: entropy and sharpness of the next-token distributions, trainer-free."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from headwatch._capture import find_output_head, logits_from_output
from headwatch.core.batch import BatchFormat, BatchView
from headwatch.core.monitor import Monitor
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.metrics import LogitStatsMetric

SCALAR_KEYS = (
    "entropy", "kl_to_uniform", "kl_from_uniform", "entropy_p05", "entropy_p50", "entropy_p95",
    "max_prob", "target_nll", "target_argmax_rate", "positions", "nonfinite_positions", "invalid_target_positions",
)  # fmt: skip
"""Values of :class:`LogitStatsMetric` published as scalars, under ``<prefix>/logits/`` and ``<prefix>/val/logits/``."""


class LogitStats(Monitor):
    """Logit statistics of the head's output on logging steps (see :class:`headwatch.LogitStatsMonitor`).

    One forward hook on the head. Off logging steps it returns after one attribute check.
    Under ``torch.compile`` the hook only keeps a detached reference to the logits (no
    graph break, so ``fullgraph=True`` works) and they are measured in :meth:`batch_end`.
    """

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
    ) -> None:
        super().__init__(prefix, strict, batch_format)
        self.head = head
        self.log_histogram = log_histogram
        self.figure_every = figure_every
        self.max_figure_history = 1000
        ignore = self.batch_format.ignore_index
        self._train = LogitStatsMetric(ignore_index=ignore, max_chunk_bytes=max_chunk_bytes)
        self._val = LogitStatsMetric(ignore_index=ignore, max_chunk_bytes=max_chunk_bytes)
        self._sink: LogitStatsMetric | None = None  # where the hook sends logits; None: do nothing
        self._view: BatchView | None = None
        self._stash: list[Tensor] = []  # logits kept by the hook under torch.compile
        self._step: int | None = None
        self._head_module: nn.Module | None = None
        self.head_name = ""
        self._hook: Any = None
        self.vocab_size = 0
        self._calls = 0
        self.entropy_history: list[tuple[int, Tensor]] = []
        self.logged_steps = 0
        self.totals = {"positions": 0.0, "nonfinite_positions": 0.0, "invalid_target_positions": 0.0}
        self.skipped_forwards = 0

    # ------------------------------------------------------------------ wiring
    def attach(self, model: nn.Module) -> None:
        name, module = find_output_head(model, self.head)
        if module is not self._head_module:
            self.detach()
            self._hook = module.register_forward_hook(self._on_head_forward)
            self._head_module, self.head_name = module, name
        self.model = model

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._head_module, self.model = None, None, None
        self._sink, self._view, self._stash = None, None, []

    def _sync_fns(self) -> None:
        for metric in (self._train, self._val):
            metric.dist_sync_fn = lambda t, group=None: self.reducer.gather(t)
            metric.distributed_available_fn = lambda: self.reducer.world_size > 1

    # ------------------------------------------------------------------ capture
    def _on_head_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._sink is None:  # the only work on steps that do not log
            return
        if torch.compiler.is_compiling():
            logits = logits_from_output(output)
            if logits is not None:
                self._stash.append(logits)  # detached in _capture (a detached view trips functionalization)
            return
        self._capture(output)

    @torch.compiler.disable
    def _capture(self, output: Any) -> None:
        sink, view = self._sink, self._view
        if sink is None or view is None:
            return
        try:
            logits = logits_from_output(output)
            if logits is None:
                return self._skip(f"the head returned {type(output).__name__}, not a floating-point logits tensor")
            mask, targets = view.mask, view.targets
            if targets is None and sink is self._train:
                self.warn_once(
                    "no_targets",
                    f"LogitStatsMonitor found no `labels` in a {type(view.batch).__name__} batch: target_nll and "
                    "target_argmax_rate are logged as NaN. For (inputs, targets) tuples pass "
                    "targets_fn=lambda batch: batch[1] (and shift_labels=False if they are already shifted). "
                    "(warned once)",
                )
            for what, t in (("mask", mask), ("targets", targets)):
                if t is not None and t.shape != logits.shape[:-1]:
                    return self._skip(
                        f"the batch's {what} has shape {tuple(t.shape)} but the logits have shape "
                        f"{tuple(logits.shape)}; pass mask_fn/targets_fn aligned with the logits"
                    )
            mask = mask.to(logits.device, non_blocking=True) if mask is not None else None
            targets = targets.to(logits.device, non_blocking=True) if targets is not None else None
            if sink.device != logits.device:
                sink.to(logits.device)
            self.vocab_size = logits.shape[-1]
            self._calls += 1
            if self._calls == 2 and sink is self._train:
                self.warn_once(
                    "twice",
                    f"LogitStatsMonitor: `{self.head_name}` ran more than once in one training batch; every "
                    "call is measured against the batch's labels and pooled (a second prediction head, or an "
                    "auxiliary pass, would need its own targets_fn). (warned once)",
                )
            sink.update(logits.detach(), mask, targets)
        except Exception as err:  # noqa: BLE001 - a monitoring failure must not stop training
            self.fail(err, "measuring the logits")

    def _skip(self, why: str) -> None:
        self.skipped_forwards += 1
        self.warn_once(f"skip:{why}", f"LogitStatsMonitor skipped a forward of `{self.head_name}`: {why}. (warned once)")

    def _drain(self) -> None:
        stash, self._stash = self._stash, []
        for logits in stash:
            self._capture(logits)

    # ------------------------------------------------------------------ training
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        self._calls = 0
        if logging:
            self._step, self._view, self._sink = step, self.batch_format.read(batch), self._train
        else:
            self._view, self._sink = None, None

    def batch_end(self) -> None:
        self._drain()
        self._sink, self._view = None, None

    def compute(self) -> dict[str, Tensor]:
        step, self._step = self._step, None
        values = self._values(self._train)
        if values is None or step is None:
            return {}
        self.logged_steps += 1
        return self._scalars_and_media(f"{self.prefix}/logits", values, step)

    def pending(self) -> bool:
        """A logging step was started and not computed yet."""
        return self._step is not None

    # ------------------------------------------------------------------ validation
    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        self._view, self._sink = self.batch_format.read(batch), self._val

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        self.batch_end()

    def validation_epoch_end(self) -> dict[str, Tensor]:
        values = self._values(self._val)
        return {} if values is None else self._scalars_and_media(f"{self.prefix}/val/logits", values, None)

    # ------------------------------------------------------------------ values
    def _values(self, metric: LogitStatsMetric) -> dict[str, Tensor] | None:
        """Synchronised values (a collective: every rank calls it on the same steps)."""
        self._sync_fns()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                return metric.compute()
        except Exception as err:  # noqa: BLE001
            self.fail(err, "computing the statistics")
            return None
        finally:
            metric.reset()

    def _scalars_and_media(self, group: str, values: dict[str, Tensor], step: int | None) -> dict[str, Tensor]:
        self.media.histograms.clear()
        self.media.figures.clear()
        entropies = values.get("entropy_values")
        if self.log_histogram and entropies is not None:
            self.media.histograms[f"{group}/entropy_histogram"] = entropies
        if step is not None and self.figure_every > 0:
            self._entropy_figure(entropies, step)
        return {f"{group}/{k}": values[k] for k in SCALAR_KEYS if k in values}

    def _entropy_figure(self, entropies: Tensor | None, step: int) -> None:
        """Keep a binned entropy distribution per logging step; draw them all every figure interval."""
        try:
            from headwatch import figures

            if entropies is None or self.vocab_size == 0:
                return
            top = figures.log_v(self.vocab_size)
            self.entropy_history.append((step, figures.entropy_histogram(entropies, top)))
            del self.entropy_history[: -self.max_figure_history]
            if (step + 1) % self.figure_every == 0 and self.reducer.rank == 0:
                steps, hists = [s for s, _ in self.entropy_history], [h for _, h in self.entropy_history]
                fig = figures.entropy_over_run(steps, hists, top)
                self.media.figures[f"{self.prefix}/logits/entropy_over_run"] = fig
        except Exception as err:  # noqa: BLE001
            self.fail(err, "drawing the entropy figure")

    def published(self, numbers: dict[str, float]) -> None:
        """Totals and warnings from the values a front door published (floats, no extra sync)."""
        for group in (f"{self.prefix}/logits", f"{self.prefix}/val/logits"):
            if f"{group}/positions" not in numbers:
                continue
            got = {k: numbers.get(f"{group}/{k}", 0.0) for k in self.totals}
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
        if got["positions"] == 0:
            self.warn_once(
                f"empty:{group}",
                f"headwatch: no valid position in {group} at this step (every position masked, ignored or "
                "non-finite); the means are logged as NaN. (warned once)",
            )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.logged_steps = int(state_dict.get("logged_steps", 0))
        for k in self.totals:
            self.totals[k] = float(state_dict.get(f"total_{k}", 0.0))
        self.failures = int(state_dict.get("failures", 0))
        self.skipped_forwards = int(state_dict.get("skipped_forwards", 0))
        self.entropy_history = [
            (int(step), torch.tensor(hist, dtype=torch.float64)) for step, hist in state_dict.get("entropy_history", [])
        ]
