"""Hooks on one model at a time (trainer-free): :class:`ModelHook`, and :class:`InputsHook`, the keyword inputs of
every forward handed to a reader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

Reader = Callable[[nn.Module, dict, dict], Any]
"""``read(module, batch, kwargs)``: the module called, its inputs as a mapping, the forward's own keyword arguments."""


class ModelHook:
    """``fn`` as a forward hook (``pre``: a forward pre-hook), with keyword arguments, on one model at a time.

    :meth:`watch` is idempotent for the same model and moves the hook from the model watched before;
    :meth:`remove` takes it off.
    """

    def __init__(self, fn: Callable[..., Any], pre: bool = False) -> None:
        self.fn, self.pre = fn, pre
        self.model: nn.Module | None = None
        """The watched model (None: none)."""
        self.handle: Any = None

    def watch(self, model: nn.Module) -> None:
        """Hook ``model`` (nothing changes when it is the model hooked now)."""
        if self.handle is not None and self.model is model:
            return
        self.remove()
        register = model.register_forward_pre_hook if self.pre else model.register_forward_hook
        self.handle = register(self.fn, with_kwargs=True)
        self.model = model

    def remove(self) -> None:
        """Remove the hook (watch nothing)."""
        if self.handle is not None:
            self.handle.remove()
        self.handle, self.model = None, None


class InputsHook(ModelHook):
    """A forward pre-hook handing each forward's inputs to ``read(module, batch, kwargs)`` before it runs.

    ``batch`` is a copy of the forward's keyword arguments, with a first positional argument as ``ids_key`` when that
    is not given by name (``model(ids)``); ``kwargs`` the forward's own. Exceptions of ``read`` propagate (a door
    guards them).
    """

    def __init__(self, read: Reader, ids_key: str = "input_ids") -> None:
        super().__init__(self._hook, pre=True)
        self.read, self.ids_key = read, ids_key

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        batch = dict(kwargs)
        if args and self.ids_key not in batch:
            batch[self.ids_key] = args[0]
        self.read(module, batch, kwargs)
