"""Captures of the two gradient flows of the matrices that really train.

- :class:`LookupFlowCapture`: the lookup flow of an :class:`~headwatch.model.weights.EmbeddingGroup`,
  ``E_i = sum over every lookup n of the group's weight with x_n = i of g_n`` (``g_n`` the gradient
  at the looking-up module's output): hooks EVERY member (a tied T5 reads its matrix in the encoder
  and in the decoder). For a tied matrix the scoring flow is ``grad - E``.
- :class:`HeadFlowCapture`: the gradient of the effective head ``dL/dW_eff = g.T @ h`` from the
  head's input ``h`` and the gradient at its output (LoRA heads, whose ``.weight.grad`` is None).

Both are inactive (no work, no sync) until ``active`` is set, on the steps that measure; the
accumulators are float32 ``(V, d_model)``, added into across micro-batches. Gradients are as the
backward sees them: divide by a ``GradScaler``'s scale before use.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from headwatch.errors import HeadwatchError
from headwatch.functional.adapters import head_weight_gradient
from headwatch.functional.rows import lookup_gradient
from headwatch.model.adapters import lora_dropout
from headwatch.model.hooks import CopySafeHook
from headwatch.model.weights import EmbeddingGroup


def _padding_idx(module: nn.Module) -> int | None:
    inner = module
    for attr in ("original_module", "base_layer"):
        inner = getattr(inner, attr, inner)
    pad = getattr(inner, "padding_idx", None)
    return int(pad) if isinstance(pad, int) else None


class _NotAMultiple(Exception):
    """The embedding's output is not ``c * weight[ids]``: its lookup flow cannot be read from the output's gradient."""


class _Capture:
    def __init__(self) -> None:
        self.active = False
        self.gradient: Tensor | None = None
        self.error: Exception | None = None
        """The first failure inside a hook (hooks never raise into the training step)."""
        self.compiled = False
        """The hooked module ran inside ``torch.compile``, where output gradients cannot be hooked."""
        self._handles: list[Any] = []
        self.timer: Any = None
        """Returns the owner's overhead clock (``kind(None)``: its backward work timed), or None: not timed."""

    def _timed(self) -> Any:
        return self.timer().kind(None) if self.timer is not None else contextlib.nullcontext()

    def reset(self) -> None:
        """Forget this step's accumulator (call after reading it)."""
        self.gradient = None

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _accumulator(self, like: Tensor, shape: tuple[int, int]) -> Tensor:
        if self.gradient is None:
            self.gradient = torch.zeros(shape, dtype=torch.float32, device=like.device)
        return self.gradient


class LookupFlowCapture(_Capture):
    """``(V, d_model)`` lookup-flow gradient of one embedding weight, over all its lookup modules.

    Args:
        group: from :func:`headwatch.model.weights.find_embedding_group`.

    Attributes:
        gradient: float32 ``(V, d_model)`` ``E`` of the steps captured since :meth:`reset`, or None.
        looked_up: bool ``(V,)`` rows read by any member since :meth:`reset`, or None.
    """

    def __init__(self, group: EmbeddingGroup) -> None:
        super().__init__()
        if not isinstance(group, EmbeddingGroup):
            raise HeadwatchError(f"`group` must be an EmbeddingGroup (find_embedding_group), got {type(group).__name__}")
        self.group = group
        self.looked_up: Tensor | None = None
        self.shape: tuple[int, ...] = tuple(group.weight.shape)
        self.sharded: Any = None
        """A :class:`headwatch.distributed.sharded.ShardedLookup` set by the monitor on steps whose matrix is
        row-sharded (FSDP2): the flow is then kept compact there instead of in ``gradient``."""
        self.probe: Tensor | None = None
        """Under ``torch.compile``: a zero ``(V, d_model)`` leaf added as ``F.embedding(ids, probe)`` to every
        lookup's output (see :meth:`arm_probe`); its ``.grad`` is the lookup flow divided by the output scale."""
        self.probe_scale: Tensor | None = None
        self.refused: str | None = None
        """Why the lookup flow of this step cannot be measured (set instead of a wrong number), or None."""

    def attach(self) -> LookupFlowCapture:
        """Register a forward hook on each distinct member; returns self."""
        self.detach()
        self.shape = tuple(self.group.weight.shape)  # (V, d_model), read now: FSDP1 flattens it outside forward
        seen: set[int] = set()
        for _, module in self.group.modules:
            if id(module) not in seen:
                seen.add(id(module))
                # first of the module's forward hooks: the output is the module's own, before any other hook
                # changes it (NEFTune's noise, a user's scaling), and before DeepSpeed ZeRO-3 releases the weight
                self._handles.append(module.register_forward_hook(CopySafeHook(self._on_forward), with_kwargs=True, prepend=True))
        return self

    def reset(self) -> None:
        super().reset()
        self.looked_up, self.sharded, self.refused = None, None, None
        self.probe, self.probe_scale = None, None

    def arm_probe(self) -> None:
        """Prepare this step's probe (call before the forward, outside compiled code, once ``compiled`` is known).

        ``torch.compile`` does not let a hook reach the gradient at the embedding's output, but it
        differentiates an input of the graph: the hook adds ``F.embedding(ids, probe)`` (zeros) to the
        output, so after the backward ``probe.grad[i] = sum over lookups n with x_n = i of g_n`` exactly,
        ``g_n`` the gradient at the output, and the lookup flow is ``c * probe.grad`` for a module that
        returns ``c * weight[ids]`` (``c`` read from the module's own forward, hooks bypassed).
        Memory: one ``(V, d_model)`` tensor of the weight's dtype, on measuring steps only.
        """
        if self.probe is not None:
            return
        module = self.group.module
        weight = self.group.weight
        # an adapter's output is not a multiple of the base weight; its gradient is the effective matrix's (c = 1)
        scale = torch.ones((), device=weight.device) if hasattr(module, "base_layer") else self._module_scale(module, weight)
        if scale is None:
            return
        self.probe_scale = scale
        self.probe = torch.zeros(self.shape, dtype=weight.dtype, device=weight.device, requires_grad=True)

    def _module_scale(self, module: nn.Module, weight: Tensor) -> Tensor | None:
        """``c`` of a module returning ``c * weight[ids]``, from its own forward on a few ids (no hooks run)."""
        try:
            with torch.no_grad():
                ids = torch.arange(min(self.shape[0], 16), device=weight.device)
                y = module.forward(ids).double()  # forward, not __call__: other hooks do not change it
                rows = weight.detach()[ids].double()
                c = (y * rows).sum() / (rows * rows).sum().clamp_min(1e-300)
                residual = float((y - c * rows).abs().max() / y.abs().max().clamp_min(1e-300))
        except Exception as err:  # noqa: BLE001
            self.refused = f"its forward could not be run on a few token ids to read its output scale ({type(err).__name__}: {err})"
            return None
        if residual > (1e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-5):
            self.refused = (
                f"its forward does not return a fixed multiple of the looked-up rows (relative residual {residual:.2e})"
            )
            return None
        return c.float()

    def flow(self) -> Tensor | None:
        """The captured ``(V, d_model)`` float32 lookup flow: the hooks' accumulator, or the probe's gradient."""
        if self.gradient is None and self.probe is not None and self.probe.grad is not None:
            self.gradient = self.probe.grad.float() * self.probe_scale
        return self.gradient

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if self.active:
            if torch.compiler.is_compiling():  # a disabled function would break fullgraph=True
                self.compiled = True
                if self.probe is not None:  # traced: an ordinary lookup and an add, no graph break
                    ids = args[0] if args else kwargs.get("input")
                    if isinstance(ids, Tensor) and isinstance(output, Tensor):
                        return output + nn.functional.embedding(ids, self.probe, padding_idx=_padding_idx(module)).to(output.dtype)
                return None
            self._watch(module, args, kwargs, output)
        return None

    @torch.compiler.disable
    def _watch(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        try:
            ids = args[0] if args else kwargs.get("input")
            if not isinstance(ids, Tensor) or not isinstance(output, Tensor):
                return
            ids = ids.detach()
            V = self.shape[0]
            if self.looked_up is None:
                self.looked_up = torch.zeros(V, dtype=torch.bool, device=ids.device)
            self.looked_up[ids.reshape(-1).long()] = True
            if output.requires_grad:
                pad = _padding_idx(module)
                scale = self._output_scale(module, ids, output)
                output.register_hook(lambda grad: self._add(ids, grad if scale is None else grad * scale, pad))
        except _NotAMultiple as err:  # the flow would be wrong: refused for the step, with the cause
            self.refused = self.refused or str(err)
        except Exception as err:  # noqa: BLE001 - monitoring never breaks the forward
            self.error = self.error or err

    def _output_scale(self, module: nn.Module, ids: Tensor, output: Tensor) -> Tensor | None:
        """``c`` when the module returns ``c * W[ids]`` with ``c != 1`` (Gemma's ``sqrt(d_model)``), else None.

        ``dL/dW[i] = c * sum dL/dy`` for such a module, so the scattered output gradient is
        scaled by ``c``. ``c`` is the least-squares ratio of the output to the looked-up rows,
        checked (one sync, on measuring steps only) to reproduce the output to float32 rounding;
        an output that is not a fixed multiple of the rows is warned about in ``self.error``.
        Modules under an adapter (their output is not a multiple of ``weight``) keep ``c = 1``.
        """
        weight = getattr(module, "weight", None)
        # FSDP1 swaps in a full view of the weight during forward: same shape, another tensor
        same = weight is self.group.weight or (isinstance(weight, Tensor) and tuple(weight.shape) == self.shape)
        if not same or not output.is_floating_point() or hasattr(module, "base_layer"):
            return None
        with torch.no_grad():
            rows = weight.detach()[ids.long()].double()
            y = output.detach().double()
            c = (y * rows).sum() / (rows * rows).sum().clamp_min(1e-300)
            residual = float((y - c * rows).abs().max() / y.abs().max().clamp_min(1e-300))
        tolerance = 1e-2 if output.dtype in (torch.bfloat16, torch.float16) else 1e-5
        if residual > tolerance:
            raise _NotAMultiple(f"its output is not a fixed multiple of the looked-up rows (relative residual {residual:.2e})")
        return None if abs(float(c) - 1.0) <= tolerance else c.to(output.dtype if output.dtype == torch.float64 else torch.float32)

    def _add(self, ids: Tensor, grad: Tensor, pad: int | None) -> None:
        try:
            with self._timed():
                if self.sharded is not None:
                    self.sharded.add(ids.to(grad.device), grad, pad)
                    return
                out = self._accumulator(grad, self.shape)
                lookup_gradient(ids.to(grad.device), grad, out.shape[0], pad, out=out)
        except Exception as err:  # noqa: BLE001
            self.error = self.error or err


class HeadFlowCapture(_Capture):
    """``(V, d_model)`` gradient of the effective head, ``sum_n g_n h_n^T``, from hooks on the head.

    Args:
        head: the module computing ``logits = h @ W_eff.T`` (for LoRA, the PEFT layer itself, so
            its output includes the adapter's part).

    Attributes:
        gradient: float32 ``(V, d_model)`` of the steps captured since :meth:`reset`, or None.
    """

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        if not isinstance(head, nn.Module):
            raise HeadwatchError(f"`head` must be an nn.Module, got {type(head).__name__}")
        self.head = head
        self.dropout = 0.0  # a LoRA dropout probability seen in training: the gradient is not captured

    def attach(self) -> HeadFlowCapture:
        """Register the forward hook; returns self."""
        self.detach()
        self._handles.append(self.head.register_forward_hook(CopySafeHook(self._on_forward), with_kwargs=True))
        return self

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.active:
            if torch.compiler.is_compiling():  # a disabled function would break fullgraph=True
                self.compiled = True
                return
            if (p := lora_dropout(module)) > 0.0:  # the adapter saw dropout(h), the base h: no one gradient
                self.dropout = p
                return
            self._watch(args, kwargs, output)

    @torch.compiler.disable
    def _watch(self, args: Any, kwargs: Any, output: Any) -> None:
        try:
            hidden = args[0] if args else kwargs.get("input")
            if isinstance(hidden, Tensor) and isinstance(output, Tensor) and output.requires_grad:
                hidden = hidden.detach()
                output.register_hook(lambda grad: self._add(hidden, grad))
        except Exception as err:  # noqa: BLE001
            self.error = self.error or err

    def _add(self, hidden: Tensor, grad: Tensor) -> None:
        try:
            with self._timed():
                out = self._accumulator(grad, (grad.shape[-1], hidden.shape[-1]))
                head_weight_gradient(hidden, grad, out=out)
        except Exception as err:  # noqa: BLE001
            self.error = self.error or err


def compiles_a_member(compiled: list[str], members: list[str]) -> bool:
    """Whether some module compiled with ``torch.compile`` (``compiled``: dotted names, ``<root>`` for the model)
    is or contains one of the lookup modules ``members`` (dotted names): their flow then needs the compiled path's
    probe (:meth:`LookupFlowCapture.arm_probe`)."""
    return any(c == "<root>" or m == c or m.startswith(c + ".") for c in compiled for m in members)
