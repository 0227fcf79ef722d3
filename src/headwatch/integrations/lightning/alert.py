"""``SharpnessCollapseAlert``: the Lightning front door of :class:`~headwatch.alerts.engine.AlertEngine`.

It only reads the values Lightning already holds in ``trainer.callback_metrics`` on the
logging steps and after each validation, and gives the alert (:class:`~headwatch.alerts.collapse.CollapseAlert`,
trainer-free) Lightning's distributed decision, loggers and checkpointing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from headwatch import tensorboard as tb
from headwatch.alerts.collapse import CollapseAlert
from headwatch.core.schedule import Schedule
from headwatch.integrations.lightning.door import (
    lightning_step,
    logging_interval,
    publish,
    published_steps,
    tensorboard_writers,
    write_layout,
)


class _LoggerSink:
    """Markers through the callback's publishing (every logger, ``callback_metrics``), text to TensorBoard."""

    def __init__(self, callback: SharpnessCollapseAlert, trainer: pl.Trainer) -> None:
        self.callback, self.trainer = callback, trainer

    def scalar(self, tag: str, value: float, step: int) -> None:
        publish(self.trainer, {tag: value}, step)

    def text(self, tag: str, text: str, step: int) -> None:
        writers = tensorboard_writers(self.trainer)
        tb.write_text(writers, tag, text, step)
        tb.flush(writers)


class SharpnessCollapseAlert(CollapseAlert, Callback):
    """Alert when the next-token distributions collapse toward a few safe tokens (or go flat).

    The Lightning front door of :class:`~headwatch.alerts.engine.AlertEngine` (which holds the
    logic, for any loop). Watches values already logged by :class:`~headwatch.LogitStatsMonitor`
    (or any logged metric), with the rules of :class:`~headwatch.alerts.rules.CollapseRules`,
    each optional:

    - ``entropy_floor``: fires when ``H < t`` (nats); re-arms at ``H >= t + margin |t|``;
    - ``entropy_ceiling``: fires when ``H > t`` (nats, predictions going flat); re-arms at
      ``H <= t - margin |t|``;
    - ``kl_ceiling``: fires when ``KL > t`` (nats); re-arms at ``KL <= t - margin |t|``;
    - ``entropy_drop`` ``r``: the smoothed entropy ``S`` fell by ``>= r`` (relative) over
      ``window`` logged values; re-arms below ``r (1 - margin)``;
    - ``rare_nll_rise`` ``t`` (off by default): the smoothed rare-target NLL (``rare_nll_metric``)
      rose by more than ``t`` nats over ``rare_window`` logged values while the smoothed overall
      target NLL (``nll_metric``) fell (:class:`~headwatch.alerts.rules.CollapseRules`);
    - ``val_stall`` (``patience`` P): ``val_metric`` of dataloader ``val_dataloader_idx`` improved
      by less than ``val_delta`` over P validations while the entropy fell by
      ``>= val_min_entropy_drop`` (relative); critical only.

    Each threshold is a number (severity ``critical``) or ``(warning, critical)`` /
    ``{"warning": w, "critical": c}``: each severity has its own episode and hysteresis. A rule
    fires when its condition holds at ``for_steps`` consecutive logging steps (validations for
    ``val_stall``), once per episode. Every process takes the same decision
    (``trainer.strategy.reduce_boolean_decision``). Each value published by a headwatch monitor is
    evaluated once, at the step it was logged; list the alert after the monitors to evaluate it in
    the same step rather than one logging interval later. With several validation dataloaders,
    validation values are read under Lightning's ``<name>/dataloader_idx_<k>`` names (else the
    plain name, a value logged once for all dataloaders).

    Actions, composable, on every alert: a console warning; a TensorBoard text entry and a scalar
    marker ``headwatch/alerts/<rule>`` (``<rule>_warning`` for a warning) = 1 at the alert step;
    one JSON object per alert appended to ``<log_dir>/headwatch_alerts.jsonl`` (flushed and
    fsynced); user ``actions`` (callables taking an :class:`Alert`); a JSON POST to a webhook
    (``webhook_url`` or ``HEADWATCH_WEBHOOK_URL``; timeout at most 2 s, bounded retries, from a
    background thread; only ``scheme://host`` of the URL is ever printed). On critical alerts
    only: ``save_checkpoint`` then ``stop_training`` on every process. A failing action is
    warned about once and counted (``action_failures``); training goes on unless ``strict=True``.

    Args:
        entropy_floor: threshold in nats (see above).
        kl_ceiling: threshold in nats (see above).
        entropy_drop: relative drop ``r`` (see above).
        window: see :class:`~headwatch.alerts.rules.CollapseRules`.
        smoothing: ``alpha`` of :class:`~headwatch.alerts.rules.CollapseRules`.
        patience: see :class:`~headwatch.alerts.rules.CollapseRules`.
        val_delta: ``delta`` of :class:`~headwatch.alerts.rules.CollapseRules`.
        val_min_entropy_drop: ``min_entropy_drop`` of :class:`~headwatch.alerts.rules.CollapseRules`.
        rearm_margin: ``margin`` of :class:`~headwatch.alerts.rules.CollapseRules`.
        warmup_steps: see :class:`~headwatch.alerts.rules.CollapseRules`.
        val_dataloader_idx: the validation dataloader ``val_stall`` watches (default 0).
        entropy_metric: logged metric watched as the entropy (nats).
        kl_metric: logged metric watched as kl_to_uniform (nats).
        val_metric: validation loss for the ``val_stall`` rule.
        val_entropy_metric: entropy at validation (default: the smoothed training entropy
            when this metric is absent).
        log_every_n_steps: read the training metrics every this many steps (default: the
            Trainer's, the steps the monitors log).
        jsonl: write the JSON Lines log.
        actions: callables run with each :class:`Alert`.
        webhook_url: URL for a JSON POST of each alert; None reads ``HEADWATCH_WEBHOOK_URL``.
        webhook_timeout: seconds per attempt, at most 2.
        webhook_retries: extra attempts after a failure (at most 5).
        save_checkpoint: save ``<log_dir>/headwatch_alert_step<step>.ckpt`` at a critical alert.
        stop_training: stop training (on all processes) at a critical alert.
        prefix: first component of every metric name the alert writes (``<prefix>/alerts/...``).
        strict: raise instead of warning when an action fails.
        entropy_ceiling: threshold in nats (see above).
        for_steps: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_nll_rise: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_window: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_nll_metric: logged metric watched as the rare targets' NLL (nats).
        nll_metric: logged metric watched as the target NLL (nats).

    Raises:
        HeadwatchError: invalid arguments (every rule off, a bad threshold, a timeout above 2 s,
            ``save_checkpoint`` / ``stop_training`` with no critical rule).
    """

    warn_message = staticmethod(rank_zero_warn)
    info_message = staticmethod(rank_zero_info)
    _step_at_start = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a new fit: fresh smoothing and episodes (a resume loads its checkpoint after setup)
            self.new_run()
        self.schedule = Schedule(logging_interval(trainer, self.log_every_n_steps, 1, type(self).__name__))
        self.wire(
            Path(trainer.log_dir or trainer.default_root_dir), _LoggerSink(self, trainer), trainer.save_checkpoint,
            lambda: setattr(trainer, "should_stop", True),
            lambda fired: bool(trainer.strategy.reduce_boolean_decision(fired, all=False)), trainer.is_global_zero, trainer.global_rank,
        )  # fmt: skip

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_layout(trainer, self.prefix, self)

    # ---------------------------------------------------------------- observing
    @staticmethod
    def _value(trainer: pl.Trainer, name: str) -> float | None:
        value = trainer.callback_metrics.get(name)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)  # logging steps only

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_start, self._optimizer_steps = lightning_step(trainer), trainer.global_step  # the monitors' step rule

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step_at_start
        if trainer.global_step != self._optimizer_steps and self.schedule.is_logging_step(step):  # every process
            read = lambda name: self._value(trainer, name)  # noqa: E731
            self.feed.train(step, self.schedule.every, read, trainer.callback_metrics, published_steps(trainer), trainer.current_epoch)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self.rules.patience is not None:
            read = lambda name: self._value(trainer, name)  # noqa: E731
            self.feed.val(trainer.global_step, read, trainer.callback_metrics, len(trainer.num_val_batches), trainer.current_epoch)

    # ---------------------------------------------------------------- end
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()
