"""Whether a forward is part of a ``generate()`` call, told inside the forward, compiled or not.

headwatch wraps the ``generate`` method of every module of a watched model whose class defines one
(:func:`watch_generate`): an instance attribute that counts the ``generate()`` calls running now and
sets :data:`active` while one does. A forward hook reads :data:`active` (one module attribute, traced
by ``torch.compile`` as a constant under a guard, no graph break: a ``fullgraph=True`` model keeps one
graph, and the first forward inside ``generate()`` recompiles once) and records it with the forward,
so a forward replayed later (compiled code: at the end of the step) is still told apart.

The wrapper is found the usual way whatever object the user calls ``generate`` on: the inner model
itself, a ``torch.compile`` ``OptimizedModule`` (its attribute lookup falls through to the inner
model), a PEFT model (its own ``generate`` is wrapped too, and it calls the inner model's). A
``generate`` method headwatch did not wrap (a model attached without it, a class method called
directly) is found by the call-stack test of :func:`headwatch.model.capture.in_generation`, in eager
code only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

active = False
"""True while a ``generate()`` method headwatch wrapped runs (read by the forward hooks)."""
_depth = 0  # wrapped generate() calls running now (nested calls: a PEFT model's calls its inner model's)
_MISSING = object()


class _WatchedGenerate:
    """The instance attribute put in place of ``module.generate``: calls the method it replaced, with
    :data:`active` set meanwhile. A copy of the module (``copy.deepcopy``: a reference model) or a pickle
    gets the plain method back, bound to the copy."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.method = module.generate  # the bound method, or the instance attribute it replaces
        self.previous = previous  # module.__dict__'s own "generate" before, or _MISSING
        self.users = 1
        self.__wrapped__ = self.method  # inspect.signature(model.generate) reads the real signature
        self.__doc__ = getattr(self.method, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global active, _depth
        _depth += 1
        active = True
        try:
            return self.method(*args, **kwargs)
        finally:
            _depth -= 1
            active = _depth > 0

    def _replaced(self) -> Any:
        return self.method if self.previous is _MISSING else self.previous

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._replaced(), memo)

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _same, (self._replaced(),)


def _same(x: Any) -> Any:
    return x


def watch_generate(model: nn.Module) -> Callable[[], None]:
    """Wrap ``generate`` of every module of ``model`` whose class defines one; returns the function that undoes it.

    Several watchers of one model share one wrapper (counted); the last release restores the method that
    was there (a ``generate`` the user assigned to the instance after headwatch is left alone).
    Costs nothing per forward; one counter update per ``generate()`` call.
    """
    wrapped: list[tuple[nn.Module, _WatchedGenerate]] = []
    for module in model.modules():
        if not callable(getattr(type(module), "generate", None)):
            continue
        own = module.__dict__.get("generate", _MISSING)
        if isinstance(own, _WatchedGenerate):
            own.users += 1
            wrapped.append((module, own))
            continue
        watcher = _WatchedGenerate(module, own)
        object.__setattr__(module, "generate", watcher)
        wrapped.append((module, watcher))

    def release() -> None:
        while wrapped:
            module, watcher = wrapped.pop()
            watcher.users -= 1
            if watcher.users > 0 or module.__dict__.get("generate") is not watcher:
                continue
            if watcher.previous is _MISSING:
                del module.__dict__["generate"]
            else:
                module.__dict__["generate"] = watcher.previous

    return release


def generating() -> bool:
    """True while a ``generate()`` method :func:`watch_generate` wrapped runs; traceable by ``torch.compile``."""
    return active
