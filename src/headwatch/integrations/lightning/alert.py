"""``SharpnessCollapseAlert``: the Lightning front door of :class:`~headwatch.alerts.engine.AlertEngine`.

It registers with the trainer's driver (:class:`~headwatch.integrations.lightning.driver.HeadwatchDriver`) as one
of the run's sinks: at each of its logging steps it reads the values the driver just published and the metrics
Lightning holds in ``trainer.callback_metrics``; after each validation it reads them again, once Lightning has
added the LightningModule's epoch metrics (``val_loss``). The alert
(:class:`~headwatch.alerts.collapse.CollapseAlert`, trainer-free) gets Lightning's distributed decision, loggers
and checkpointing.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from headwatch import tensorboard as tb
from headwatch.alerts.collapse import CollapseAlert
from headwatch.core.monitor import Media
from headwatch.core.schedule import Schedule
from headwatch.integrations.lightning.door import logging_interval, tensorboard_writers
from headwatch.integrations.lightning.driver import HeadwatchDriver


class _Markers:
    """Where the alert's markers and messages go: the marker to every logger and ``trainer.callback_metrics``
    (a scalar Lightning holds like any logged value), the message to the TensorBoard loggers; flushed at once."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def scalar(self, tag: str, value: float, step: int) -> None:
        writers = tensorboard_writers(self.trainer)
        try:
            for logger in self.trainer.loggers:
                logger.log_metrics({tag: value}, step=step)
            self.trainer.callback_metrics[tag] = torch.tensor(value)
        finally:
            tb.flush(writers)

    def text(self, tag: str, text: str, step: int) -> None:
        writers = tensorboard_writers(self.trainer)
        tb.write_text(writers, tag, text, step)
        tb.flush(writers)


class _AlertSink:
    """The alert as a sink of the driver's run: at each of the alert's logging steps, the values just published
    and the metrics Lightning holds (every rank: the decision is a collective)."""

    def __init__(self, alert: SharpnessCollapseAlert, driver: HeadwatchDriver) -> None:
        self.alert, self.driver = alert, driver

    @property
    def strict(self) -> bool:
        """A strict alert raises what its actions raise (through the run: :meth:`Orchestrator.sink_failed`)."""
        return self.alert.strict

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        trainer = self.driver.trainer
        if val or trainer is None or not self.alert.schedule.is_logging_step(step):
            return  # a validation is read at on_validation_end, with the module's epoch metrics
        alert = self.alert
        read = lambda name: alert._value(trainer, name)  # noqa: E731
        alert.feed.train(step, alert.schedule.every, read, trainer.callback_metrics, self.driver.published, trainer.current_epoch)

    def end(self, step: int) -> None:
        self.alert.flush()


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
    evaluated once, at the step it was published (the alert is one of the run's sinks, wherever it
    stands in ``trainer.callbacks``); other logged metrics are read at each of its logging steps. With
    several validation dataloaders,
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
        save_checkpoint: save ``<log_dir>/headwatch_alert_step<step>.ckpt`` at a critical alert (once per firing
            episode; rules firing at one step share one).
        stop_training: stop training (on all processes) at a critical alert.
        prefix: first component of every metric name the alert writes (``<prefix>/alerts/...``).
        strict: raise instead of warning when an action fails.
        entropy_ceiling: threshold in nats (see above).
        for_steps: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_nll_rise: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_window: see :class:`~headwatch.alerts.rules.CollapseRules`.
        rare_nll_metric: logged metric watched as the rare targets' NLL (nats).
        nll_metric: logged metric watched as the target NLL (nats).
        keep_checkpoints: the alert checkpoints kept on disk, the latest (default 3; an int >= 1).

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
            Path(trainer.log_dir or trainer.default_root_dir), _Markers(trainer), trainer.save_checkpoint,
            lambda: setattr(trainer, "should_stop", True),
            lambda fired: bool(trainer.strategy.reduce_boolean_decision(fired, all=False)), trainer.is_global_zero, trainer.global_rank,
        )  # fmt: skip
        driver = HeadwatchDriver.of(trainer, pl_module, stage, before=self)
        sink = getattr(self, "_sink", None)
        if sink is None or sink.driver is not driver:
            self._sink = _AlertSink(self, driver)
        driver.add_sink(self._sink, self.engine, self.schedule.every, self.prefix)

    # ---------------------------------------------------------------- observing
    @staticmethod
    def _value(trainer: pl.Trainer, name: str) -> float | None:
        value = trainer.callback_metrics.get(name)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)  # logging steps only

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a validation (Lightning has added the module's epoch metrics, ``val_loss``, by now)."""
        if not trainer.sanity_checking and self.rules.patience is not None:
            read = lambda name: self._value(trainer, name)  # noqa: E731
            self.feed.val(trainer.global_step, read, trainer.callback_metrics, len(trainer.num_val_batches), trainer.current_epoch)

    # ---------------------------------------------------------------- end
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()
