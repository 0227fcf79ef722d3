"""Lazy public names of a package (PEP 562): a name's module is imported on the first use of the name.

One definition for every package that keeps its import cheap this way (``headwatch``,
``headwatch.remedies``): the package lists ``name -> module`` and binds what :func:`lazy_names`
returns as its module-level ``__getattr__`` and ``__dir__``. No torch import.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str], exported: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package named ``package``.

    Args:
        package: the package's ``__name__``.
        names: public name -> the module that defines it under that name, imported on the first use
            of the name; the value is then bound in the package, so later uses do not come back here.
        exported: what ``dir(package)`` lists, sorted (the package's ``__all__``).

    Returns:
        ``__getattr__`` raises ``AttributeError`` (naming the package and the name) for a name that
        is not in ``names``, as Python does for a missing module attribute.
    """
    listed = sorted(exported)

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
