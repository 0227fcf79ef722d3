"""``GradientDensity``: gradient density of the embedding vs the head, and the tied split, trainer-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.core.frequency import TokenCounts, check_token_counts
from headwatch.core.monitor import Monitor, StepFailed
from headwatch.distributed import fsdp1
from headwatch.distributed.reduce import collective_device
from headwatch.distributed.sharded import (ShardedLookup, is_sharded, local_rows, row_norms_full, row_statistics,
                                           tied_flow_statistics, tied_flow_sums, tied_flow_values)
from headwatch.distributed.zero import full_gradient, gradient_ready, zero_held
from headwatch.errors import StateReader, check_bool, check_int, check_module_or_name
from headwatch.functional.frequency import BUCKETS, FrequencySnapshot, seen_count_ranks
from headwatch.functional.rows import dense_rows, norm_ratio, spearman_of_ranks
from headwatch.model.adapters import trainable_matrices
from headwatch.model.find import Matrices, resolve_matrices
from headwatch.model.flows import HeadFlowCapture, LookupFlowCapture, compiles_a_member
from headwatch.model.sources import compiled_modules
from headwatch.model.weights import declared_shape, effective_weight, refused_kind


class GradientDensity(Monitor):
    """Per-row gradient and update statistics (see :class:`headwatch.GradientDensityMonitor`).

    Needs a :class:`TokenCounts` (``frequency``) attached to the same model. The matrices are the
    effective ones (:mod:`headwatch.model.weights`): the lookup flow is captured on every module that
    looks up the embedding's weight (tied T5: encoder and decoder), a LoRA head's row gradient is
    ``g.T @ h`` from hooks on the head, and a frozen matrix gets no gradient statistics at all.

    Args: see :class:`headwatch.GradientDensityMonitor`; ``figure_every``: steps between figures (0: none).

    Raises:
        HeadwatchError: an invalid argument (checked here, whatever the front door).
    """

    name = "grad"

    def __init__(
        self,
        frequency: TokenCounts,
        head: str | nn.Module | None = None,
        embedding: str | nn.Module | None = None,
        update_density: bool = True,
        log_histogram: bool = True,
        figure_every: int = 0,
        prefix: str = "headwatch",
        strict: bool = False,
    ) -> None:
        super().__init__(prefix, strict)
        check_token_counts("frequency", frequency)  # None: a front door sets it at set-up
        check_module_or_name("head", head)
        check_module_or_name("embedding", embedding)
        check_bool("update_density", update_density)
        check_bool("log_histogram", log_histogram)
        check_int("figure_every", figure_every, minimum=0)
        self.frequency = frequency
        self.head = head
        self.embedding = embedding
        self.update_density = update_density
        self.log_histogram = log_histogram
        self.figure_every = figure_every
        self.tied = False
        self.tying_text = ""
        self.tying_published = ""
        """The ``grad/tying`` text last put in :attr:`media` (it is published again when it changes)."""
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self.matrices: Matrices | None = None
        self._refused_roles: set[str] = set()
        self._lookup_capture: LookupFlowCapture | None = None
        self._head_capture: HeadFlowCapture | None = None
        self._active = False
        self._step: int | None = None
        self._measured = False
        self._failed_here = False  # this step's gradient measurement failed on this process (said then)
        self._elsewhere: set[str] = set()  # the step's flows without a gradient here that another process has
        self._tied_sums: Tensor | None = None
        self._weights: dict[str, Tensor] = {}  # the matrices as the step's gradient statistics read them
        self._before: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}
        self._snapshot: FrequencySnapshot | None = None
        self._histograms: dict[str, Tensor] = {}
        self._full_norms: dict[str, Tensor] = {}
        self._scratch_buffers: dict[str, Tensor] = {}
        self.logged_steps = 0

    # ---------------------------------------------------------------- wiring
    def attach(self, model: nn.Module) -> None:
        self.detach()
        m = self.matrices = resolve_matrices(model, self.head, self.embedding)
        self.tied, self._head, self._emb, self.model = m.tie.tied, m.head, m.embedding.module, model
        head, emb = m.trains["head"], m.trains["embedding"]
        # PEFT trainable tokens: only k rows train, as a separate (k, d) delta; refused (said once, in m.text())
        self._refused_roles = {role for role, state in m.trains.items() if refused_kind(state)}
        if self.tied and self._refused_roles:
            self._refused_roles = {"head", "embedding"}
        if emb.trains and "embedding" not in self._refused_roles and (self.tied or emb.gradient_parameter is None):
            self._lookup_capture = LookupFlowCapture(m.embedding).attach()  # every lookup of the weight
            self._lookup_capture.timer = lambda: self.clock  # its backward work counted by the overhead budget
            # compiled code around the lookups known now: the first logging step already has its probe
            self._lookup_capture.compiled = compiles_a_member(compiled_modules(model), [n for n, _ in m.embedding.modules])
        if head.trains and "head" not in self._refused_roles and head.gradient_parameter is None:
            self._head_capture = HeadFlowCapture(m.head).attach()  # LoRA: no Parameter holds dL/dW_eff
            self._head_capture.timer = lambda: self.clock
        self.tying_text = m.text()
        if m.config_message:
            self.warn_once("config_tie", m.config_message)
        for role, state in m.trains.items():
            if not state.trains or role in self._refused_roles:  # one message, whichever the roles
                self.warn_once("matrices_text", f"GradientDensityMonitor: {m.text()} (said once)")

    def detach(self) -> None:
        for capture in self._captures():
            capture.detach()
        self._lookup_capture, self._head_capture, self.model = None, None, None
        self._reset_step()
        self._scratch_buffers = {}

    def _captures(self) -> list[LookupFlowCapture | HeadFlowCapture]:
        return [c for c in (self._lookup_capture, self._head_capture) if c is not None]

    def _root(self) -> nn.Module | None:
        return self.root if self.root is not None else self.model

    def _scratch(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A ``(V, d_model)`` work buffer; kept between logging steps on the CPU only (first-touch page faults)."""
        dtype = dtype or like.dtype
        buf = self._scratch_buffers.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(like.shape, dtype=dtype, device=like.device)
            if like.device.type == "cpu":
                self._scratch_buffers[name] = buf
        return buf

    def _reset_step(self) -> None:
        self._active, self._step, self._measured, self._failed_here = False, None, False, False
        for capture in self._captures():
            capture.active = False
            capture.reset()
        self._before, self._pending, self._snapshot, self._histograms, self._full_norms = {}, {}, None, {}, {}
        self._tied_sums = None  # this process's rows' tied-flow sums, reduced at compute
        self._weights = {}

    # ---------------------------------------------------------------- protocol
    def _parameters_replaced(self) -> bool:
        """A module's ``weight`` is no longer the Parameter resolved at attach (``fully_shard`` after attach). The whole
        Parameter FSDP2 registers in place of the sharded one during its forward (a door whose step starts inside the
        forward: the Hugging Face Trainer's) is no replacement: it holds no gradient after the backward."""
        m = self.matrices
        if m is None:
            return False
        modules = {"head": self._head, "embedding": self._emb}
        return any(
            state.kind == "plain"
            and state.gradient_parameter is not None
            and (now := getattr(modules[role], "weight", None)) is not state.gradient_parameter
            and not (is_sharded(state.gradient_parameter) and isinstance(now, Tensor) and not is_sharded(now))
            for role, state in m.trains.items()
        )

    def _trainability_changed(self) -> bool:
        """A matrix was frozen or unfrozen since attach (a head warm-up, a finetuning callback)."""
        m = self.matrices
        if m is None:
            return False
        now = trainable_matrices(self._head, self._emb)
        return any(now[role].trains != state.trains for role, state in m.trains.items())

    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        if logging and self.model is not None and (self._parameters_replaced() or self._trainability_changed()):
            # FSDP2 swapped in DTensor Parameters after attach, or a matrix was (un)frozen: resolve again
            self.attach(self.model)
        if logging:
            if self._step != step:
                self._reset_step()
            self._active, self._step = True, step
        else:
            self._active = False
        for capture in self._captures():
            capture.active = self._active
        lookup = self._lookup_capture
        # row-sharded (FSDP2: a DTensor between steps): keep the tied lookup flow compact
        held = self.matrices.trains["head"].gradient_parameter if self.matrices is not None else None  # not FSDP2's whole one
        if self._active and self.tied and lookup is not None and lookup.sharded is None and is_sharded(held if held is not None else self._head.weight):  # type: ignore[union-attr]
            lookup.sharded = ShardedLookup()
        if self._active and lookup is not None and lookup.compiled and lookup.sharded is None:
            lookup.arm_probe()  # torch.compile: the lookup flow through a probe input of the graph

    def gradients_ready(self, loss_scale: float | Tensor | None = None) -> None:
        if not self._active or self._measured:
            return
        self._measured = True  # several optimizers: measure once per step
        try:
            if fsdp1.uses_orig_params(self._root()):
                with self.full_matrices([self._head, self._emb], with_grads=True):  # FSDP1: a collective
                    self._pending = self._gradient_stats(loss_scale)
                    weights, self._weights = self._weights, {}  # read once (ZeRO-3: one gather per matrix)
                    if self.update_density:
                        local = {name: local_rows(w).local for name, w in (weights or self._matrices()).items()}  # this process's rows
                        self._before = {name: self._scratch(f"before:{name}", w).copy_(w) for name, w in local.items()}
            else:
                self.warn_once(
                    "fsdp1_flat",
                    "GradientDensityMonitor: FSDP1 runs with use_orig_params=False, which keeps no gradient per "
                    "parameter, so the embedding and head gradients cannot be measured; their statistics are "
                    "skipped. Fix: FullyShardedDataParallel(..., use_orig_params=True) (Lightning's FSDPStrategy "
                    "default), or FSDP2 (fully_shard). (warned once)",
                )
        except Exception as err:  # noqa: BLE001
            self.fail(err, "measuring gradients")
            # said here; the processes agree at compute, with the step's sums (every process drops the values)
            self._pending, self._before, self._failed_here = {}, {}, True
        for capture in self._captures():
            capture.reset()

    def pending(self) -> bool:
        return self._step is not None

    def empty_sums(self, val: bool = False) -> dict[str, Tensor]:
        """``tied_flow``: the tied flows' row sums (:func:`~headwatch.distributed.sharded.tied_flow_sums`) of a
        row-sharded tied matrix; nothing else (the gradient statistics are measured whole in :meth:`gradients_ready`,
        a row-sharded matrix's rows gathered there)."""
        weight = getattr(self._head, "weight", None) if self.tied else None
        if val or not is_sharded(weight):
            return {}
        return {"tied_flow": torch.zeros(3, dtype=torch.float64, device=local_rows(weight).local.device)}

    def local_sums(self, val: bool = False) -> dict[str, Tensor]:
        """:meth:`empty_sums` with this step's values. Raises :class:`~headwatch.core.monitor.StepFailed` when the
        measurement of :meth:`gradients_ready` failed on this process, so that every process drops the step's values."""
        if not val and self._failed_here:
            self._failed_here = False
            self._reset_step()
            raise StepFailed("measuring gradients")
        out = self.empty_sums(val)
        if "tied_flow" in out and self._tied_sums is not None:
            out["tied_flow"] = self._tied_sums
        return out

    def skip_sums(self, val: bool = False) -> None:
        if not val:
            self._reset_step()

    def from_sums(self, total: dict[str, Tensor], val: bool = False) -> dict[str, Tensor]:
        """The step's gradient and update statistics (the update's: a collective when the matrices are sharded).
        A failure raises: :func:`~headwatch.core.monitor.compute_due` then drops the values on every process alike."""
        if val:
            return {}
        step = self._step
        self.media.histograms.clear()
        self.media.figures.clear()
        self.media.host.clear()
        self.media.texts.clear()
        try:
            scalars = dict(self._pending)
            if self._tied_sums is not None:
                scalars.update({f"{self.prefix}/grad/{k}": v for k, v in tied_flow_values(total["tied_flow"]).items()})
            with self.full_matrices([self._head, self._emb]):  # FSDP1: a collective, entered on every process
                if self._before:
                    scalars.update(self._update_stats())
            if scalars and step is not None:
                self.logged_steps += 1
                if self.log_histogram:
                    self.media.histograms.update(self._histograms)
                if self.tying_text != self.tying_published and self.reducer.rank == 0:  # the first measurement after attach
                    self.media.texts[f"{self.prefix}/grad/tying"] = self.tying_published = self.tying_text
                if self.figure_every > 0 and (step + 1) % self.figure_every == 0 and self.reducer.rank == 0:
                    try:  # rank zero only: a figure that fails loses the figure, not the scalars
                        self._norm_figure()
                    except Exception as err:  # noqa: BLE001
                        self.fail(err, "drawing the row-norm figure")
            return scalars
        finally:
            self._reset_step()

    # ---------------------------------------------------------------- math
    def _matrices(self) -> dict[str, Tensor]:
        """The distinct effective matrices that train (float32): ``shared`` when tied, ``embedding`` and ``head``
        when not. A matrix frozen at attach (or since: :meth:`_trainability_changed` resolves again) is left out,
        so nothing is published for it (the key-set rule: decided from the configuration, the same on every rank)."""
        trains = {role: state.trains for role, state in self.matrices.trains.items()} if self.matrices is not None else {}
        if self.tied:
            both = trains.get("head", True) or trains.get("embedding", True)
            return {"shared": effective_weight(self._head)} if both else {}  # type: ignore[arg-type]
        matrices = {"embedding": self._emb, "head": self._head}
        return {name: effective_weight(m) for name, m in matrices.items() if trains.get(name, True)}  # type: ignore[arg-type]

    @staticmethod
    def _available(capture: LookupFlowCapture | HeadFlowCapture | None) -> bool:
        """Whether ``capture`` holds this step's flow on this process (a row-sharded lookup flow: its token ids)."""
        if capture is None:
            return False
        sharded = getattr(capture, "sharded", None)
        grad = capture.flow() if isinstance(capture, LookupFlowCapture) else capture.gradient
        return grad is not None or (sharded is not None and bool(sharded.ids))

    def _agree(self, param: dict[str, Tensor | None]) -> dict[str, tuple[bool, bool]]:
        """Every decision the gradient measurement must take alike on every process, agreed in ONE ``all_reduce``
        (a collective with several processes; nothing with one): name -> ``(on every process, on some process)``.

        ``lookup_ok``: the tied lookup flow is not refused (:meth:`_lookup_cause`); ``lookup`` / ``head_flow``: the
        captured flows are there; ``head_compiled``: the head capture ran under ``torch.compile`` or LoRA dropout; ``ready:<role>``:
        DeepSpeed still holds the gradient (:func:`~headwatch.distributed.zero.gradient_ready`); ``grad:<role>``: the
        Parameter has a gradient here (a process may have skipped its backward)."""
        hc = self._head_capture
        local = {
            "lookup_ok": self._lookup_cause() is None,
            "lookup": self._available(self._lookup_capture),
            "head_flow": self._available(hc),
            "head_compiled": hc is not None and (hc.compiled or hc.dropout > 0.0),
        }
        for role, p in param.items():
            local[f"ready:{role}"] = gradient_ready(p)
            local[f"grad:{role}"] = p is not None and (p.grad is not None or zero_held(p))
        W = self.reducer.world_size
        if W <= 1:
            return {k: (v, v) for k, v in local.items()}
        device = next((p.device for p in param.values() if p is not None), None) or collective_device()
        flags = torch.zeros(len(local), dtype=torch.long, device=device)
        for i, v in enumerate(local.values()):
            if v:
                flags[i] = 1  # a fill, not a copy
        counts = self.reducer.sum(flags).tolist()  # the decisions on the host: one read
        return {k: (n == W, n > 0) for k, n in zip(local, counts)}

    def _captured(self, capture: LookupFlowCapture | HeadFlowCapture | None, loss_scale: float | Tensor | None, everywhere: bool) -> Any:
        """A capture's ``(V, d)`` gradient, unscaled and averaged like ``.grad``; None unless ``everywhere`` (agreed:
        every process holds it)."""
        if capture is None:
            return None
        if capture.error is not None:
            err, capture.error = capture.error, None
            self.fail(err, "capturing a gradient flow")
        if isinstance(capture, HeadFlowCapture) and capture.compiled and capture.gradient is None:
            self.warn_once(
                "compiled_head",
                f"GradientDensityMonitor: the head `{self.matrices.head_name}` is an adapter (LoRA) running inside "  # type: ignore[union-attr]
                "torch.compile: no Parameter holds its effective gradient, and compiled code does not hand the "
                "gradient at its output to a hook, so the head's gradient statistics are not reported (the "
                "logits statistics still are). They are measured when the head runs outside the compiled "
                "region, or with the adapter merged. (warned once)",
            )
        if isinstance(capture, HeadFlowCapture) and capture.dropout and capture.gradient is None:
            self.warn_once("lora_dropout_head", f"GradientDensityMonitor: the head `{self.matrices.head_name}` is a LoRA "  # type: ignore[union-attr]
                f"layer with lora_dropout={capture.dropout:g}: in training its adapter sees dropout(h) while the base sees h, "
                "so no one matrix's gradient is what the loss trained, and the head's gradient statistics are not reported "
                "(the logits and the update statistics still are). Set lora_dropout=0 (or leave lm_head out of "
                "target_modules) to measure them. (warned once)")  # fmt: skip
        if not everywhere:
            return None  # every process takes the same path
        sharded = getattr(capture, "sharded", None)
        if sharded is not None:
            return sharded  # combined on this process's rows in _flows
        grad = capture.flow() if isinstance(capture, LookupFlowCapture) else capture.gradient
        if loss_scale is not None:
            grad = grad / loss_scale  # captured from the scaled loss; .grad is unscaled already
        return self.reducer.mean(grad)  # as DDP averages .grad

    def _flows(self, loss_scale: float | Tensor | None) -> dict[str, Any]:
        """The step's flows (None: no gradient on this process); :attr:`_elsewhere`: those of them another process has."""
        self._elsewhere = set()
        trains = self.matrices.trains  # type: ignore[union-attr]
        if self._refused_roles:
            trains = {role: state._replace(trains=False) if role in self._refused_roles else state for role, state in trains.items()}
        param = {role: state.gradient_parameter for role, state in trains.items()}
        agreed = self._agree(param)
        refused = self._lookup_refused(agreed["lookup_ok"][0])
        lookup = None if refused else self._captured(self._lookup_capture, loss_scale, agreed["lookup"][0])
        head_eff = self._captured(self._head_capture, loss_scale, agreed["head_flow"][0])
        # a LoRA head inside torch.compile or under LoRA dropout: refused in _captured, said once there
        head_refused = agreed["head_compiled"][0] and head_eff is None

        def gradient(role: str) -> Tensor | None:  # ZeRO: DeepSpeed holds it (a collective), agreed ready or refused alike
            return full_gradient(param[role], say=self.info_once, ready=agreed[f"ready:{role}"][0])

        def elsewhere(flows: dict[str, Any], role: str) -> set[str]:  # flows without a gradient here that another process has
            return {f for f, g in flows.items() if g is None and param[role] is not None and agreed[f"grad:{role}"][1]}

        head_grad = gradient("head") if param["head"] is not None else head_eff
        if not self.tied:
            emb_grad = gradient("embedding") if param["embedding"] is not None else lookup
            skip = {"embedding": refused, "head": head_refused}  # frozen, or a refused lookup flow: said once, with its cause
            flows = {flow: grad for flow, grad in {"embedding": emb_grad, "head": head_grad}.items() if trains[flow].trains and not skip[flow]}
            self._elsewhere = {f for role in flows for f in elsewhere({role: flows[role]}, role)}
            return flows
        if not trains["head"].trains:
            return {}
        if param["head"] is not None:
            total = head_grad
        else:  # tied through adapters (ensure_weight_tying): no Parameter holds the sum of the flows
            total = lookup + head_eff if lookup is not None and head_eff is not None else None
        if total is None:  # the flows another process has, by the same agreed decisions
            flows = {} if head_refused else {"shared": None} if refused or lookup is None else {"embedding": None, "head": None, "shared": None}
            self._elsewhere = elsewhere(flows, "head")
            return flows
        total = dense_rows(total).float()
        if refused:
            return {"shared": total}
        if lookup is None:
            self.warn_once(
                "nolookup",
                "GradientDensityMonitor: the tied embedding's forward was not called with token ids on this "
                "step (F.embedding on its weight?), so its gradient cannot be split into the lookup and "
                "scoring flows; only the shared gradient is reported. (warned once)",
            )
            return {"shared": total}
        if isinstance(lookup, ShardedLookup):  # rows of this process, averaged over processes
            shard = local_rows(total)
            lookup = lookup.rows(shard, self.reducer)
            if loss_scale is not None:
                lookup = lookup.with_local(lookup.local / loss_scale)
            scoring = torch.sub(shard.local, lookup.local, out=self._scratch("scoring", lookup.local))
            return {"embedding": lookup, "head": lookup.with_local(scoring), "shared": shard}
        scoring = torch.sub(total, lookup, out=self._scratch("scoring", total, torch.float32))
        return {"embedding": lookup, "head": scoring, "shared": total}

    def _lookup_cause(self) -> str | None:
        """Why this step's lookup flow would be wrong or is out of reach on this process; None: it is fine."""
        capture = self._lookup_capture
        if capture is None:
            return None
        cause = capture.refused
        sharded = capture.sharded
        if cause is None and capture.compiled and sharded is not None and not sharded.ids:
            cause = (
                "the model runs under torch.compile and the tied matrix is row-sharded (FSDP2), where headwatch "
                "keeps the lookup flow from hooks on the embedding's output, which compiled code does not run "
                "(the compiled path's probe is made for unsharded matrices only); it is not measured under compile"
            )
        elif cause is None and capture.compiled and capture.probe is None and capture.flow() is None:
            cause = (
                "the model runs under torch.compile, which headwatch learned only during this step's compiled "
                "forward (compiled code does not hand the gradient at the embedding's output to a hook); from the "
                "next logging step on, the flow is measured exactly through a zero probe added to the embedding's "
                "output inside the compiled graph"
            )
        return cause

    def _lookup_refused(self, everywhere_ok: bool) -> bool:
        """The lookup flow of this step would be wrong or is out of reach (``everywhere_ok`` False: on some process,
        agreed): say why once; True then (every process alike)."""
        capture = self._lookup_capture
        if capture is None or everywhere_ok:
            return False
        cause = self._lookup_cause() or "another process could not measure it"
        group = capture.group
        name = group.modules[0][0] if group.modules else "the embedding"
        what = "only the shared gradient of the tied matrix is reported" if self.tied else "its gradient statistics are skipped"
        self.warn_once(
            f"lookup_refused:{cause[:40]}",
            f"GradientDensityMonitor: the lookup flow of `{name}` is not measured on this step: {cause}; {what}. (warned once)",
        )
        return True

    def _gradient_stats(self, loss_scale: float | Tensor | None) -> dict[str, Tensor]:
        snap = self._snapshot = self.frequency.snapshot()
        g = f"{self.prefix}/grad"
        # made on the device (a fill, not a copy): the orchestrator's one transfer reads it with the rest
        out: dict[str, Any] = {f"{g}/tied": torch.full((), float(self.tied), dtype=torch.float64, device=snap.counts.device)}
        shape = declared_shape(self._head)  # what untying costs (headwatch report); Python numbers: no transfer
        out.update({f"{self.prefix}/model/{k}": float(v) for k, v in zip(("vocab_size", "hidden_size"), shape or ())})
        self._histograms, self._full_norms = {}, {}
        flows = self._flows(loss_scale)
        elsewhere = self._elsewhere
        for flow, grad in flows.items():
            if grad is None and flow in elsewhere:
                # another process has this gradient (this one skipped its backward): the same keys on every rank,
                # NaN here ("not measured on this process"), computed on zeros so that every collective matches
                grad = torch.zeros_like(local_rows(self._matrix_of(flow)).local, dtype=torch.float32)
                self.warn_once(
                    f"nograd_here:{flow}",
                    f"GradientDensityMonitor: the {flow} has no gradient on this process on a step where another "
                    "process has one (a skipped backward?); its values are NaN here on that step. (warned once)",
                )
                stats_nan = True
            else:
                stats_nan = False
            if grad is None:
                self.warn_once(
                    f"nograd:{flow}",
                    f"GradientDensityMonitor: the {flow} has no gradient on this step (frozen, or not in the "
                    "loss); its statistics are skipped. (warned once)",
                )
                continue
            device = local_rows(grad).local.device
            valid = snap.valid.to(device)
            bucket = snap.bucket.to(device)
            # the shared gradient is the sum of the two flows: overall and rare vs frequent suffice
            groups = {f"{g}/{flow}": valid}
            groups.update({f"{g}/{name}/{flow}": bucket == BUCKETS.index(name) for name in (("top1",) if flow == "shared" else BUCKETS)})
            groups[f"{g}/rare/{flow}"] = snap.rare.to(device)
            stats, norms = row_statistics(grad, groups, self.reducer)  # (V,) norms, gathered when row-sharded
            if stats_nan:
                stats = {k: torch.full_like(v, float("nan")) for k, v in stats.items()}
                norms = torch.full_like(norms, float("nan"))
            out.update(stats)
            out[f"{g}/{flow}_rare_to_frequent_norm_ratio"] = norm_ratio(out[f"{g}/rare/{flow}_row_norm_mean"], out[f"{g}/top1/{flow}_row_norm_mean"])
            # the valid rows' norms; the others -1 (no norm is negative), dropped on the host (published)
            self._histograms[f"{g}/{flow}_row_norm_histogram"] = torch.where(valid.to(norms.device), norms, -1.0)
            if flow != "shared":
                self._full_norms[flow] = norms
        if self.tied and flows.get("embedding") is not None:
            args = (flows["embedding"], flows["head"], snap.valid, self._full_norms["embedding"], self._full_norms["head"])
            if is_sharded(flows["embedding"]):  # sums over the rows: reduced with the step's other sums (compute)
                self._tied_sums = tied_flow_sums(*args)
            else:
                out.update({f"{g}/{k}": v for k, v in tied_flow_statistics(args[0], args[1], args[2], self.reducer, *args[3:]).items()})
        seen = snap.seen
        # Spearman's rho of log(count) and the row norm: ranks of the counts are those of their log (a strictly
        # increasing map), computed once for every matrix; unseen rows (count 0) are not selected
        count_ranks = seen_count_ranks(snap)  # from the snapshot's count order: no second sort
        self._weights = self._matrices()  # kept for the update's "before" copy (gradients_ready)
        for name, weight in self._weights.items():
            norms = row_norms_full(weight, self.reducer)
            rho = spearman_of_ranks(count_ranks, norms.double().to(count_ranks.device), seen)
            out[f"{self.prefix}/freq/{name}_norm_spearman"] = rho
        return out

    def _matrix_of(self, flow: str) -> Tensor:
        """The matrix whose gradient ``flow`` is (``embedding``: the input embedding's; else the head's)."""
        matrices = self._matrices()
        return matrices.get(flow, matrices.get("head", matrices.get("shared", effective_weight(self._head))))  # type: ignore[arg-type]

    def _update_stats(self) -> dict[str, Tensor]:
        u = f"{self.prefix}/update"
        out: dict[str, Tensor] = {}
        snap = self._snapshot
        for name, weight in self._matrices().items():
            before = self._before.get(name)
            if before is None:
                continue
            rows = local_rows(weight)
            delta = rows.with_local(before)  # W_before - W_after, made in place (in the copy) as it is measured
            V = rows.num_rows
            valid = snap.valid.to(before.device) if snap is not None else torch.ones(V, dtype=torch.bool, device=before.device)
            out.update(row_statistics(delta, {f"{u}/{name}": valid}, self.reducer, subtract=rows.local)[0])
        return out

    def _norm_figure(self) -> None:
        snap, norms = self._snapshot, dict(self._full_norms)
        if snap is None or not norms:
            return
        # the counts and norms go to the host in the step's one transfer; the figure is drawn in published()
        self.media.host.update({"norm_figure/counts": snap.counts, "norm_figure/valid": snap.valid})
        self.media.host.update({f"norm_figure/norm/{name}": v for name, v in norms.items()})

    def _draw_norm_figure(self) -> None:
        """The row-norm figure from the counts and norms moved to the host with the step's values."""
        from headwatch.core import figures

        host = self.media.host
        if "norm_figure/counts" not in host:
            return
        self.media.host = {}
        norms = {tag.rpartition("/")[2]: v for tag, v in host.items() if tag.startswith("norm_figure/norm/")}
        title = "gradient row norm vs token frequency" + (" (tied: lookup and scoring flows)" if self.tied else "")
        try:
            fig = figures.norm_vs_frequency_rank(host["norm_figure/counts"], host["norm_figure/valid"], norms, title)
        except Exception as err:  # noqa: BLE001 - a figure that fails loses the figure, not the scalars
            self.fail(err, "drawing the row-norm figure")
            return
        self.media.figures[f"{self.prefix}/grad/row_norm_vs_frequency"] = fig

    def published(self, numbers: dict[str, float]) -> None:
        """The row-norm histograms (on the host now) keep the valid rows only (their -1 entries dropped); the
        row-norm figure of a figure step is drawn."""
        self._draw_norm_figure()
        for tag, values in self.media.histograms.items():
            if values.device.type == "cpu":
                self.media.histograms[tag] = values[~(values < 0)]  # NaN norms stay

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "logged_steps": self.logged_steps, "failures": self.failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters, checked (see ``FailurePolicy.restore``)."""

        def read(r: StateReader) -> Callable[[], None]:
            logged, failures = r.count("logged_steps"), r.count("failures")

            def apply() -> None:
                self.logged_steps, self.failures = logged, failures

            return apply

        self.restore(state_dict, read)

    def reset(self) -> None:
        """A new run: the counters and the step in progress (its captures and snapshots) emptied."""
        super().reset()
        self._reset_step()
        self.tying_published = ""  # a new run (a new log) says it again
