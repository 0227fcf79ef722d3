"""FSDP1 (``FullyShardedDataParallel``, Lightning's ``FSDPStrategy``): the full matrices on logging steps.

FSDP1 flattens the parameters of each wrapped unit into one 1-D ``FlatParameter`` and shards
that: outside forward and backward, the embedding's and the head's ``weight`` (and, after
backward, ``.grad``; ``use_orig_params=True``) are 1-D views of this process's part of the flat
vector, cutting across rows, so no row can be measured locally. headwatch measures them inside
``FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False,
with_grads=...)`` of only the units whose flat parameter holds the watched modules (usually the
root unit: embedding, final norm, head), on logging steps only, with every process taking part
(a collective).

Cost, per process, while a measurement runs: the full flat parameter of those units (``V d``
values per matrix in the parameter's dtype: 2.1 GB per float32 matrix at ``V = 128256``,
``d = 4096``) and, with ``with_grads``, its full gradient (the same again); freed on exit.
FSDP2 (``fully_shard``, row-sharded DTensors, :mod:`headwatch.distributed.sharded`) needs none of this.

Gradient statistics need ``use_orig_params=True`` (Lightning's default): with
``use_orig_params=False`` FSDP1 keeps no per-parameter gradient (``with_grads`` refuses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from headwatch.errors import HeadwatchError

__all__ = ["full_matrices", "holding_units", "unwrapped", "uses_orig_params", "units"]


def _fsdp_type() -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return None
    return FullyShardedDataParallel


def units(root: nn.Module | None) -> list[nn.Module]:
    """Every ``FullyShardedDataParallel`` (FSDP1) module in ``root`` (itself included), outermost first."""
    fsdp = _fsdp_type()
    if root is None or fsdp is None:
        return []
    return [m for m in root.modules() if isinstance(m, fsdp)]


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a ``FullyShardedDataParallel`` root wraps (whose names are the model's own), else ``model``.

    Attaching there rather than to the root keeps FSDP1's ``_fsdp_wrapped_module.`` out of the names
    headwatch prints; the measurements still summon from the root.
    """
    fsdp = _fsdp_type()
    return model.module if fsdp is not None and isinstance(model, fsdp) else model


def _held_modules(unit: nn.Module) -> set[nn.Module]:
    handle = getattr(unit, "_handle", None)
    flat = getattr(handle, "flat_param", None)
    return set(getattr(flat, "_modules", ()))  # modules whose parameters (shared ones too) live in it


def holding_units(root: nn.Module | None, modules: Iterable[nn.Module | None]) -> list[nn.Module]:
    """The FSDP1 units of ``root`` whose flat parameter holds a parameter of one of ``modules``.

    Modules that are not plain ``nn.Module``s owning their weight (a PEFT wrapper) count through
    their submodules: a LoRA head's base layer and adapters.
    """
    wanted = {sub for m in modules if m is not None for sub in m.modules()}
    return [u for u in units(root) if _held_modules(u) & wanted]


def uses_orig_params(root: nn.Module | None) -> bool:
    """False when an FSDP1 unit of ``root`` runs with ``use_orig_params=False`` (no per-parameter ``.grad``)."""
    return all(bool(getattr(u, "_use_orig_params", True)) for u in units(root))


@contextlib.contextmanager
def full_matrices(root: nn.Module | None, modules: Iterable[nn.Module | None] | None, with_grads: bool = False) -> Iterator[None]:
    """Inside, the weights (and with ``with_grads`` the gradients) of ``modules`` are full tensors.

    A no-op without FSDP1 in ``root``. With FSDP1 it is a collective: every process must enter
    it at the same point. ``modules=None``: every unit holding an embedding-like module
    (``num_embeddings``) or a linear layer whose ``out_features`` equals one's
    ``num_embeddings`` (what resolving the head and embedding looks at), else the root alone.
    The root is summoned first when FSDP has not initialised it yet (no forward so far), so a
    nested unit is never taken for the root.

    Args:
        root: the model as FSDP wraps it (the ``FullyShardedDataParallel`` root, or a module
            containing the units).
        modules: the watched modules (head, embedding), or None (resolution, see above).
        with_grads: also the full ``.grad`` (needs ``use_orig_params=True``).

    Raises:
        HeadwatchError: FSDP1 flattened ``modules`` but no unit of ``root`` holds them (the model
            was wrapped after headwatch attached to it); said once per monitor (``warn_key``).
    """
    found = units(root)
    held = (holding_units(root, modules) if modules is not None else _vocabulary_units(found, root)) if found else []  # type: ignore[arg-type]
    if modules is not None and not held:
        _refuse_wrapped_after(root, modules)
    if not found:
        yield
        return
    fsdp = _fsdp_type()
    chosen = [u for u in (held or found[:1]) if not _summoned(u)]  # re-entrant: nested calls reuse the outer one
    if not chosen:
        yield
        return
    if getattr(found[0], "_is_root", True) is None and found[0] not in chosen:
        chosen = [found[0], *chosen]  # lazy init from the real root (before the first forward)
    elif found[0] in chosen:
        chosen = [found[0], *(u for u in chosen if u is not found[0])]
    with contextlib.ExitStack() as stack:
        for unit in chosen:
            stack.enter_context(fsdp.summon_full_params(unit, recurse=False, writeback=False, with_grads=with_grads))
        yield


def _refuse_wrapped_after(root: nn.Module | None, modules: Iterable[nn.Module | None]) -> None:
    """Raise when FSDP1 flattened ``modules`` but no unit of ``root`` holds them (wrapped after attach)."""
    wanted = {sub for m in modules if m is not None for sub in m.modules()}
    # use_orig_params=True: FSDP1 marks the Parameters it flattened; False: the wrapped module keeps the FlatParameter
    marked = any(getattr(p, "_fsdp_flattened", False) for m in wanted for p in m.parameters(recurse=False))
    flats = (getattr(m, "_flat_param", None) for m in (root.modules() if root is not None else ()))
    if marked or any(set(getattr(flat, "_modules", ())) & wanted for flat in flats if flat is not None):
        err = HeadwatchError(
            "the head and embedding weights were flattened by FullyShardedDataParallel (FSDP1), which "
            "wrapped the model after headwatch attached to it: from the inner model headwatch cannot "
            "summon the full matrices, so the gradient, update and collision statistics are skipped. "
            "Fix: create headwatch.Headwatch on the wrapped model, after FullyShardedDataParallel(model, ...) "
            "(the Lightning and Hugging Face callbacks find the wrapped model themselves)"
        )
        err.warn_key = "fsdp1_wrapped_after"  # type: ignore[attr-defined]  # Monitor.fail: said once per monitor
        raise err


def _summoned(unit: nn.Module) -> bool:
    state = getattr(unit, "training_state", None)
    return getattr(state, "name", "") == "SUMMON_FULL_PARAMS"


def _vocabulary_units(found: list[nn.Module], root: nn.Module) -> list[nn.Module]:
    """Units whose flat parameter holds a 2-D parameter with as many rows as an embedding-like
    module (``num_embeddings``) has: the candidates for the head and the embedding (from FSDP's
    record of the original shapes, without gathering anything)."""
    sizes = {int(m.num_embeddings) for m in root.modules() if isinstance(getattr(m, "num_embeddings", None), int)}
    out = []
    for unit in found:
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        shapes = getattr(flat, "_shapes", ())
        if any(len(shape) == 2 and int(shape[0]) in sizes for shape in shapes):
            out.append(unit)
    return out
