"""Adapters (PEFT LoRA, ``modules_to_save``): the matrix a module really computes with.

Under PEFT LoRA the matrix that scores is ``W + s * B @ A`` (Hu et al., 2021) while ``.weight``
is the frozen base; ``modules_to_save`` trains a copy. PEFT is duck-typed here
(``lora_A``/``lora_embedding_A``, ``modules_to_save``/``original_module``, PEFT 0.21 layouts):
headwatch does not import it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from headwatch.errors import HeadwatchError
from headwatch.functional.adapters import add_low_rank_


# ---------------------------------------------------------------- storage and kinds
def _is_lora(module: nn.Module) -> bool:
    # AdaLoRA's layers carry `lora_A` too, but its delta is B @ (A * E) / ranknum: not the LoRA this module computes
    lora = hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A")
    return hasattr(module, "get_base_layer") and lora and not hasattr(module, "lora_E")


def adapter_name(module: nn.Module) -> str:
    """The PEFT method of an adapter layer, from where its class lives (``peft.tuners.ia3.layer.Linear``: ``ia3``;
    every PEFT method's layers are named ``Linear``/``Embedding``, so the class name alone does not say)."""
    where = type(module).__module__
    parts = where.split(".")
    method = parts[2] if len(parts) > 2 and parts[:2] == ["peft", "tuners"] else None
    described = f"{where}.{type(module).__qualname__}"
    return f"PEFT {method} ({described})" if method else type(module).__name__


def is_saved_copy(module: nn.Module) -> bool:
    return hasattr(module, "modules_to_save") and hasattr(module, "original_module")


def _token_layer(module: nn.Module) -> nn.Module | None:
    """The PEFT trainable-tokens layer of ``module`` (``TrainableTokensLayer``, or the one a
    ``TrainableTokensWrapper`` from ``LoraConfig(trainable_token_indices=...)`` runs), else None."""
    if hasattr(module, "trainable_tokens_delta") and hasattr(module, "base_layer"):
        return module
    inner = getattr(module, "token_adapter", None)
    if (
        isinstance(inner, nn.Module)
        and hasattr(inner, "trainable_tokens_delta")
        and hasattr(inner, "base_layer")
    ):
        return inner
    return None


def _token_deltas(layer: nn.Module) -> list[tuple[list[int], Tensor]]:
    """``(token_indices, delta (k, d_model))`` of each active, unmerged trainable-tokens adapter."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return []
    deltas = layer.trainable_tokens_delta
    return [
        (list(layer.token_indices[a]), deltas[a]) for a in _active(layer) if a in deltas
    ]


def trainable_token_count(module: nn.Module) -> int | None:
    """How many rows PEFT trainable tokens train in ``module`` (None: not a trainable-tokens layer)."""
    layer = _token_layer(module)
    if layer is None:
        return None
    return len({i for indices, _ in _token_deltas(layer) for i in indices})


def storage_weight(module: nn.Module) -> Tensor | None:
    """The stored ``weight`` Parameter a module's rows come from, under any adapter wrapper.

    LoRA layers: the base layer's weight; ``modules_to_save`` wrappers: the original module's
    (the one a tie would share). ``None`` when there is no 2-D weight.
    """
    seen = 0
    while seen < 8:  # wrappers nest at most a few levels
        seen += 1
        if is_saved_copy(module):
            module = module.original_module
        elif _token_layer(module) is not None and _token_layer(module) is not module:
            module = _token_layer(
                module
            )  # a TrainableTokensWrapper: its layer, then that layer's base
        elif hasattr(module, "get_base_layer") and hasattr(module, "base_layer"):
            base = module.get_base_layer()
            if base is module:
                break
            module = base
        else:
            break
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, Tensor) and weight.ndim == 2 else None


# ---------------------------------------------------------------- effective weights
def _active(module: nn.Module) -> list[str]:
    active = getattr(module, "active_adapters", None)
    if active is None:
        active = getattr(module, "active_adapter", [])
    return [active] if isinstance(active, str) else list(active)


def _lora_factors(
    module: nn.Module, adapter: str
) -> tuple[Tensor, Tensor, float] | None:
    """``(left (V, r), right (r, d), scaling)`` of one adapter, or None if the layer lacks it."""
    variant = getattr(module, "lora_variant", {}).get(adapter)
    if variant is not None:
        raise HeadwatchError(
            f"adapter {adapter!r} of {type(module).__name__} is a LoRA variant (DoRA or similar: "
            f"{type(variant).__name__}): its effective weight is not base + s * B @ A (DoRA rescales each column "
            "by a trained magnitude), and headwatch does not compute it, so this matrix's gradient, update and "
            "collision statistics are refused (the logits are still measured); to measure them, adapt it with "
            "plain LoRA (use_dora=False) or measure the merged model"
        )
    # an adapter can be active on a layer it does not target (PEFT activates names model-wide): no scaling there
    if hasattr(module, "lora_embedding_A") and adapter in module.lora_embedding_A:
        return (
            module.lora_embedding_A[adapter].T,
            module.lora_embedding_B[adapter].T,
            float(module.scaling[adapter]),
        )  # (V, r), (r, d)
    if hasattr(module, "lora_A") and adapter in module.lora_A:
        return (
            module.lora_B[adapter].weight,
            module.lora_A[adapter].weight,
            float(module.scaling[adapter]),
        )  # (out, r), (r, in)
    return None


def _saved_active(wrapper: nn.Module) -> nn.Module:
    """The module a ``modules_to_save`` wrapper runs: the active adapter's copy, else the original."""
    active = [a for a in _active(wrapper) if a in wrapper.modules_to_save]
    if getattr(wrapper, "disable_adapters", False) or not active:
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def adapter_kind(module: nn.Module) -> str:
    """How ``module``'s matrix is made: ``"plain"``, ``"lora"`` (a delta added in the forward),
    ``"lora_merged"`` (merged into the base: the forward reads the base), ``"modules_to_save"`` or
    ``"trainable_tokens"`` (PEFT: a few rows replaced by a trained ``(k, d_model)`` delta)."""
    if is_saved_copy(module):
        return "modules_to_save"
    if _token_layer(module) is not None:
        return "trainable_tokens"
    if _is_lora(module):
        if getattr(module, "disable_adapters", False):
            return "plain"
        return "lora_merged" if getattr(module, "merged", False) else "lora"
    if hasattr(module, "get_base_layer") and module.get_base_layer() is not module:
        raise HeadwatchError(
            f"{adapter_name(module)}: {type(module).__name__} is an adapter layer headwatch does not know (it "
            "computes LoRA, modules_to_save and trainable tokens only); its effective weight is not the base "
            "weight (IA3 scales it, BOFT and OFT rotate it, VeRA and AdaLoRA add deltas of their own), so this "
            "matrix's gradient, update and collision statistics are refused (the logits are still measured); to "
            "measure them, adapt this matrix with LoRA or leave it out of target_modules"
        )
    return "plain"


@torch.no_grad()
def effective_weight(module: nn.Module, copy: bool = False) -> Tensor:
    """The ``(V, d_model)`` matrix the module really computes with, as rows (one per token).

    - plain ``nn.Linear`` / ``nn.Embedding``: its ``weight`` (detached, float32; a float32 weight
      is returned as is, without a copy, unless ``copy``: pass ``copy=True`` to keep it across an
      optimizer step, e.g. for update statistics);
    - PEFT LoRA ``Linear``/``Embedding``: ``W + sum_a s_a * B_a @ A_a`` over the active adapters
      (``fan_in_fan_out`` bases are transposed to rows); merged: the base (it holds the deltas);
      disabled: the base minus any merged deltas (what the forward computes);
    - ``modules_to_save``: the active adapter's trained copy (the original when disabled).

    Memory: one ``(V, d_model)`` float32 result; the low-rank products go row chunk by row chunk.

    Raises:
        HeadwatchError: no 2-D weight, an unknown adapter type, or a LoRA variant (DoRA).
    """
    kind = adapter_kind(module)
    if kind == "modules_to_save":
        chosen = _saved_active(module)
        return effective_weight(chosen, copy)
    if (
        kind == "trainable_tokens"
    ):  # the base with the trained rows written over it (PEFT get_merged_weights)
        layer = _token_layer(module)
        out = layer.base_layer.weight.detach().to(torch.float32, copy=True)  # type: ignore[union-attr]
        for indices, delta in _token_deltas(layer):  # type: ignore[arg-type]
            out[torch.tensor(indices, device=out.device)] = delta.detach().float()
        return out
    if kind == "plain" and not _is_lora(module):
        from headwatch.distributed.zero import (
            full_weight,  # DeepSpeed ZeRO-3: the partitioned weight's full value
        )

        weight = full_weight(getattr(module, "weight", None))
        if not isinstance(weight, Tensor) or weight.ndim != 2:
            raise HeadwatchError(
                f"{type(module).__name__} has no 2-D `weight`; expected a head or an embedding"
            )
        return weight.detach().to(torch.float32, copy=copy)
    base = module.get_base_layer().weight
    rows = base.T if getattr(module, "fan_in_fan_out", False) else base
    out = rows.detach().to(torch.float32, copy=True)
    if kind == "lora_merged":
        return out
    if getattr(module, "disable_adapters", False):
        adapters, sign = list(getattr(module, "merged_adapters", [])), -1.0
    else:
        adapters, sign = _active(module), 1.0
    for adapter in adapters:
        factors = _lora_factors(module, adapter)
        if factors is not None:
            left, right, scaling = factors
            add_low_rank_(out, left, right, sign * scaling)
    return out


def _forward_parameters(module: nn.Module) -> list[Tensor]:
    """Parameters the module's effective matrix is computed from."""
    kind = adapter_kind(module)
    if kind == "modules_to_save":
        chosen = _saved_active(module)
        return _forward_parameters(chosen)
    if kind == "trainable_tokens":
        layer = _token_layer(module)
        return [layer.base_layer.weight, *(delta for _, delta in _token_deltas(layer))]  # type: ignore[union-attr, arg-type]
    if not _is_lora(module):
        return [module.weight]
    params = [module.get_base_layer().weight]
    if kind == "lora":
        for adapter in _active(module):
            if (
                hasattr(module, "lora_embedding_A")
                and adapter in module.lora_embedding_A
            ):
                params += [
                    module.lora_embedding_A[adapter],
                    module.lora_embedding_B[adapter],
                ]
            elif hasattr(module, "lora_A") and adapter in module.lora_A:
                params += [
                    *module.lora_A[adapter].parameters(),
                    *module.lora_B[adapter].parameters(),
                ]
    return params


class Trainability(NamedTuple):
    trains: bool
    """Some parameter the effective matrix is computed from has ``requires_grad``."""
    kind: str
    """:func:`adapter_kind` of the module."""
    gradient_parameter: Tensor | None
    """The Parameter whose ``.grad`` IS the effective matrix's gradient: ``weight`` (also a LoRA
    base that trains, since ``W_eff = W + delta``; a ``fan_in_fan_out`` base holds it transposed),
    or the ``modules_to_save`` copy's; None when no Parameter holds it (a frozen LoRA base: use
    :func:`headwatch.functional.adapters.head_weight_gradient`)."""


def trainable_matrices(
    head: nn.Module, embedding: nn.Module
) -> dict[str, Trainability]:
    """Which of the head and the embedding train at all, and where their gradient is.

    A matrix whose ``trains`` is False has no gradient: say so once, and do not log zeros as
    its gradient density. Under LoRA the row gradient is that of the effective matrix, never
    the frozen base's ``weight.grad`` (``gradient_parameter`` is None).

    Returns:
        ``{"head": Trainability, "embedding": Trainability}``.

    Raises:
        HeadwatchError: as :func:`effective_weight` (unknown adapter type, LoRA variant).
    """
    result = {}
    for role, module in (("head", head), ("embedding", embedding)):
        params = _forward_parameters(module)
        trains = any(p.requires_grad for p in params)
        holder = (
            params[0] if params[0].requires_grad else None
        )  # W_eff = base + delta: same gradient
        result[role] = Trainability(trains, adapter_kind(module), holder)
    return result


def _key(t: Tensor) -> tuple:
    """Identity of a tensor's memory: two views with equal keys read the same numbers."""
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): its storage is this process's shard
        t = t.to_local()
    storage = t.untyped_storage()
    # a meta tensor (deferred init) holds no memory and every data pointer is 0: the storage itself tells them apart
    where = storage._cdata if t.is_meta else storage.data_ptr()
    return (t.device, where, t.storage_offset(), tuple(t.shape), t.stride())


def matrix_signature(module: nn.Module) -> tuple:
    """What the effective matrix is made of, as memory identities: the base rows and each active
    unmerged LoRA factor pair with its scale. Equal signatures mean one effective matrix (a tie,
    including PEFT's ``ensure_weight_tying`` adapters, which share the factors' memory)."""
    kind = adapter_kind(module)
    if kind == "modules_to_save":
        chosen = _saved_active(module)
        return matrix_signature(chosen)
    if (
        kind == "trainable_tokens"
    ):  # a tied head's layer shares the embedding's deltas (PEFT tied_adapter)
        layer = _token_layer(module)
        rows = [(tuple(i), _key(d.detach())) for i, d in _token_deltas(layer)]  # type: ignore[arg-type]
        return (_key(layer.base_layer.weight.detach()), *sorted(rows, key=repr))  # type: ignore[union-attr]
    if not _is_lora(module):
        return (_key(module.weight.detach()),)
    base = module.get_base_layer().weight.detach()
    parts: list[tuple] = [
        _key(base.T if getattr(module, "fan_in_fan_out", False) else base)
    ]
    if kind == "lora":
        for adapter in _active(module):
            factors = _lora_factors(module, adapter)
            if factors is not None:
                left, right, scaling = factors
                parts.append((scaling, _key(left.detach()), _key(right.detach())))
    return (parts[0], *sorted(parts[1:], key=repr))
