"""``SynonymCollisionMonitor``: rare tokens whose rows became near-duplicates of other rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from headwatch._base import HeadwatchCallback, check_bool, check_module_or_name, check_positive_int
from headwatch._capture import find_head_and_embedding, logits_from_output, positions_from_batch
from headwatch._errors import HeadwatchError
from headwatch.figures import check_figure_argument, matplotlib_available
from headwatch.frequency import BUCKETS, FrequencySnapshot, TokenFrequency
from headwatch.functional.logits import DEFAULT_MAX_CHUNK_BYTES
from headwatch.functional.neighbors import nearest_neighbours, pair_cosine, synonym_confusion, synonym_table

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


def _encode_group(tokenizer: Any, words: Sequence[Any]) -> list[int]:
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
        if isinstance(token_ids, list) and len(token_ids) == 1:
            ids.append(int(token_ids[0]))
        else:
            raise HeadwatchError(
                f"synonym {word!r} is {len(token_ids)} tokens ({token_ids}); synonym groups are of single tokens"
            )
    return ids


class SynonymCollisionMonitor(HeadwatchCallback):
    """Rare-token synonym collision: rare tokens whose head or embedding row is a near-duplicate.

    Definition (for a matrix ``W``: head rows, and embedding rows when untied; a tied
    matrix is measured once, reported as ``head``). With ``R`` the rare tokens (the
    trainer's :class:`~headwatch.TokenFrequency` definition: seen, and in the bottom half
    by count rank unless configured otherwise; never-seen and never-occurring rows are
    excluded and counted separately), rare token ``r`` *collides* when

        ``nn_cos(r) = max_{j valid, j != r} cos(W_r, W_j) >= tau``

    and the collision rate is ``|{r in R : nn_cos(r) >= tau}| / |R|``. Exact nearest
    neighbours by chunked matrix products (:func:`headwatch.functional.nearest_neighbours`).
    When ``|R| > max_rare``, a uniform random sample of ``max_rare`` rare tokens
    (``torch.Generator`` seeded with ``seed + step``) is measured and its size logged.

    Supervised mode: ``synonym_groups`` (lists of token ids, or strings with a
    ``tokenizer``) also give the fraction of within-group pairs ``(r, s)``, ``r`` rare,
    with ``cos(W_r, W_s) >= tau``; and, on the logits path, the fraction of positions
    whose target is a rare grouped token at which some synonym scores at least as high as
    the target (prediction confusion).

    Runs on rank zero only (the weights are the same on every process), every
    ``every_n_steps`` optimizer steps and at the end of each training epoch.

    Args:
        tau: collision threshold on the cosine (default 0.9).
        every_n_steps: measure every this many steps; None: ten times the Trainer's
            ``log_every_n_steps``.
        on_epoch_end: also measure at the end of each training epoch.
        max_rare: largest number of rare tokens measured (sampled above it).
        max_per_bucket: rows sampled per frequency bucket for the per-bucket similarity.
        top_pairs: number of most similar colliding pairs reported.
        synonym_groups: optional list of groups (token ids or strings).
        tokenizer: decodes pairs to text and encodes string synonyms.
        head, embedding: modules or dotted names; found automatically if None.
        seed: base seed of the samples.
        max_chunk_bytes: working-memory bound of the neighbour search (default 64 MiB).
        figures: at each measurement, an image of nearest-neighbour cosine histograms of
            rare vs frequent tokens (``headwatch/collision/nn_similarity_<m>``); ``"auto"``:
            when matplotlib is installed.
        prefix: first component of every metric name.
        strict: raise on a failure to measure instead of warning once.

    Logged metrics (``<m>`` is ``head``, and ``embedding`` when untied):

    - ``headwatch/collision/rare_rate_<m>``: colliding rare tokens / measured rare tokens;
    - ``headwatch/collision/<bucket>/<m>_nn_cosine_mean``: mean ``nn_cos`` of the rows of
      each frequency bucket (``top1``, ``top10``, ``top50``, ``tail``, ``unseen``, ``rare``);
    - ``headwatch/collision/rare_count``, ``rare_sample_size``, ``unseen_count``,
      ``invalid_count``: sizes of the sets;
    - supervised: ``headwatch/collision/synonym_pair_rate_<m>``, ``synonym_pairs``,
      ``synonym_confusion_rate``, ``synonym_confusion_positions``;
    - with a ``TensorBoardLogger``: text ``headwatch/collision/top_pairs_<m>``, a table of
      the most similar colliding pairs (decoded when a tokenizer is given).
    """

    def __init__(
        self,
        tau: float = DEFAULT_TAU,
        every_n_steps: int | None = None,
        on_epoch_end: bool = True,
        max_rare: int = 8192,
        max_per_bucket: int = 1024,
        top_pairs: int = 20,
        synonym_groups: Sequence[Sequence[int | str]] | None = None,
        tokenizer: Any = None,
        head: str | nn.Module | None = None,
        embedding: str | nn.Module | None = None,
        seed: int = 0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        figures: bool | str = "auto",
        prefix: str = "headwatch",
        strict: bool = False,
    ) -> None:
        super().__init__(every_n_steps, prefix, strict)
        if figures not in (True, False, "auto"):
            raise HeadwatchError(f"`figures` must be True, False or 'auto', got {figures!r}")
        if figures is True:
            check_figure_argument(1, "figures")
        if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not -1.0 <= tau <= 1.0:
            raise HeadwatchError(f"`tau` must be a cosine in [-1, 1], got {tau!r}")
        check_bool("on_epoch_end", on_epoch_end)
        for name, value in (
            ("max_rare", max_rare),
            ("max_per_bucket", max_per_bucket),
            ("top_pairs", top_pairs),
            ("max_chunk_bytes", max_chunk_bytes),
        ):
            check_positive_int(name, value)
        check_module_or_name("head", head)
        check_module_or_name("embedding", embedding)
        if synonym_groups is not None:
            if isinstance(synonym_groups, (str, bytes)):
                raise HeadwatchError("`synonym_groups` must be a list of groups, each a list of token ids or strings")
            synonym_groups = [list(g) if isinstance(g, (list, tuple)) else g for g in synonym_groups]  # a generator once
            if not all(isinstance(g, list) for g in synonym_groups):
                raise HeadwatchError("`synonym_groups` must be a list of groups, each a list of token ids or strings")
        self.tau = float(tau)
        self.every_n_steps = every_n_steps
        self.on_epoch_end = on_epoch_end
        self.max_rare = max_rare
        self.max_per_bucket = max_per_bucket
        self.top_pairs = top_pairs
        self.synonym_groups = [list(g) for g in synonym_groups] if synonym_groups is not None else None
        self.tokenizer = tokenizer
        self.head = head
        self.embedding = embedding
        self.seed = seed
        self.max_chunk_bytes = max_chunk_bytes
        self.figures = figures

        self.tied = False
        self._head: nn.Module | None = None
        self._emb: nn.Module | None = None
        self._freq: TokenFrequency | None = None
        self._group_ids: list[list[int]] = []
        self._table: Tensor | None = None
        self._hook_handle: Any = None
        self._hooked: nn.Module | None = None
        self._confusion_active = False
        self._positions: tuple[Tensor | None, Tensor | None] = (None, None)
        self._confusion = torch.zeros(2, dtype=torch.float64)
        self._last_step = -1
        self.last_result: dict[str, Any] = {}
        self._measurements = 0

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _, head, _, emb, self.tied = find_head_and_embedding(pl_module, self.head, self.embedding)
        weight = head.weight
        self._head, self._emb = head, emb
        self._freq = TokenFrequency.attach(trainer, pl_module, stage)
        self._resolve_every(trainer)
        if self.every_n_steps is None:
            self._every = 10 * trainer.log_every_n_steps
        V = weight.shape[0]
        if self.synonym_groups is not None:
            self._group_ids = [_encode_group(self.tokenizer, g) for g in self.synonym_groups]
            self._table = synonym_table(self._group_ids, V)
            if self._hook_handle is None or self._hooked is not head:  # a new model: hook its head
                if self._hook_handle is not None:
                    self._hook_handle.remove()
                self._hook_handle = head.register_forward_hook(self._on_head_forward)
                self._hooked = head
        self._info_once(
            f"headwatch: synonym collision of rare tokens in {'the tied matrix' if self.tied else 'head and embedding'}"
            f", tau={self.tau}, every {self._every} steps"
        )

    def _matrices(self) -> dict[str, Tensor]:
        assert self._head is not None and self._emb is not None
        if self.tied:
            return {"head": self._head.weight}
        return {"head": self._head.weight, "embedding": self._emb.weight}

    # ---------------------------------------------------------------- confusion (logits path)
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # count confusion on the last logging step before each measurement
        step = trainer.global_step
        self._confusion_active = self._table is not None and self._every > 0 and (step + 1) % self._every == 0
        if self._confusion_active:
            self._positions = positions_from_batch(batch)

    def _on_head_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._confusion_active:
            self._count_confusion(output)

    @torch.compiler.disable
    def _count_confusion(self, output: Any) -> None:
        try:
            mask, targets = self._positions
            output = logits_from_output(output)
            if output is None or targets is None or targets.shape != output.shape[:-1]:
                return
            if mask is not None:
                targets = torch.where(mask.to(targets.device), targets, torch.full_like(targets, -100))
            assert self._freq is not None and self._table is not None
            snap = self._freq.latest_snapshot()
            eligible = snap.rare & (self._table >= 0).any(dim=1).to(snap.rare.device)
            n, confused = synonym_confusion(output, targets, self._table, eligible)
            self._confusion = self._confusion.to(n.device) + torch.stack([n, confused])
        except Exception as err:  # noqa: BLE001
            self._fail(err, "counting synonym confusion")

    # ---------------------------------------------------------------- schedule
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._confusion_active = False
        self._positions = (None, None)
        step = trainer.global_step - 1
        if trainer.global_step > 0 and step != self._last_step and self._is_logging_step(step):
            self._measure(trainer, step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step - 1
        if self.on_epoch_end and step >= 0 and step != self._last_step:
            self._measure(trainer, step)

    def _measure(self, trainer: pl.Trainer, step: int) -> None:
        self._last_step = step
        try:
            assert self._freq is not None
            snap = self._freq.snapshot(trainer)  # a collective: every rank
            confusion = trainer.strategy.reduce(self._confusion.clone(), reduce_op="sum")
            self._confusion = torch.zeros_like(self._confusion)
            if not trainer.is_global_zero:
                return
            scalars, tables = self.measure(snap, step)
            if self._table is not None:
                n, confused = confusion[0], confusion[1]
                scalars[f"{self.prefix}/collision/synonym_confusion_positions"] = n
                scalars[f"{self.prefix}/collision/synonym_confusion_rate"] = torch.where(
                    n > 0, confused / n.clamp(min=1), torch.nan
                )
            self._publish(trainer, scalars, step)
            for tag, text in tables.items():
                self._write_text(trainer, tag, text, step)
            if self.figures is True or (self.figures == "auto" and matplotlib_available()):
                self._similarity_figure(trainer, step)
            self._measurements += 1
        except Exception as err:  # noqa: BLE001
            self._fail(err, "measuring synonym collision")

    def _similarity_figure(self, trainer: pl.Trainer, step: int) -> None:
        from headwatch import figures

        for name, by_bucket in self.last_result.get("bucket_cosines", {}).items():
            shown = {b: by_bucket[b] for b in ("top1", "top10", "rare") if b in by_bucket}
            title = f"{name}: nearest-neighbour cosine, rare vs frequent tokens"
            fig = figures.nn_similarity_by_bucket(shown, self.tau, title)
            figures.add_figure(trainer, f"{self.prefix}/collision/nn_similarity_{name}", fig, step)

    # ---------------------------------------------------------------- math
    @torch.no_grad()
    def measure(self, snap: FrequencySnapshot, step: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
        """Collision statistics of the current weights; returns ``(scalars, text tables)``.

        Also keeps the full result (colliding pairs, per-row cosines) in ``last_result``.
        """
        c = f"{self.prefix}/collision"
        generator = torch.Generator().manual_seed(self.seed + step)
        valid = snap.valid
        rare_ids = snap.rare.nonzero().flatten()
        sample = rare_ids
        if rare_ids.numel() > self.max_rare:
            pick = torch.randperm(rare_ids.numel(), generator=generator)[: self.max_rare]
            sample = rare_ids[pick.to(rare_ids.device)].sort().values
        scalars: dict[str, Any] = {
            f"{c}/rare_count": float(rare_ids.numel()),
            f"{c}/rare_sample_size": float(sample.numel()),
            f"{c}/unseen_count": float((valid & (snap.counts == 0)).sum()),
            f"{c}/invalid_count": float((~valid).sum()),
        }
        tables: dict[str, str] = {}
        result: dict[str, Any] = {"rare_sample": sample.cpu()}
        bucket_rows = {
            name: self._sample_rows((snap.bucket == i).nonzero().flatten(), generator)
            for i, name in enumerate(BUCKETS)
        }
        bucket_rows["rare"] = sample
        result["bucket_cosines"] = {}
        for name, weight in self._matrices().items():
            result["bucket_cosines"][name] = {}
            dev = weight.device
            nn_rare = nearest_neighbours(weight, sample.to(dev), valid.to(dev), self.max_chunk_bytes)
            colliding = nn_rare.cosine >= self.tau
            scalars[f"{c}/rare_rate_{name}"] = (
                colliding.sum(dtype=torch.float64) / sample.numel() if sample.numel() else math.nan
            )
            for bucket, rows in bucket_rows.items():
                if bucket == "rare":
                    cos = nn_rare.cosine
                else:
                    cos = nearest_neighbours(weight, rows.to(dev), valid.to(dev), self.max_chunk_bytes).cosine
                result["bucket_cosines"][name][bucket] = cos.cpu()
                finite = cos[torch.isfinite(cos)]
                scalars[f"{c}/{bucket}/{name}_nn_cosine_mean"] = finite.double().mean() if finite.numel() else math.nan
            pairs = self._top_pairs(sample.to(dev), nn_rare, colliding)
            result[name] = {"cosine": nn_rare.cosine.cpu(), "neighbour": nn_rare.index.cpu(), "pairs": pairs}
            tables[f"{c}/top_pairs_{name}"] = self._table_text(pairs, snap)
            if self._group_ids:
                rate, count = self._synonym_pairs(weight, snap)
                scalars[f"{c}/synonym_pair_rate_{name}"] = rate
                scalars[f"{c}/synonym_pairs"] = float(count)
        self.last_result = result
        return scalars, tables

    def _sample_rows(self, rows: Tensor, generator: torch.Generator) -> Tensor:
        if rows.numel() <= self.max_per_bucket:
            return rows
        pick = torch.randperm(rows.numel(), generator=generator)[: self.max_per_bucket]
        return rows[pick.to(rows.device)].sort().values

    def _top_pairs(self, sample: Tensor, nn_rare: Any, colliding: Tensor) -> list[tuple[int, int, float]]:
        cos = torch.where(colliding, nn_rare.cosine, torch.full_like(nn_rare.cosine, -math.inf))
        k = min(self.top_pairs, int(colliding.sum()))
        if k == 0:
            return []
        top = torch.topk(cos, k)
        return [
            (int(sample[i]), int(nn_rare.index[i]), float(nn_rare.cosine[i]))
            for i in top.indices.tolist()
        ]

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

    def _synonym_pairs(self, weight: Tensor, snap: FrequencySnapshot) -> tuple[Any, int]:
        a, b = [], []
        rare = snap.rare.cpu()
        for group in self._group_ids:
            for r in group:
                if bool(rare[r]):
                    for s in group:
                        if s != r:
                            a.append(r)
                            b.append(s)
        if not a:
            return math.nan, 0
        cos = pair_cosine(weight, torch.tensor(a), torch.tensor(b))
        return (cos >= self.tau).sum(dtype=torch.float64) / len(a), len(a)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "measurements": self._measurements, "last_step": self._last_step, "failures": self._failures}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._measurements = int(state_dict.get("measurements", 0))
        self._last_step = int(state_dict.get("last_step", -1))
        self._failures = int(state_dict.get("failures", 0))
