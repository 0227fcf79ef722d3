"""Measure at the loss: the tensor, the labels and the positions a loss actually scored, taken inside its call.

A forward hook sees what a model returns; the loss may have scored something else: bf16 logits under autocast
where a recomputation from the hidden states is float32, a family's own transform, labels handed to the loss
that the forward's inputs do not hold. Where the loss is computed by code headwatch knows, headwatch takes what
that code used. In order of preference (``docs/sources.md``):

1. **Per-token values the loss returns itself.** TRL's fused LM head (``model(..., fused_lm_head=True)``) returns
   a ``FusedCausalLMOutput`` whose ``log_probs``, ``entropy`` and ``is_top1`` ARE the loss's values (computed under
   TRL's autocast, with TRL's transform table and temperature) and whose ``label_mask`` is the loss's positions:
   :func:`fused_head_values` reads them from the output (TRL binds its kernel privately at import, so no
   wrapper could see the call).
2. **The inputs of a loss call headwatch wraps**, read inside the call (:class:`LossCalls`):

   - a Hugging Face model's ``loss_function`` (a settable property of ``PreTrainedModel``): ``logits``, ``labels``
     or ``shift_labels``, ``ignore_index`` (:func:`logits_loss_call`);
   - Cut Cross-Entropy's ``linear_cross_entropy`` as its transformers patch calls it: ``e`` (the hidden states,
     after any scaling the patch applies), ``c`` (the head's weight), ``targets``, ``shift``, ``softcap``,
     ``ignore_index``, ``impl`` (:func:`cce_call`);
   - Liger Kernel's ``LigerForCausalLMLoss`` as its transformers patch calls it: ``hidden_states``,
     ``lm_head_weight``, ``labels`` or ``shift_labels``, ``final_logit_softcapping``, ``ignore_index``
     (:func:`liger_call`).

   Both fused losses bind the name in their own modules at import; :class:`LossCalls` replaces it in every loaded
   module of theirs that holds it (``cut_cross_entropy*``, ``liger_kernel.transformers*``), at attach and on each
   logging step (a patch imported later), and restores them when the last capture detaches.
3. **The forward hooks** (:class:`headwatch.model.capture.LogitsCapture`'s logits or hidden-state path), for
   direct calls headwatch cannot see, with the self-check.

Off logging steps a wrapper does one attribute check before calling the loss (no tensor kept, no host sync).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from headwatch.model.sources import FinalTransform

SOURCES = {
    "trl_fused_head": "the per-token values TRL's fused LM head returns (log_probs, entropy, is_top1, label_mask): "
    "the loss's own, at its precision, transform and temperature",
    "loss_function": "the logits and labels the model's `loss_function` received (the tensor the loss scored)",
    "cut_cross_entropy": "the hidden states, head weight and targets Cut Cross-Entropy's `linear_cross_entropy` "
    "received, projected at the loss's precision",
    "liger": "the hidden states, head weight and labels Liger Kernel's `LigerForCausalLMLoss` received, projected "
    "at the loss's precision",
    "forward": "the model's forward (its logits, or its final hidden states and the head's weight)",
}
"""Where a capture came from: key (``Captured.source``) -> what was measured, in words (said once per run)."""


@dataclass(frozen=True)
class LossValues:
    """Per-position values a loss computed itself, on the positions of the capture's ``targets`` ``(...)``."""

    nll: Tensor
    """``(...)`` ``-log p(target)`` in nats (0 where the loss does not count the position)."""
    valid: Tensor
    """``(...)`` bool: the positions the loss counts."""
    entropy: Tensor | None = None
    """``(...)`` the entropy of the distribution the loss scored, nats; None: not computed by the loss."""
    is_top1: Tensor | None = None
    """``(...)`` bool: the target is the most likely token (ties with an earlier token not counted); None: not computed."""


def shifted_targets(labels: Tensor, ignore_index: int) -> Tensor:
    """``(..., T)`` labels -> the targets aligned with the logits of each position: ``labels[..., t + 1]``, the last
    position ``ignore_index`` (what ``ForCausalLMLoss`` and both fused losses score)."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force for ``device`` now, or None when autocast is off there."""
    kind = device.type
    try:
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None


def fused_head_values(output: Any, kwargs: Mapping[str, Any]) -> tuple[LossValues, Tensor, bool] | None:
    """``(values, targets, shifted)`` of TRL's fused LM head output, or None when ``output`` is not one.

    ``output`` holds ``log_probs`` and ``label_mask`` ``(B, T - 1)`` (``(B, T)`` with ``shift_labels``); ``targets``
    are the labels the kernel scored (``labels[:, 1:]``, or ``shift_labels``), ``shifted``: True when they come
    from ``labels`` (the hidden states to match are then ``last_hidden_state[:, :-1]``).
    """
    log_probs, mask = getattr(output, "log_probs", None), getattr(output, "label_mask", None)
    if not isinstance(log_probs, Tensor) or not isinstance(mask, Tensor) or log_probs.shape != mask.shape:
        return None
    shift = kwargs.get("shift_labels")
    labels = kwargs.get("labels")
    if isinstance(shift, Tensor):
        targets, shifted = shift, False
    elif isinstance(labels, Tensor):
        targets, shifted = labels[..., 1:], True
    else:
        return None
    if targets.shape != log_probs.shape:
        return None
    entropy, top1 = getattr(output, "entropy", None), getattr(output, "is_top1", None)
    values = LossValues(
        nll=-log_probs.detach(),
        valid=mask.detach().bool(),
        entropy=entropy.detach() if isinstance(entropy, Tensor) and entropy.shape == mask.shape else None,
        is_top1=top1.detach().bool() if isinstance(top1, Tensor) and top1.shape == mask.shape else None,
    )
    return values, targets.detach().to(log_probs.device), shifted


@dataclass(frozen=True)
class LossCall:
    """What one loss call scored, read from its arguments."""

    source: str
    """A key of :data:`SOURCES`."""
    targets: Tensor
    """``(...)`` the targets aligned with ``logits`` or ``hidden`` (shifted as the loss shifts them)."""
    ignore_index: int
    logits: Tensor | None = None
    """``(..., V)`` the logits the loss received (``loss_function``)."""
    hidden: Tensor | None = None
    """``(..., d_model)`` the projection's input (a fused loss)."""
    weight: Tensor | None = None
    """``(V, d_model)`` the head weight the fused loss received."""
    bias: Tensor | None = None
    """``(V,)`` the head bias the fused loss received, if any."""
    transform: FinalTransform | None = None
    """What the fused loss applies to ``hidden @ weight.T`` (its softcapping), or None."""
    precision: tuple[torch.dtype, torch.dtype] | None = None
    """``(inputs, product)``: the dtypes the fused loss projects in (inputs rounded to, product rounded to)."""


def _softcap(cap: Any) -> FinalTransform | None:
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        return None
    c = float(cap)
    return FinalTransform(f"{c} * tanh(x / {c}) (the loss's softcap)", lambda x, c=c: torch.tanh(x / c) * c)


def logits_loss_call(kwargs: Mapping[str, Any], args: tuple = ()) -> LossCall | None:
    """A Hugging Face ``loss_function(logits=, labels=, vocab_size=, ignore_index=, shift_labels=, ...)`` call
    (``ForCausalLMLoss``'s signature), or None when its arguments are not a causal LM's (another loss: no capture)."""
    logits = kwargs.get("logits", args[0] if args else None)
    labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
    ignore_index = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or not isinstance(ignore_index, int):
        return None
    if isinstance(shift, Tensor):
        targets = shift
    elif isinstance(labels, Tensor) and not labels.is_floating_point():
        targets = shifted_targets(labels, ignore_index)
    else:
        return None
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        return None
    return LossCall("loss_function", targets.detach().to(logits.device), ignore_index, logits=logits.detach())


def _bound(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _precision(hidden: Tensor, product_in_inputs: bool) -> tuple[torch.dtype, torch.dtype]:
    inputs = autocast_dtype(hidden.device) or hidden.dtype
    return inputs, inputs if product_in_inputs else torch.float32


def cce_call(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> LossCall | None:
    """Cut Cross-Entropy's ``linear_cross_entropy(e, c, targets, ignore_index, softcap, reduction, shift, ...)``.

    ``impl="torch_compile"`` scores ``e @ c.T`` in ``e``'s dtype (autocast's when on); ``impl="cce"`` accumulates
    the same rounded inputs in float32 without rounding the product.
    """
    a = _bound(fn, args, kwargs)
    if a is None:
        return None
    e, c, targets, ignore_index = a.get("e"), a.get("c"), a.get("targets"), a.get("ignore_index", -100)
    if not (isinstance(e, Tensor) and isinstance(c, Tensor) and isinstance(targets, Tensor) and isinstance(ignore_index, int)):
        return None
    if c.ndim != 2 or tuple(targets.shape) != tuple(e.shape[:-1]):
        return None
    shift = a.get("shift", False)
    aligned = shifted_targets(targets, ignore_index) if shift else targets
    impl = a.get("impl")
    impl = getattr(impl, "name", impl)
    compiled = str(impl).lower() == "torch_compile"
    bias = a.get("bias")
    return LossCall(
        "cut_cross_entropy", aligned.detach(), ignore_index, hidden=e.detach(), weight=c.detach(),
        bias=bias.detach() if isinstance(bias, Tensor) else None, transform=_softcap(a.get("softcap")),
        precision=_precision(e, product_in_inputs=compiled),
    )  # fmt: skip


def liger_call(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> LossCall | None:
    """Liger Kernel's ``LigerForCausalLMLoss(hidden_states, lm_head_weight, labels, hidden_size, num_items_in_batch,
    ignore_index, shift_labels, final_logit_softcapping, ...)``: each chunk scored as ``hidden @ weight.T`` in the
    hidden states' dtype (autocast's when on), then in float32."""
    a = _bound(fn, args, kwargs)
    if a is None:
        return None
    h, w, ignore_index = a.get("hidden_states"), a.get("lm_head_weight"), a.get("ignore_index", -100)
    labels, shift = a.get("labels"), a.get("shift_labels")
    if not (isinstance(h, Tensor) and isinstance(w, Tensor) and w.ndim == 2 and isinstance(ignore_index, int)):
        return None
    if isinstance(shift, Tensor):
        targets = shift
    elif isinstance(labels, Tensor):
        targets = shifted_targets(labels, ignore_index)
    else:
        return None
    if tuple(targets.shape) != tuple(h.shape[:-1]):
        return None
    return LossCall(
        "liger", targets.detach().to(h.device), ignore_index, hidden=h.detach(), weight=w.detach(),
        transform=_softcap(a.get("final_logit_softcapping")), precision=_precision(h, product_in_inputs=True),
    )  # fmt: skip


FUSED_LOSSES: dict[str, tuple[tuple[str, ...], Callable[..., LossCall | None]]] = {
    "linear_cross_entropy": (("cut_cross_entropy",), cce_call),
    "LigerForCausalLMLoss": (("liger_kernel.transformers",), liger_call),
}
"""Name of the loss function -> (the module prefixes holding it, its reader)."""

class _Wrapped:
    """A fused loss function headwatch put in place of the original in one module (see :class:`LossCalls`)."""

    def __init__(self, original: Callable[..., Any], read: Callable[..., LossCall | None]) -> None:
        self.__wrapped__ = original
        self.read = read
        self.__doc__ = getattr(original, "__doc__", None)
        self.__name__ = getattr(original, "__name__", "loss")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if LossCalls.armed and not torch.compiler.is_compiling():  # off logging steps: one attribute check
            LossCalls.heard(self.read, self.__wrapped__, args, kwargs)
        return self.__wrapped__(*args, **kwargs)


class LossCalls:
    """The fused loss functions wrapped in their modules, shared by every capture (one process-wide registry).

    :meth:`listen` adds a capture's listener (called with each :class:`LossCall` while :attr:`armed`), wrapping
    the functions where needed; the returned callable removes it, and the last removal restores the originals.
    """

    armed = False
    """True while some listener is armed (a logging step): the wrappers read their call."""
    _listeners: ClassVar[list[Callable[[], Any]]] = []  # weak references to the listening captures
    _replaced: ClassVar[dict[tuple[str, str], _Wrapped]] = {}  # (module, name) -> the wrapper put there
    # every loaded module's name read once (thousands of prefix tests cost ~20 ms a logging step on a CPU);
    # those of the fused losses' packages are read again at every call, where a patch may have been applied since
    _scanned: ClassVar[set[str]] = set()
    _candidates: ClassVar[list[tuple[str, str, Callable[..., LossCall | None]]]] = []
    _modules_seen: ClassVar[int] = -1  # len(sys.modules) at the last scan: an import since makes it grow

    @classmethod
    def listen(cls, owner: Any) -> Callable[[], None]:
        """``owner.heard(call)`` receives each loss call while ``owner.listening`` is True; returns the removal."""
        ref = weakref.ref(owner)
        cls._listeners.append(ref)
        cls.wrap_loaded()

        def remove() -> None:
            cls._listeners[:] = [r for r in cls._listeners if r is not ref and r() is not None]
            if not cls._listeners:
                cls.restore()
            cls.rearm()

        return remove

    @classmethod
    def rearm(cls) -> None:
        """:attr:`armed` from the listeners' ``listening`` (called by a capture when it arms or ends a step)."""
        cls.armed = any(getattr(r(), "listening", False) for r in cls._listeners)

    @classmethod
    def heard(cls, read: Callable[..., LossCall | None], fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> None:
        call = None
        for ref in list(cls._listeners):
            owner = ref()
            if owner is None or not getattr(owner, "listening", False):
                continue
            if call is None:
                try:
                    call = read(fn, args, kwargs)
                except Exception:  # noqa: BLE001 - an odd call: the forward hooks measure it
                    return
                if call is None:
                    return
            owner.heard(call)

    @classmethod
    def wrap_loaded(cls) -> None:
        """Wrap the fused loss functions in every loaded module that holds one (a patch imported since included)."""
        if not cls._listeners:
            return
        if len(sys.modules) != cls._modules_seen:  # a module imported since (the scan of ~3000 names: 0.6 ms)
            new = [n for n in list(sys.modules) if n not in cls._scanned]
            cls._scanned.update(new)
            cls._modules_seen = len(sys.modules)
        else:
            new = []
        cls._candidates += [(n, name, read) for n in new for name, (prefixes, read) in FUSED_LOSSES.items() if n.startswith(prefixes)]
        for module_name, name, read in cls._candidates:
            module = sys.modules.get(module_name)
            current = getattr(module, name, None) if module is not None else None
            if current is None or isinstance(current, _Wrapped) or not callable(current):
                continue
            wrapper = _Wrapped(current, read)
            try:
                setattr(module, name, wrapper)
            except (AttributeError, TypeError):
                continue
            cls._replaced[(module_name, name)] = wrapper

    @classmethod
    def restore(cls) -> None:
        """Put the original functions back where they were wrapped (and still wrapped)."""
        for (module_name, name), wrapper in list(cls._replaced.items()):
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, name, None) is wrapper:
                setattr(module, name, wrapper.__wrapped__)
        cls._replaced.clear()


class _WatchedLoss:
    """The instance's ``loss_function`` headwatch put in place (:func:`watch_loss_function`): reads each call made while
    its capture listens, then calls the loss it replaced. A copy of the model (``copy.deepcopy``: a reference model)
    or a pickle gets the loss it replaced, never a capture's reader."""

    __headwatch_loss__ = True

    def __init__(self, original: Callable[..., Any], heard: Callable[[LossCall], None], listening: Callable[[], bool]) -> None:
        self.__wrapped__ = original
        self.heard, self.listening = heard, listening
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and self.listening():  # off logging steps: one check
            try:
                call = logits_loss_call(kwargs, args)
            except Exception:  # noqa: BLE001 - an odd call: the forward hooks measure it
                call = None
            if call is not None:
                self.heard(call)
        return self.__wrapped__(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _identity, (self.__wrapped__,)


def _identity(x: Any) -> Any:
    return x


def watch_loss_function(owner: nn.Module, heard: Callable[[LossCall], None], listening: Callable[[], bool]) -> Callable[[], None] | None:
    """Wrap ``owner.loss_function`` (a Hugging Face ``PreTrainedModel``'s settable property) so that each call made
    while ``listening()`` is read (:func:`logits_loss_call`) and handed to ``heard`` before the loss runs.

    Returns the undo (the instance's own ``loss_function`` put back, or none), or None when ``owner`` has no
    settable ``loss_function``.
    """
    prop = getattr(type(owner), "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None or prop.fget is None:
        return None
    own = owner.__dict__.get("_loss_function")
    try:
        original = own if own is not None else prop.fget(owner)
    except Exception:  # noqa: BLE001 - a model whose loss cannot be resolved: the forward hooks measure it
        return None
    wrapper = _WatchedLoss(original, heard, listening)
    prop.fset(owner, wrapper)

    def undo() -> None:
        if owner.__dict__.get("_loss_function") is wrapper:
            if own is None:
                del owner.__dict__["_loss_function"]
            else:
                prop.fset(owner, own)

    return undo
