"""``GradientDensityMonitor``: how sparse the embedding's gradient is, how dense the head's, and
how the two flows of a tied matrix pull on each row (Lightning adapter)."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import nn

from headwatch.errors import check_every
from headwatch.core.gradients import GradientDensity
from headwatch.core.figures import check_figure_argument, resolve_figure_interval
from headwatch.integrations.lightning.frequency import TokenFrequency
from headwatch.integrations.lightning.callback import MonitorCallback

__all__ = ["GradientDensityMonitor"]


class GradientDensityMonitor(GradientDensity, MonitorCallback):
    """Gradient density of the input embedding vs the output head, and what tying does to them.

    Through the lookup, embedding row ``i`` gets gradient only when token ``i`` is in the
    batch (sparse); through the softmax every head row gets gradient on every step (dense).
    On logging steps only, in ``on_before_optimizer_step`` (after gradient accumulation and
    AMP unscaling, before clipping), this monitor measures both flows per vocabulary row
    (:class:`headwatch.core.GradientDensity`). When the embedding and the head share one
    ``Parameter`` (tied), its gradient is split exactly: a hook on the embedding's output
    captures ``dL/d(embedding output)`` and scatters it onto token rows (the lookup part
    ``E``); the scoring part is ``H = grad - E`` (unscaled under a ``GradScaler``, averaged
    over processes under DDP). Token frequencies come from the trainer's
    :class:`~headwatch.TokenFrequency` (added with defaults if absent).

    Args:
        head: the output head (module or dotted name); found automatically if None.
        embedding: the input embedding (module or dotted name); found automatically if None.
        log_every_n_steps: measure every this many optimizer steps; None: the Trainer's.
        update_density: also measure which rows the optimizer step changed (copies the
            ``(V, d_model)`` matrices on logging steps only).
        log_histogram: with a ``TensorBoardLogger``, histograms of per-row gradient norms.
        figure_every_n_steps: every this many steps, an image of per-row gradient norm against
            token frequency rank (``headwatch/grad/row_norm_vs_frequency``); ``"auto"``: ten
            logging intervals if matplotlib is installed, else off; 0/None: off.
        prefix: first component of every metric name.
        strict: raise on a failure to measure instead of warning once and skipping.

    Raises:
        HeadwatchError: in ``__init__`` for invalid arguments; at set-up when the head or
            the embedding cannot be found, or their vocabulary sizes differ.

    Logged metrics (``<flow>``: ``embedding``, ``head``, and ``shared`` when tied;
    ``<matrix>``: ``embedding`` and ``head``, or ``shared``; ``<bucket>``: ``top1``,
    ``top10``, ``top50``, ``tail``, ``unseen``, ``rare``; definitions in :mod:`headwatch.names`):
    ``grad/<flow>_row_density``, ``grad/<flow>_row_norm_{mean,max,p50,p95}``, the same per
    ``grad/<bucket>/``, ``grad/<flow>_rare_to_frequent_norm_ratio``, ``grad/tied``,
    ``grad/tied_flow_cosine_mean``, ``grad/tied_flow_conflict_fraction``,
    ``grad/tied_flow_rows``, ``update/<matrix>_row_density``,
    ``update/<matrix>_row_norm_{mean,max,p50,p95}``, ``freq/<matrix>_norm_spearman``,
    histograms ``grad/<flow>_row_norm_histogram``, text ``grad/tying``.
    """

    def __init__(
        self,
        head: str | nn.Module | None = None,
        embedding: str | nn.Module | None = None,
        log_every_n_steps: int | None = None,
        update_density: bool = True,
        log_histogram: bool = True,
        figure_every_n_steps: int | str | None = "auto",
        prefix: str = "headwatch",
        strict: bool = False,
    ) -> None:
        check_every("log_every_n_steps", log_every_n_steps)  # the adapter's; the core checks the rest
        check_figure_argument(figure_every_n_steps)
        super().__init__(None, head, embedding, update_density, log_histogram, 0, prefix, strict)  # type: ignore[arg-type]
        self.log_every_n_steps = log_every_n_steps
        self.figure_every_n_steps = figure_every_n_steps

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super()._attach(trainer, pl_module, stage)
        self.frequency = TokenFrequency.of_trainer(trainer, pl_module, self.embedding)
        self.figure_every = resolve_figure_interval(self.figure_every_n_steps, self.schedule.every)
        self._info_once(f"headwatch: {self.tying_text}")
