"""``CollapseAlert``: the collapse alert of a front door, trainer-free: its options, engine, actions and state.

:class:`~headwatch.integrations.lightning.alert.SharpnessCollapseAlert` is ``CollapseAlert`` plus Lightning's
hooks (as Lightning's own ``SpikeDetection`` is the Fabric class plus a callback). Its arguments and behaviour
are documented there. Unlike the rest of :mod:`headwatch.alerts` this module imports torch (the failure policy
of :mod:`headwatch.core.monitor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from headwatch.alerts.actions import JSONL_NAME, KEEP_CHECKPOINTS, AlertSink
from headwatch.alerts.engine import AlertEngine, check_alert_args, standard_actions
from headwatch.alerts.events import Alert
from headwatch.alerts.feed import LoggedFeed
from headwatch.alerts.rules import CollapseRules, Threshold
from headwatch.alerts.webhook import WebhookSender, check_webhook_options, redact_url, resolve_webhook_url
from headwatch.alerts.wiring import wire_alert
from headwatch.core.monitor import FailurePolicy
from headwatch.core.schedule import Schedule
from headwatch.errors import check_bool, check_every, check_int, check_prefix


class CollapseAlert(FailurePolicy):
    """The trainer-free part of a collapse alert callback (arguments: see
    :class:`~headwatch.integrations.lightning.alert.SharpnessCollapseAlert`).

    It builds the :class:`~headwatch.alerts.rules.CollapseRules` and the
    :class:`~headwatch.alerts.engine.AlertEngine` (messages through :attr:`warn_message` and
    :attr:`info_message`, which a door sets to its trainer's rank-zero printers); a door calls
    :meth:`new_run` when a run starts, :meth:`wire` once it knows the run's folder, sink, checkpointing,
    stopping and distributed decision, and feeds :attr:`feed` at each logging step and validation.

    Raises:
        HeadwatchError: invalid arguments (every rule off, a bad threshold, a timeout above 2 s,
            ``save_checkpoint`` / ``stop_training`` with no critical rule).
    """

    warn_message: Callable[[str], Any] | None = None
    """How the engine warns (None: ``warnings.warn``)."""
    info_message: Callable[[str], Any] | None = None
    """How the engine says a set-up line or a resolved episode (None: nothing)."""

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
        keep_checkpoints: int = KEEP_CHECKPOINTS,
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
        self.keep_checkpoints = check_int("keep_checkpoints", keep_checkpoints, minimum=1)
        check_webhook_options(webhook_timeout, webhook_retries)
        self._webhook_url = resolve_webhook_url(webhook_url)
        self.entropy_metric, self.kl_metric = entropy_metric, kl_metric
        self.val_metric, self.val_entropy_metric = val_metric, val_entropy_metric
        self.jsonl = jsonl
        self.actions = list(actions)
        self.webhook_timeout, self.webhook_retries = float(webhook_timeout), webhook_retries
        self.save_checkpoint, self.stop_training = save_checkpoint, stop_training
        self.engine = AlertEngine(rules, strict=strict, warn=self.warn_message, info=self.info_message, name=type(self).__name__)
        self._webhook: WebhookSender | None = None
        self.feed = LoggedFeed(self.engine, self.warn_once)
        """What the engine sees of the trainer's logged metrics (each published value once)."""
        self.process_rank = 0
        self._jsonl_path: Path | None = None

    @property
    def rank(self) -> int:
        return self.process_rank

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
        """Where the JSON Lines log is written (known after :meth:`wire`)."""
        return self._jsonl_path

    def new_run(self) -> None:
        """A new run: fresh smoothing and episodes, and the steps of the values already evaluated forgotten (a
        resumed run loads its checkpoint's state after this)."""
        self.engine.reset()
        self.feed.reset()

    def wire(
        self, log_dir: Path, sink: AlertSink, checkpoint: Callable[[Path], Any], stop: Callable[[], Any],
        reduce_bool: Callable[[bool], bool], main_process: bool, rank: int,
    ) -> None:  # fmt: skip
        """The run's actions (:func:`~headwatch.alerts.engine.standard_actions`): markers and texts through ``sink``,
        ``<log_dir>/headwatch_alerts.jsonl``, the user's callables, the webhook (its sender started here, once), and
        on critical alerts ``checkpoint(<log_dir>/headwatch_alert_step<step>.ckpt)`` (once per step, the latest
        ``keep_checkpoints`` kept) then ``stop()`` (every process,
        when asked for); the distributed decision ``reduce_bool`` and whether this process (rank ``rank``) is the
        main one."""
        self.process_rank = rank
        self._jsonl_path = log_dir / JSONL_NAME
        if self._webhook_url is not None and self._webhook is None:
            self._webhook = WebhookSender(self._webhook_url, self.webhook_timeout, self.webhook_retries, self.engine.action_failed)
            self.engine.info(f"headwatch: alerts will be posted to {redact_url(self._webhook_url)}")

        def save(alert: Alert) -> Path:
            path = log_dir / f"headwatch_alert_step{alert.step}.ckpt"
            checkpoint(path)  # every process: a collective
            return path

        def halt(alert: Alert) -> None:
            stop()  # the decision was reduced over processes, so all stop

        self.engine.actions = standard_actions(
            warn=self.engine.warn, sink=sink, prefix=self.prefix,
            jsonl_path=self._jsonl_path if self.jsonl else None, callables=self.actions, webhook=self._webhook,
            save_checkpoint=save if self.save_checkpoint else None, stop=halt if self.stop_training else None,
            keep_checkpoints=self.keep_checkpoints,
        )
        wire_alert(self.engine, reduce_bool, main_process, self.engine.name)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for webhook posts still in flight (bounded by their timeouts and retries)."""
        self.engine.flush(timeout)

    def close(self) -> None:
        """Flush and release the webhook thread; write the alert records kept back."""
        self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)
