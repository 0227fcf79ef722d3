"""``LoggedFeed``: an :class:`~headwatch.alerts.engine.AlertEngine` fed from the metrics a trainer already holds.

Trainer-free (no torch, no Lightning): a front door that keeps logged values by name (Lightning's
``trainer.callback_metrics``) hands over a reader of one value, the names logged so far and the step each
headwatch value was published at; this module decides which values the rules see, and when, and says what
is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from headwatch.alerts.engine import AlertEngine, closest_names
from headwatch.alerts.events import Alert

Reader = Callable[[str], "float | None"]
"""A metric's current value by name (None: not logged)."""


class LoggedFeed:
    """Which logged values an alert evaluates at each logging step and validation.

    Args:
        engine: the engine whose rules (read at each call: they may be replaced) name the watched metrics.
        warn_once: ``warn_once(key, message)`` of the door's failure policy.
        name: the door's name in messages.

    A value published by a headwatch monitor carries its step (``published``): it is evaluated exactly once,
    at that step, whatever the order of the door's callbacks. Any other logged metric is read at every
    logging step.
    """

    def __init__(self, engine: AlertEngine, warn_once: Callable[[str, str], None], name: str = "SharpnessCollapseAlert") -> None:
        self.engine, self.warn_once, self.name = engine, warn_once, name
        self.evaluated: dict[str, int] = {}
        """Metric -> the last published step evaluated."""

    def reset(self) -> None:
        """A new run: its steps start again."""
        self.evaluated = {}

    def fresh(self, name: str, read: Reader, published: Mapping[str, int]) -> tuple[float | None, int | None]:
        """``(value, step)`` of a metric not evaluated yet; ``(None, None)`` if absent or already seen; ``step`` None
        for a metric no headwatch monitor published."""
        value = read(name)
        if value is None:
            return None, None
        step = published.get(name)
        if step is None:
            return value, None
        if step <= self.evaluated.get(name, -1):
            return None, None
        self.evaluated[name] = step
        return value, step

    def train(self, step: int, every: int, read: Reader, logged: Collection[str], published: Mapping[str, int], epoch: int = 0) -> list[Alert]:
        """A training logging step ``step`` (logging every ``every`` steps): observe the watched values not seen yet.

        Every process calls it on the same steps and takes part in the decision, even one that holds no value
        (a metric logged on rank zero only): no mismatched collectives. Warns once when neither the entropy
        nor the KL metric has been logged 20 logging intervals in (the monitors log from the first logging
        step, the collision monitor every 10).
        """
        rules = self.engine.rules
        entropy, entropy_step = self.fresh(rules.entropy_metric, read, published)
        kl, kl_step = self.fresh(rules.kl_metric, read, published)
        if rules.entropy_metric not in logged and rules.kl_metric not in logged and step >= 20 * every:
            self.warn_once(
                "missing",
                f"{self.name}: neither {rules.entropy_metric!r} ({closest_names(rules.entropy_metric, list(logged))}) "
                f"nor {rules.kl_metric!r} ({closest_names(rules.kl_metric, list(logged))}) has been logged by this step; "
                "check the names (and that the monitor that logs them is attached). (warned once)",
            )
        observed = entropy_step if entropy_step is not None else kl_step if kl_step is not None else step
        watched = [(rules.entropy_metric, entropy), (rules.kl_metric, kl)]
        if rules.rare_nll_rise is not None:
            watched += [(name, self.fresh(name, read, published)[0]) for name in (rules.rare_nll_metric, rules.nll_metric)]
        return self.engine.observe_train(observed, {k: v for k, v in watched if v is not None}, epoch=epoch, published=list(logged))

    def val(self, step: int, read: Reader, logged: Collection[str], loaders: int, epoch: int = 0) -> list[Alert]:
        """A validation over ``loaders`` dataloaders ended at ``step``: observe ``val_metric`` and
        ``val_entropy_metric`` of the watched one (``<name>/dataloader_idx_<k>`` when there are several, else the
        plain name). Warns once when the watched index is out of range or ``val_metric`` was not logged."""
        rules = self.engine.rules
        n, k = max(loaders, 1), rules.val_dataloader_idx
        if k >= n:
            self.warn_once("val_idx", f"{self.name}: val_dataloader_idx={k} but the validation has {n} "
                                      f"dataloader(s) (indices 0..{n - 1}); val_stall is not evaluated. (warned once)")
            return []

        def of_loader(name: str) -> float | None:
            value = read(f"{name}/dataloader_idx_{k}") if n > 1 else None
            return value if value is not None else read(name)

        loss = of_loader(rules.val_metric)
        if loss is None:
            watched = f"{rules.val_metric}/dataloader_idx_{k}" if n > 1 else rules.val_metric
            self.warn_once("val_missing", f"{self.name}: `val_metric` {watched!r} was not logged at this "
                           f"validation, so val_stall cannot fire; {closest_names(watched, list(logged))}. (warned once)")
        values = {rules.val_metric: loss, rules.val_entropy_metric: of_loader(rules.val_entropy_metric)}
        values = {name: v for name, v in values.items() if v is not None}
        return self.engine.observe_val(step, values, dataloader_idx=k, epoch=epoch)
