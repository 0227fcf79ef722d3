"""``SynonymCollision``: rare tokens whose rows became near-duplicates of other rows, trainer-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from headwatch._capture import logits_from_output
from headwatch._errors import HeadwatchError
from headwatch.core.batch import BatchFormat, BatchView
from headwatch.core.frequency import TokenCounts
from headwatch.core import sharded
from headwatch.core.monitor import Monitor
from headwatch.functional.collision import sample_rows, top_colliding_pairs
from headwatch.functional.frequency import BUCKETS, FrequencySnapshot
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.neighbors import synonym_confusion, synonym_table
from headwatch.weights import effective_weight, resolve_matrices

DEFAULT_TAU = 0.9
"""Default collision threshold on the nearest-neighbour cosine: near-duplicate rows.

Independent random rows almost never reach it: at d_model 64 the largest cosine among
32768 Gaussian rows is about 0.6, at d_model 256 about 0.3."""


def decode_token(tokenizer: Any, token_id: int) -> str:
    """A token's text from a ``tokenizers.Tokenizer``, a Hugging Face tokenizer, or a callable."""
    if tokenizer is None:
        return str(token_id)
    if callable(tokenizer) and not hasattr(tokenizer, "decode"):
        return str(tokenizer(token_id))
    if hasattr(tokenizer, "decode"):
        try:
            return str(tokenizer.decode([token_id]))
        except Exception:  # noqa: BLE001 - fall back to the vocabulary entry
            pass
    if hasattr(tokenizer, "id_to_token"):
        return str(tokenizer.id_to_token(token_id))
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return str(tokenizer.convert_ids_to_tokens(token_id))
    raise HeadwatchError(
        f"cannot decode with a {type(tokenizer).__name__}: pass a tokenizers.Tokenizer, a Hugging Face "
        "tokenizer, or a callable id -> str"
    )


def encode_group(tokenizer: Any, words: Sequence[Any]) -> list[int]:
    """Token ids of a synonym group given as ids or single-token strings."""
    ids: list[int] = []
    for word in words:
        if isinstance(word, bool):
            raise HeadwatchError(f"synonym group entry {word!r} is a bool, not a token id or a string")
        if isinstance(word, int) or (hasattr(word, "__index__") and not isinstance(word, str)):
            ids.append(int(word.__index__()))  # ints, numpy integers
            continue
        if not isinstance(word, str):
            raise HeadwatchError(f"synonym group entry {word!r} is a {type(word).__name__}: token ids or strings only")
        if tokenizer is None:
            raise HeadwatchError(f"synonym group entry {word!r} is a string: pass tokenizer= to encode it")
        if hasattr(tokenizer, "token_to_id") and tokenizer.token_to_id(word) is not None:
            ids.append(int(tokenizer.token_to_id(word)))
            continue
        try:  # Hugging Face tokenizers add BOS/EOS unless told not to
            encoded = tokenizer.encode(word, add_special_tokens=False)
        except TypeError:
            encoded = tokenizer.encode(word)
        token_ids = list(getattr(encoded, "ids", encoded))
        if len(token_ids) != 1:
            raise HeadwatchError(
                f"synonym {word!r} is {len(token_ids)} tokens ({token_ids}); synonym groups are of single tokens"
            )
        ids.append(int(token_ids[0]))
    return ids


class SynonymCollision(Monitor):
    """Collision statistics of head (and untied embedding) rows (see :class:`headwatch.SynonymCollisionMonitor`).

    Every rank computes the same values (the weights and the summed counts are the same on
    every process), so every rank publishes the same keys on the same steps.
    """

    name = "collision"
    every_factor = 10  # a neighbour search is costlier than a logging step

    def __init__(
        self,
        frequency: TokenCounts | None = None,
        tau: float = DEFAULT_TAU,
        max_rare: int = 8192,
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
    ) -> None:
        super().__init__(prefix, strict, batch_format)
        self.frequency = frequency
        self.tau, self.max_rare, self.max_per_bucket, self.top_pairs = float(tau), max_rare, max_per_bucket, top_pairs
        self.synonym_groups = [list(g) for g in synonym_groups] if synonym_groups is not None else None
        self.tokenizer, self.head, self.embedding, self.seed = tokenizer, head, embedding, seed
        self.max_chunk_bytes, self.draw_figures, self.on_epoch_end = max_chunk_bytes, figures, on_epoch_end
        self.tied = False
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self._group_ids: list[list[int]] = []
        self._table: Tensor | None = None
        self._hook: Any = None
        self._hooked: nn.Module | None = None
        self._view: BatchView | None = None
        self._stash: list[Tensor] = []
        self._confusion = torch.zeros(2, dtype=torch.float64)
        self._step: int | None = None
        self._last_step = -1
        self.last_result: dict[str, Any] = {}
        self._measurements = 0

    # ---------------------------------------------------------------- wiring
    def attach(self, model: nn.Module) -> None:
        matrices = resolve_matrices(model, self.head, self.embedding)
        head, emb, self.tied = matrices.head, matrices.embedding.module, matrices.tie.tied
        self._head, self._emb, self.model = head, emb, model
        if self.synonym_groups is not None:
            self._group_ids = [encode_group(self.tokenizer, g) for g in self.synonym_groups]
            self._table = synonym_table(self._group_ids, head.weight.shape[0])
            if self._hook is None or self._hooked is not head:  # a new model: hook its head
                self.detach()
                self._hook, self._hooked = head.register_forward_hook(self._on_head_forward), head
        self.model = model

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._hooked, self._view, self._stash = None, None, None, []

    def _matrices(self) -> dict[str, Tensor]:
        if self._head is None or self._emb is None:
            raise HeadwatchError("SynonymCollisionMonitor has no model: attach it first")
        head = effective_weight(self._head)  # under LoRA the matrix that scores, not the frozen base
        return {"head": head} if self.tied else {"head": head, "embedding": effective_weight(self._emb)}

    # ---------------------------------------------------------------- confusion (logits path)
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        # count confusion on the logging step of each measurement
        self._view = self.batch_format.read(batch) if self._table is not None and logging else None
        if logging:
            self._step = step

    def _on_head_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._view is None:
            return
        if torch.compiler.is_compiling():
            logits = logits_from_output(output)
            if logits is not None:
                self._stash.append(logits)  # detached in _capture (a detached view trips functionalization)
            return
        self._count_confusion(output)

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
            eligible = snap.rare & (self._table >= 0).any(dim=1).to(snap.rare.device)
            n, confused = synonym_confusion(logits, targets.to(logits.device), self._table, eligible)
            self._confusion = self._confusion.to(n.device) + torch.stack([n, confused])
        except Exception as err:  # noqa: BLE001
            self.fail(err, "counting synonym confusion")

    def batch_end(self) -> None:
        stash, self._stash = self._stash, []
        for logits in stash:
            self._count_confusion(logits)
        self._view = None

    # ---------------------------------------------------------------- schedule
    def train_epoch_end(self, step: int) -> bool:
        if self.on_epoch_end and step != self._last_step:
            self._step = step
            return True
        return False

    def compute(self) -> dict[str, Tensor]:
        """Measure now (a collective: the counts and the confusion are summed over processes)."""
        step = self._step if self._step is not None else self._last_step + 1
        self._step = None
        if self.frequency is None:
            raise HeadwatchError("SynonymCollision needs a TokenCounts (`frequency`)")
        snap = self.frequency.snapshot()
        confusion = self.reducer.sum(self._confusion)
        self._confusion = torch.zeros_like(self._confusion)
        self._last_step = step
        scalars, tables = self.measure(snap, step)
        if self._table is not None:
            n, confused = confusion[0], confusion[1]
            scalars[f"{self.prefix}/collision/synonym_confusion_positions"] = n
            scalars[f"{self.prefix}/collision/synonym_confusion_rate"] = torch.where(n > 0, confused / n.clamp(min=1), torch.nan)
        self._measurements += 1
        self.media.texts = tables if self.reducer.rank == 0 else {}
        self.media.figures = self._similarity_figures() if self.draw_figures and self.reducer.rank == 0 else {}
        return scalars

    def _similarity_figures(self) -> dict[str, Any]:
        from headwatch import figures

        out = {}
        for name, by_bucket in self.last_result.get("bucket_cosines", {}).items():
            shown = {b: by_bucket[b] for b in ("top1", "top10", "rare") if b in by_bucket}
            title = f"{name}: nearest-neighbour cosine, rare vs frequent tokens"
            out[f"{self.prefix}/collision/nn_similarity_{name}"] = figures.nn_similarity_by_bucket(shown, self.tau, title)
        return out

    # ---------------------------------------------------------------- math
    @torch.no_grad()
    def measure(self, snap: FrequencySnapshot, step: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
        """Collision statistics of the current weights; returns ``(scalars, text tables)``.

        Also keeps the full result (colliding pairs, per-row cosines) in ``last_result``.
        """
        c = f"{self.prefix}/collision"
        generator = torch.Generator().manual_seed(self.seed + step)
        rare_ids = snap.rare.nonzero().flatten()
        sample = sample_rows(rare_ids, self.max_rare, generator)
        scalars: dict[str, Any] = {
            f"{c}/rare_count": float(rare_ids.numel()),
            f"{c}/rare_sample_size": float(sample.numel()),
            f"{c}/unseen_count": float((snap.valid & (snap.counts == 0)).sum()),
            f"{c}/invalid_count": float((~snap.valid).sum()),
        }
        bucket_rows = {
            name: sample_rows((snap.bucket == i).nonzero().flatten(), self.max_per_bucket, generator)
            for i, name in enumerate(BUCKETS)
        }
        bucket_rows["rare"] = sample
        tables: dict[str, str] = {}
        result: dict[str, Any] = {"rare_sample": sample.cpu(), "bucket_cosines": {}}
        for name, weight in self._matrices().items():
            untrained = snap.valid.to(weight.device) & sharded.zero_rows_full(weight, self.reducer)  # never anybody's collision
            scalars[f"{c}/untrained_count_{name}"] = untrained.sum(dtype=torch.float64)
            trained = snap.valid.to(weight.device) & ~untrained
            queries = {b: rows[trained[rows.to(weight.device)].cpu()] for b, rows in bucket_rows.items()}
            stats, nn_rare, cosines = sharded.collision_statistics(  # row-sharded (FSDP2): each process searches its rows
                weight, queries["rare"], queries, trained, self.tau, self.max_chunk_bytes, self.reducer
            )
            scalars[f"{c}/rare_rate_{name}"] = stats.pop("rare_rate")
            scalars.update({f"{c}/{k.split('_nn_')[0]}/{name}_nn_cosine_mean": v for k, v in stats.items()})
            result["bucket_cosines"][name] = cosines
            pairs = top_colliding_pairs(queries["rare"].to(weight.device), nn_rare, self.tau, self.top_pairs)
            result[name] = {"rows": queries["rare"].cpu(), "cosine": nn_rare.cosine.cpu(), "neighbour": nn_rare.index.cpu(), "pairs": pairs}
            tables[f"{c}/top_pairs_{name}"] = self._table_text(pairs, snap)
            if self._group_ids:
                rate, count = sharded.synonym_pair_rate(weight, self._group_ids, snap.rare, self.tau, self.reducer)
                scalars[f"{c}/synonym_pair_rate_{name}"] = rate
                scalars[f"{c}/synonym_pairs"] = float(count)
        self.last_result = result
        return scalars, tables

    def _table_text(self, pairs: list[tuple[int, int, float]], snap: FrequencySnapshot) -> str:
        if not pairs:
            return f"no rare token collides at tau = {self.tau}"
        lines = ["| rare token | count | nearest row | count | cosine |", "|---|---|---|---|---|"]
        for r, j, cos in pairs:
            lines.append(
                f"| {r} `{decode_token(self.tokenizer, r)!r}` | {int(snap.counts[r])} "
                f"| {j} `{decode_token(self.tokenizer, j)!r}` | {int(snap.counts[j])} | {cos:.4f} |"
            )
        return "\n".join(lines)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "measurements": self._measurements, "last_step": self._last_step, "failures": self.failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._measurements = int(state_dict.get("measurements", 0))
        self._last_step = int(state_dict.get("last_step", -1))
        self.failures = int(state_dict.get("failures", 0))
