"""``SynonymCollision``: rare tokens whose rows became near-duplicates of other rows, trainer-free.

The headline rate is measured on drift-corrected rows (mean and top principal directions removed,
:mod:`headwatch.functional.drift`); the common drift itself is logged under ``collision/drift/``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.model import generation
from headwatch.model.find import logits_from_output, resolve_matrices
from headwatch.model.hooks import CopySafeHook
from headwatch.errors import (HeadwatchError, StateReader, check_bool, check_every, check_int, check_module_or_name,
                             check_optional, check_positive_int, check_range)
from headwatch.model.batch import BatchFormat, BatchView
from headwatch.distributed import sharded
from headwatch.core.forwards import not_loss_forward
from headwatch.core.frequency import TokenCounts, check_token_counts
from headwatch.core.monitor import Monitor
from headwatch.core.tokens import check_synonym_groups, decode_token, encode_group
from headwatch.core.schedule import Schedule
from headwatch.distributed.reduce import Reducer
from headwatch.functional.collision import panel_mask, panel_order, sample_mask, top_colliding_pairs_fixed
from headwatch.functional.intervals import wilson_interval
from headwatch.distributed.sharded_drift import (
    corrected_collision_rows,
    nn_cosines_rows,
    pair_cosine_rows,
    pairable_rows_sharded,
    synonym_statistics_rows,
)
from headwatch.functional.drift import default_k
from headwatch.functional.drift_pairs import FixedCollision, corrected_collision_groups, ordered_pairs, synonym_statistics_masked
from headwatch.functional.frequency import BUCKETS, FrequencySnapshot, bucket_capacity
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.neighbors import synonym_confusion, synonym_table
from headwatch.model.weights import effective_weight

__all__ = ["DEFAULT_TAU", "PANEL_HALF_WIDTH", "PANEL_START", "SynonymCollision", "decode_token", "encode_group"]

DEFAULT_TAU = 0.9
"""Default collision threshold on the (drift-corrected) nearest-neighbour cosine: near-duplicate rows.

Independent random rows almost never reach it: at d_model 64 the largest cosine among
32768 Gaussian rows is about 0.6, at d_model 256 about 0.3."""

PANEL_START = 1024
"""Rare rows in the collision panel at the first probe (all rare rows when fewer), when ``max_rare`` is None."""

PANEL_HALF_WIDTH = 0.01
"""The panel doubles after a probe whose rate's 95% Wilson half-width ``(high - low) / 2`` exceeds this (a
fraction): it takes about 1825 measured rows at a rate of 5%, 9604 at 50%."""

_TRAIN, _VAL = 0, 1


def _on_host(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` on the host in one transfer (float64 on the way: exact for float32, bool and ids below
    2**53), each back in its dtype and shape (as the orchestrator's ``to_host`` moves ``Media.host``)."""
    if not tensors:
        return {}
    device = next((v.device for v in tensors.values() if v.device.type != "cpu"), torch.device("cpu"))
    flat = torch.cat([v.detach().to(device=device, dtype=torch.float64).reshape(-1) for v in tensors.values()]).cpu()
    out, offset = {}, 0
    for tag, v in tensors.items():
        out[tag] = flat[offset : offset + v.numel()].reshape(v.shape).to(v.dtype)
        offset += v.numel()
    return out


class SynonymCollision(Monitor):
    """Collision statistics of head (and untied embedding) rows (see :class:`headwatch.SynonymCollisionMonitor`).

    Every rank computes the same values (the weights and the summed counts are the same on
    every process; the principal directions are seeded), so every rank publishes the same keys
    on the same steps. A row-sharded matrix (FSDP2, DTensor ``Shard(0)``) is measured on each
    process's own rows, the sums and maxima combined exactly (:mod:`headwatch.distributed.sharded_drift`):
    no process holds the whole ``(V, d_model)`` matrix.

    Args: see :class:`headwatch.SynonymCollisionMonitor`; ``figures``: draw the similarity
    histograms (a bool here); ``frequency``: the shared :class:`TokenCounts`; ``every_n_steps``: measure
    every this many steps, whatever the door (None: ``every_factor`` times its logging interval);
    ``max_rare``: the panel's size, fixed (None: :data:`PANEL_START`, grown by :meth:`grow_panel`).

    Raises:
        HeadwatchError: an invalid argument (checked here, whatever the front door).
    """

    name = "collision"
    every_factor = 10  # a neighbour search is costlier than a logging step
    probe = True  # under an overhead budget, on the run's probe steps instead

    def __init__(
        self,
        frequency: TokenCounts | None = None,
        tau: float = DEFAULT_TAU,
        max_rare: int | None = None,
        max_per_bucket: int = 1024,
        top_pairs: int = 20,
        synonym_groups: Sequence[Sequence[int | str]] | None = None,
        tokenizer: Any = None,
        head: str | nn.Module | None = None,
        embedding: str | nn.Module | None = None,
        seed: int = 0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        figures: bool = False,
        on_epoch_end: bool = True,
        prefix: str = "headwatch",
        strict: bool = False,
        batch_format: BatchFormat | None = None,
        k: int | None = None,
        include_unseen: bool = False,
        every_n_steps: int | None = None,
    ) -> None:
        super().__init__(prefix, strict, batch_format)
        check_token_counts("frequency", frequency)  # None: a front door sets it at set-up
        tau = check_range("tau", tau, -1, 1)  # a cosine; -1: every rare token collides
        for name, value in (("max_per_bucket", max_per_bucket), ("top_pairs", top_pairs),
                            ("max_chunk_bytes", max_chunk_bytes)):  # fmt: skip
            check_positive_int(name, value)
        check_optional(check_positive_int, "max_rare", max_rare)  # None: the panel rule sizes the panel
        check_every("every_n_steps", every_n_steps)
        groups = check_optional(check_synonym_groups, "synonym_groups", synonym_groups)
        check_module_or_name("head", head)
        check_module_or_name("embedding", embedding)
        check_int("seed", seed)
        for name, value in (("figures", figures), ("on_epoch_end", on_epoch_end), ("include_unseen", include_unseen)):
            check_bool(name, value)
        check_optional(check_int, "k", k, minimum=1)  # principal directions removed
        self.frequency = frequency
        self.tau, self.max_rare, self.max_per_bucket, self.top_pairs = tau, max_rare, max_per_bucket, top_pairs
        self.k, self.include_unseen, self.every_n_steps = k, include_unseen, every_n_steps
        self.panel = max_rare if max_rare is not None else PANEL_START
        """Rare rows measured at the next probe (``max_rare``, else grown by :meth:`grow_panel`)."""
        self._panel_keys: Tensor | None = None
        self.synonym_groups = groups
        self.tokenizer, self.head, self.embedding, self.seed = tokenizer, head, embedding, seed
        self.max_chunk_bytes, self.draw_figures, self.on_epoch_end = max_chunk_bytes, figures, on_epoch_end
        self.tied = False
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self._group_ids: list[list[int]] = []
        self._pairs: tuple[Any, Tensor, Tensor] | None = None
        self._table: Tensor | None = None
        self._has_synonym: Tensor | None = None
        self._hook: Any = None
        self._unwatch: Callable[[], None] | None = None  # restores the generate() methods wrapped at attach
        self._hooked: nn.Module | None = None
        self._view: BatchView | None = None
        self._split, self._forwards = _TRAIN, 0
        self._stash: list[Tensor] = []
        self._confusion = torch.zeros(2, 2, dtype=torch.float64)  # [train, val] x [positions, confused]
        self._step: int | None = None
        self._computing: int | None = None  # the step being measured (between the two phases)
        self._last_step = -1
        self.last_result: dict[str, Any] = {}
        self._measurements = 0

    # ---------------------------------------------------------------- wiring
    def configure(self, schedule: Schedule | None = None, reducer: Reducer | None = None) -> None:
        """As :meth:`Monitor.configure`; ``every_n_steps``, when given, replaces the door's interval for this monitor."""
        if schedule is not None and self.every_n_steps is not None:
            schedule = Schedule(self.every_n_steps)
        super().configure(schedule, reducer)

    def attach(self, model: nn.Module) -> None:
        matrices = resolve_matrices(model, self.head, self.embedding)
        head, emb, self.tied = matrices.head, matrices.embedding.module, matrices.tie.tied
        self._head, self._emb, self.model = head, emb, model
        if isinstance(getattr(head, "weight", None), Tensor) and head.weight.ndim == 2:  # at set-up: no copy at a probe
            self._panel_order(head.weight.shape[0], head.weight.device)
        if self.synonym_groups is not None:
            self._group_ids = [encode_group(self.tokenizer, g) for g in self.synonym_groups]
            # checks the ids; the table, its rows with synonyms and the counts live on the device from set-up on
            # (counting confusion on a training step copies nothing)
            device = head.weight.device
            self._table = synonym_table(self._group_ids, head.weight.shape[0]).to(device)
            self._has_synonym = (self._table >= 0).any(dim=1)
            self._confusion = self._confusion.to(device)
            self._synonym_pairs(head.weight.device)  # on the device at set-up, not at a measurement
            if self._hook is None or self._hooked is not head:  # a new model: hook its head
                self.detach()
                self._hook, self._hooked = head.register_forward_hook(CopySafeHook(self._on_head_forward)), head
                self._unwatch = generation.watch_generate(model)  # generate()'s forwards told apart, compiled too
        self.model = model

    def _synonym_pairs(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The ordered synonym pairs ``(a, b)`` (``(P,)`` int64 each) on ``device``, copied there once."""
        key = (tuple(tuple(g) for g in self._group_ids), device)
        if self._pairs is None or self._pairs[0] != key:
            a, b = ordered_pairs(self._group_ids)
            self._pairs = (key, a.to(device), b.to(device))
        return self._pairs[1], self._pairs[2]

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        self._hook, self._hooked, self._view, self._stash = None, None, None, []

    def _matrices(self) -> dict[str, Tensor]:
        if self._head is None or self._emb is None:
            raise HeadwatchError("SynonymCollisionMonitor has no model: attach it first")
        head = effective_weight(self._head)  # under LoRA the matrix that scores, not the frozen base
        return {"head": head} if self.tied else {"head": head, "embedding": effective_weight(self._emb)}

    # ---------------------------------------------------------------- confusion (logits path)
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        # confusion is counted on every training batch (on the device, no host sync) and
        # published at the next measurement
        self._view = self.batch_format.read(batch) if self._table is not None else None
        self._split, self._forwards = _TRAIN, 0
        if logging:
            self._step = step

    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        self._view = self.batch_format.read(batch) if self._table is not None else None
        self._split, self._forwards = _VAL, 0

    def validation_batch_end(self, dataloader_idx: int = 0) -> None:
        self.batch_end()

    def _on_head_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._view is None:
            return
        if torch.compiler.is_compiling():
            logits = logits_from_output(output)
            if logits is not None:
                # detached in _capture (a detached view trips functionalization)
                self._stash.append((logits, torch.is_grad_enabled(), generation.active))
            return
        if self._loss_forward(torch.is_grad_enabled(), None):
            self._count_confusion(output)

    def _loss_forward(self, grad_enabled: bool, generating: bool | None) -> bool:
        """The capture contract (:mod:`headwatch.core.forwards`): only the forwards the loss uses are counted.
        ``generating``: recorded inside the forward (compiled code), None: asked from inside it (eager)."""
        if not_loss_forward(self._split == _TRAIN, grad_enabled, self._forwards == 0, generating) is not None:
            return False
        self._forwards += 1
        return True

    @torch.compiler.disable
    def _count_confusion(self, output: Any) -> None:
        try:
            logits, view = logits_from_output(output), self._view
            targets = view.masked_targets() if view is not None else None
            logits = logits.detach() if logits is not None else None
            if logits is None or targets is None or targets.shape != logits.shape[:-1]:
                return
            targets = torch.where(targets == view.format.ignore_index, torch.full_like(targets, -100), targets)  # type: ignore[union-attr]
            if self.frequency is None or self._table is None:
                return
            snap = self.frequency.latest_snapshot()
            has = self._has_synonym if self._has_synonym is not None else (self._table >= 0).any(dim=1)
            eligible = snap.rare & has.to(snap.rare.device)
            n, confused = synonym_confusion(logits, targets.to(logits.device), self._table, eligible)
            self._confusion = self._confusion.to(n.device)
            self._confusion[self._split] += torch.stack([n, confused])
        except Exception as err:  # noqa: BLE001
            self.fail(err, "counting synonym confusion")

    def batch_end(self) -> None:
        stash, self._stash = self._stash, []
        for logits, grad_enabled, generating in stash:
            if self._loss_forward(grad_enabled, generating):
                self._count_confusion(logits)
        self._view = None

    def empty_sums(self, val: bool = False) -> dict[str, Tensor]:
        """``confusion``: float64 ``(eligible positions, confused positions)`` of the split, with synonym groups."""
        if self._table is None:
            return {}
        return {"confusion": torch.zeros(2, dtype=torch.float64, device=self._confusion.device)}

    def local_sums(self, val: bool = False) -> dict[str, Tensor]:
        """This process's synonym confusion counts of the split, handed over (they start again from 0)."""
        if not val:
            self._computing = self._step if self._step is not None else self._last_step + 1
            self._step = None
        out = self.empty_sums(val)
        if out:
            split = _VAL if val else _TRAIN
            out["confusion"] = self._confusion[split].clone()
            self._confusion[split] = 0.0
        return out

    def skip_sums(self, val: bool = False) -> None:
        """The step's confusion counts are dropped (they start again from 0)."""
        self._confusion[_VAL if val else _TRAIN] = 0.0
        if not val:
            self._computing, self._step = None, None

    def _confusion_scalars(self, total: dict[str, Tensor], name: str) -> dict[str, Tensor]:
        """The confusion rate from the counts summed over processes; ``{}`` without synonym groups."""
        if "confusion" not in total:
            return {}
        n, confused = total["confusion"]
        c = f"{self.prefix}/collision/{name}"
        return {
            f"{c}synonym_confusion_positions": n,
            f"{c}synonym_confusion_rate": torch.where(n > 0, confused / n.clamp(min=1), torch.nan),
        }

    # ---------------------------------------------------------------- schedule
    def train_epoch_end(self, step: int) -> bool:
        if self.on_epoch_end and step != self._last_step:
            self._step = step
            return True
        return False

    def from_sums(self, total: dict[str, Tensor], val: bool = False) -> dict[str, Tensor]:
        """Measure now (training; validation: the synonym confusion of the epoch's batches only), on every process:
        the confusion counts come summed over processes, the matrices are measured here (the gathers of
        row-sharded matrices are collectives of their own).

        Nothing is read on the host here (one process): the scalars stay on the device and the
        per-row results (sample, cosines, the top pairs' ids and cosines) go to :attr:`media` ``.host``,
        moved in the orchestrator's one transfer; :meth:`published` then builds ``last_result``, the
        top-pairs table and the figures from them, on the host.
        """
        if val:
            return self._confusion_scalars(total, "val/")
        step, self._computing = self._computing, None
        if self.frequency is None:
            raise HeadwatchError("SynonymCollision needs a TokenCounts (`frequency`)")
        snap = self.frequency.snapshot()
        confusion = self._confusion_scalars(total, "")
        self._last_step = step if step is not None else self._last_step + 1
        self.media.texts, self.media.figures = {}, {}
        with self.full_matrices([self._head, self._emb]):  # FSDP1: the full matrices (a collective)
            scalars, self.media.host = self._measure_on_device(snap, self._last_step)
        scalars.update(confusion)
        self._measurements += 1
        return scalars

    def published(self, numbers: dict[str, float]) -> None:
        """The measurement's per-row results are on the host now: ``last_result``, the top-pairs table
        (token ids decoded here) and the figures. Fewer than 2 pairable rows: the values are dropped
        (removed from ``numbers``) and the cause raised (warned once by the door)."""
        host, self.media.host = self.media.host, {}
        if not host:
            return
        try:
            tables = self._finish(host)
        except HeadwatchError:
            for key in [k for k in numbers if k.startswith(f"{self.prefix}/collision/")]:
                del numbers[key]
            raise
        self.media.texts = tables if self.reducer.rank == 0 else {}
        self.media.figures = self._similarity_figures() if self.draw_figures and self.reducer.rank == 0 else {}
        self.grow_panel(numbers)

    def grow_panel(self, numbers: dict[str, float]) -> bool:
        """Double :attr:`panel` when a published rate's 95% Wilson half-width ``(high - low) / 2`` exceeds
        :data:`PANEL_HALF_WIDTH` and the panel does not hold every rare row yet; returns whether it grew.

        ``numbers``: the published values, the same on every process (the weights and the summed counts are): every
        process grows its panel at the same probe, no collective. ``max_rare`` fixes it; a NaN interval leaves it.
        """
        c = f"{self.prefix}/collision"
        halves = [
            (numbers[f"{c}/rare_rate_{m}_high"] - numbers[f"{c}/rare_rate_{m}_low"]) / 2.0
            for m in ("head", "embedding") if f"{c}/rare_rate_{m}_low" in numbers and f"{c}/rare_rate_{m}_high" in numbers
        ]  # fmt: skip
        whole = numbers.get(f"{c}/rare_sample_size", 0.0) >= numbers.get(f"{c}/rare_count", math.inf)
        if self.max_rare is not None or whole or not any(h > PANEL_HALF_WIDTH for h in halves):
            return False
        rows = self._panel_keys.numel() if self._panel_keys is not None else 2 * self.panel  # the vocabulary's
        self.panel = min(2 * self.panel, max(rows, self.panel))
        return True

    def _similarity_figures(self) -> dict[str, Any]:
        from headwatch.core import figures

        out = {}
        for name, by_bucket in self.last_result.get("bucket_cosines", {}).items():
            shown = {b: by_bucket[b] for b in ("top1", "top10", "rare") if b in by_bucket}
            title = f"{name}: nearest-neighbour cosine (drift removed), rare vs frequent tokens"
            out[f"{self.prefix}/collision/nn_similarity_{name}"] = figures.nn_similarity_by_bucket(shown, self.tau, title)
        return out

    # ---------------------------------------------------------------- math
    @torch.no_grad()
    def measure(self, snap: FrequencySnapshot, step: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
        """Collision statistics of the current weights; returns ``(scalars, text tables)``.

        Scalars are float64 0-d tensors on the weights' device. Also keeps the full result (colliding
        pairs, per-row cosines, on the host) in ``last_result``. The direct API: the per-row results
        are moved to the host here, in one transfer (:meth:`compute` leaves it to the orchestrator's).

        Raises:
            HeadwatchError: fewer than 2 pairable rows (no mean and directions to remove).
        """
        scalars, host = self._measure_on_device(snap, step)
        return scalars, self._finish(_on_host(host))

    def _measure_on_device(self, snap: FrequencySnapshot, step: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """``(scalars, per-row results)``, every tensor on the device, nothing read on the host (one process;
        a row-sharded matrix selects its queries by value, see :meth:`_neighbours_sharded`)."""
        c = f"{self.prefix}/collision"
        rare = snap.rare
        sample, taken = panel_mask(rare, self._panel_order(rare.numel(), rare.device), self.panel)
        generator = torch.Generator(device=rare.device).manual_seed(self.seed + step)
        scalars: dict[str, Tensor] = {
            f"{c}/rare_count": rare.sum(dtype=torch.float64),
            f"{c}/rare_sample_size": taken.sum(dtype=torch.float64),
            f"{c}/unseen_count": (snap.valid & (snap.counts == 0)).sum(dtype=torch.float64),
            f"{c}/invalid_count": (~snap.valid).sum(dtype=torch.float64),
        }
        buckets = {  # a bucket's sample slots: at most the rows it can hold (the same rows, in the same slots)
            name: sample_mask(snap.bucket == i, min(self.max_per_bucket, bucket_capacity(name, rare.numel())), generator)
            for i, name in enumerate(BUCKETS)
        }
        host: dict[str, Tensor] = {"rare_sample": sample, "rare_taken": taken}
        for name, weight in self._matrices().items():
            self._measure_matrix(name, weight, snap, (sample, taken), buckets, scalars, host)
        return scalars, host

    def _panel_order(self, V: int, device: torch.device) -> Tensor:
        """The ``V`` rows' priorities (:func:`~headwatch.functional.collision.panel_order`, from ``seed`` alone: the
        same panel on every process and at every probe), made once on the host and copied to ``device``."""
        keys = self._panel_keys
        if keys is None or keys.numel() != V or keys.device != device:
            keys = self._panel_keys = panel_order(V, self.seed).to(device)
        return keys

    def _measure_matrix(
        self, name: str, weight: Tensor, snap: FrequencySnapshot, sample: tuple[Tensor, Tensor],
        buckets: dict[str, tuple[Tensor, Tensor]], scalars: dict[str, Tensor], host: dict[str, Tensor],
    ) -> None:  # fmt: skip
        c, budget, reducer = f"{self.prefix}/collision", self.max_chunk_bytes, self.reducer
        rows = sharded.local_rows(weight)  # row-sharded (FSDP2): this process's rows only, combined exactly
        dev, d = rows.local.device, rows.local.shape[1]
        p = pairable_rows_sharded(rows, snap.valid.to(dev), (snap.counts > 0).to(dev), self.include_unseen, budget, reducer)
        k = min(self.k if self.k is not None else default_k(d), d)
        ids, taken = sample[0].to(dev), sample[1].to(dev)
        groups = {g: (i.to(dev), t.to(dev) & p.mask[i.to(dev)]) for g, (i, t) in buckets.items()}
        if rows.sharded:
            res, corr_rows, cosines = self._neighbours_sharded(rows, ids, taken, groups, p.mask, k)
        else:
            searched = [g for g in groups if g != "unseen" or self.include_unseen]  # unseen rows: never pairable
            res, corr_rows, found = corrected_collision_groups(
                rows.local, ids, taken, p.mask, self.tau, k, budget, [groups[g][0] for g in searched]
            )  # one pass over the corrected rows for the panel and every group
            cosines = {g: torch.full(i.shape, math.nan, device=dev) for g, (i, _) in groups.items()}
            cosines.update({g: n.cosine for g, n in zip(searched, found)})
        scalars[f"{c}/rare_rate_{name}"] = res.rate
        n = res.measured.sum(dtype=torch.float64)
        low, high = wilson_interval((res.measured & (res.cosine >= self.tau)).sum(dtype=torch.float64), n)
        scalars[f"{c}/rare_rate_{name}_low"], scalars[f"{c}/rare_rate_{name}_high"] = low, high
        scalars[f"{c}/rare_measured_{name}"] = n
        scalars[f"{c}/drift/raw_rate_{name}"] = res.raw_rate
        scalars[f"{c}/drift/mean_cos_{name}"] = res.drift_mean_cos
        scalars[f"{c}/drift/removed_variance_{name}"] = res.removed_variance
        scalars[f"{c}/untrained_count_{name}"] = p.zero.double()  # valid all-zero rows: never trained
        scalars[f"{c}/nonfinite_count_{name}"] = p.nonfinite.double()
        groups = {"rare": (ids, res.measured), **groups}
        cosines = {"rare": res.cosine, **cosines}
        for group, (_, kept) in groups.items():
            finite = kept & torch.isfinite(cosines[group])
            n = finite.sum(dtype=torch.float64)
            total = torch.where(finite, cosines[group].double(), 0.0).sum()
            scalars[f"{c}/{group}/{name}_nn_cosine_mean"] = torch.where(n > 0, total / n, float("nan"))
            host[f"{name}/bucket/{group}"], host[f"{name}/bucket_kept/{group}"] = cosines[group], kept
        at, pair_taken = top_colliding_pairs_fixed(res.cosine, res.measured, self.tau, self.top_pairs)
        r, j = ids[at], res.neighbour[at].clamp(min=0)
        raw = pair_cosine_rows(weight, r, j, reducer)
        counts = snap.counts.to(dev)
        host.update({
            f"{name}/cosine": res.cosine, f"{name}/neighbour": res.neighbour, f"{name}/raw_cosine": res.raw_cosine,
            f"{name}/measured": res.measured, f"{name}/basis_rows": res.basis_rows,
            f"{name}/pairs": torch.stack([r.double(), j.double(), res.cosine[at].double(), raw.double(),
                                          counts[r].double(), counts[j].double(), pair_taken.double()], dim=1),
            f"{name}/excluded": torch.stack([p.unseen, p.padded, p.zero, p.nonfinite]),
        })  # fmt: skip
        if self._group_ids:
            if rows.sharded:
                st = synonym_statistics_rows(corr_rows, self._group_ids, p.mask, self.tau, budget, reducer)
            else:
                st = synonym_statistics_masked(corr_rows, *self._synonym_pairs(dev), p.mask, self.tau, budget)
            scalars[f"{c}/synonym_pair_rate_{name}"] = st["pair_rate"]
            scalars[f"{c}/synonym_partner_rank_{name}"] = st["median_rank"]
            if name == "head":
                scalars[f"{c}/synonym_pairs"] = st["pairs"]
                scalars[f"{c}/synonym_skipped_pairs"] = st["skipped_pairs"]

    def _neighbours_sharded(
        self, rows: Any, ids: Tensor, taken: Tensor, groups: dict[str, tuple[Tensor, Tensor]], pairable: Tensor, k: int
    ) -> tuple[FixedCollision, Any, dict[str, Tensor]]:
        """The row-sharded search (:mod:`headwatch.distributed.sharded_drift`, exact over processes) in the
        fixed-size form of the one-process path. It selects the measured rows by value (the sharded
        search takes compact query ids): syncs, on this path only."""
        budget, reducer = self.max_chunk_bytes, self.reducer
        res, corr_rows = corrected_collision_rows(rows, ids[taken], pairable, self.tau, k, budget, reducer)
        measured = taken & pairable[ids]

        def spread(values: Tensor, kept: Tensor, fill: float) -> Tensor:
            out = torch.full(kept.shape, fill, dtype=values.dtype, device=values.device)
            out[kept] = values
            return out

        found = nn_cosines_rows(corr_rows, {g: i[t] for g, (i, t) in groups.items()}, pairable, budget, reducer)
        fixed = FixedCollision(
            rate=res.rate, raw_rate=res.raw_rate, drift_mean_cos=res.drift_mean_cos, removed_variance=res.removed_variance,
            measured=measured, cosine=spread(res.cosine, measured, math.nan), neighbour=spread(res.neighbour, measured, -1),
            raw_cosine=spread(res.raw_cosine, measured, math.nan), basis_rows=pairable.sum(dtype=torch.float64),
        )  # fmt: skip
        return fixed, corr_rows, {g: spread(found[g].to(ids.device), groups[g][1], math.nan) for g in groups}

    def _finish(self, host: dict[str, Tensor]) -> dict[str, str]:
        """``last_result`` and the text tables from the measurement's per-row results, on the host.

        Raises:
            HeadwatchError: fewer than 2 pairable rows (the mean and directions are undefined).
        """
        c = f"{self.prefix}/collision"
        taken = host["rare_taken"].bool()
        result: dict[str, Any] = {"rare_sample": host["rare_sample"].long()[taken], "bucket_cosines": {}}
        tables: dict[str, str] = {}
        for name in [n for n in ("head", "embedding") if f"{n}/cosine" in host]:
            n = int(host[f"{name}/basis_rows"])
            if n < 2:
                raise HeadwatchError(f"principal directions need at least 2 valid rows, got {n}")
            measured = host[f"{name}/measured"].bool()
            pairs = [
                (int(r), int(j), float(cos), float(raw), int(cr), int(cj))
                for r, j, cos, raw, cr, cj, ok in host[f"{name}/pairs"].tolist() if ok
            ]  # fmt: skip
            tables[f"{c}/top_pairs_{name}"] = self._table_text(pairs, host[f"{name}/excluded"].long().tolist())
            result[name] = {
                "cosine": host[f"{name}/cosine"].float()[measured], "neighbour": host[f"{name}/neighbour"].long()[measured],
                "queries": host["rare_sample"].long()[measured], "raw_cosine": host[f"{name}/raw_cosine"].float()[measured],
                "pairs": [(r, j, cos) for r, j, cos, _, _, _ in pairs],
            }  # fmt: skip
            result["bucket_cosines"][name] = {
                t.split("/")[-1]: host[t].float()[host[t.replace("/bucket/", "/bucket_kept/")].bool()]
                for t in host if t.startswith(f"{name}/bucket/")
            }  # fmt: skip
        self.last_result = result
        return tables

    def _table_text(self, pairs: list[tuple[int, int, float, float, int, int]], excluded: list[int]) -> str:
        unseen, padded, zero, nonfinite = excluded
        note = (
            f"not paired: {unseen} never-seen, {padded} padded or invalid, {zero} zero, "
            f"{nonfinite} non-finite rows (drift removed: mean and top principal directions)"
        )
        if not pairs:
            return f"no rare token collides at tau = {self.tau}\n\n{note}"
        lines = ["| rare token | count | nearest row | count | cosine (drift removed) | raw cosine |", "|---|---|---|---|---|---|"]
        for r, j, cos, raw_cos, count_r, count_j in pairs:
            lines.append(
                f"| {r} `{decode_token(self.tokenizer, r)!r}` | {count_r} "
                f"| {j} `{decode_token(self.tokenizer, j)!r}` | {count_j} | {cos:.4f} | {raw_cos:.4f} |"
            )
        return "\n".join(lines) + f"\n\n{note}"

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2, "measurements": self._measurements, "last_step": self._last_step, "failures": self.failures,
            "panel": self.panel,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters, checked (see ``FailurePolicy.restore``)."""

        def read(r: StateReader) -> Callable[[], None]:
            measurements, last_step, failures = r.count("measurements"), r.step("last_step"), r.count("failures")
            panel = r.count("panel", PANEL_START)  # a version-1 state: the panel starts again
            if panel < 1:
                raise r.fail("panel", "an int >= 1", panel)

            def apply() -> None:
                self._measurements, self._last_step, self.failures = measurements, last_step, failures
                self.panel = panel if self.max_rare is None else self.max_rare  # an explicit max_rare wins

            return apply

        self.restore(state_dict, read, versions=(1, 2))

    def reset(self) -> None:
        """A new run: counters, the synonym-confusion sums and the step in progress emptied; the panel starts again."""
        super().reset()
        self._confusion = torch.zeros(2, 2, dtype=torch.float64)
        self._step, self._view, self._stash, self._split, self.last_result = None, None, [], _TRAIN, {}
