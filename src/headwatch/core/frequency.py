"""``TokenCounts``: token counts of the training inputs, counted once and shared by every monitor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.core.monitor import Monitor
from headwatch.distributed.reduce import collective_device
from headwatch.errors import (
    HeadwatchError,
    StateReader,
    check_int,
    check_module_or_name,
    check_optional,
    check_protocol,
    check_range,
    check_tensor,
)
from headwatch.functional.frequency import (
    FrequencySnapshot,
    frequency_snapshot,
    token_scalars,
)
from headwatch.model.batch import BatchFormat
from headwatch.model.find import find_input_embedding


def check_token_counts(name: str, value: Any) -> Any:
    """None, or token counts: a :class:`TokenCounts`, or a stand-in with its ``snapshot()`` method."""
    return check_optional(check_protocol, name, value, ["snapshot"], "a TokenCounts (or an object with its snapshot() method)")


class TokenCounts(Monitor):
    """Count every token id of the training inputs (one ``index_add_`` per batch, no host sync).

    Args: see :class:`headwatch.TokenFrequency` (``vocab_size``, ``valid_token_mask``,
    ``embedding``, ``rare_max_count``, ``rare_fraction``); ids are read with
    ``batch_format`` (``ids_fn`` or ``input_ids``; ``attention_mask == 0`` not counted).

    Raises:
        HeadwatchError: an invalid argument (checked here, whatever the front door).
    """

    name = "tokens"

    def __init__(
        self,
        vocab_size: int | None = None,
        valid_token_mask: Tensor | None = None,
        embedding: str | nn.Module | None = None,
        rare_max_count: int | None = None,
        rare_fraction: float = 0.5,
        prefix: str = "headwatch",
        batch_format: BatchFormat | None = None,
    ) -> None:
        super().__init__(prefix, strict=False, batch_format=batch_format)
        self.vocab_size = check_optional(check_int, "vocab_size", vocab_size, minimum=1)
        self.valid_token_mask = check_optional(check_tensor, "valid_token_mask", valid_token_mask, ndim=1, dtype=torch.bool)
        self.embedding = check_module_or_name("embedding", embedding)
        self.rare_max_count = check_optional(check_int, "rare_max_count", rare_max_count, minimum=1)
        self.rare_fraction = check_range("rare_fraction", rare_fraction, 0, 1, low_open=True)
        self.num_rows = 0
        self.padding_idx: int | None = None
        self._local: Tensor | None = None  # (V,) int64 on the device: this process's counts since start/restore
        self._out_of_range: Tensor | None = None  # int64 scalar on the device
        self._restored = torch.zeros(0, dtype=torch.long)  # (V,) global counts from a checkpoint
        self._restored_out_of_range = 0
        self._batches = 0
        self._cache: tuple[int, FrequencySnapshot] | None = None
        self._mask_copy: tuple[Tensor, Tensor] | None = None  # (valid_token_mask, its copy on the device)

    # ----------------------------------------------------------- set-up
    def attach(self, model: nn.Module) -> None:
        name, module = find_input_embedding(model, self.embedding)
        rows = module.weight.shape[0]
        if self.num_rows and rows != self.num_rows:
            self._resize_counts(rows)  # resize_token_embeddings after attach (said once by the orchestrator)
        if self.vocab_size is not None and self.vocab_size > rows:
            raise HeadwatchError(
                f"`vocab_size={self.vocab_size}` is larger than the input embedding `{name}` ({rows} rows): "
                "the tokenizer and the model disagree on the vocabulary"
            )
        if self.valid_token_mask is not None and self.valid_token_mask.numel() != rows:
            raise HeadwatchError(
                f"`valid_token_mask` has {self.valid_token_mask.numel()} entries but the input embedding "
                f"`{name}` has {rows} rows"
            )
        self.num_rows = rows
        self._fit_restored()
        pad = getattr(module, "padding_idx", None)
        self.padding_idx = int(pad) if isinstance(pad, int) else None
        self.model = model

    def _resize_counts(self, rows: int) -> None:
        """Counts kept for ``self.num_rows`` rows, fitted to ``rows``: added rows start at 0; rows removed are dropped
        (on the device, no sync)."""
        local = self._local
        if local is not None:
            grown = torch.cat([local, local.new_zeros(max(rows - local.numel(), 0))]) if rows > local.numel() else local
            self._local = grown[:rows].clone()
        self._cache = None

    def valid_rows(self, device: torch.device | None = None) -> Tensor:
        """``(V,)`` bool: rows that can occur, on ``device`` (default the host).

        Built on ``device`` (no copy), except from ``valid_token_mask``: its copy on ``device`` is kept
        for the next calls (one host-to-device copy per device, not one per logging step).
        """
        if self.valid_token_mask is not None:
            mask = self.valid_token_mask
            if device is not None and mask.device != torch.device(device):
                copy = self._mask_copy
                if copy is None or copy[0] is not mask or copy[1].device != torch.device(device):
                    copy = self._mask_copy = (mask, mask.to(device))
                mask = copy[1]
            valid = mask.clone()
        else:
            valid = torch.ones(self.num_rows, dtype=torch.bool, device=device)
            if self.vocab_size is not None:
                valid[self.vocab_size :] = False
        if self.padding_idx is not None:
            valid[self.padding_idx] = False
        return valid

    # ----------------------------------------------------------- counting
    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        self._batches += 1
        try:
            view = self.batch_format.read(batch)
            ids, attention = view.ids, view.ids_mask
            if ids is None:
                self.warn_once(
                    "no_ids",
                    "TokenFrequency found no integer `input_ids` in the batch; pass ids_fn=lambda batch: ... "
                    "to count tokens. Frequencies stay empty for such batches. (warned once)",
                )
                return
            if attention is not None and attention.shape != ids.shape:
                self.warn_once(
                    "attention_shape",
                    f"TokenFrequency: the batch's attention_mask has shape {tuple(attention.shape)} but input_ids "
                    f"{tuple(ids.shape)}; it is ignored and every id is counted. (warned once)",
                )
                attention = None
            self.count(ids, attention)
        except Exception as err:  # noqa: BLE001 - counting must not stop training
            self.fail(err, "counting the batch's token ids")

    @torch.no_grad()
    def count(self, ids: Tensor, attention_mask: Tensor | None = None) -> None:
        """Add ``ids`` (any shape) to the counts; positions with ``attention_mask == 0`` are skipped."""
        V = self.num_rows
        if V == 0:
            raise HeadwatchError("TokenFrequency.count called before setup: the vocabulary size is unknown")
        flat = ids.reshape(-1).long()
        if self._local is None or self._local.device != flat.device:
            self._local = torch.zeros(V, dtype=torch.long, device=flat.device)
            self._out_of_range = torch.zeros((), dtype=torch.long, device=flat.device)
        in_range = (flat >= 0) & (flat < V)
        weight = in_range
        if attention_mask is not None:
            keep = attention_mask.reshape(-1).to(flat.device) != 0
            weight = weight & keep
            self._out_of_range += (~in_range & keep).sum()
        else:
            self._out_of_range += (~in_range).sum()
        # index_add_ instead of bincount: bincount syncs on CUDA to size its output
        self._local.index_add_(0, flat.clamp(0, V - 1), weight.long())

    # ----------------------------------------------------------- reading
    def snapshot(self) -> FrequencySnapshot:
        """Counts summed over every process, with buckets and rare tokens (a collective: call on all ranks).

        Kept until the next batch is counted: a second call in between is no collective."""
        if self._cached():
            return self._cache[1]  # type: ignore[index]
        device = self._local.device if self._local is not None else torch.device("cpu")
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long, device=device)
        return self._remember(self.reducer.sum(local))

    def _cached(self) -> bool:
        """Whether the last snapshot still holds (no batch counted since)."""
        return self._cache is not None and self._cache[0] == self._batches

    def _remember(self, summed: Tensor) -> FrequencySnapshot:
        """The snapshot of ``summed`` (this run's counts summed over processes) plus the restored counts, kept."""
        total = summed + self._restored.to(summed.device) if self._restored.numel() else summed
        snap = frequency_snapshot(total, self.valid_rows(total.device), self.rare_max_count, self.rare_fraction)
        self._cache = (self._batches, snap)
        return snap

    def latest_snapshot(self) -> FrequencySnapshot:
        """The last snapshot summed over processes; before the first one, this process's counts.

        Not a collective: safe inside a forward hook.
        """
        if self._cache is not None:
            return self._cache[1]
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long)
        counts = local + self._restored.to(local.device) if self._restored.numel() else local
        return frequency_snapshot(counts, self.valid_rows(counts.device), self.rare_max_count, self.rare_fraction)

    def empty_sums(self, val: bool = False) -> dict[str, Tensor]:
        """``out_of_range`` (int64) and, unless a snapshot of the current counts is kept, the ``(V,)`` int64
        ``counts``: they ride with the step's other sums (no validation values)."""
        if val:
            return {}
        device = self._local.device if self._local is not None else collective_device()
        out = {"out_of_range": torch.zeros((), dtype=torch.long, device=device)}
        if not self._cached():
            out["counts"] = torch.zeros(self.num_rows, dtype=torch.long, device=device)
        return out

    def local_sums(self, val: bool = False) -> dict[str, Tensor]:
        out = self.empty_sums(val)
        if self._out_of_range is not None and "out_of_range" in out:
            out["out_of_range"] = self._out_of_range.clone()
        if self._local is not None and "counts" in out:
            out["counts"] = self._local.clone()  # counting goes on in place
        return out

    def from_sums(self, total: dict[str, Tensor], val: bool = False) -> dict[str, Tensor]:
        if val:
            return {}
        snap = self._remember(total["counts"]) if "counts" in total else self.snapshot()
        t = f"{self.prefix}/tokens"
        out = {f"{t}/{k}": v for k, v in token_scalars(snap).items()}
        out[f"{t}/out_of_range"] = (total["out_of_range"] + self._restored_out_of_range).double()
        return out

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Global counts (a collective: the sum over processes is taken here)."""
        local = self._local if self._local is not None else torch.zeros(self.num_rows, dtype=torch.long)
        oor = self._out_of_range if self._out_of_range is not None else torch.zeros((), dtype=torch.long)
        both = self.reducer.sum(torch.cat([local, oor.reshape(1).to(local.device)])).cpu()
        counts = both[:-1] + self._restored if self._restored.numel() else both[:-1]
        return {
            "version": 1,
            "counts": counts.clone(),
            "out_of_range": int(both[-1]) + self._restored_out_of_range,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counts, checked: a 1-D integer tensor of counts >= 0, as long as the state's ``num_rows``
        (a vocabulary resized since is handled by :meth:`_fit_restored`); an invalid state restarts the counts from
        zero with one warning (see ``FailurePolicy.restore``; ``strict``: raises)."""

        def read(r: StateReader) -> Callable[[], None]:
            num_rows = r.count("num_rows", 0)
            counts = r.counts("counts", length=num_rows if "num_rows" in r.state else None)
            out_of_range = r.count("out_of_range")

            def apply() -> None:
                self._restored = counts if counts is not None else torch.zeros(0, dtype=torch.long)
                self._restored_out_of_range = out_of_range

            return apply

        self.restore(state_dict, read)
        self._local = None
        self._out_of_range = None
        self._cache = None
        self._fit_restored()

    def _fit_restored(self) -> None:
        """Restored counts for a resized vocabulary: grown rows start at 0; shrunk: counting starts afresh."""
        have, want = self._restored.numel(), self.num_rows
        if have == 0 or want == 0 or have == want:
            return
        if have < want:
            self._restored = torch.cat([self._restored, torch.zeros(want - have, dtype=torch.long)])
            self.warn_once(
                "resized",
                f"TokenFrequency: the checkpoint counted {have} token ids, the embedding now has {want} rows; "
                "the added rows start at count 0. (warned once)",
            )
        else:
            self._restored = torch.zeros(0, dtype=torch.long)
            self.warn_once(
                "resized",
                f"TokenFrequency: the checkpoint counted {have} token ids but the embedding now has only {want} "
                "rows; the restored counts cannot be mapped and counting starts afresh (the checkpoint keeps "
                "them). (warned once)",
            )
