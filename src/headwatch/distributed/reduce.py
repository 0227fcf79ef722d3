"""Reducers: how a monitor's sums, gathers and shared decisions cross processes.

A monitor never calls ``torch.distributed`` itself; the front door injects a reducer:
:class:`NoReducer` (one process), :class:`TorchDistributedReducer` (any engine on
``torch.distributed``: a plain DDP loop, accelerate), or Lightning's strategy
(:class:`headwatch.integrations.lightning.LightningReducer`). Every method is a collective
when ``world_size > 1``: every rank calls it, in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


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
        if self.world_size == 1:
            return [tensor]
        from torchmetrics.utilities.distributed import gather_all_tensors

        return gather_all_tensors(tensor, group=self.group)

    def all(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        device = "cuda" if torch.distributed.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor(0 if flag else 1, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return int(t) == 0
