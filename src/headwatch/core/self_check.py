"""``SelfCheck``: what headwatch captured on a logging step, compared with figures the trainer already has.

Owned by the :class:`~headwatch.core.orchestrator.Orchestrator` (one per run, every front door). On each
training logging step it adds, on the device and before the step's one host transfer:

- ``debug/capture/forwards``, ``debug/capture/positions``, ``debug/capture/labelled_positions``: what
  :class:`~headwatch.core.logits.LogitStats` measured (its :class:`CaptureTally`);
  ``debug/capture/generation_forwards``, ``debug/capture/no_grad_forwards``: the step's forwards left out (counted by the
  orchestrator, :meth:`SelfCheck.skipped_forward`);
- ``debug/check/reference_nll`` (with ``debug/check/reference_positions``, ``debug/check/reference_forwards``) and
  ``check/nll_gap = logits/target_nll - debug/check/reference_nll``: the trainer's own token-mean cross-entropy
  of the step's loss forwards, when one exists (a Hugging Face model's ``outputs.loss``, read by a forward
  hook; a plain-loop user's ``step_end(loss=...)``; a Lightning user's logged metric);
- ``check/entropy_gap``, ``check/accuracy_gap``: against TRL's logged ``entropy`` and
  ``mean_token_accuracy`` of the step, when a door hands them (:meth:`SelfCheck.trainer_metrics`);
- ``check/mismatch``: 1 when a gap is beyond its tolerance (:data:`TOLERANCES`) or not finite while the
  reference is, else 0;
- ``check/vanished_gradient``: 1 when the head's gradient is all zero (row density 0) next to a finite positive
  loss; else 0 (a row density below 1 alone is not: a masked vocabulary column has no gradient).

After the transfer, :meth:`SelfCheck.published` warns once per kind, naming the likely cause. See
``docs/self_check.md`` for the formulas, the tolerances and where each reference comes from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.core.capture_tally import CaptureTally
from headwatch.core.monitor import FailurePolicy
from headwatch.core.overhead import agree_budgets
from headwatch.core.tolerance import (  # noqa: F401 - their home before
    EPS,
    TOLERANCES,
    Tolerance,
    dtype_tolerance,
    scored_dtype,
)
from headwatch.distributed.reduce import NoReducer, Reducer, collective_device, stacked
from headwatch.errors import HeadwatchError, check_prefix
from headwatch.model.hooks import ModelHook

TOTALS = 10
"""Leading entries of the self-check's summed counts (:meth:`SelfCheck.local_sums`), before the per-forward slots."""

MAX_PAIRED = 64
"""Loss forwards per logging step whose positions are summed over processes to weigh TRL's per-micro-batch
entries (more: the entries are averaged unweighted)."""


def _labelled_count(kwargs: dict[str, Any], output: Any, module: nn.Module) -> Tensor | None:
    """Positions whose label the model's loss counts (Hugging Face conventions), on the device; None: unknown.

    TRL's fused head returns ``label_mask``; else ``labels`` of the forward's keyword inputs (``-100`` ignored),
    shifted by one in causal LMs (not when ``shift_labels`` is given, nor in encoder-decoders).
    """
    mask = getattr(output, "label_mask", None)
    if isinstance(mask, Tensor):
        return mask.sum()
    shifted = kwargs.get("shift_labels")
    if isinstance(shifted, Tensor):
        return (shifted != -100).sum()
    labels = kwargs.get("labels")
    if not isinstance(labels, Tensor) or labels.is_floating_point():
        return None
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return (labels != -100).sum()
    return (labels[..., 1:] != -100).sum()


def output_loss(output: Any) -> Tensor | None:
    """``outputs.loss`` of a model output (a ``ModelOutput``, a dict, or an object with ``loss``), or None."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


class SelfCheck(FailurePolicy):
    """Publish what was captured and compare it with the trainer's own figures (see the module docstring).

    Args:
        prefix: first component of every metric name.
        reducer: distributed reductions (the orchestrator's).
        tolerances: per compared figure (``"nll"``, ``"entropy"``, ``"accuracy"``), fixed for the run; default: by
            the dtype the loss scored (:func:`dtype_tolerance`).

    Raises:
        HeadwatchError: a bad ``prefix``.
    """

    def __init__(
        self, prefix: str = "headwatch", reducer: Reducer | None = None, tolerances: dict[str, Tolerance] | None = None, evaluation: bool = False
    ) -> None:
        self.prefix = check_prefix(prefix)
        self.evaluation = evaluation
        """Checks an evaluation (names under ``<prefix>/val/``): eval-mode forwards' ``outputs.loss`` against the first
        validation dataloader's ``val/logits/*``; else the training logging steps."""
        self._tally = "val_tally" if evaluation else "capture_tally"
        self.evaluation_check: SelfCheck | None = None
        """The evaluation's check, handed the eval-mode forwards this check's hook sees (one hook on the model: a
        second would change how ``torch.compile`` traces the model's hooks)."""
        self.reducer: Reducer = reducer or NoReducer()
        self.tolerances: dict[str, Tolerance] = dict(tolerances or {})
        """Tolerances set for the run, by figure; the others follow the dtype of each step (:meth:`tolerance`)."""
        self._dtype: tuple[torch.dtype | None, int] = (None, 0)  # the dtype and V of the step being checked
        self.active = False
        self.policy_gradient = False
        """An RL run (policy-gradient loss, :meth:`Orchestrator.sample_at`): the model's ``outputs.loss`` is the
        sampled tokens' NLL, not the loss that trains, and a zero gradient is legitimate (zero advantages):
        no ``check/vanished_gradient``."""
        self.mismatched_steps = 0
        """Logging steps with a gap beyond its tolerance, this run."""
        self.vanished_steps = 0
        """Logging steps with a vanished head gradient, this run."""
        self.hook = ModelHook(self._on_output)
        """The forward hook on the model whose ``outputs.loss`` is read (:meth:`attach`)."""
        """The module whose ``outputs.loss`` is read (None: not attached)."""
        self._taken: tuple | None = None  # what local_sums took for extend
        self._optional: list[str] = []  # the step's reference keys, dropped after the transfer where none exists
        self.interval = 0
        """The run's logging interval in steps (the door's ``log_every_n_steps`` / ``logging_steps``), checked against
        its sum over processes on each training logging step (:meth:`withheld`)."""
        self._reset()

    @property
    def rank(self) -> int:
        return self.reducer.rank

    def tolerance(self, key: str) -> Tolerance:
        """The tolerance of ``key`` on the step being checked: set for the run, else :func:`dtype_tolerance` of the dtype
        the measured forwards' logits were scored in (the same on every process: the run's configuration)."""
        return self.tolerances.get(key) or dtype_tolerance(key, *self._dtype)

    def _reset(self) -> None:
        self._sums: list[Tensor] = []  # per loss forward: its NLL summed over its labelled positions (float64)
        self._weights: list[Tensor | float] = []  # its labelled positions (1.0 when unknown)
        self._counted = True  # every forward's labelled positions are known
        self._step_loss: Tensor | float | None = None
        self._logged_upto: Tensor | None = None  # the capture's labelled positions when a logged loss was last handed
        self._trl: dict[str, list[float]] = {}
        self._skipped: dict[str, int] = {"generation": 0, "no_grad": 0}  # forwards of the step not measured, by kind

    # ---------------------------------------------------------------- wiring
    def attach(self, model: nn.Module) -> None:
        """Read ``outputs.loss`` of ``model``'s training forwards (a forward hook; nothing between logging steps).
        Idempotent for the same model."""
        self.hook.watch(model)

    def detach(self) -> None:
        self.hook.remove()

    @property
    def model(self) -> nn.Module | None:
        """The model whose ``outputs.loss`` is read (None: none)."""
        return self.hook.model

    # ---------------------------------------------------------------- the step
    def begin(self, logging: bool) -> None:
        """A training step starts; ``logging``: it is measured (the references are collected)."""
        self.active = logging
        self._reset()

    def _on_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A forward of the model: a training forward with gradients and a ``loss`` is one of the step's loss forwards."""
        if not self.active or not module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            other = self.evaluation_check  # an eval-mode forward of an evaluation (never traced: read outside compile)
            if not torch.compiler.is_compiling() and other is not None and other.active and not module.training:
                other._read(module, kwargs, output)
            return
        self._read(module, kwargs, output)

    def _read(self, module: nn.Module, kwargs: dict, output: Any) -> None:
        """One loss forward's ``outputs.loss`` and its labelled positions, recorded."""
        try:
            loss = output_loss(output)
            if loss is None:
                return
            aux = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
            if aux is not None:
                self.warn_once(
                    "aux_loss",
                    "headwatch self-check: the model's `outputs.loss` includes an auxiliary loss (MoE router "
                    "load balancing), so it is not the cross-entropy headwatch measures; no check/nll_gap is "
                    "published. (warned once)",
                )
                self._reset()
                self.active = False
                return
            count = _labelled_count(kwargs, output, module)
            if count is None:
                return
            items = kwargs.get("num_items_in_batch")  # the loss is the sum over the step's items / N
            weight = items if items is not None else count
            self.add_nll_sum(_weighted(loss.detach().double(), weight, count), count)
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            self.fail(err, "reading the model's loss")

    def rows_left_out(self) -> None:
        """An evaluation batch whose repeated rows (an even distributed split) are left out of the capture but not of
        the model's loss: the evaluation has no comparable reference (NaN, summed over processes: on every rank)."""
        self.add_nll_sum(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))

    def skipped_forward(self, kind: str) -> None:
        """A forward of the logging step that feeds no loss (``"generation"``: a ``generate()`` call's; ``"no_grad"``:
        a reference, old log-probability or metrics pass; :func:`headwatch.core.forwards.skipped_in_training`)."""
        self._skipped[kind] = self._skipped.get(kind, 0) + 1

    def add_nll_sum(self, nll_sum: Tensor, count: Tensor) -> None:
        """One loss forward: its NLL summed over ``count`` labelled positions (tensors on the device)."""
        self._sums.append(nll_sum.reshape(()).double())
        self._weights.append(count)

    def add_loss(self, loss: Tensor | float, count: Tensor | None = None) -> None:
        """One loss forward's token-mean cross-entropy (a door's figure, e.g. Lightning's logged loss),
        weighted by its labelled positions ``count`` (a device tensor; None: every call weighs the same)."""
        if isinstance(loss, Tensor):
            loss = loss.detach().double().reshape(())
        self._sums.append(_weighted(loss, count, count) if count is not None else loss)  # type: ignore[arg-type]
        self._weights.append(count if count is not None else 1.0)
        self._counted = self._counted and count is not None

    def add_logged_loss(self, key: str, logged: Mapping[str, Any], tally: CaptureTally | None, by: str, how: str) -> None:
        """The trainer's logged metric ``key`` of this (micro-)batch (``logged``: its logged metrics by name) as one loss
        figure's token-mean cross-entropy (:meth:`add_loss`) over the labelled positions the capture ``tally`` counted
        since the last call of the step (this batch's measured forwards; None: unknown, unweighted and not counted).

        A logged mean says nothing of which positions it averaged: the loss a user logs is over the logits this batch's
        forwards returned (only the kept ones under ``logits_to_keep``, every forward of R-Drop pooled), not over the
        batch's labels. The position count still fails where a measured batch handed no value (a process or micro-batch
        that did not log ``key``). A ``key`` not logged is warned about once, naming who logs it (``by``) and ``how``;
        any failure follows the failure policy."""
        try:
            upto, self._logged_upto = self._logged_upto, tally.labelled if tally is not None else None
            value = logged.get(key)
            if value is None:
                self.warn_once(
                    f"compare_loss:{key}",
                    f"headwatch self-check: `compare_loss={key!r}` names no metric {by} logged on this "
                    f"step (logged: {sorted(logged)}); log it with {how}. No check/nll_gap. (warned once)",
                )
                return
            count = self._logged_upto
            if count is not None and upto is not None:
                count = count - upto.to(count.device)
            self.add_loss(value, count)
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            self.fail(err, f"reading the logged metric {key!r}")

    def step_loss(self, loss: Tensor | float) -> None:
        """The step's token-mean cross-entropy over its measured forward(s), as the user computed it
        (``Headwatch.step_end(loss=...)``); replaces what the hook read."""
        self._step_loss = loss.detach() if isinstance(loss, Tensor) else float(loss)

    def trainer_metrics(self, **values: Sequence[float]) -> None:
        """A trainer's logged per-micro-batch values of this step: ``entropy`` (nats), ``accuracy`` (fraction)."""
        self._trl = {k: [float(x) for x in v] for k, v in values.items() if v}

    # ---------------------------------------------------------------- compute (on the device)
    def local_sums(self, monitors: Sequence[Any], device: torch.device | None = None) -> dict[str, Tensor]:
        """Phase one of :meth:`extend` with several processes: this step's counts on this process, taken (the step's
        records start empty) and kept for :meth:`extend`; ``{"totals": (TOTALS + MAX_PAIRED,) float64}`` (labelled
        positions, the loss forwards' NLL sum and positions, whether some forward's positions are unknown, the step
        loss weighted by its positions and their weight, the loss forwards, whether a step loss was handed, whether
        the capture's labels are unknown, the logging interval, each forward's positions), to be summed over processes
        with the step's other sums. No collective. ``device``:
        where to build it (default: where this step's tensors are, else where collectives run).

        A failure warns once (raises when strict) and gives zeros of the same layout: no check value this step."""
        tally = next((getattr(m, self._tally) for m in monitors if isinstance(getattr(m, self._tally, None), CaptureTally)), None)
        self._dtype = (tally.dtype, tally.vocab_size) if tally is not None else (None, 0)
        taken = (tally.take() if tally is not None else (0, None), self._sums, self._weights, self._counted, self._step_loss, self._trl, dict(self._skipped))
        self._reset()
        self.active = False  # until the next logging step begins
        if device is None:
            own = [x for x in (taken[0][1], *taken[1], *taken[2], taken[4]) if isinstance(x, Tensor)]
            device = own[0].device if own else collective_device()
        try:
            self._taken = (*taken, device)
            return {"totals": self._local(device)}
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            self._taken = None
            self.fail(err, "computing the self-check")
            return {"totals": torch.zeros(TOTALS + MAX_PAIRED, dtype=torch.float64, device=device)}

    def _local(self, device: torch.device) -> Tensor:
        """The counts of :meth:`local_sums` from what it took."""
        (_, labelled), sums, weights, counted, step_loss = self._taken[0], *self._taken[1:5]  # type: ignore[index]

        def dev(x: Tensor | float) -> Tensor:
            return _on(x, device)

        zero = dev(0.0)
        w = torch.stack([dev(x) for x in weights]) if weights else None  # (forwards,)
        # each forward's positions summed over processes too (TRL's entries are per micro-batch, over every process):
        # a fixed-size slot per forward, so that every rank's collective has the same shape
        slots = torch.zeros(MAX_PAIRED, dtype=torch.float64, device=device)
        if w is not None and len(weights) <= MAX_PAIRED:
            slots[: len(weights)] = w
        # the user's step loss (a token mean on this process), weighted by its labelled positions: the mean over
        # processes is the same on every rank, so is every decision taken from it
        weight = dev(labelled) if labelled is not None else dev(1.0)
        return torch.cat([torch.stack([
            dev(labelled) if labelled is not None else zero,
            torch.stack([dev(s) for s in sums]).sum() if sums else zero,
            w.sum() if w is not None else zero,
            dev(0.0 if counted else 1.0),
            _weighted(dev(step_loss), weight, weight) if step_loss is not None else zero,
            weight if step_loss is not None else zero,
            dev(float(len(sums))),  # the reference's forwards: whether a reference exists anywhere, from the sum
            dev(1.0 if step_loss is not None else 0.0),
            dev(1.0 if labelled is None else 0.0),  # the capture's labelled positions are not known here
            dev(float(self.interval)),  # the same on every process, or the reductions pair different steps
        ]), slots])  # fmt: skip

    def extend(self, scalars: dict[str, Any], monitors: Sequence[Any], reduced: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
        """``scalars`` (a training logging step's values, still on the device) with the capture and check
        values added: device ops only (Python numbers enter as scalar operands or fills, never as copies).
        ``reduced``: :meth:`local_sums` summed over processes (the orchestrator reduces it with the step's other
        sums); None: taken here and, with several processes, summed here (a collective: every rank calls it on
        the same steps)."""
        p = self.prefix
        out = dict(scalars)
        own_nll, positions = scalars.get(f"{p}/logits/target_nll"), scalars.get(f"{p}/logits/positions")
        tensors = [v for v in scalars.values() if isinstance(v, Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        if reduced is None:
            local = self.local_sums(monitors, device)["totals"]
            total = self.reducer.sum(local) if self.reducer.world_size > 1 else local
        else:
            total = reduced["totals"].to(device)
        taken, self._taken = self._taken, None
        if taken is None:  # local_sums failed (said there)
            return out
        (forwards, _), sums, weights, counted, step_loss, trl, skipped, _ = taken

        def dev(x: Tensor | float) -> Tensor:
            return _on(x, device)

        w = torch.stack([dev(x) for x in weights]) if weights else None  # (forwards,)
        if w is not None and len(weights) <= MAX_PAIRED:  # the global positions of each forward (on one process: w)
            w = total[TOTALS : TOTALS + len(weights)]
            w = torch.where(total[3] > 0, 1.0, w)  # a process without its counts: unweighted on every process (no sync)
        if isinstance(positions, Tensor):
            out[f"{p}/debug/capture/forwards"] = float(forwards)
            out[f"{p}/debug/capture/positions"] = positions
            out[f"{p}/debug/capture/labelled_positions"] = total[0]
            if not self.evaluation:
                out[f"{p}/debug/capture/generation_forwards"] = float(skipped.get("generation", 0))
                out[f"{p}/debug/capture/no_grad_forwards"] = float(skipped.get("no_grad", 0))
        # whether a reference exists, and which, is decided from the sums over processes (a rank whose loss forward
        # raised has none of its own): the keys are added on every rank and dropped after the transfer where no
        # process had a reference (:meth:`withheld`)
        by_step = total[7] > 0
        exists = (total[6] + total[7]) > 0
        reference = torch.where(by_step, total[4] / total[5], total[1] / total[2])  # step losses weighted by positions
        reference = torch.where(exists, reference, float("nan"))
        gaps: list[Tensor] = []
        self._optional = []
        if not self.evaluation and self.reducer.world_size > 1:  # checked after the transfer (withheld)
            out[f"{p}/debug/check/_interval"] = total[9]
        if isinstance(positions, Tensor):  # no logit statistics (no monitor): nothing to compare
            measured = positions.to(device) > 0  # 0: the logit statistics were refused (said once): nothing to compare
            if any(getattr(m, "temperature", None) not in (None, 1.0) for m in monitors):
                measured = measured & False  # a sampling temperature: the loss scores another distribution (by configuration)
            out[f"{p}/debug/check/_references"] = total[6] + total[7]
            out[f"{p}/debug/check/reference_nll"] = reference
            out[f"{p}/debug/check/reference_forwards"] = torch.where(by_step, dev(float("nan")), dev(float(len(sums))))
            # position counts agree exactly, or fail, where every process knows its capture's labelled positions: the
            # forwards' own counts, or those of the step losses (each weighted by its process's labelled positions; a
            # process whose loss was thrown away after its forward is measured by the capture, absent from the loss)
            exact = (total[8] == 0) & (by_step | (total[3] == 0))
            positions_ref = torch.where(by_step, total[5], total[2])
            out[f"{p}/debug/check/reference_positions"] = torch.where(exact, positions_ref, float("nan"))
            own = own_nll.double() if isinstance(own_nll, Tensor) else dev(float("nan"))
            out[f"{p}/check/nll_gap"] = gap = own - reference
            gaps.append(self._beyond(gap, reference, "nll") & measured)
            gaps.append(exact & measured & (total[0] != positions_ref) & torch.isfinite(reference))  # NaN: not comparable
            self._optional = [f"{p}/debug/check/{k}" for k in ("reference_nll", "reference_forwards", "reference_positions")]
            self._optional.append(f"{p}/check/nll_gap")
        for key, name in (("entropy", "logits/entropy"), ("accuracy", "logits/target_argmax_rate")):
            values, mine = trl.get(key), scalars.get(f"{p}/{name}")
            if not values or not isinstance(mine, Tensor):
                continue
            # the step's micro-batch values, weighted by their loss forwards' positions when they pair up
            vw = w if w is not None and len(weights) == len(values) and counted else torch.ones(len(values), dtype=torch.float64, device=device)
            ref = torch.stack([vw[i] * v for i, v in enumerate(values)]).sum() / vw.sum()
            out[f"{p}/check/{key}_gap"] = gap = mine.double() - ref
            gaps.append(self._beyond(gap, ref, key))
        if gaps:
            out[f"{p}/check/mismatch"] = torch.stack(gaps).any().double()
            if len(gaps) == 2 and self._optional:  # the NLL's alone: dropped with them
                self._optional.append(f"{p}/check/mismatch")
        loss: Tensor | None = None  # from reduced values: the same flag on every process
        if isinstance(own_nll, Tensor):
            loss = torch.where(exists, reference, own_nll.to(device).double())
        elif self.reducer.world_size == 1 and (sums or step_loss is not None):  # no logit statistics: the reference
            loss = reference
        vanished = self._vanished(scalars, loss, device)
        if vanished is not None:
            out[f"{p}/check/vanished_gradient"] = vanished
        return out

    def checked(self, scalars: dict[str, Any], monitors: Sequence[Any], reduced: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
        """:meth:`extend`; a failure warns once (raises when strict) and adds nothing."""
        try:
            return self.extend(scalars, monitors, reduced)
        except Exception as err:  # noqa: BLE001 - a monitoring failure never stops training
            self.fail(err, "computing the self-check")
            return scalars

    def _beyond(self, gap: Tensor, reference: Tensor, key: str) -> Tensor:
        """True where ``gap`` is beyond the tolerance of ``key``, or not finite while ``reference`` is."""
        tol = self.tolerance(key)
        within = gap.abs() <= tol.atol + tol.rtol * reference.abs()
        return ~within & torch.isfinite(reference)

    def _vanished(self, scalars: dict[str, Any], loss: Any, device: torch.device) -> Tensor | None:
        """1 when the head's gradient vanished next to a finite positive loss, 0 when not, None: not measured."""
        if self.policy_gradient:  # zero advantages (every completion of a group rewarded alike) give zero gradient
            return None
        p = self.prefix
        head, shared = (scalars.get(f"{p}/grad/{k}") for k in ("head_row_density", "shared_row_density"))
        if not isinstance(loss, Tensor) or not (isinstance(head, Tensor) or isinstance(shared, Tensor)):
            return None
        # all zero: no row of the head has a gradient. A row density below 1 is no sign of it: a column the model
        # masks (logits -inf: a padding token) gives its row no gradient, and a row's gradient can underflow
        flag = torch.zeros((), dtype=torch.bool, device=device)
        for density in (head, shared):
            if isinstance(density, Tensor):
                flag = flag | (density.to(device) == 0)
        loss = loss.to(device=device, dtype=torch.float64)
        return (flag & torch.isfinite(loss) & (loss > 0)).double()

    # ---------------------------------------------------------------- after the transfer
    def withheld(self, numbers: dict[str, float]) -> dict[str, str]:
        """The figures withheld on a step, decided from values reduced over processes: where the self-check failed
        (``check/mismatch`` 1) every ``logits/*`` figure of the step; where the head's gradient vanished
        (``check/vanished_gradient`` 1) the row densities of the head (or the shared matrix), overall and by bucket,
        which would read as a measured 0. The flags and the gaps themselves are published."""
        p = self.prefix
        out: dict[str, str] = {}
        if (interval := numbers.pop(f"{p}/debug/check/_interval", None)) is not None:
            self.same_interval(interval)
        references = numbers.pop(f"{p}/debug/check/_references", None)  # the loss forwards over processes
        if references == 0:  # no process had a reference: its keys are not published (on every rank alike)
            for key in self._optional:
                numbers.pop(key, None)
            self._no_reference()
        if numbers.get(f"{p}/check/mismatch", 0.0) > 0:  # reduced values: every process withholds alike
            out.update(dict.fromkeys((k for k in numbers if k.startswith(f"{p}/logits/")), "the self-check failed"))
        if numbers.get(f"{p}/check/vanished_gradient", 0.0) > 0:
            cause = "the head's gradient vanished"
            out.update({k: cause for k in numbers if k.startswith(f"{p}/grad/") and k.endswith(("head_row_density", "shared_row_density"))})
        return out

    def same_interval(self, total: float) -> None:
        """``total``: the logging interval summed over processes, from a logging step's reduced sums.

        Raises:
            HeadwatchError: ``total`` is not ``world_size`` times this process's interval (nothing of the step is
                published); marked ``strict`` (raised through a door's guard).
        """
        world = self.reducer.world_size
        if total != world * self.interval:
            raise self._interval_error(f"the mean over the {world} processes is {total / world:g}")

    def agree_interval(self, budget: float | None) -> None:
        """Before the first step (every process at the same point), every process's logging interval and ``budget`` (its
        overhead_budget), gathered (one collective, on no step): different intervals raise (as :meth:`same_interval`),
        and so does a budget on some processes only (:func:`agree_budgets`), before a step pairs its reductions with
        another step's or, DDP-wrapped, with DDP's gradient all-reduce (a hang)."""
        if self.reducer.world_size > 1:
            mine = torch.tensor([float(self.interval), math.nan if budget is None else budget], dtype=torch.float64)
            both = stacked(self.reducer, mine.to(collective_device())).reshape(-1, 2).tolist()  # a host read at start-up
            if len(set(every := [float(x) for x, _ in both])) > 1:
                raise self._interval_error("by rank: " + ", ".join(f"{x:g}" for x in every))
            agree_budgets([None if math.isnan(b) else b for _, b in both], self.rank)  # NaN: no budget

    def _interval_error(self, others: str) -> HeadwatchError:
        error = HeadwatchError(
            f"headwatch: the processes log at different intervals: this process (rank {self.rank}) logs every "
            f"{self.interval} step(s), {others}. Their reductions pair different steps' values (wrong numbers, then a "
            "hang), so nothing is published. Pass the same log_every_n_steps (plain loop, Lightning's Trainer) or "
            "logging_steps (Hugging Face TrainingArguments) on every process."
        )
        error.strict = True  # type: ignore[attr-defined]  # not a monitoring failure: the run is misconfigured
        return error

    def _no_reference(self) -> None:
        if not self.evaluation:
            self.note_once(  # a figure left out (check/nll_gap): a note, never raised
                "no_reference",
                "headwatch self-check: no trainer loss to compare target_nll with on this run (no training forward "
                "returned `outputs.loss`: the trainer computes the loss outside the model, e.g. label smoothing or "
                "`compute_loss_func`, or the model is compiled), so check/nll_gap is not published; pass "
                "step_end(loss=...) (plain loop) or compare_loss=<logged key> (Lightning) to compare. The "
                "debug/capture/* counts are still published. (said once)",
            )

    def published(self, numbers: dict[str, float]) -> None:
        """Warn once per kind (rank zero) from the published floats: a gap beyond tolerance, a vanished gradient."""
        p, get = self.prefix, numbers.get
        if get(f"{p}/check/mismatch", 0.0) > 0:
            self.mismatched_steps += 1
            self._warn_mismatch(numbers)
        if get(f"{p}/check/vanished_gradient", 0.0) > 0:
            self.vanished_steps += 1
            loss = get(f"{p}/debug/check/reference_nll", get(f"{p}/logits/target_nll", float("nan")))
            self.warn_once(
                "vanished_gradient",
                f"headwatch self-check: the output head's gradient VANISHED next to a finite, positive loss ({loss:.4g} "
                "nats): a softmax cross-entropy gives every row of the head a gradient. Likely causes: a fused loss whose "
                "backward returns a zero head gradient, a hook or a `torch.no_grad` that cuts the head out of the graph, "
                f"fp16 underflow without a loss scaler. On such steps {p}/check/vanished_gradient is 1 and the head's row "
                f"densities are withheld (counted in {p}/check/withheld). (warned once)",
            )

    def _warn_mismatch(self, numbers: dict[str, float]) -> None:
        p, get, nan, parts = self.prefix, numbers.get, float("nan"), []
        nll_gap = get(f"{p}/check/nll_gap")
        nll_tol = self.tolerance("nll")
        lab, ref_pos = get(f"{p}/debug/capture/labelled_positions", nan), get(f"{p}/debug/check/reference_positions", nan)
        if nll_gap is not None and abs(nll_gap) <= nll_tol.atol + nll_tol.rtol * abs(get(f"{p}/debug/check/reference_nll", 0.0)):
            if not math.isnan(ref_pos) and lab != ref_pos:  # values agree, positions do not: counted exactly
                parts.append(f"headwatch's forwards hold {lab:.0f} labelled positions, the loss counts {ref_pos:.0f} (position "
                             "counts must match exactly); likely cause: other positions (prompt tokens, `logits_to_keep`, a "
                             "different label shift) whose mean happens to agree, or a measured batch that handed no loss (a process "
                             "or micro-batch that logged no `compare_loss=` metric)")  # fmt: skip
        elif nll_gap is not None:
            own, ref = get(f"{p}/logits/target_nll", nan), get(f"{p}/debug/check/reference_nll", nan)
            fw, ref_fw = get(f"{p}/debug/capture/forwards", nan), get(f"{p}/debug/check/reference_forwards", nan)
            if math.isnan(own) or lab == 0:
                cause = ("headwatch saw no labels in the forward it measured: the trainer took `labels` out of the model's "
                         "inputs (label smoothing, `compute_loss_func`) or the batch keeps them under another key (`targets_fn=`)")  # fmt: skip
            elif not math.isnan(fw) and not math.isnan(ref_fw) and fw != ref_fw:
                cause = (f"headwatch measured {fw:.0f} forward(s) but the loss came from {ref_fw:.0f}: a forward that does not feed "
                         "the loss was pooled (a second pass for metrics, generation, a reference model) or the loss's forward was missed")  # fmt: skip
            elif not math.isnan(ref_pos) and lab != ref_pos:
                cause = (f"headwatch's forwards hold {lab:.0f} labelled positions, the loss counts {ref_pos:.0f}: other positions "
                         "(prompt tokens, `logits_to_keep`, a different label shift), or a measured forward whose loss was "
                         "thrown away on some process (an exception after the forward, a skipped batch, a batch that logged no "
                         "`compare_loss=` metric)")  # fmt: skip
            else:
                cause = ("same positions, different values: the labels changed after the forward, the loss is not plain "
                         "cross-entropy (label smoothing, an auxiliary loss, a temperature), or it comes from a different forward")  # fmt: skip
            parts.append(f"target NLL {own:.6g} vs the trainer's loss {ref:.6g} nats (gap {nll_gap:.3g}); likely cause: {cause}")
        for key, name, unit in (("entropy", "logits/entropy", "nats"), ("accuracy", "logits/target_argmax_rate", "")):
            gap = get(f"{p}/check/{key}_gap")
            if gap is None:
                continue
            tol = self.tolerance(key)
            mine = get(f"{p}/{name}", nan)
            ref = mine - gap
            if not abs(gap) <= tol.atol + tol.rtol * abs(ref):
                what = "entropy" if key == "entropy" else "mean_token_accuracy"
                parts.append(
                    f"{name} {mine:.6g} vs TRL's logged {what} {ref:.6g} {unit}(gap {gap:.3g}); likely cause: other positions "
                    "(prompt or padding positions, each row's last position) or another distribution (a temperature, softcapping)"
                )
        if parts:
            self.warn_once(
                "mismatch",
                "headwatch self-check FAILED: what headwatch measured disagrees with the trainer's own figures beyond the "
                "tolerance (docs/self_check.md): " + "; ".join(parts) + f". The gaps are published under {p}/check/; "
                f"{p}/check/mismatch is 1 on such steps, and their {p}/logits/* figures are withheld on every process "
                f"(counted in {p}/check/withheld). (warned once)",
            )

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"mismatched_steps": self.mismatched_steps, "vanished_steps": self.vanished_steps}

    def load_state_dict(self, state: Any) -> None:
        """The counts of a checkpoint; a missing or invalid value (an older checkpoint) starts from 0."""
        state = state if isinstance(state, dict) else {}
        for key in ("mismatched_steps", "vanished_steps"):
            value = state.get(key, 0)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            setattr(self, key, value if ok else 0)


def _on(x: Tensor | float, device: torch.device) -> Tensor:
    """``x`` as a float64 scalar tensor on ``device`` (a Python number: a fill, not a host-to-device copy)."""
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _weighted(loss: Tensor | float, weight: Tensor | float, count: Tensor) -> Tensor:
    """``loss * weight`` (float64), 0 where the forward has no labelled position (``count`` 0): the model's loss of
    such a forward is NaN (0 / 0), and it holds no position of the reference (``docs/self_check.md``)."""
    if not isinstance(loss, Tensor):
        loss = torch.full((), float(loss), dtype=torch.float64, device=count.device)
    product = loss.double() * (weight.double() if isinstance(weight, Tensor) else float(weight))
    return torch.where((count > 0).to(product.device), product, 0.0)
