"""``SharpnessCollapseAlert``: the Lightning front door of :class:`~headwatch.alerts.engine.AlertEngine`.

It only reads the values Lightning already holds in ``trainer.callback_metrics`` on the
logging steps and after each validation, and gives the engine Lightning's distributed decision,
loggers and checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning.pytorch.callbacks import Callback

from headwatch import tensorboard as tb
from headwatch.core.monitor import FailurePolicy
from headwatch.core.schedule import Schedule
from headwatch.errors import check_bool, check_every, check_prefix
from headwatch.integrations.lightning.door import lightning_step, publish, published_steps, tensorboard_writers
from headwatch.alerts.actions import JSONL_NAME
from headwatch.alerts.engine import AlertEngine, check_alert_args, closest_names, standard_actions
from headwatch.alerts.events import Alert
from headwatch.alerts.rules import CollapseRules, Threshold
from headwatch.alerts.webhook import WebhookSender, check_webhook_options, redact_url, resolve_webhook_url


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


class SharpnessCollapseAlert(FailurePolicy, Callback):
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

    def __init__(
        self,
        entropy_floor: Threshold = None,
        kl_ceiling: Threshold = None,
        entropy_drop: Threshold = 0.5,
        window: int = 10,
        smoothing: float = 0.3,
        patience: int | None = None,
        val_delta: float = 0.0,
        val_min_entropy_drop: float = 0.02,
        rearm_margin: float = 0.05,
        warmup_steps: int = 0,
        entropy_metric: str = "headwatch/logits/entropy",
        kl_metric: str = "headwatch/logits/kl_to_uniform",
        val_metric: str = "val_loss",
        val_entropy_metric: str = "headwatch/val/logits/entropy",
        log_every_n_steps: int | None = None,
        jsonl: bool = True,
        actions: Sequence[Callable[[Alert], Any]] = (),
        webhook_url: str | None = None,
        webhook_timeout: float = 2.0,
        webhook_retries: int = 2,
        save_checkpoint: bool = False,
        stop_training: bool = False,
        prefix: str = "headwatch",
        strict: bool = False,
        entropy_ceiling: Threshold = None,
        for_steps: int = 1,
        val_dataloader_idx: int = 0,
        rare_nll_rise: Threshold = None,
        rare_window: int = 10,
        rare_nll_metric: str = "headwatch/logits/rare/target_nll",
        nll_metric: str = "headwatch/logits/target_nll",
    ) -> None:
        self.log_every_n_steps = check_every("log_every_n_steps", log_every_n_steps)
        self.prefix = check_prefix(prefix)
        self.strict = check_bool("strict", strict)
        self.schedule = Schedule(0)
        rules = CollapseRules(
            entropy_floor=entropy_floor, kl_ceiling=kl_ceiling, entropy_drop=entropy_drop, window=window,
            alpha=smoothing, patience=patience, delta=val_delta, min_entropy_drop=val_min_entropy_drop,
            margin=rearm_margin, warmup_steps=warmup_steps, entropy_ceiling=entropy_ceiling, for_steps=for_steps,
            val_dataloader_idx=val_dataloader_idx, entropy_metric=entropy_metric, kl_metric=kl_metric,
            val_metric=val_metric, val_entropy_metric=val_entropy_metric, rare_nll_rise=rare_nll_rise,
            rare_window=rare_window, rare_nll_metric=rare_nll_metric, nll_metric=nll_metric,
        )
        for name, value in (("jsonl", jsonl), ("save_checkpoint", save_checkpoint), ("stop_training", stop_training)):
            check_bool(name, value)
        check_alert_args(rules, actions, save_checkpoint or stop_training)
        check_webhook_options(webhook_timeout, webhook_retries)
        self._webhook_url = resolve_webhook_url(webhook_url)
        self.entropy_metric, self.kl_metric = entropy_metric, kl_metric
        self.val_metric, self.val_entropy_metric = val_metric, val_entropy_metric
        self.jsonl = jsonl
        self.actions = list(actions)
        self.webhook_timeout, self.webhook_retries = float(webhook_timeout), webhook_retries
        self.save_checkpoint, self.stop_training = save_checkpoint, stop_training
        self.engine = AlertEngine(rules, strict=strict, warn=rank_zero_warn, info=rank_zero_info, name=type(self).__name__)
        self._webhook: WebhookSender | None = None
        self._evaluated: dict[str, int] = {}  # metric -> last published step evaluated
        self._step_at_start = 0
        self._jsonl_path: Path | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    @property
    def rank(self) -> int:
        return getattr(self, "_rank", 0)

    # ---------------------------------------------------------------- the engine's state, as in 0.1
    @property
    def rules(self) -> CollapseRules:
        return self.engine.rules

    @rules.setter
    def rules(self, rules: CollapseRules) -> None:
        self.engine.rules = rules

    @property
    def alerts(self) -> list[Alert]:
        return self.engine.alerts

    @property
    def action_failures(self) -> int:
        return self.engine.action_failures

    @property
    def jsonl_path(self) -> Path | None:
        """Where the JSON Lines log is written (known after ``setup``)."""
        return self._jsonl_path

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a new fit: fresh smoothing and episodes (a resume loads its checkpoint after setup)
            self.engine.reset()
            self._evaluated = {}  # the steps of the values already evaluated: a new run's steps start again
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        self.schedule, self._rank = Schedule(every), trainer.global_rank
        if every == 0:
            rank_zero_warn(f"{type(self).__name__}: log_every_n_steps is 0, training steps are not measured.")
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._jsonl_path = log_dir / JSONL_NAME
        if self._webhook_url is not None and self._webhook is None:
            self._webhook = WebhookSender(self._webhook_url, self.webhook_timeout, self.webhook_retries, self.engine.action_failed)
            rank_zero_info(f"headwatch: alerts will be posted to {redact_url(self._webhook_url)}")

        def checkpoint(alert: Alert) -> None:
            trainer.save_checkpoint(log_dir / f"headwatch_alert_step{alert.step}.ckpt")  # every process: a collective

        def stop(alert: Alert) -> None:
            trainer.should_stop = True  # the decision was reduced over processes, so all stop

        self.engine.actions = standard_actions(
            warn=rank_zero_warn, sink=_LoggerSink(self, trainer), prefix=self.prefix,
            jsonl_path=self._jsonl_path if self.jsonl else None, callables=self.actions, webhook=self._webhook,
            save_checkpoint=checkpoint if self.save_checkpoint else None, stop=stop if self.stop_training else None,
        )
        self.engine.reduce_bool = lambda fired: bool(trainer.strategy.reduce_boolean_decision(fired, all=False))
        self.engine.main_process = trainer.is_global_zero

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if trainer.is_global_zero:
                tb.write_layout(tensorboard_writers(trainer), self.prefix)
        except Exception as err:  # noqa: BLE001
            self.fail(err, "writing the TensorBoard dashboard layout")

    # ---------------------------------------------------------------- observing
    @staticmethod
    def _value(trainer: pl.Trainer, name: str) -> float | None:
        value = trainer.callback_metrics.get(name)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)  # logging steps only

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_start, self._optimizer_steps = lightning_step(trainer), trainer.global_step  # the monitors' step rule

    def _fresh(self, trainer: pl.Trainer, name: str) -> tuple[float | None, int | None]:
        """``(value, step)`` of a metric not evaluated yet; ``(None, None)`` if absent or already seen.

        Metrics published by headwatch callbacks carry their step (the one use of
        ``published_steps``), so each value is evaluated exactly once whatever the callbacks'
        order. Other logged metrics are read at every logging step.
        """
        value = self._value(trainer, name)
        if value is None:
            return None, None
        step = published_steps(trainer).get(name)
        if step is None:
            return value, None
        if step <= self._evaluated.get(name, -1):
            return None, None
        self._evaluated[name] = step
        return value, step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step_at_start
        if trainer.global_step == self._optimizer_steps or not self.schedule.is_logging_step(step):
            return
        # Every process reaches this point on the same steps and takes part in the decision,
        # even one that holds no value (a metric logged on rank zero only): no mismatched collectives.
        entropy, entropy_step = self._fresh(trainer, self.entropy_metric)
        kl, kl_step = self._fresh(trainer, self.kl_metric)
        logged = trainer.callback_metrics
        # monitors log from the first logging step; SynonymCollisionMonitor every 10: allow 20 intervals
        if self.entropy_metric not in logged and self.kl_metric not in logged and step >= 20 * self.schedule.every:
            self.warn_once(
                "missing",
                f"SharpnessCollapseAlert: neither {self.entropy_metric!r} ({closest_names(self.entropy_metric, list(logged))}) "
                f"nor {self.kl_metric!r} ({closest_names(self.kl_metric, list(logged))}) has been logged by this step; "
                "check the names (and that the monitor that logs them is attached). (warned once)",
            )
        observed = entropy_step if entropy_step is not None else kl_step if kl_step is not None else step
        watched = [(self.entropy_metric, entropy), (self.kl_metric, kl)]
        if self.rules.rare_nll_rise is not None:
            watched += [(name, self._fresh(trainer, name)[0]) for name in (self.rules.rare_nll_metric, self.rules.nll_metric)]
        values = {k: v for k, v in watched if v is not None}
        self.engine.observe_train(observed, values, epoch=trainer.current_epoch)

    def _val_value(self, trainer: pl.Trainer, name: str, k: int, n: int) -> float | None:
        """``name`` of dataloader ``k`` of ``n``: ``<name>/dataloader_idx_<k>`` when n > 1, else ``name``."""
        value = self._value(trainer, f"{name}/dataloader_idx_{k}") if n > 1 else None
        return value if value is not None else self._value(trainer, name)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.rules.patience is None:
            return
        n, k = max(len(trainer.num_val_batches), 1), self.rules.val_dataloader_idx
        if k >= n:
            self.warn_once("val_idx", f"SharpnessCollapseAlert: val_dataloader_idx={k} but the validation has {n} "
                                       f"dataloader(s) (indices 0..{n - 1}); val_stall is not evaluated. (warned once)")
            return
        loss = self._val_value(trainer, self.val_metric, k, n)
        if loss is None:
            watched = f"{self.val_metric}/dataloader_idx_{k}" if n > 1 else self.val_metric
            self.warn_once("val_missing", f"SharpnessCollapseAlert: `val_metric` {watched!r} was not logged at this "
                            f"validation, so val_stall cannot fire; {closest_names(watched, list(trainer.callback_metrics))}. (warned once)")
        values = {self.val_metric: loss, self.val_entropy_metric: self._val_value(trainer, self.val_entropy_metric, k, n)}
        values = {name: v for name, v in values.items() if v is not None}
        self.engine.observe_val(trainer.global_step, values, dataloader_idx=k, epoch=trainer.current_epoch)

    # ---------------------------------------------------------------- end, checkpoint
    def flush(self, timeout: float | None = None) -> None:
        """Wait for webhook posts still in flight (bounded by their timeouts and retries)."""
        self.engine.flush(timeout)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)
