"""DeepSpeed ZeRO: recognise the Parameters it manages and read their full gradient and weight.

ZeRO keeps ``param.grad`` empty between ``engine.backward`` and ``engine.step`` (measured with
DeepSpeed 0.19.8 on 2 CPU processes, fp32: ``param.grad is None`` at stages 1, 2 and 3): the
gradient lives in its own partitioned buffers. DeepSpeed marks its Parameters, so no import is
needed to recognise them:

- stages 1 and 2: ``param._hp_mapping`` (the weight itself is whole on every process);
- stage 3: ``param.ds_id`` (and ``ds_shape``, ``ds_numel``, ``ds_status``); outside the forward
  ``param`` is an empty ``torch.Size([0])`` placeholder.

The full values are read with DeepSpeed's documented accessors
(``deepspeed.utils.safe_get_full_grad``, ``deepspeed.zero.GatheredParameters``). Each is a
collective over the data-parallel group: every process calls them in the same order (headwatch's
measurements already run on every process), and
each assembles the whole ``(V, d_model)`` tensor on every process (``4 V d_model`` bytes in
float32: 2.1 GB at ``V = 128256``, ``d_model = 4096``) for the measurement's duration.
``deepspeed`` is imported only for a Parameter that carries these marks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from headwatch.errors import HeadwatchError
from headwatch.distributed.reduce import Reducer

__all__ = ["full_gradient", "full_weight", "gathered", "gradient_ready", "zero_held", "zero_stage"]


def zero_stage(param: Tensor | None) -> int:
    """3 for a ZeRO-3 partitioned Parameter, 1 for one whose gradient ZeRO stage 1 or 2 holds, else 0."""
    if param is None:
        return 0
    if hasattr(param, "ds_id"):
        return 3
    return 1 if hasattr(param, "_hp_mapping") else 0


def _gradient_ready(param: Tensor) -> bool:
    """Whether ZeRO still holds this process's part of ``param``'s gradient (no collective).

    After ``engine.step()`` it does not: stage 1/2's ``safe_get_full_grad`` then raises on the
    processes that own a fragment while the others wait in its all-reduce, and stage 3's returns the
    values left in its fp32 buffer. Checking first, and agreeing, keeps every process on one path.
    Reads the attributes DeepSpeed's own accessors read (DeepSpeed 0.19); where they are missing
    (another version, ZeRO-3 optimizer offload), trusts ``safe_get_full_grad``.
    """
    if zero_stage(param) == 3:
        opt = getattr(param, "_z3_optimizer", None)
        try:
            if opt.offload_optimizer:  # type: ignore[union-attr]
                return True
            group = opt.grad_position[opt.get_param_id(param)][0]  # type: ignore[union-attr]
            return opt.averaged_gradients.get(group) is not None  # type: ignore[union-attr]  # set by backward, None after step
        except (AttributeError, KeyError, TypeError, IndexError):
            return True
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:  # this process holds no fragment of the parameter
        return True
    try:
        mapping.get_lp_grad_fragment(param._index_in_param_group)  # type: ignore[attr-defined]
    except (ValueError, KeyError, AttributeError, IndexError):
        return False
    return True


def zero_held(param: Tensor | None) -> bool:
    """Whether DeepSpeed ZeRO holds ``param``'s gradient (``param.grad`` is None): :func:`full_gradient` reads it."""
    return param is not None and param.grad is None and param.requires_grad and bool(zero_stage(param))


def gradient_ready(param: Tensor | None) -> bool:
    """False when ZeRO holds ``param``'s gradient and no longer has this process's part (``engine.step()`` ran);
    True otherwise (no collective). What :func:`full_gradient` agrees on before its collective."""
    return not zero_held(param) or _gradient_ready(param)  # type: ignore[arg-type]


def full_gradient(
    param: Tensor | None, reducer: Reducer | None = None, say: Callable[[str], None] | None = None, ready: bool | None = None
) -> Tensor | None:
    """``param.grad``, or, for a Parameter whose gradient DeepSpeed ZeRO holds, the full averaged gradient.

    Between ``engine.backward`` and ``engine.step``, on the gradient-accumulation boundary, this is
    ``deepspeed.utils.safe_get_full_grad(param)``, shape ``param``'s full shape (``ds_shape`` at stage
    3), averaged over processes like DDP's ``.grad`` (measured equal to one process's ``.grad`` within
    4e-7 relative, fp32). A collective under ZeRO: ``reducer`` (every process) first agrees that the
    gradient is there, unless the caller already did (``ready``: :func:`gradient_ready` of every process, agreed
    with its other decisions). ``say`` (a monitor's ``info_once``) receives one line saying so and what it costs.

    Not detectable here: a call on a micro-step that is not the accumulation boundary (stage 1 then
    returns each process's own partial sum). Detected and refused: a call after ``engine.step()``.

    Raises:
        HeadwatchError: DeepSpeed holds the gradient but cannot give it on some process (called
            after ``engine.step``); the message says where to call from.
    """
    if not zero_held(param):
        return None if param is None else param.grad
    stage = "3" if zero_stage(param) == 3 else "1 or 2"
    if ready is None:
        ready = _gradient_ready(param)  # type: ignore[arg-type]
        if reducer is not None:
            ready = reducer.all(ready)
    if not ready:
        raise HeadwatchError(
            f"DeepSpeed ZeRO stage {stage} holds this matrix's gradient (`param.grad` is None) and no longer "
            "has it: `engine.step()` already ran. In a plain loop call `before_optimizer_step()` after "
            "`engine.backward(loss)` and before `engine.step()`, on a gradient-accumulation boundary; the Hugging "
            "Face Trainer (accelerate) steps the engine inside `accelerator.backward`, before `on_pre_optimizer_step`, "
            "so its gradients cannot be read there: use the plain loop, or FSDP2 (`fully_shard`), where headwatch "
            "reads `.grad`"
        )
    if say is not None:
        say(
            f"headwatch: DeepSpeed ZeRO stage {stage} holds the gradients (`param.grad` is None); read with "
            "`deepspeed.utils.safe_get_full_grad`, which assembles each full (vocab_size, d_model) float32 "
            "gradient on every process on logging steps (a collective)"
        )
    from deepspeed.utils import safe_get_full_grad

    grad = safe_get_full_grad(param)
    if grad is None:
        raise HeadwatchError(f"DeepSpeed ZeRO stage {stage}: `deepspeed.utils.safe_get_full_grad` returned None for a trained matrix")
    return grad


def full_weight(weight: Tensor | None) -> Tensor | None:
    """``weight``, or, for a ZeRO-3 partitioned Parameter, a float32 copy of its full value (a collective).

    ZeRO-3: gathered with ``deepspeed.zero.GatheredParameters`` (released on exit) and copied, shape
    ``ds_shape``: the weight the forward computes with, in its dtype (bf16 under DeepSpeed's bf16
    mode), as stages 1 and 2 and plain models give it; not the optimizer's float32 master copy
    (``safe_get_full_fp32_param``), whose update differs from the bf16 weights' by their rounding.
    Other tensors are returned unchanged.
    """
    if zero_stage(weight) != 3:
        return weight
    import deepspeed  # `deepspeed.zero` is an attribute, not an importable module

    with deepspeed.zero.GatheredParameters([weight]):
        return weight.detach().to(torch.float32, copy=True)  # type: ignore[union-attr]


def _vocabulary_matrices(model: nn.Module) -> list[Tensor]:
    """ZeRO-3 Parameters that may be the embedding or the head: 2-D, sharing a dimension with an embedding's rows."""
    params = {id(p): p for p in model.parameters() if zero_stage(p) == 3 and len(p.ds_shape) == 2}  # type: ignore[attr-defined]
    rows = {int(m.weight.ds_shape[0]) for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) in params}
    return [p for p in params.values() if rows & {int(p.ds_shape[0]), int(p.ds_shape[1])}]  # type: ignore[attr-defined]


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside: the ZeRO-3 partitioned vocabulary-sized matrices of ``model`` hold their full values.

    For resolving the head and the embedding after ``deepspeed.initialize`` (their shapes are read
    then). Gathers only 2-D Parameters with a dimension equal to an ``nn.Embedding``'s rows (the
    embedding and the head, ``2 V d_model`` values), never the whole model; a collective. Without
    ZeRO-3 Parameters, a no-op that imports nothing.
    """
    params = _vocabulary_matrices(model) if any(zero_stage(p) == 3 for p in model.parameters()) else []
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield
