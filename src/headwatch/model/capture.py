"""Capture the measured tensor on logging steps, and say what is wrong when it cannot.

:class:`LogitsCapture` hands one :class:`Captured` per forward of an armed step (:meth:`LogitsCapture.begin`)
to a ``consume`` callback, from inside the forward (no ``(B, T, V)`` tensor outlives it): taken at the loss
where the loss is code headwatch knows (:mod:`headwatch.model.at_loss`), else by forward hooks from a
:class:`~headwatch.model.sources.LogitsSource`: the owner's logits when they cover every position of the batch
(the logits path), else the final hidden states ``(B, T, d_model)`` and the head's weight with the family's
final transform (the hidden-state path: a fused loss never calls the head; ``logits_to_keep``; or forced).

:meth:`LogitsCapture.end` closes the step and returns a :class:`CaptureReport`: where and by which path it
measured, or the cause of measuring nothing (hooks skipped by code compiled before they were registered, a
head that never runs, logits of too few positions, a post-head transform the hidden path cannot reproduce)
with its fix. Between logging steps each hook does one attribute check: no host-device sync, no tensor kept.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from headwatch.distributed.sharded import fully_sharded, is_sharded
from headwatch.model import generation
from headwatch.model.at_loss import LossCall, LossCalls, LossValues, autocast_dtype, fused_head_values, watch_loss_function
from headwatch.model.find import logits_from_output
from headwatch.model.hooks import CopySafeHook
from headwatch.errors import HeadwatchError
from headwatch.model.sources import FinalTransform, LogitsSource, compiled_modules

Path = Literal["auto", "logits", "hidden"]
PATHS = ("auto", "logits", "hidden")
_CHECK_ROWS = 8  # rows of the head's raw output kept to check the final transform
_MAX_FRAMES = 200  # frames looked at for a generate() call above a forward


def called_from(name: str, owner: type | tuple[type, ...]) -> bool:
    """True when a frame of the caller's stack runs a function named ``name`` whose ``self`` is an ``owner``.

    At most 200 frames are looked at. Costs one walk of the stack; not traceable by ``torch.compile``
    (call it from eager code only).
    """
    frame = sys._getframe(1)
    try:
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return False
            if frame.f_code.co_name == name and isinstance(frame.f_locals.get("self"), owner):
                return True
            frame = frame.f_back
        return False
    finally:
        del frame


def in_generation() -> bool:
    """True when the caller runs inside a ``generate()`` method of an ``nn.Module``.

    Hugging Face ``GenerationMixin.generate`` (every decoding strategy runs below it), a PEFT
    model's ``generate``, nanoGPT's ``generate``: called from a forward hook, this says whether the
    forward is a prompt pass or a decoding step. A ``generate`` headwatch wrapped
    (:func:`headwatch.model.generation.watch_generate`) is told by one flag; any other by a walk of the
    call stack (:func:`called_from`, eager code only).
    """
    return generation.active or called_from("generate", nn.Module)


@dataclass(frozen=True)
class Captured:
    """What one forward gave to measure: the logits, or the hidden states and the head."""

    path: Literal["logits", "hidden"]
    logits: Tensor | None = None
    """``(..., V)`` detached logits (logits path)."""
    hidden: Tensor | None = None
    """``(..., d_model)`` detached final hidden states, the head's input (hidden path)."""
    weight: Tensor | None = None
    """``(V, d_model)`` head weight (hidden path)."""
    bias: Tensor | None = None
    transform: FinalTransform | None = None
    """Applied to ``hidden @ weight.T + bias`` to give the logits the loss uses."""
    kept: int | None = None
    """The tensor covers only the last ``kept`` positions of each row (an int ``logits_to_keep``): the batch's
    ``(B, T)`` mask and targets are to be sliced ``[:, -kept:]``; None: every position."""
    source: str = "forward"
    """Where it was taken (a key of :data:`headwatch.model.at_loss.SOURCES`): at the loss, or the forward hooks."""
    targets: Tensor | None = None
    """``(...)`` the targets the loss scored, aligned with the tensor (taken at the loss): they replace the batch's
    labels and mask, the positions being ``targets != ignore_index``; None: the batch's."""
    ignore_index: int = -100
    """The loss's ``ignore_index`` (with ``targets``)."""
    given: LossValues | None = None
    """Per-position values the loss computed itself (TRL's fused LM head), used as they are."""
    precision: tuple[torch.dtype, torch.dtype] | None = None
    """Hidden path: ``(inputs, product)`` dtypes of the loss's projection, reproduced (None: float32 throughout)."""


@dataclass(frozen=True)
class CaptureReport:
    """The outcome of one armed step, from :meth:`LogitsCapture.end`."""

    measured: int
    """Forwards handed to ``consume`` during the step."""
    path: Literal["logits", "hidden"] | None
    problem: str | None = None
    """A stable key for warn-once: ``not_fired``, ``compiled``, ``head_not_called``,
    ``few_positions``, ``no_logits``, ``transform_mismatch``, ``hidden_mismatch``, ``sharded_weight``, ``failed``;
    None when all went well."""
    message: str | None = None
    """One sentence: the cause and the fix (set with ``problem``)."""
    note: str | None = None
    """Which path was measured and why, when it is not the plain logits path (info once per ``reason``)."""
    reason: str | None = None
    """A stable key for ``note``: ``forced``, ``head_not_called``, ``few_positions`` or ``kept_positions``."""
    skipped: int = 0
    """Forwards seen during the step that ``accept`` refused (not the loss's forward): not measured, not a problem."""
    sources: tuple[str, ...] = ()
    """Where the measured forwards were taken (keys of :data:`headwatch.model.at_loss.SOURCES`), in order, once each."""


class LogitsCapture:
    """Forward hooks that hand the measured tensor to ``consume`` on armed steps.

    Args:
        source: from :func:`headwatch.model.sources.resolve_logits_source`.
        consume: called with a :class:`Captured` inside the forward, at most once per forward
            of the owner module (the monitor computes its statistics there and drops the tensor).
        path: ``"auto"`` (logits when they cover every position, else hidden states),
            ``"logits"`` or ``"hidden"`` (forced).
        model: the whole model, to name compiled modules in a diagnosis (optional).
        strict: let an exception raised while measuring (in ``consume``) propagate as a
            :class:`HeadwatchError` instead of ending the step with problem ``"failed"``.
        accept: ``accept(grad_enabled, generating) -> bool``, asked once per forward of the owner (eagerly:
            from the owner's forward hook, or at :meth:`end` for compiled code) with the grad mode the forward
            ran under and whether it ran inside a ``generate()`` call: True (a ``generate`` :meth:`attach`
            wrapped was running, recorded inside the forward, compiled or not), None (asked from inside the
            eager forward: the call stack can still tell, :func:`in_generation`) or False (replayed after a
            compiled forward, with no wrapped ``generate`` running). A forward it refuses is not measured
            (:attr:`CaptureReport.skipped`). None: every forward is measured. The policy is the core's
            (:mod:`headwatch.core.forwards`).

    Raises:
        HeadwatchError: ``path`` is not one of the three values, or ``consume`` is not callable.
    """

    def __init__(
        self,
        source: LogitsSource,
        consume: Callable[[Captured], None],
        path: Path = "auto",
        model: nn.Module | None = None,
        strict: bool = False,
        accept: Callable[[bool], bool] | None = None,
    ) -> None:
        if path not in PATHS:
            raise HeadwatchError(f"`path` must be one of {PATHS}, got {path!r}")
        if not callable(consume):
            raise HeadwatchError(f"`consume` must be a callable taking a Captured, got {consume!r}")
        self.source, self.consume, self.path, self.model, self.strict = source, consume, path, model, strict
        self.accept = accept
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []  # the loss wrappers' removals
        self.fused_head_in_float32 = False
        """TRL's fused head projects in float32 outside autocast (``cast_lm_head_to_fp32``; the HF door sets it)."""
        self._unwatch: Callable[[], None] | None = None
        self._armed = False
        self._copy_weight = False
        self._reference: tuple[int, ...] | None = None
        self._reset_step()

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        """Register the hooks (call before the model's first forward: compiled code skips later hooks) and wrap
        the ``generate`` methods of the model (:func:`headwatch.model.generation.watch_generate`)."""
        self.detach()
        s = self.source
        self._unwatch = generation.watch_generate(self.model if self.model is not None else s.owner)
        # first under FSDP2: its own forward hook frees the whole head weight that the hidden-state path projects with
        first = fully_sharded(self.model if self.model is not None else s.owner)
        self._handles.append(s.owner.register_forward_hook(CopySafeHook(self._on_owner), with_kwargs=True, prepend=first))
        if s.kind == "model_logits":  # measured at the loss where the loss is code headwatch knows (docs/sources.md)
            undo = watch_loss_function(s.owner, self.heard, lambda: self.listening)
            self._undo.extend([*([undo] if undo is not None else []), LossCalls.listen(self)])
        self._handles.append(s.head.register_forward_pre_hook(CopySafeHook(self._on_head_input)))
        if s.owner is not s.head:
            self._handles.append(s.head.register_forward_hook(CopySafeHook(self._on_head_output)))
        if s.base is not None:
            self._handles.append(s.base.register_forward_hook(CopySafeHook(self._on_base)))
        if s.embedding is not None and s.embedding is not s.head:
            self._handles.append(s.embedding.register_forward_hook(CopySafeHook(self._on_embedding)))
        if s.hidden_module is not None:
            self._handles.append(s.hidden_module.register_forward_pre_hook(CopySafeHook(self._on_hidden_module), with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def begin(self, positions_shape: tuple[int, ...] | torch.Size | None = None) -> None:
        """Arm for one step. ``positions_shape``: the batch's ``(B, T)`` of targets or mask, if known."""
        self._reset_step()
        self._reference = tuple(positions_shape) if positions_shape is not None else None
        # FSDP2 frees the whole head weight after the forward: hidden_module= (measured at the step's end) keeps a copy
        self._copy_weight = self.model is not None and fully_sharded(self.model)
        self._armed = True
        LossCalls.wrap_loaded()  # a fused loss's patch imported since attach
        LossCalls.rearm()

    def end(self) -> CaptureReport:
        """Measure what compiled code stashed, fall back to the hidden states if the owner never ran, report."""
        try:
            if self._armed:
                self._replay()
            if self._armed and self._measured == 0 and self._problem is None and self._skipped == 0:
                if self._fired and self._hidden:  # the owner never ran but the hidden states were seen
                    if self._accepted(self._hidden_grad, self._hidden_gen):
                        self._guarded(self._measure_hidden, None)
                elif not self._fired:
                    self._diagnose_silence()
                else:
                    self._set_problem("head_not_called", self._head_message(None))
            return CaptureReport(
                self._measured, self._path, self._problem, self._message, self._note, self._reason, self._skipped,
                tuple(self._sources),
            )
        finally:
            self._armed = False
            LossCalls.rearm()
            self._reset_step()

    def _reset_step(self) -> None:
        self._events: list[tuple[str, Any]] = []  # (hook, tensor or None) in call order, replayed eagerly
        self._measured = 0
        self._skipped = 0
        self._path: Literal["logits", "hidden"] | None = None
        self._problem: str | None = None
        self._message: str | None = None
        self._note: str | None = None
        self._reason: str | None = None
        self._fired: set[str] = set()
        self._sources: list[str] = []
        self._clear_forward()

    def _clear_forward(self) -> None:
        self._hidden: list[tuple[str, Tensor]] = []
        self._raw_rows: Tensor | None = None
        self._raw_lead: tuple[int, ...] | None = None
        self._head_input: Tensor | None = None
        self._head_calls = 0
        self._weight_seen: Tensor | None = None
        self._hidden_grad = True  # the grad mode of the last hidden states seen (the owner-less fallback)
        self._hidden_gen = False  # whether they were seen inside a wrapped generate()
        self._autocast: torch.dtype | None = None  # autocast's dtype while the base model ran
        self._at_loss = False  # a loss call of this forward was taken (measured or refused): the hooks do not measure it

    # Each hook only appends (kind, tensor) when armed: traced by torch.compile (hooks registered
    # before compiling) that is a list mutation, no graph break, so fullgraph=True works; the
    # events are replayed eagerly by the owner's hook, or by end() when the forward was compiled.
    # Those that decide whether the forward is measured record the grad mode and generation.active
    # with it (read inside the forward: a compiled one keeps them as constants under a guard).
    def _on_embedding(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._armed:
            self._events.append(("embedding", None))

    def _on_head_input(self, module: nn.Module, args: Any) -> None:
        if self._armed and args and isinstance(args[0], Tensor):
            self._events.append(("head_in", args[0]))

    def _on_head_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._armed:
            raw = logits_from_output(output)
            # detached at replay: a detached view inside a compiled graph trips functionalization
            rows = raw.reshape(-1, raw.shape[-1])[:_CHECK_ROWS].clone() if raw is not None else None
            self._events.append(("head_out", (rows, tuple(raw.shape[:-1]) if raw is not None else None)))

    def _head_weight_now(self, copy: bool) -> None:
        """The head's weight as the forward sees it; ``copy``: a ``(V, d_model)`` copy under FSDP2 (see :meth:`begin`)."""
        weight = getattr(self.source.head, "weight", None)
        if isinstance(weight, Tensor) and not torch.compiler.is_compiling():
            self._events.append(("head_weight", weight.detach().clone() if copy and self._copy_weight else weight))

    def _on_base(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._armed:
            self._head_weight_now(copy=False)  # the head usually runs after: no copy (checked when used)
            h = getattr(output, "last_hidden_state", None)
            if h is None and isinstance(output, (tuple, list)) and output:
                h = output[0]
            device = h.device if isinstance(h, Tensor) else torch.device("cpu")
            self._events.append(("base", (h, torch.is_grad_enabled(), generation.active, autocast_dtype(device))))

    def _on_hidden_module(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self._armed:
            self._head_weight_now(copy=True)
            h = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
            self._events.append(("hidden_module", (h, torch.is_grad_enabled(), generation.active, None)))

    def _on_owner(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self._armed:  # the only work on steps that do not log: one attribute check
            fused = fused_head_values(output, kwargs)  # TRL's fused LM head: the loss's own per-token values
            self._events.append(("owner", (logits_from_output(output), torch.is_grad_enabled(), generation.active, fused)))
            if not torch.compiler.is_compiling():
                self._replay(live=True)

    # ------------------------------------------------------------------ at the loss
    @property
    def listening(self) -> bool:
        """Whether a loss call is read now (an armed step, in eager code)."""
        return self._armed

    def heard(self, call: LossCall) -> None:
        """A loss call inside a forward of an armed step (:mod:`headwatch.model.at_loss`): measured from what it
        received when the forward is one the contract measures; the hooks then leave that forward alone."""
        path = "logits" if call.logits is not None else "hidden"
        if (call.weight is not None and not self._same_head(call.weight)) or self._at_loss or self.path not in ("auto", path):
            return  # another model's loss, a second loss call in one forward (the first was measured), a forced path
        self._at_loss = True
        if self._accepted(torch.is_grad_enabled(), None):
            self._guarded(self._emit, Captured(
                path, logits=call.logits, hidden=call.hidden, weight=call.weight, bias=call.bias, transform=call.transform,
                source=call.source, targets=call.targets, ignore_index=call.ignore_index, precision=call.precision,
            ))  # fmt: skip

    def _same_head(self, weight: Tensor) -> bool:
        mine = getattr(self.source.head, "weight", None)
        return isinstance(mine, Tensor) and weight.shape == mine.shape and weight.data_ptr() == mine.data_ptr()

    @torch.compiler.disable
    def _replay(self, live: bool = False) -> None:
        """Measure the stashed events; ``live``: called from the owner's eager forward hook (the call stack is the
        forward's)."""
        events, self._events = self._events, []
        s = self.source
        for kind, value in events:
            self._fired.add(kind)
            if kind == "head_weight":
                self._weight_seen = value
            elif kind == "head_in":
                self._head_input = value
                self._hidden.append((f"the input of `{s.head_name}`", value))
            elif kind == "head_out":
                self._head_calls += 1
                rows, self._raw_lead = value
                self._raw_rows = rows.detach() if isinstance(rows, Tensor) else None
            elif kind in ("base", "hidden_module"):
                value, self._hidden_grad, self._hidden_gen, cast = value
                self._autocast = cast if kind == "base" else self._autocast
                if not (isinstance(value, Tensor) and value.is_floating_point()):
                    continue
                if kind == "base":
                    self._hidden.append((f"the `last_hidden_state` of `{s.base_name}`", value))
                else:
                    self._hidden.insert(0, (f"the first input of `{s.hidden_name}`", value))  # named by the user: first
            elif kind == "owner":
                logits, grad, gen, fused = value
                if s.owner is s.head:
                    self._head_calls += 1
                try:
                    if self._at_loss:  # measured (or refused) inside its loss call
                        continue
                    if self._accepted(grad, True if gen else None if live else False):
                        self._guarded(self._decide if fused is None else self._measure_fused, fused if fused is not None else logits)
                finally:
                    self._clear_forward()

    def _accepted(self, grad: bool, generating: bool | None) -> bool:
        """``accept(grad, generating)`` (True without one); a refused forward is counted in ``skipped``."""
        if self.accept is None:
            return True
        try:
            ok = bool(self.accept(grad, generating))
        except Exception as err:  # noqa: BLE001 - a monitoring failure must not stop training
            if self.strict:
                raise HeadwatchError(f"deciding whether to measure a forward failed: {type(err).__name__}: {err}") from err
            self._set_problem("failed", f"deciding whether to measure a forward failed ({type(err).__name__}: {err}).")
            return False
        if not ok:
            self._skipped += 1
        return ok

    def _guarded(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception as err:  # noqa: BLE001 - a monitoring failure must not stop training
            if self.strict:
                raise HeadwatchError(f"measuring the logits failed: {type(err).__name__}: {err}") from err
            self._set_problem("failed", f"measuring the logits failed ({type(err).__name__}: {err}); training goes on.")

    def _decide(self, logits: Tensor | None) -> None:
        lead = tuple(logits.shape[:-1]) if logits is not None else None
        full = logits is not None and (self._reference is None or lead == self._reference)
        kept = None if full else self._kept_positions(logits)
        if self.path == "logits" or (self.path == "auto" and (full or kept is not None)):
            if logits is None:
                self._set_problem("no_logits", self._head_message(None))
                return
            if kept is not None:
                self._reason = "kept_positions"
                self._note = (
                    f"`{self.source.owner_name or '<root>'}` returned the logits of the last {kept} positions of each row "
                    "(logits_to_keep): headwatch measures those positions only, the ones a loss on these logits uses."
                )
            self._emit(Captured("logits", logits=logits.detach(), kept=kept))
        else:
            self._measure_hidden(logits, kept)

    def _kept_positions(self, logits: Tensor | None) -> int | None:
        """``k`` when ``logits`` ``(B, k, V)`` are those of the last ``k`` positions of the batch's ``(B, T)``
        (an int ``logits_to_keep``), checked on the first rows: the head's input is the last ``k`` rows of the
        full final hidden states. None otherwise (every position, positions that cannot be told, or ``hidden_module=``
        named: the user asked for the hidden states of every position, e.g. a fused loss beside last-position logits)."""
        ref, h_in = self._reference, self._head_input
        if self.source.hidden_module is not None or logits is None or ref is None or len(ref) != 2 or logits.ndim != 3 or not isinstance(h_in, Tensor):
            return None
        k = logits.shape[1]
        if logits.shape[0] != ref[0] or not 0 < k < ref[1] or tuple(h_in.shape[:2]) != (ref[0], k):
            return None
        picked = self._pick_hidden()
        if picked is None or picked[1].ndim != 3:
            return None
        a = h_in.detach().reshape(-1, h_in.shape[-1])[:_CHECK_ROWS].float()
        b = picked[1].detach()[:, -k:].reshape(-1, picked[1].shape[-1])[:_CHECK_ROWS].float()
        return k if a.shape == b.shape and torch.allclose(a, b, rtol=1e-3, atol=1e-4) else None

    # ------------------------------------------------------------------ decisions
    def _emit(self, captured: Captured) -> None:
        self.consume(captured)
        self._measured += 1
        self._path = captured.path
        if captured.source not in self._sources:
            self._sources.append(captured.source)

    def _measure_fused(self, fused: tuple[LossValues, Tensor, bool]) -> None:
        """TRL's fused LM head: its per-token values as they are, and the hidden states (those positions) with the
        head's weight, to reproduce at the loss's precision what the values lack (:mod:`headwatch.model.captured`)."""
        values, targets, shifted = fused
        cut = [h[:, :-1] if shifted and h.ndim == 3 else h for _, h in self._hidden]
        hidden = next((h.detach() for h in cut if tuple(h.shape[:-1]) == tuple(values.nll.shape)), None)
        seen, bias = self._weight_seen, getattr(self.source.head, "bias", None)
        weight = seen if isinstance(seen, Tensor) and seen.ndim == 2 else getattr(self.source.head, "weight", None)
        ok = hidden is not None and isinstance(weight, Tensor) and weight.ndim == 2 and not is_sharded(weight)
        cast = torch.float32 if self.fused_head_in_float32 else self._autocast or (hidden.dtype if ok else None)  # type: ignore[union-attr]
        self._emit(Captured(
            "hidden", hidden=hidden if ok else None, weight=weight.detach() if isinstance(weight, Tensor) else None,
            bias=bias.detach() if ok and isinstance(bias, Tensor) else None, transform=self.source.transform,
            source="trl_fused_head", targets=targets, given=values, precision=(cast, cast) if ok and cast else None,
        ))  # fmt: skip

    def _pick_hidden(self) -> tuple[str, Tensor] | None:
        d = self.source.head.weight.shape[1] if isinstance(getattr(self.source.head, "weight", None), Tensor) else None
        for where, h in self._hidden:
            if d is not None and h.shape[-1] != d:
                continue
            if self._reference is None or tuple(h.shape[:-1]) == self._reference:
                return where, h
        return None

    def _measure_hidden(self, logits: Tensor | None, kept: int | None = None) -> None:
        s = self.source
        picked = self._pick_hidden()
        if picked is None:
            key = "few_positions" if logits is not None else "head_not_called"
            self._set_problem(key, self._head_message(logits))
            return
        where, hidden = picked
        if logits is not None and self._raw_rows is not None and self._raw_lead == tuple(logits.shape[:-1]):
            if not self._transform_matches(logits):
                return
        if not self._is_head_input(where, hidden):
            return
        seen = self._weight_seen  # as the forward used it (FSDP2 reshards the module's weight after the forward)
        weight = seen if isinstance(seen, Tensor) and seen.ndim == 2 and not is_sharded(seen) else getattr(s.head, "weight", None)
        bias = getattr(s.head, "bias", None)
        if not isinstance(weight, Tensor) or weight.ndim != 2:
            self._set_problem("no_logits", f"the head `{s.head_name}` has no 2-D weight to project the hidden states")
            return
        if is_sharded(weight) or is_sharded(bias) or weight.untyped_storage().nbytes() == 0:
            self._set_problem(
                "sharded_weight",
                f"the head's weight `{s.head_name}.weight` is sharded over processes (FSDP2) and its full value, "
                "which the forward used, is freed by the time the head's absence is known, so the logits cannot be "
                "recomputed from the hidden states; nothing is measured. Pass hidden_module=<the fused loss module> "
                "(headwatch then keeps a copy of the full weight read during the forward, on logging steps).",
            )
            return
        transform = f" then {s.transform.description}" if s.transform is not None else ""
        if kept is not None:  # forced path='hidden' on logits_to_keep: the kept positions only
            hidden = hidden[:, -kept:]
        if self.path == "hidden":
            self._reason, why = "forced", "forced by path='hidden'"
        elif logits is None and self._head_calls == 0:
            self._reason, why = "head_not_called", f"`{s.head_name}` never ran in this forward (a fused linear cross-entropy)"
        else:
            self._reason, why = "few_positions", self._positions_phrase(logits)
        self._note = (
            f"headwatch measures the logits as {where} @ `{s.head_name}.weight`.T{transform} ({why}); "
            "statistics are computed in chunks from those, never holding the (B, T, V) logits."
        )
        self._emit(Captured("hidden", hidden=hidden.detach(), weight=weight.detach(),
                            bias=bias.detach() if isinstance(bias, Tensor) else None, transform=s.transform, kept=kept))

    def _is_head_input(self, where: str, hidden: Tensor) -> bool:
        """Where the head ran too, its input must be rows of ``hidden`` (no pre-head transform in between)."""
        h_in = self._head_input
        if not isinstance(h_in, Tensor) or h_in is hidden or h_in.ndim != hidden.ndim or h_in.shape[0] != hidden.shape[0]:
            return True
        if h_in.shape == hidden.shape:
            part = hidden
        elif h_in.ndim == 3 and h_in.shape[1] < hidden.shape[1] and h_in.shape[2] == hidden.shape[2]:
            part = hidden[:, -h_in.shape[1] :]  # an int logits_to_keep keeps the last positions
        else:
            return True
        a = h_in.detach().reshape(-1, h_in.shape[-1])[:_CHECK_ROWS].float()
        b = part.detach().reshape(-1, part.shape[-1])[:_CHECK_ROWS].float()
        if torch.allclose(a, b, rtol=1e-3, atol=1e-4):
            return True
        self._set_problem(
            "hidden_mismatch",
            f"{where} is not the input of the head `{self.source.head_name}` (a transform between them, or "
            "logits_to_keep given as indices), so the hidden-state path would measure another distribution; "
            "nothing is measured. Pass hidden_module= naming the module whose first input is the head's input "
            "for every position.",
        )
        return False

    def _transform_matches(self, logits: Tensor) -> bool:
        raw = self._raw_rows.float()  # (n, V), the head's raw output
        final = logits.detach().reshape(-1, logits.shape[-1])[: raw.shape[0]].float()  # (n, V)
        expected = self.source.transform(raw) if self.source.transform is not None else raw
        if torch.allclose(expected, final, rtol=2e-2, atol=2e-2):
            return True
        declared = self.source.transform.description if self.source.transform is not None else "none"
        self._set_problem(
            "transform_mismatch",
            f"the logits `{self.source.owner_name or '<root>'}` returns are not the head's output under the final "
            f"transform its config declares ({declared}), so the hidden-state path would measure another "
            "distribution; nothing is measured. Pass logits_module= naming a module that returns the logits of "
            "every position, or let the model return them (no logits_to_keep) on logging steps.",
        )
        return False

    def _positions_phrase(self, logits: Tensor | None) -> str:
        got = "no logits" if logits is None else f"logits of shape {tuple(logits.shape)}"
        want = f"positions {self._reference}" if self._reference is not None else "every position"
        return f"`{self.source.owner_name or '<root>'}` returned {got} where the batch has {want} (e.g. logits_to_keep)"

    def _head_message(self, logits: Tensor | None) -> str:
        s = self.source
        ran = "never ran" if self._head_calls == 0 else f"ran {self._head_calls} time(s)"
        return (
            f"the head `{s.head_name}` {ran} in this forward and {self._positions_phrase(logits)}: a fused linear "
            "cross-entropy (Liger Kernel, Cut Cross-Entropy) computes the loss from the final hidden states and "
            f"`{s.head_name}.weight` without logits, and logits_to_keep keeps only some positions. headwatch measures "
            "such models from the final hidden states of every position: pass hidden_module=<the module whose first "
            "input is the final hidden states (B, T, d_model), e.g. the fused loss module>."
            + self._compiled_phrase()
        )

    def _compiled_phrase(self) -> str:
        names = compiled_modules(self.model) if self.model is not None else []
        if not names:
            return ""
        return (
            f" Note: {', '.join(f'`{n}`' for n in names)} is compiled (torch.compile); hooks registered after its "
            "first call do not run in compiled code."
        )

    def _diagnose_silence(self) -> None:
        s = self.source
        names = compiled_modules(self.model) if self.model is not None else []
        if names:
            listed = ", ".join(f"`{n}`" for n in names)
            self._set_problem(
                "compiled",
                f"none of headwatch's hooks (on `{s.owner_name or '<root>'}`, `{s.head_name}`) ran during this "
                f"step's forward: {listed} is compiled (torch.compile) and was called before headwatch registered "
                "its hooks, and compiled code does not run hooks added later. Fix: attach headwatch (create the "
                "Trainer with the callback) before the compiled model's first call, or call torch._dynamo.reset() "
                "after attaching so it recompiles with the hooks, or pass logits_module=<the compiled module> when "
                "its output holds the logits (a hook on the compiled module itself still runs).",
            )
            return
        self._set_problem(
            "not_fired",
            f"none of headwatch's hooks (on `{s.owner_name or '<root>'}`, `{s.head_name}`) ran during this step: "
            "the model was not called through these modules (a copy of the model, a replaced forward, or a "
            "forward outside the training step). Pass logits_module= naming the module whose output holds the logits.",
        )

    def _set_problem(self, key: str, message: str) -> None:
        if self._problem is None:
            self._problem, self._message = key, f"headwatch: {message}"
