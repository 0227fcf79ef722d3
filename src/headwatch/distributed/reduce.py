"""Reducers: how a monitor's sums, gathers and shared decisions cross processes.

A monitor never calls ``torch.distributed`` itself; the front door injects a reducer:
:class:`NoReducer` (one process), :class:`TorchDistributedReducer` (any engine on
``torch.distributed``: a plain DDP loop, accelerate), or Lightning's strategy
(:class:`headwatch.integrations.lightning.LightningReducer`). Every method is a collective
when ``world_size > 1``: every rank calls it, in the same order.

:func:`reduce_step` reduces the sums of a whole logging step at once, as OLMo-core's
``reduce_metrics`` does: every monitor's sums packed by dtype, one ``all_reduce`` per dtype, then one
``all_gather`` per dtype for the per-position values that quantiles need (``docs/distributed.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from headwatch.errors import HeadwatchError


@runtime_checkable
class Reducer(Protocol):
    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def sum(self, tensor: Tensor) -> Tensor:
        """Element-wise sum over processes (a new tensor; the input is not modified)."""

    def mean(self, tensor: Tensor) -> Tensor:
        """Element-wise mean over processes."""

    def gather(self, tensor: Tensor) -> list[Tensor]:
        """Every process's tensor, in rank order (first dimensions may differ)."""

    def all(self, flag: bool) -> bool:
        """True when ``flag`` is True on every process."""

    # Optional, not required of a reducer: ``all_gather(tensor) -> Tensor``, every process's ``tensor`` (the same
    # shape on every process) stacked in rank order, ``(W, *shape)``, in one collective; :func:`stacked` uses
    # ``gather`` for a reducer without it.


class NoReducer:
    """One process: every reduction is the identity."""

    world_size = 1
    rank = 0

    def sum(self, tensor: Tensor) -> Tensor:
        return tensor.clone()

    def mean(self, tensor: Tensor) -> Tensor:
        return tensor.clone()

    def gather(self, tensor: Tensor) -> list[Tensor]:
        return [tensor]

    def all(self, flag: bool) -> bool:
        return bool(flag)

    def all_gather(self, tensor: Tensor) -> Tensor:
        return tensor.unsqueeze(0)


class TorchDistributedReducer:
    """``torch.distributed`` (the default process group, or ``group``); one process when not initialized."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @staticmethod
    def _on() -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size(self.group) if self._on() else 1

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank(self.group) if self._on() else 0

    def sum(self, tensor: Tensor) -> Tensor:
        out = tensor.clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return out

    def mean(self, tensor: Tensor) -> Tensor:
        out = self.sum(tensor)
        return out / self.world_size if self.world_size > 1 else out

    def gather(self, tensor: Tensor) -> list[Tensor]:
        """Two collectives (the shapes, then the tensors padded to the largest), one host read of the shapes."""
        if self.world_size == 1:
            return [tensor]
        if tensor.ndim == 0:
            return list(self.all_gather(tensor).unbind(0))
        shapes = self.all_gather(torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)).tolist()
        largest = [max(dims) for dims in zip(*shapes)]
        padded = tensor.new_zeros(largest)
        padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
        parts = self.all_gather(padded)
        return [part[tuple(slice(0, n) for n in shape)] for part, shape in zip(parts, shapes)]

    def all_gather(self, tensor: Tensor) -> Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, tensor, group=self.group)
        return torch.stack(out)

    def all(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        device = "cuda" if torch.distributed.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor(0 if flag else 1, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return int(t) == 0


def stacked(reducer: Reducer, tensor: Tensor) -> Tensor:
    """:meth:`Reducer.all_gather` of ``reducer``, or its :meth:`~Reducer.gather` stacked when it has none."""
    gather = getattr(reducer, "all_gather", None)
    if gather is not None:
        return gather(tensor)
    return torch.stack([t.to(tensor.device) for t in reducer.gather(tensor)])


class Values(NamedTuple):
    """One process's values to be concatenated over processes (rank order) by :func:`reduce_step`: what a
    quantile or a histogram of every position needs. ``tensor``: 1-D, any length on each process."""

    tensor: Tensor


Part = Mapping[str, "Tensor | Values"]
"""One contributor's entries to :func:`reduce_step`: name -> this process's sum (any shape and numeric dtype,
summed element-wise over processes) or :class:`Values` (concatenated over processes)."""


def check_part(part: Part) -> None:
    """Raise a :class:`HeadwatchError` unless every entry of ``part`` is a numeric tensor or :class:`Values` of one."""
    for name, v in part.items():
        t = v.tensor if isinstance(v, Values) else v
        if not isinstance(t, Tensor) or t.dtype == torch.bool or (isinstance(v, Values) and t.ndim != 1):
            raise HeadwatchError(
                f"a step's sums: `{name}` must be a numeric tensor or Values of a 1-D one, got {type(t).__name__} "
                f"{getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}"
            )


def collective_device() -> torch.device:
    """Where a collective of no tensor runs: the current GPU under NCCL, else the CPU (gloo, or no process group)."""
    on = torch.distributed.is_available() and torch.distributed.is_initialized()
    if on and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_step(parts: Sequence[Part], reducer: Reducer, failed: Sequence[bool] | None = None) -> tuple[list[dict[str, Tensor]], list[bool]]:
    """Every part's sums summed over processes and its :class:`Values` concatenated over processes, together.

    The sums are packed by dtype into one flat buffer each and reduced with one ``all_reduce`` per dtype
    (``int64`` always, with several processes: it also carries ``failed`` and each process's number of
    values); then the values are padded to the longest process's and gathered with one ``all_gather`` per
    dtype (one host read of the numbers of values). One process: no collective, the entries as given.

    Args:
        parts: one mapping per contributor (a monitor, the self-check); every process passes the same names,
            shapes and dtypes in the same order (the values' lengths may differ).
        reducer: the processes (every method a collective).
        failed: per part, whether it failed on this process (its entries are then zeros of the same layout).

    Returns:
        ``(reduced parts, failed)``: each part with its sums over processes (float64 stays float64: exact
        sums of counts and float64 totals) and its values concatenated in rank order; per part, whether it
        failed on any process.

    Raises:
        HeadwatchError: an entry that is neither a numeric tensor nor :class:`Values` of a 1-D one
            (:func:`check_part`), or ``failed`` of another length than ``parts``.
    """
    flags = [bool(f) for f in (failed if failed is not None else [False] * len(parts))]
    if len(flags) != len(parts):
        raise HeadwatchError(f"reduce_step: {len(flags)} failure flags for {len(parts)} parts")
    for part in parts:
        check_part(part)
    W = reducer.world_size
    if W <= 1:
        return [{k: v.tensor if isinstance(v, Values) else v for k, v in part.items()} for part in parts], flags
    sums = [(i, k, v) for i, part in enumerate(parts) for k, v in part.items() if not isinstance(v, Values)]
    values = [(i, k, v.tensor.reshape(-1)) for i, part in enumerate(parts) for k, v in part.items() if isinstance(v, Values)]
    tensors = [v for _, _, v in sums] + [v for _, _, v in values]
    home = tensors[0].device if tensors else collective_device()
    # the int64 block starts with the failure flags, then each process's number of values per entry (W slots
    # each); filled in place from Python numbers (fills, not host-to-device copies)
    head = torch.zeros(len(flags) + W * len(values), dtype=torch.long, device=home)
    for i, f in enumerate(flags):
        if f:
            head[i] = 1
    for j, (_, _, v) in enumerate(values):
        head[len(flags) + W * j + reducer.rank] = v.numel()
    blocks: dict[torch.dtype, list[Tensor]] = {torch.long: [head]}
    for _, _, v in sums:
        blocks.setdefault(v.dtype, []).append(v)
    reduced = {dtype: reducer.sum(torch.cat([t.reshape(-1).to(home) for t in blocks[dtype]])) for dtype in sorted(blocks, key=str)}
    out: list[dict[str, Tensor]] = [{} for _ in parts]
    at = {dtype: 0 for dtype in reduced}
    at[torch.long] = head.numel()
    for i, k, v in sums:
        out[i][k] = reduced[v.dtype][at[v.dtype] : at[v.dtype] + v.numel()].reshape(v.shape).to(v.device)
        at[v.dtype] += v.numel()
    known = reduced[torch.long][: head.numel()].tolist()  # flags and sizes on the host: the step's one read of them
    anywhere = [n > 0 for n in known[: len(flags)]]
    sizes = [known[len(flags) + W * j : len(flags) + W * (j + 1)] for j in range(len(values))]  # (entries, W)
    for dtype in sorted({v.dtype for _, _, v in values}, key=str):
        entries = [j for j, (_, _, v) in enumerate(values) if v.dtype == dtype]
        mine = torch.cat([values[j][2].to(home) for j in entries])
        padded = mine.new_zeros(max(1, max(sum(sizes[j][r] for j in entries) for r in range(W))))
        padded[: mine.numel()] = mine
        rows = stacked(reducer, padded)  # (W, longest): every process's values of this dtype
        start = [0] * W
        for j in entries:
            i, k, v = values[j]
            pieces = []
            for r in range(W):
                pieces.append(rows[r, start[r] : start[r] + sizes[j][r]])
                start[r] += sizes[j][r]
            out[i][k] = torch.cat(pieces).to(v.device)
    return out, anywhere
