"""What every front door shares: :class:`Driver`, the base of a door that holds its run's orchestrator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headwatch.core.orchestrator import Orchestrator


class _OfRun:
    """A read-only attribute of a front door that is its orchestrator's attribute of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, door: Any, owner: type | None = None) -> Any:
        return self if door is None else getattr(door.run, self.name)


class Driver:
    """Base of a front door that holds its run's :class:`Orchestrator` as ``run`` (the plain loop, the HF callback, Lightning's driver).

    ``monitors`` (``list[Monitor]``), ``reducer`` and ``latest`` (the values of the last measurement, by
    full name) are the orchestrator's.
    """

    run: Orchestrator
    monitors = _OfRun()
    reducer = _OfRun()
    latest = _OfRun()
