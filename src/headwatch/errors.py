"""The package's one exception class, and the argument checks that raise it.

Every public constructor of headwatch checks all its arguments at once through the ``check_*``
functions below (torchmetrics' ``_arg_validation`` style; public names, since every layer uses
them). They live here, at the bottom of the layers, so that ``model.BatchFormat``, the trainer-free
core, the alerts and the remedies share them, and every front door (Lightning, Hugging Face, a
plain loop) gets the same check from the object it builds. This module imports only the standard
library; ``torch`` is imported inside the two checks that look at modules and tensors.

A failed check raises :class:`HeadwatchError` with one message shape::

    `tau` must be a number in [-1, 1], got 5.0

the argument's name, the values allowed and the value given (its ``repr``, cut at 200
characters; a tensor is described by its dtype and shape). Each check returns the value.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class HeadwatchError(Exception):
    """Raised for bad input or configuration anywhere in headwatch.

    Every error says what was expected, what was received, and, where it applies, how to
    fix it (for example which argument to pass).
    """

    expected: str | None = None
    """Set by a failed argument check: the values the argument allows (read by :func:`check_optional`)."""


_REPR_LIMIT = 200


def _shown(value: Any) -> str:
    """The value as a message shows it: its ``repr`` (cut at 200 characters), a tensor's dtype and shape."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        kind = "nn.Parameter" if isinstance(value, torch.nn.Parameter) else "tensor"
        return f"a {str(value.dtype).replace('torch.', '')} {kind} of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def argument_error(name: str, expected: str, value: Any) -> HeadwatchError:
    """``"`name` must be <expected>, got <value>"``; ``name`` already holding a backtick is shown as is
    (``"`alpha` (`smoothing`)"``: a field and the front-door argument that sets it)."""
    label = name if "`" in name else f"`{name}`"
    err = HeadwatchError(f"{label} must be {expected}, got {_shown(value)}")
    err.expected = expected
    return err


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _interval(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def check_bool(name: str, value: Any) -> bool:
    """``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise argument_error(name, "a bool", value)
    return value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The bounds of every int argument: a value torch cannot hold in an int64 tensor (an ``ignore_index`` or a
seed of ``10**30``) would fail later, far from its cause."""


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """An ``int`` (not a bool, not a float) in ``[minimum, maximum]`` (a bound of None: the int64 bound)."""
    if not _is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise argument_error(name, "an int" + _interval(minimum, maximum), value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise argument_error(name, "an int" + _interval(minimum, maximum) + " that fits in an int64", value)
    return value


def check_positive_int(name: str, value: Any) -> int:
    """An ``int >= 1``."""
    return check_int(name, value, minimum=1)


def check_every(name: str, value: Any) -> int | None:
    """A step interval: None (the trainer's) or an ``int >= 1``."""
    return check_optional(check_int, name, value, minimum=1)


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number (int or float, not a bool; never NaN or infinite) in the interval from
    ``low`` to ``high`` (None: unbounded; ``*_open``: the bound itself excluded). Returns it as a float."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        kind = "a number" if low is not None and high is not None else "a finite number"
        raise argument_error(name, kind + _interval(low, high, low_open, high_open), value)
    return float(value)


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """One of ``allowed``, of the same type (``1`` is not ``True``; nothing is compared with ``==`` across types)."""
    allowed = tuple(allowed)
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise argument_error(name, f"one of {allowed}", value)
    return value


def check_str(name: str, value: Any, *, empty: bool = False) -> str:
    """A string; non-empty unless ``empty``."""
    if not isinstance(value, str) or (not empty and not value):
        raise argument_error(name, "a string" if empty else "a non-empty string", value)
    return value


def check_prefix(value: Any, name: str = "prefix") -> str:
    """The first component of metric names: a non-empty string not ending in ``/``."""
    if not isinstance(value, str) or not value or value.endswith("/"):
        raise argument_error(name, "a non-empty string not ending in '/'", value)
    return value


def check_module_or_name(name: str, value: Any) -> Any:
    """None (found automatically), an ``nn.Module`` or its dotted name (``""``: the model itself)."""
    if value is None or isinstance(value, str):
        return value
    from torch import nn

    if not isinstance(value, nn.Module):
        raise argument_error(name, "None, an nn.Module or its dotted name (str)", value)
    return value


def check_callable(name: str, value: Any, what: str = "a callable") -> Any:
    """Anything callable; ``what`` says what it is called with (``"a callable taking the batch"``)."""
    if not callable(value):
        raise argument_error(name, what, value)
    return value


def check_instance(name: str, value: Any, cls: type | tuple[type, ...], what: str | None = None) -> Any:
    """An instance of ``cls`` (a class or a tuple of them); ``what``: how the message names it
    (default ``a <class name>``)."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise argument_error(name, what or f"a {names}", value)
    return value


def check_protocol(name: str, value: Any, methods: Iterable[str], what: str) -> Any:
    """An object with callable ``methods`` (duck typing: a class of headwatch's or a stand-in); ``what`` names it."""
    if not all(callable(getattr(value, m, None)) for m in methods):
        raise argument_error(name, what, value)
    return value


def check_tensor(name: str, value: Any, *, ndim: int | None = None, dtype: Any = None, parameter: bool = False) -> Any:
    """A ``torch.Tensor`` (an ``nn.Parameter`` with ``parameter``) with ``ndim`` dimensions and ``dtype``, when given."""
    import torch

    cls = torch.nn.Parameter if parameter else torch.Tensor
    ok = isinstance(value, cls) and (ndim is None or value.ndim == ndim) and (dtype is None or value.dtype == dtype)
    if not ok:
        parts = [f"{ndim}-D" if ndim is not None else "", str(dtype).replace("torch.", "") if dtype is not None else "",
                 "nn.Parameter" if parameter else "tensor"]
        what = " ".join(p for p in parts if p)
        raise argument_error(name, f"{'an' if what.startswith(('a', 'e', 'i', 'o', 'u', 'nn.')) else 'a'} {what}", value)
    return value


def check_sequence(name: str, value: Any, of: str, valid: Callable[[Any], bool], *, empty: bool = True) -> list[Any]:
    """A list, tuple or other iterable (read once; not a string or a mapping) whose items all pass
    ``valid``; ``of`` names the items (``"strings"``). Non-empty unless ``empty``. Returns it as a list."""
    items = None
    if not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Iterable):
        items = list(value)
    if items is None or not all(valid(v) for v in items) or (not empty and not items):
        one_shot = items is not None and iter(value) is value  # a generator: show what it gave
        raise argument_error(name, f"{'a' if empty else 'a non-empty'} sequence of {of}", items if one_shot else value)
    return items


def check_optional(check: Callable[..., T], name: str, value: Any, *args: Any, **kwargs: Any) -> T | None:
    """None, or a value ``check(name, value, *args, **kwargs)`` accepts; the message then says None is allowed too."""
    if value is None:
        return None
    try:
        return check(name, value, *args, **kwargs)
    except HeadwatchError as err:
        if err.expected is None:
            raise
        raise argument_error(name, f"None or {err.expected}", value) from None


# ---------------------------------------------------------------------------- checkpoint state


class StateError(HeadwatchError):
    """A part of a checkpoint state that cannot be restored: not a dict, of an unknown version, or holding a
    value of the wrong type, shape or sign, or not finite. The message names the part and the key."""


MAX_TOTAL = 2**62
"""The largest count or total a state may hold: room to keep adding in int64 (0.3 took ``2**63 - 1`` and wrapped)."""


class StateReader:
    """Read one part of a checkpoint state (a ``state_dict``), checking each value against the current run.

    Every accessor returns the value, or the default when the key is absent (a state written by an older
    version), and raises :class:`StateError` naming ``part`` and the key when the value is present but
    invalid. A caller reads every value before it changes anything, so that an invalid state changes
    nothing (see ``FailurePolicy.restore`` in :mod:`headwatch.core.monitor`).

    Args:
        state: the part as loaded (``torch.load``).
        part: its name in messages (e.g. ``"TokenCounts"``).
        versions: the versions this code reads; a state without ``version`` is read as the first.

    Raises:
        StateError: ``state`` is not a dict, or its version is not among ``versions``.
    """

    def __init__(self, state: Any, part: str, versions: tuple[int, ...] = (1,)) -> None:
        self.part = part
        if not isinstance(state, Mapping):
            raise StateError(f"{part}: the state must be a dict, got {_shown(state)}")
        self.state = state
        version = state.get("version", versions[0])
        if not _is_int(version) or version not in versions:
            raise StateError(f"{part}: `version` must be one of {list(versions)}, got {_shown(version)}")
        self.version = int(version)

    def fail(self, key: str, expected: str, value: Any) -> StateError:
        return StateError(f"{self.part}: `{key}` must be {expected}, got {_shown(value)}")

    def count(self, key: str, default: int = 0) -> int:
        """An int >= 0 (a count, a step)."""
        value = self.state.get(key, default)
        if not _is_int(value) or not 0 <= value <= MAX_TOTAL:
            raise self.fail(key, "an int >= 0 (at most 2**62)", value)
        return int(value)

    def step(self, key: str, default: int = -1) -> int:
        """An int >= -1 (a step; -1: none yet)."""
        value = self.state.get(key, default)
        if not _is_int(value) or value < -1:
            raise self.fail(key, "an int >= -1", value)
        return int(value)

    def number(self, key: str, default: float = 0.0, minimum: float | None = 0.0) -> float:
        """A finite number (>= ``minimum`` unless None)."""
        value = self.state.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            minimum is not None and not minimum <= value <= MAX_TOTAL
        ):
            bound = "" if minimum is None else f" >= {minimum:g} (at most 2**62)"
            raise self.fail(key, f"a finite number{bound}", value)
        return float(value)

    def optional_number(self, key: str) -> float | None:
        """None or a finite number."""
        value = self.state.get(key)
        return None if value is None else self.number(key, minimum=None)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.state.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "a bool", value)
        return value

    def items(self, key: str, valid: Callable[[Any], bool] | None = None, what: str = "a list") -> list[Any]:
        """A list or tuple (default empty) whose entries pass ``valid``."""
        value = self.state.get(key, [])
        if not isinstance(value, (list, tuple)) or (valid is not None and not all(valid(v) for v in value)):
            raise self.fail(key, what, value)
        return list(value)

    def mapping(self, key: str) -> Mapping[str, Any]:
        """A dict (default empty)."""
        value = self.state.get(key, {})
        if not isinstance(value, Mapping):
            raise self.fail(key, "a dict", value)
        return value

    def counts(self, key: str, length: int | None = None) -> Any:
        """A 1-D integer tensor of non-negative counts (``length`` entries when given), on the CPU; None when absent."""
        import torch

        value = self.state.get(key)
        if value is None:
            return None
        if (
            not isinstance(value, torch.Tensor)
            or value.ndim != 1
            or value.dtype.is_floating_point
            or value.dtype.is_complex
            or value.dtype == torch.bool
            or (length is not None and value.numel() != length)
        ):
            size = f"{length} " if length is not None else ""
            raise self.fail(key, f"a 1-D integer tensor of {size}counts", value)
        if value.is_meta or value.layout != torch.strided:  # no values to restore (meta), or not a plain array
            raise self.fail(key, "a dense tensor holding its values (not meta, not sparse)", f"a {value.layout} tensor on {value.device}")
        if value.numel() and bool((value < 0).any()):
            raise self.fail(key, "counts >= 0", f"{int((value < 0).sum())} negative entries")
        if value.numel() and float(value.double().sum()) > MAX_TOTAL:
            raise self.fail(key, "counts whose total is at most 2**62", f"a total of {float(value.double().sum()):.4g}")
        return value.detach().long().cpu().clone()

