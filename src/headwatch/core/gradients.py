"""``GradientDensity``: gradient density of the embedding vs the head, and the tied split, trainer-free."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from headwatch._capture import find_head_and_embedding
from headwatch.core.frequency import TokenCounts
from headwatch.core.monitor import Monitor
from headwatch.functional.frequency import BUCKETS, FrequencySnapshot
from headwatch.functional.rows import dense_rows, lookup_gradient, row_norms, spearman
from headwatch.sources import tie_config_mismatch
from headwatch.functional.tied import row_group_statistics, tied_flow_statistics


class GradientDensity(Monitor):
    """Per-row gradient and update statistics (see :class:`headwatch.GradientDensityMonitor`).

    Needs a :class:`TokenCounts` (``frequency``) attached to the same model. On a tied
    matrix a forward hook on the embedding captures ``dL/d(output)`` on logging steps.
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
        self.frequency = frequency
        self.head = head
        self.embedding = embedding
        self.update_density = update_density
        self.log_histogram = log_histogram
        self.figure_every = figure_every
        self.tied = False
        self.tying_text = ""
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self._hook: Any = None
        self._active = False
        self._step: int | None = None
        self._measured = False
        self._lookup: Tensor | None = None  # (V, d) lookup-path gradient of a tied matrix, this step
        self._before: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}
        self._snapshot: FrequencySnapshot | None = None
        self._histograms: dict[str, Tensor] = {}
        self._full_norms: dict[str, Tensor] = {}
        self._scratch_buffers: dict[str, Tensor] = {}
        self.logged_steps = 0

    # ---------------------------------------------------------------- wiring
    def attach(self, model: nn.Module) -> None:
        head_name, head, emb_name, emb, self.tied = find_head_and_embedding(model, self.head, self.embedding)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.tied:
            self._hook = emb.register_forward_hook(self._on_embedding_forward, with_kwargs=True)
        self._head, self._emb, self.model = head, emb, model
        mismatch = tie_config_mismatch(model, head.weight, emb.weight)  # the config says otherwise: storage wins
        if mismatch is not None:
            self.warn_once("tie_config", mismatch)
        shape = tuple(head.weight.shape)
        self.tying_text = (
            f"`{emb_name}` and `{head_name}` are TIED: one Parameter of shape {shape}; its "
            "gradient is split into the lookup (embedding) and scoring (head) flows"
            if self.tied
            else f"`{emb_name}` {tuple(emb.weight.shape)} and `{head_name}` {shape} are UNTIED"
        )

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self.model = None, None
        self._reset_step()
        self._scratch_buffers = {}

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
        self._active, self._step, self._measured, self._lookup = False, None, False, None
        self._before, self._pending, self._snapshot, self._histograms, self._full_norms = {}, {}, None, {}, {}

    # ---------------------------------------------------------------- capture (tied)
    def _on_embedding_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._active:
            if torch.compiler.is_compiling():
                self.warn_once(
                    "compiled_lookup",
                    "GradientDensityMonitor: the tied embedding runs inside torch.compile, where its output "
                    "gradient cannot be hooked; only the shared gradient is reported. (warned once)",
                )
                return
            self._watch_lookup(args, kwargs, output)

    @torch.compiler.disable
    def _watch_lookup(self, args: Any, kwargs: Any, output: Any) -> None:
        try:
            ids = args[0] if args else kwargs.get("input")
            if not isinstance(ids, Tensor) or not isinstance(output, Tensor) or not output.requires_grad:
                return
            ids = ids.detach()
            output.register_hook(lambda grad: self._add_lookup(ids, grad))
        except Exception as err:  # noqa: BLE001
            self.fail(err, "hooking the embedding output")

    def _add_lookup(self, ids: Tensor, grad: Tensor) -> None:
        try:
            V = self._emb.weight.shape[0]  # type: ignore[union-attr]
            pad = getattr(self._emb, "padding_idx", None)
            if self._lookup is None:
                like = grad.new_empty(()).expand(V, grad.shape[-1])
                self._lookup = self._scratch("lookup", like, torch.float32).zero_()
            lookup_gradient(ids.to(grad.device), grad, V, pad if isinstance(pad, int) else None, out=self._lookup)
        except Exception as err:  # noqa: BLE001
            self.fail(err, "capturing the embedding-path gradient")

    # ---------------------------------------------------------------- protocol
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        if logging:
            if self._step != step:
                self._reset_step()
            self._active, self._step = True, step
        else:
            self._active = False

    def gradients_ready(self, loss_scale: float | Tensor | None = None) -> None:
        if not self._active or self._measured:
            return
        self._measured = True  # several optimizers: measure once per step
        try:
            self._pending = self._gradient_stats(loss_scale)
            if self.update_density:
                self._before = {
                    name: self._scratch(f"before:{name}", w).copy_(w.detach()) for name, w in self._matrices().items()
                }
        except Exception as err:  # noqa: BLE001
            self.fail(err, "measuring gradients")
            self._pending = {}
        self._lookup = None

    def pending(self) -> bool:
        return self._step is not None

    def compute(self) -> dict[str, Tensor]:
        step = self._step
        self.media.histograms.clear()
        self.media.figures.clear()
        try:
            scalars = dict(self._pending)
            if self._before:
                scalars.update(self._update_stats())
            if scalars and step is not None:
                self.logged_steps += 1
                if self.log_histogram:
                    self.media.histograms.update(self._histograms)
                if self.figure_every > 0 and (step + 1) % self.figure_every == 0 and self.reducer.rank == 0:
                    self._norm_figure()
            return scalars
        except Exception as err:  # noqa: BLE001
            self.fail(err, "logging gradient statistics")
            return {}
        finally:
            self._reset_step()

    # ---------------------------------------------------------------- math
    def _matrices(self) -> dict[str, Tensor]:
        """The distinct weight matrices: ``shared`` when tied, ``embedding`` and ``head`` when not."""
        if self.tied:
            return {"shared": self._head.weight}  # type: ignore[union-attr]
        return {"embedding": self._emb.weight, "head": self._head.weight}  # type: ignore[union-attr]

    def _flows(self, loss_scale: float | Tensor | None) -> dict[str, Tensor | None]:
        head_grad = self._head.weight.grad  # type: ignore[union-attr]
        if not self.tied:
            return {"embedding": self._emb.weight.grad, "head": head_grad}  # type: ignore[union-attr]
        if head_grad is None:
            return {"embedding": None, "head": None, "shared": None}
        total = dense_rows(head_grad).float()
        # every process must take the same path: the split below is a collective
        if not self.reducer.all(self._lookup is not None):
            self.warn_once(
                "nolookup",
                "GradientDensityMonitor: the tied embedding's forward was not called with token ids on this "
                "step (F.embedding on its weight?), so its gradient cannot be split into the lookup and "
                "scoring flows; only the shared gradient is reported. (warned once)",
            )
            return {"shared": total}
        lookup = self._lookup
        if loss_scale is not None:
            lookup = lookup / loss_scale  # captured from the scaled loss; .grad is unscaled already
        lookup = self.reducer.mean(lookup)  # as DDP averages .grad
        scoring = torch.sub(total, lookup, out=self._scratch("scoring", total, torch.float32))
        return {"embedding": lookup, "head": scoring, "shared": total}

    def _gradient_stats(self, loss_scale: float | Tensor | None) -> dict[str, Tensor]:
        snap = self._snapshot = self.frequency.snapshot()
        g = f"{self.prefix}/grad"
        out: dict[str, Tensor] = {f"{g}/tied": torch.tensor(1.0 if self.tied else 0.0, dtype=torch.float64)}
        self._histograms, self._full_norms = {}, {}
        flows = self._flows(loss_scale)
        for flow, grad in flows.items():
            if grad is None:
                self.warn_once(
                    f"nograd:{flow}",
                    f"GradientDensityMonitor: the {flow} has no gradient on this step (frozen, or not in the "
                    "loss); its statistics are skipped. (warned once)",
                )
                continue
            grad = dense_rows(grad)
            valid = snap.valid.to(grad.device)
            norms = row_norms(grad)
            bucket = snap.bucket.to(grad.device)
            # the shared gradient is the sum of the two flows: overall and rare vs frequent suffice
            groups = {f"{g}/{flow}": valid}
            groups.update({f"{g}/{name}/{flow}": bucket == BUCKETS.index(name) for name in (("top1",) if flow == "shared" else BUCKETS)})
            groups[f"{g}/rare/{flow}"] = snap.rare.to(grad.device)
            out.update(row_group_statistics(grad, groups, norms))
            out[f"{g}/{flow}_rare_to_frequent_norm_ratio"] = out[f"{g}/rare/{flow}_row_norm_mean"] / out[f"{g}/top1/{flow}_row_norm_mean"]
            self._histograms[f"{g}/{flow}_row_norm_histogram"] = norms[valid]
            if flow != "shared":
                self._full_norms[flow] = norms
        if self.tied and flows.get("embedding") is not None:
            stats = tied_flow_statistics(
                flows["embedding"], flows["head"], snap.valid, self._full_norms["embedding"], self._full_norms["head"]  # type: ignore[arg-type]
            )
            out.update({f"{g}/{k}": v for k, v in stats.items()})
        seen = snap.seen
        log_counts = snap.counts[seen].double().log()
        for name, weight in self._matrices().items():
            norms = row_norms(weight.detach())
            rho = spearman(log_counts, norms[seen.to(norms.device)].double().to(log_counts.device))
            out[f"{self.prefix}/freq/{name}_norm_spearman"] = rho
        return out

    def _update_stats(self) -> dict[str, Tensor]:
        u = f"{self.prefix}/update"
        out: dict[str, Tensor] = {}
        snap = self._snapshot
        for name, weight in self._matrices().items():
            before = self._before.get(name)
            if before is None:
                continue
            delta = before.sub_(weight.detach())  # W_before - W_after, in place: same row norms and zeros
            norms = row_norms(delta)
            valid = snap.valid.to(delta.device) if snap is not None else torch.ones_like(norms, dtype=torch.bool)
            out.update(row_group_statistics(delta, {f"{u}/{name}": valid}, norms))
        return out

    def _norm_figure(self) -> None:
        from headwatch import figures

        snap, norms = self._snapshot, dict(self._full_norms)
        if snap is None or not norms:
            return
        title = "gradient row norm vs token frequency" + (" (tied: lookup and scoring flows)" if self.tied else "")
        fig = figures.norm_vs_frequency_rank(snap.counts, snap.valid, norms, title)
        self.media.figures[f"{self.prefix}/grad/row_norm_vs_frequency"] = fig

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "logged_steps": self.logged_steps, "failures": self.failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.logged_steps = int(state_dict.get("logged_steps", 0))
        self.failures = int(state_dict.get("failures", 0))
