"""Hooks on one model at a time (trainer-free): :class:`ModelHook`, and :class:`InputsHook`, the keyword inputs of
every forward handed to a reader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Reader = Callable[[nn.Module, dict, dict], Any]


class InertHook:
    """What a deep copy or a pickle of a module carries in place of a headwatch hook: returns None (the forward's
    inputs and output unchanged), measures nothing, references no monitor and no lock."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class CopySafeHook:
    """A hook headwatch puts on a user's module: calls ``fn``. ``copy.deepcopy`` of the module (an EMA or SWA copy,
    ``torch.optim.swa_utils.AveragedModel``, a reference model) and a pickle (``torch.save(model)``) carry an
    :class:`InertHook` instead, so a copy neither feeds the monitor nor drags it (its locks, its writer) along;
    the original keeps measuring.

    The hook's work is timed on the overhead clock (:class:`~headwatch.core.overhead.OverheadClock`, as the kind
    around it) of the object ``fn`` is a method of: its ``clock``, else what its ``timer`` returns; neither: not
    timed. Inside ``torch.compile`` it is not timed (no host clock in a traced graph)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(self.fn, "__self__", None)
        clock = getattr(owner, "clock", None)
        if clock is None and (timer := getattr(owner, "timer", None)) is not None:
            clock = timer()
        if clock is None or torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        with clock.kind(None):
            return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return InertHook, ()
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
        self.handle = register(CopySafeHook(self.fn), with_kwargs=True)
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
