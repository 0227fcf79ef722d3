"""Head warm-up: train only the output head for a number of optimizer steps, then everything.

:class:`HeadWarmupCore` holds the logic and the state without a trainer; :class:`HeadWarmup`
is the thin Lightning adapter (a ``BaseFinetuning`` callback).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch import nn
from torch.optim import Optimizer

from headwatch.model.find import find_head_and_embedding
from headwatch.errors import HeadwatchError, check_bool, check_int, check_module_or_name, check_optional, check_range

PHASE_KEY = "headwatch/remedies/head_warmup_phase"
"""Logged scalar: 0 while only the head trains, 1 once everything trains."""


class HeadWarmupCore:
    """Which parameters train, and how the optimizer's groups look, during and after a head warm-up.

    Phase 0 (steps ``0 .. warmup_steps - 1``): every parameter outside the head has
    ``requires_grad = False``, so it gets no gradient and optimizers that skip gradient-less
    parameters (all of ``torch.optim``, AdamW's decoupled weight decay included) leave it and
    its state exactly as they were. With ``head_lr``, the head steps at that constant learning
    rate (see :meth:`attach`). Phase 1 (from step ``warmup_steps``): the frozen parameters
    train again with their groups' learning rates. The optimizer's param groups are the ones
    the user built throughout (nothing to restore, as Lightning's finetuning callbacks must
    when they add groups), and its state, keyed by parameter, is untouched.

    What "the head" is (:meth:`head_parameters`): the shared matrix of a tied model is never
    trained as the head only. A tied plain head is refused, or untied first with ``untie=True``
    (:func:`~headwatch.remedies.untie_output_head`, which puts the new head into the optimizers it
    is given); a :class:`~headwatch.remedies.TiedOutputProjection` warms up its projection ``P``
    (and bias) while ``E``, the input embedding's matrix, stays frozen with the rest.

    Args:
        warmup_steps: optimizer steps of phase 0 (0: no warm-up).
        head_lr: learning rate of the head during phase 0; None keeps its group's.
        untie: untie a tied head (``init="copy"``) before the warm-up instead of refusing it.

    Raises:
        HeadwatchError: ``warmup_steps`` not an int >= 0, ``head_lr`` not None or > 0, ``untie``
            not a bool.
    """

    def __init__(self, warmup_steps: int, head_lr: float | None = None, untie: bool = False) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.head_lr = check_optional(check_range, "head_lr", head_lr, 0, low_open=True)
        self.untie = check_bool("untie", untie)
        self.phase = 0 if warmup_steps > 0 else 1
        self.switched_at_step: int | None = None
        self._frozen: list[nn.Parameter] = []
        self._hooks: dict[int, list[Any]] = {}  # id(optimizer) -> step pre/post hook handles

    def head_parameters(
        self,
        model: nn.Module,
        head: str | nn.Module | None = None,
        optimizers: Iterable[Optimizer] = (),
        resumed: bool = False,
    ) -> tuple[list[nn.Parameter], str]:
        """The parameters that train during the warm-up (never the shared matrix), and a sentence saying which.

        - an untied head: every parameter of the head module (weight, bias);
        - a :class:`~headwatch.remedies.TiedOutputProjection`: its own parameters (``P``, bias),
          not ``E``, which is the input embedding's and stays frozen;
        - a tied plain head, warm-up still to do: with ``untie``, untied here by
          :func:`~headwatch.remedies.untie_output_head` (``init="copy"``: the same logits) with
          ``optimizer=optimizers``, so a built optimizer trains the new head (state copied from
          the shared matrix); otherwise refused.

        Args:
            model: the model that trains.
            head: the head module or its dotted name (None: found as the monitors find it).
            optimizers: optimizers already built (given to ``untie_output_head``).
            resumed: the fit resumes a checkpoint already loaded into this model (then a tied
                head cannot be untied here: the checkpoint's separate head went into the shared matrix).

        Raises:
            HeadwatchError: the head cannot be found; a tied plain head during the warm-up without
                ``untie``, or with ``untie`` on a resumed fit.
        """
        from headwatch.remedies.projection import TiedOutputProjection

        found = find_head_and_embedding(model, head)
        if not found.tied or self.phase != 0:
            return list(found.head.parameters()), f"`{found.head_name}`"
        shared = found.embedding.weight
        if isinstance(found.head, TiedOutputProjection):
            own = [p for p in found.head.parameters() if p is not shared]
            return own, (f"the projection of `{found.head_name}` (its tied matrix is `{found.embedding_name}`'s and "
                         "stays frozen)")
        fix = ("untie first (headwatch.remedies.untie_output_head in LightningModule.configure_model), pass "
               "untie=True, or keep the tie and warm up a projection (install_tied_projection)")
        if not self.untie:
            raise HeadwatchError(
                f"HeadWarmup: `{found.head_name}` is tied to `{found.embedding_name}` (one matrix), so a head-only "
                f"warm-up would train the input embedding too; {fix}"
            )
        if resumed:
            raise HeadwatchError(
                f"HeadWarmup(untie=True): `{found.head_name}` is still tied to `{found.embedding_name}` in a resumed "
                "fit, after the checkpoint loaded; untie in LightningModule.configure_model (before the checkpoint loads)"
            )
        from headwatch.remedies.untie import untie_output_head

        optimizers = list(optimizers)
        report = untie_output_head(model, head=found.head, embedding=found.embedding, optimizer=optimizers or None)
        where = (f"; the new head joined {report.optimizers_updated} optimizer(s) with a copy of the shared matrix's "
                 "state" if report.optimizers_updated else "")
        return list(found.head.parameters()), (
            f"`{found.head_name}`, untied from `{found.embedding_name}` first (untie=True: a copy, same logits{where})"
        )

    def freeze(self, model: nn.Module, head_params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Phase 0: set ``requires_grad = False`` on every trainable parameter outside the head.

        Raises:
            HeadwatchError: a head parameter is also held by another module of ``model`` (a tied
                matrix: training it would train that module too; see :meth:`head_parameters`).
        """
        if self.phase != 0 or self._frozen:
            return self._frozen
        head_params = list(head_params)
        holders: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            for _, p in module.named_parameters(recurse=False, remove_duplicate=False):  # its own, directly
                holders.setdefault(id(p), []).append(name)
        for p in head_params:
            if len(set(holders.get(id(p), []))) > 1:
                raise HeadwatchError(
                    f"HeadWarmup: a head parameter is shared by {', '.join(f'`{n}`' for n in sorted(set(holders[id(p)])))} "
                    "(a tied matrix): a head-only warm-up would train them all; untie first or pass only the "
                    "head's own parameters"
                )
        head_ids = {id(p) for p in head_params}
        self._frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
        for p in self._frozen:
            p.requires_grad_(False)
            p.grad = None
        return self._frozen

    def release(self) -> None:
        """Give the frozen parameters back ``requires_grad = True`` (phase switch, or end of a run)."""
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    def attach(self, optimizer: Optimizer, head_params: Iterable[nn.Parameter]) -> bool:
        """Phase 0 with ``head_lr``: step the head at ``head_lr``. Returns whether it hooked ``optimizer``.

        The optimizer's groups are never changed: a pre-step hook sets ``lr = head_lr`` on the
        groups that hold head parameters (their other parameters are frozen, so only the head
        feels it) and a post-step hook puts the scheduler's values back, so LR schedulers,
        ``state_dict`` and checkpoints see exactly the groups the user built.
        """
        if self.phase != 0 or self.head_lr is None or id(optimizer) in self._hooks:
            return False
        head_ids = {id(p) for p in head_params}

        def head_groups(opt: Optimizer) -> list[dict[str, Any]]:
            # looked up at each step: load_state_dict (a resumed checkpoint) replaces the group dicts
            return [g for g in opt.param_groups if any(id(p) in head_ids for p in g["params"])]

        if not head_groups(optimizer):
            return False
        saved: list[tuple[dict[str, Any], float]] = []

        def pre(opt: Optimizer, args: Any, kwargs: Any) -> None:
            saved[:] = [(g, g["lr"]) for g in head_groups(opt)]
            for g, _ in saved:
                g["lr"] = self.head_lr

        def post(opt: Optimizer, args: Any, kwargs: Any) -> None:
            for g, lr in saved:
                g["lr"] = lr

        self._hooks[id(optimizer)] = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        return True

    def _detach(self, optimizer: Optimizer) -> None:
        for handle in self._hooks.pop(id(optimizer), []):
            handle.remove()

    def step(self, global_step: int, optimizers: Iterable[Optimizer]) -> bool:
        """Call before each optimizer step's forward pass; switches to phase 1 at ``warmup_steps``.

        Returns:
            True on the call that switched.
        """
        if self.phase != 0 or global_step < self.warmup_steps:
            return False
        self.release()
        for optimizer in optimizers:
            self._detach(optimizer)
        self.phase = 1
        self.switched_at_step = global_step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "switched_at_step": self.switched_at_step,
            "warmup_steps": self.warmup_steps,
            "head_lr": self.head_lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = int(state.get("phase", self.phase))
        self.switched_at_step = state.get("switched_at_step")
        if self.phase != 0:  # restored after the freeze (a strategy that restores after setup): all train
            self.release()
            for handles in self._hooks.values():
                for handle in handles:
                    handle.remove()
            self._hooks = {}


class HeadWarmup(BaseFinetuning):
    """Lightning callback: only the output head trains for ``warmup_steps`` optimizer steps.

    Then every parameter it froze trains again, in the param groups ``configure_optimizers``
    built, which the warm-up never changes (see :class:`HeadWarmupCore`). Build the optimizer
    over all parameters, as usual: frozen ones simply get no gradient. The freeze happens in
    ``on_fit_start``, after ``LightningModule.configure_model`` (where the README unties), so the
    head and the embedding are resolved on the model as it trains. The phase is saved in
    checkpoints; resuming mid-warm-up freezes again and switches at the same step.

    The head is found as the monitors find it (or pass ``head=``). Its parameters are those of
    the head module (weight, bias), never the shared matrix of a tied model
    (:meth:`HeadWarmupCore.head_parameters`): a tied plain head is refused with a
    ``HeadwatchError`` at fit start, unless ``untie=True``, which unties it (``init="copy"``: the
    same logits) in ``setup``, before the optimizer is built, or, for a head that only exists
    after ``configure_model``, in ``on_fit_start`` with ``optimizer=`` the trainer's optimizers
    (the new head joins the shared matrix's param group with a copy of its state); either is said
    in one log line. For a :class:`TiedOutputProjection` the projection ``P`` (and bias) warms up
    and ``E``, the embedding's matrix, stays frozen with the rest.

    One process only for now: DDP, FSDP and DeepSpeed decide which parameters they synchronise
    when they wrap the model, after the freeze, so the parameters unfrozen later would not be.

    Args:
        warmup_steps: optimizer steps during which only the head trains.
        head_lr: the head's learning rate during the warm-up (constant); None keeps its group's.
        head: the head module or its dotted name, when it cannot be found automatically.
        untie: untie a tied head before the warm-up (see above) instead of refusing it.

    Logged metrics:
        - ``headwatch/remedies/head_warmup_phase``: 0 during the warm-up, 1 after; logged at the
          first step of a fit, every ``log_every_n_steps`` steps and at the switch.

    Raises:
        HeadwatchError: bad arguments (at construction); the head cannot be found, or
            ``world_size > 1`` (in ``setup``); a tied plain head without ``untie=True`` (at fit start).
    """

    def __init__(
        self, warmup_steps: int, head_lr: float | None = None, head: str | nn.Module | None = None, untie: bool = False
    ) -> None:
        super().__init__()
        self.core = HeadWarmupCore(warmup_steps, head_lr, untie)
        self.head = check_module_or_name("head", head)
        self._head_params: list[nn.Parameter] = []
        self._last_logged: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(warmup_steps=self.core.warmup_steps, head_lr=self.core.head_lr)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.world_size > 1:
            # DDP builds its gradient reducer from the parameters that require grad when it wraps the
            # model, i.e. after this freeze: parameters unfrozen later would never be all-reduced.
            raise HeadwatchError(
                f"HeadWarmup supports one process only (world_size=1), got world_size={trainer.world_size}: "
                "under DDP the parameters it unfreezes would not be synchronised"
            )
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(trainer.strategy, DeepSpeedStrategy):  # as BaseFinetuning.setup
            raise HeadwatchError("HeadWarmup does not support the DeepSpeed strategy: choose another strategy")
        # No freeze here, unlike BaseFinetuning.setup: Lightning calls `configure_model` after the
        # callbacks' `setup`, and a model untied or built there is the one that trains (on_fit_start).
        if self.core.untie:
            self._untie_before_the_optimizer(pl_module)

    def _untie_before_the_optimizer(self, pl_module: pl.LightningModule) -> None:
        """``untie=True``: untie a tied plain head now, before ``configure_optimizers`` and before a checkpoint
        loads (so a resumed fit gets its saved head), and before the monitors resolve the final model."""
        from headwatch.remedies.projection import TiedOutputProjection
        from headwatch.remedies.untie import untie_output_head

        try:
            found = find_head_and_embedding(pl_module, self.head)
        except HeadwatchError:  # built in configure_model: untied in on_fit_start, with the optimizers
            return
        if found.tied and not isinstance(found.head, TiedOutputProjection):
            untie_output_head(pl_module, head=found.head, embedding=found.embedding)
            rank_zero_info(f"headwatch: HeadWarmup(untie=True) untied `{found.head_name}` from `{found.embedding_name}` "
                           "before the optimizer is built (a copy: same logits)")

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        """BaseFinetuning's hook (no optimizer known here); the fit calls :meth:`_freeze` from ``on_fit_start``."""
        self._freeze(pl_module)

    def _freeze(self, pl_module: pl.LightningModule, optimizers: Iterable[Optimizer] = (), resumed: bool = False) -> None:
        self._head_params, what = self.core.head_parameters(pl_module, self.head, optimizers, resumed)
        frozen = self.core.freeze(pl_module, self._head_params)
        if frozen:
            rank_zero_info(
                f"headwatch: HeadWarmup trains only {what} until step {self.core.warmup_steps} "
                f"({sum(p.numel() for p in frozen):,} parameters frozen)"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Freeze the final model: after ``setup``, ``configure_model`` and the checkpoint's callback
        state (Lightning restores it before ``on_fit_start`` unless the strategy defers it), before
        the first forward. The optimizer already holds every parameter; frozen ones get no gradient."""
        if self.core.phase == 0:
            self._freeze(pl_module, trainer.optimizers, resumed=trainer.ckpt_path is not None)
        else:  # a checkpoint restored after setup says the warm-up is over
            self.core.release()
        for optimizer in trainer.optimizers:
            self.core.attach(optimizer, self._head_params)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing per epoch: the switch is per optimizer step (``on_train_batch_start``)."""

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        """Unused (BaseFinetuning's per-epoch hook); see ``on_train_batch_start``."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        switched = self.core.step(trainer.global_step, trainer.optimizers)
        if switched:
            rank_zero_info(f"headwatch: HeadWarmup done at step {trainer.global_step}: every parameter trains now")
        self._log(trainer, force=switched or self._last_logged is None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # leave the model trainable; a resumed fit freezes it again from the saved phase
            self.core.release()

    @rank_zero_only
    def _log(self, trainer: pl.Trainer, force: bool = False) -> None:
        step = trainer.global_step
        if step == self._last_logged or not (force or step % max(1, trainer.log_every_n_steps) == 0):
            return
        self._last_logged = step
        for logger in trainer.loggers:
            logger.log_metrics({PHASE_KEY: float(self.core.phase)}, step=step)

    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.core.load_state_dict(state_dict)
