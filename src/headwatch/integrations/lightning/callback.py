"""``MonitorCallback``: what makes a headwatch core monitor a Lightning callback: it registers with the trainer's
driver (:class:`~headwatch.integrations.lightning.driver.HeadwatchDriver`), which drives every monitor of the run."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from headwatch.core.monitor import Monitor
from headwatch.integrations.lightning.driver import HeadwatchDriver, drivers


class MonitorCallback(Callback):
    """A core :class:`~headwatch.core.monitor.Monitor` (the same object) as a Lightning callback.

    A Lightning monitor is ``class XMonitor(XCore, MonitorCallback)``, as Lightning's own ``SpikeDetection``
    is the Fabric class plus a callback. Its ``setup`` registers the core with the trainer's driver, which
    measures on the steps Lightning logs and resolves the model's modules in ``on_fit_start`` (after
    ``configure_model``, before the first forward); a subclass adds its own set-up in :meth:`_attach`.
    The callback keeps its own state in checkpoints (``state_key``, ``state_dict``).
    """

    log_every_n_steps: int | None = None
    compare_loss: str | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)  # type: ignore[attr-defined]

    def _core(self) -> Monitor:
        return self  # type: ignore[return-value]

    def driver(self, trainer: pl.Trainer) -> HeadwatchDriver | None:
        """The driver of ``trainer`` this callback registered with (None before ``setup``)."""
        found = drivers(trainer.callbacks)
        return found[0] if found else None

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Register with the trainer's driver (added before this callback when absent) and resolve the model's
        modules a first time (Lightning calls ``configure_model`` after this hook, and the driver attaches again in
        ``on_fit_start`` / ``on_validation_start`` on the final model: the set-up lines are said then)."""
        driver = HeadwatchDriver.of(trainer, pl_module, stage, before=self)
        if not driver.register(self, trainer, pl_module, stage):
            return
        self._hw_provisional = stage in ("fit", "validate")
        try:
            driver.attach_one(self, trainer, pl_module, stage)
        except Exception:  # noqa: BLE001 - the model may be built later (configure_model, LightningModule.setup)
            pass
        finally:
            self._hw_provisional = False
        driver.use()

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve modules and register hooks (idempotent); subclasses add their set-up."""
        self._core().attach(pl_module)

    def _info_once(self, message: str) -> None:
        """A set-up line, said once per callback; not while ``setup`` resolves a model that
        ``configure_model`` may still change (the attach that follows says it)."""
        warned = self._core()._warned
        if not getattr(self, "_hw_provisional", False) and message not in warned:
            warned.add(message)
            rank_zero_info(message)

    def _measuring_validation(self, trainer: pl.Trainer) -> bool:
        """Whether this monitor measures the validation batches (a monitor that does says when)."""
        return False
