"""``GradientDensityMonitor``: how sparse the embedding's gradient is, how dense the head's, and
how the two flows of a tied matrix pull on each row."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from headwatch._base import HeadwatchCallback, check_bool, check_module_or_name
from headwatch._capture import find_head_and_embedding
from headwatch._errors import HeadwatchError
from headwatch.figures import check_figure_argument, resolve_figure_interval
from headwatch.frequency import BUCKETS, FrequencySnapshot, TokenFrequency
from headwatch.functional.rows import (
    dense_rows,
    lookup_gradient,
    row_cosine,
    row_density,
    row_nonzero_given_norms,
    row_norms,
    spearman,
    summarize_groups,
)

STATS = ("mean", "max", "p50", "p95")


class GradientDensityMonitor(HeadwatchCallback):
    """Gradient density of the input embedding vs the output head, and what tying does to them.

    Through the lookup, embedding row ``i`` gets gradient only when token ``i`` is in the
    batch (sparse); through the softmax every head row gets gradient on every step (dense).
    On logging steps only, in ``on_before_optimizer_step`` (after gradient accumulation and
    AMP unscaling, before clipping), this monitor measures both flows per vocabulary row.

    When the embedding and the head share one ``Parameter`` (tied), its gradient is split
    exactly: a hook on the embedding's output (registered in ``setup``, active only on
    logging steps) captures ``dL/d(embedding output)`` and scatters it onto token rows
    (the lookup part ``E``); the scoring part is the remainder ``H = grad - E``. With a
    ``GradScaler`` the captured part is divided by the loss scale; under DDP it is
    averaged over processes like the gradient itself.

    Token frequencies come from the trainer's :class:`~headwatch.TokenFrequency` (added with
    defaults if absent); rows that can never occur are excluded from every statistic.

    Args:
        head: the output head (module or dotted name); found automatically if None.
        embedding: the input embedding (module or dotted name); found automatically if None.
        log_every_n_steps: measure every this many optimizer steps; None: the Trainer's.
        update_density: also measure which rows the optimizer step changed (copies the
            ``(V, d_model)`` matrices on logging steps only).
        log_histogram: with a ``TensorBoardLogger``, histograms of per-row gradient norms.
        figure_every_n_steps: every this many steps, an image of per-row gradient norm
            against token frequency rank, log-log, both flows in one figure
            (``headwatch/grad/row_norm_vs_frequency``); ``"auto"``: ten logging intervals
            if matplotlib is installed, else off; 0/None: off.
        prefix: first component of every metric name.
        strict: raise on a failure to measure instead of warning once and skipping.

    Raises:
        HeadwatchError: in ``__init__`` for invalid arguments; in ``setup`` when the head or
            the embedding cannot be found, or their vocabulary sizes differ.

    Logged metrics (``<flow>`` is ``embedding`` (lookup flow) or ``head`` (scoring flow);
    for a tied matrix also ``shared``, its whole gradient, whose buckets are ``top1`` and ``rare`` only; ``<matrix>`` is ``embedding`` and
    ``head`` when untied, ``shared`` when tied; ``<bucket>`` is one of ``top1``, ``top10``,
    ``top50``, ``tail``, ``unseen``, ``rare``; norms are L2 norms in gradient units):

    - ``headwatch/grad/<flow>_row_density``: valid rows with a non-zero gradient / valid rows;
    - ``headwatch/grad/<flow>_row_norm_{mean,max,p50,p95}``: per-row gradient norm statistics;
    - ``headwatch/grad/<bucket>/<flow>_row_density`` and ``<flow>_row_norm_{mean,max,p50,p95}``;
    - ``headwatch/grad/<flow>_rare_to_frequent_norm_ratio``: mean row norm of the rare tokens
      divided by that of the ``top1`` bucket;
    - ``headwatch/grad/tied``: 1 when tied, 0 when untied;
    - tied only: ``headwatch/grad/tied_flow_cosine_mean`` (mean over rows that get both
      flows of ``cos(E_i, H_i)``) and ``headwatch/grad/tied_flow_conflict_fraction`` (the
      fraction of those rows with cosine < 0), ``headwatch/grad/tied_flow_rows``;
    - ``headwatch/update/<matrix>_row_density``: valid rows changed by the optimizer step /
      valid rows; ``headwatch/update/<matrix>_row_norm_{mean,max,p50,p95}``: per-row update
      norms ``||W_after - W_before||`` in weight units;
    - ``headwatch/freq/<matrix>_norm_spearman``: Spearman correlation between the log
      frequency of seen tokens and the L2 norm of their weight rows ("frequency gravity");
    - histograms ``headwatch/grad/<flow>_row_norm_histogram`` (TensorBoard only).
    """

    def __init__(
        self,
        head: str | nn.Module | None = None,
        embedding: str | nn.Module | None = None,
        log_every_n_steps: int | None = None,
        update_density: bool = True,
        log_histogram: bool = True,
        figure_every_n_steps: int | str | None = "auto",
        prefix: str = "headwatch",
        strict: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps, prefix, strict)
        check_figure_argument(figure_every_n_steps)
        check_module_or_name("head", head)
        check_module_or_name("embedding", embedding)
        check_bool("update_density", update_density)
        check_bool("log_histogram", log_histogram)
        self.head = head
        self.embedding = embedding
        self.update_density = update_density
        self.log_histogram = log_histogram
        self.figure_every_n_steps = figure_every_n_steps
        self._figure_every = 0

        self.tied = False
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self._freq: TokenFrequency | None = None
        self._hook_handle: Any = None
        self._active = False
        self._step: int | None = None
        self._measured = False
        self._lookup: Tensor | None = None  # (V, d) lookup-path gradient of a tied matrix, this step
        self._before: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor | float] = {}
        self._snapshot: FrequencySnapshot | None = None
        self._histograms: dict[str, Tensor] = {}
        self._full_norms: dict[str, Tensor] = {}
        self._scratch_buffers: dict[str, Tensor] = {}
        self._logged_steps = 0

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        head_name, head, emb_name, emb, self.tied = find_head_and_embedding(pl_module, self.head, self.embedding)
        head_weight = head.weight
        self._freq = TokenFrequency.attach(trainer, pl_module, stage)
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
        if self.tied:
            self._hook_handle = emb.register_forward_hook(self._on_embedding_forward, with_kwargs=True)
        self._head, self._emb = head, emb
        self._resolve_every(trainer)
        self._figure_every = resolve_figure_interval(self.figure_every_n_steps, self._every)
        text = (
            f"`{emb_name}` and `{head_name}` are TIED: one Parameter of shape {tuple(head_weight.shape)}; its "
            "gradient is split into the lookup (embedding) and scoring (head) flows"
            if self.tied
            else f"`{emb_name}` {tuple(emb.weight.shape)} and `{head_name}` {tuple(head_weight.shape)} are UNTIED"
        )
        self._info_once(f"headwatch: {text}")
        if stage == "fit":
            self._write_text(trainer, f"{self.prefix}/grad/tying", text, trainer.global_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reset_step()
        self._scratch_buffers = {}

    def _scratch(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A ``(V, d_model)`` work buffer for a logging step.

        On the CPU it is kept between logging steps: a fresh allocation of hundreds of MB
        is page-faulted in on first touch, which costs more than the statistics. On an
        accelerator the caching allocator makes a fresh one cheap, so nothing is held
        between logging steps.
        """
        dtype = dtype or like.dtype
        buf = self._scratch_buffers.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(like.shape, dtype=dtype, device=like.device)
            if like.device.type == "cpu":
                self._scratch_buffers[name] = buf
        return buf

    def _reset_step(self) -> None:
        self._active = False
        self._step = None
        self._measured = False
        self._lookup = None
        self._before = {}
        self._pending = {}
        self._snapshot = None
        self._histograms = {}
        self._full_norms = {}

    # ---------------------------------------------------------------- capture (tied)
    def _on_embedding_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._active:
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
            self._fail(err, "hooking the embedding output")

    def _add_lookup(self, ids: Tensor, grad: Tensor) -> None:
        try:
            V = self._emb.weight.shape[0]  # type: ignore[union-attr]
            pad = getattr(self._emb, "padding_idx", None)
            if self._lookup is None:
                like = grad.new_empty(()).expand(V, grad.shape[-1])
                self._lookup = self._scratch("lookup", like, torch.float32).zero_()
            lookup_gradient(ids.to(grad.device), grad, V, pad if isinstance(pad, int) else None, out=self._lookup)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "capturing the embedding-path gradient")
        return None

    # ---------------------------------------------------------------- schedule
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._is_logging_step(step):
            if self._step != step:
                self._reset_step()
            self._active = True
            self._step = step
        else:
            self._active = False

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active or self._measured:
            return
        self._measured = True  # several optimizers: measure once per step
        try:
            self._pending = self._gradient_stats(trainer)
            if self.update_density:
                self._before = {
                    name: self._scratch(f"before:{name}", w).copy_(w.detach()) for name, w in self._matrices().items()
                }
        except Exception as err:  # noqa: BLE001
            self._fail(err, "measuring gradients")
            self._pending = {}
        self._lookup = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None or trainer.global_step == self._step:
            return  # not a logging step, or still accumulating
        step = self._step
        try:
            scalars = dict(self._pending)
            if self._before:
                scalars.update(self._update_stats())
            if scalars:
                self._publish(trainer, scalars, step)
                self._logged_steps += 1
                self._write_histograms(trainer, step)
                if self._figure_every > 0 and (step + 1) % self._figure_every == 0:
                    self._norm_figure(trainer, step)
        except Exception as err:  # noqa: BLE001
            self._fail(err, "logging gradient statistics")
        finally:
            self._reset_step()

    # ---------------------------------------------------------------- math
    def _matrices(self) -> dict[str, Tensor]:
        """The distinct weight matrices: ``shared`` when tied, ``embedding`` and ``head`` when not."""
        if self.tied:
            return {"shared": self._head.weight}  # type: ignore[union-attr]
        return {"embedding": self._emb.weight, "head": self._head.weight}  # type: ignore[union-attr]

    def _flows(self, trainer: pl.Trainer) -> dict[str, Tensor | None]:
        head_grad = self._head.weight.grad  # type: ignore[union-attr]
        if not self.tied:
            return {"embedding": self._emb.weight.grad, "head": head_grad}  # type: ignore[union-attr]
        if head_grad is None:
            return {"embedding": None, "head": None, "shared": None}
        total = dense_rows(head_grad).float()
        captured = self._lookup is not None
        if trainer.world_size > 1:  # every process must take the same path: the split below is a collective
            captured = bool(trainer.strategy.reduce_boolean_decision(captured, all=True))
        if not captured:
            # the embedding module's forward did not run on token ids (e.g. F.embedding on its weight):
            # the lookup part cannot be separated, and calling it zero would credit it all to the head
            self._warn_once(
                "nolookup",
                "GradientDensityMonitor: the tied embedding's forward was not called with token ids on this "
                "step (F.embedding on its weight?), so its gradient cannot be split into the lookup and "
                "scoring flows; only the shared gradient is reported. (warned once)",
            )
            return {"shared": total}
        lookup = self._lookup
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            lookup = lookup / scaler.get_scale()  # captured from the scaled loss; .grad is unscaled already
        if trainer.world_size > 1:
            lookup = trainer.strategy.reduce(lookup.clone(), reduce_op="mean")  # as DDP averages .grad
        scoring = torch.sub(total, lookup, out=self._scratch("scoring", total, torch.float32))
        return {"embedding": lookup, "head": scoring, "shared": total}

    def _gradient_stats(self, trainer: pl.Trainer) -> dict[str, Tensor | float]:
        assert self._freq is not None
        snap = self._freq.snapshot(trainer)
        self._snapshot = snap
        g = f"{self.prefix}/grad"
        out: dict[str, Tensor | float] = {f"{g}/tied": 1.0 if self.tied else 0.0}
        self._histograms = {}
        self._full_norms: dict[str, Tensor] = {}
        flows = self._flows(trainer)
        for flow, grad in flows.items():
            if grad is None:
                self._warn_once(
                    f"nograd:{flow}",
                    f"GradientDensityMonitor: the {flow} has no gradient on this step (frozen, or not in the "
                    "loss); its statistics are skipped. (warned once)",
                )
                continue
            grad = dense_rows(grad)
            valid = snap.valid.to(grad.device)
            norms = row_norms(grad)
            nonzero = row_nonzero_given_norms(grad, norms)
            bucket = snap.bucket.to(grad.device)
            # the shared gradient is the sum of the two flows: overall and rare vs frequent suffice
            buckets = ("top1",) if flow == "shared" else BUCKETS
            groups = {f"{g}/{flow}": valid}
            groups.update({f"{g}/{name}/{flow}": bucket == BUCKETS.index(name) for name in buckets})
            groups[f"{g}/rare/{flow}"] = snap.rare.to(grad.device)
            for key, summary in summarize_groups(norms, groups).items():
                out[f"{key}_row_density"] = row_density(nonzero, groups[key])
                out.update({f"{key}_row_norm_{stat}": getattr(summary, stat) for stat in STATS})
            out[f"{g}/{flow}_rare_to_frequent_norm_ratio"] = (
                out[f"{g}/rare/{flow}_row_norm_mean"] / out[f"{g}/top1/{flow}_row_norm_mean"]  # type: ignore[operator]
            )
            self._histograms[f"{g}/{flow}_row_norm_histogram"] = norms[valid]
            if flow != "shared":
                self._full_norms[flow] = norms
        if self.tied and flows.get("embedding") is not None:
            cosine, both = row_cosine(
                flows["embedding"], flows["head"], self._full_norms["embedding"], self._full_norms["head"]  # type: ignore[arg-type]
            )
            rows = both & snap.valid.to(cosine.device)
            n = rows.sum(dtype=torch.float64)
            out[f"{g}/tied_flow_rows"] = n
            out[f"{g}/tied_flow_cosine_mean"] = torch.where(
                n > 0, (cosine * rows).sum(dtype=torch.float64) / n.clamp(min=1), torch.nan
            )
            out[f"{g}/tied_flow_conflict_fraction"] = torch.where(
                n > 0, ((cosine < 0) & rows).sum(dtype=torch.float64) / n.clamp(min=1), torch.nan
            )
        f = f"{self.prefix}/freq"
        seen = snap.seen
        log_counts = snap.counts[seen].double().log()
        for name, weight in self._matrices().items():
            norms = row_norms(weight.detach())
            out[f"{f}/{name}_norm_spearman"] = spearman(log_counts, norms[seen.to(norms.device)].double().to(log_counts.device))
        return out

    def _update_stats(self) -> dict[str, Tensor | float]:
        u = f"{self.prefix}/update"
        out: dict[str, Tensor | float] = {}
        snap = self._snapshot
        for name, weight in self._matrices().items():
            before = self._before.get(name)
            if before is None:
                continue
            delta = before.sub_(weight.detach())  # W_before - W_after, in place: same row norms and zeros
            valid = snap.valid.to(delta.device) if snap is not None else None
            norms = row_norms(delta)
            out[f"{u}/{name}_row_density"] = row_density(row_nonzero_given_norms(delta, norms), valid)
            groups = {f"{u}/{name}": valid if valid is not None else torch.ones_like(norms, dtype=torch.bool)}
            for key, summary in summarize_groups(norms, groups).items():
                out.update({f"{key}_row_norm_{stat}": getattr(summary, stat) for stat in STATS})
        return out

    def _norm_figure(self, trainer: pl.Trainer, step: int) -> None:
        from headwatch import figures

        snap = self._snapshot
        norms = {k.rsplit("/", 1)[-1].replace("_row_norm_histogram", ""): v for k, v in self._full_norms.items()}
        if snap is None or not norms:
            return
        title = "gradient row norm vs token frequency" + (" (tied: lookup and scoring flows)" if self.tied else "")
        fig = figures.norm_vs_frequency_rank(snap.counts, snap.valid, norms, title)
        figures.add_figure(trainer, f"{self.prefix}/grad/row_norm_vs_frequency", fig, step)

    def _write_histograms(self, trainer: pl.Trainer, step: int) -> None:
        if self.log_histogram:
            for tag, values in self._histograms.items():
                self._write_histogram(trainer, tag, values, step)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "logged_steps": self._logged_steps, "failures": self._failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._logged_steps = int(state_dict.get("logged_steps", 0))
        self._failures = int(state_dict.get("failures", 0))

