"""Which tensor headwatch measures, and how the batch's labels line up with it.

The distribution that matters is the one the loss uses and the model samples from. Several
families transform the head's output before the loss (Gemma 2/3 ``final_logit_softcapping``:
``cap * tanh(x / cap)``; Cohere ``logit_scale``; Falcon-H1 ``lm_head_multiplier``; Granite
``logits_scaling``), so the head's raw output is not it. The rule, in order:

1. ``logits_module=`` if the user names one: its output (a tensor, ``.logits`` or ``[0]``);
2. a Hugging Face model: the ``logits`` returned by the module that owns the head (the
   innermost module whose ``get_output_embeddings()`` is the head: the ``*ForCausalLM`` /
   ``*ForConditionalGeneration``). Every post-head transform is inside it, whatever its
   config key;
3. otherwise the head's own output.

Targets follow the model kind: causal LMs shift labels inside (logits at ``t`` score
``labels[t + 1]``); encoder-decoder models (``config.is_encoder_decoder``, e.g. T5) take
labels already aligned with the decoder's logits, and the batch's ``attention_mask`` is the
encoder's, so only ``decoder_attention_mask`` masks decoder positions.

When the logits are not there (a fused linear cross-entropy never calls the head; HF
``logits_to_keep`` keeps a few positions), :class:`headwatch.model.capture.LogitsCapture`
measures from the final hidden states and the head's weight, with the family's final
transform (:func:`final_logit_transform`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from headwatch.model.find import name_of, find_input_embedding, find_output_head
from headwatch.errors import HeadwatchError

Alignment = Literal["causal", "seq2seq", "aligned"]
ALIGNMENTS = ("causal", "seq2seq", "aligned")


@dataclass(frozen=True)
class FinalTransform:
    """An elementwise map from the head's raw output to the logits the loss uses."""

    description: str
    """In words, with the config key and value, e.g. ``"30.0 * tanh(x / 30.0) (final_logit_softcapping)"``."""
    fn: Callable[[Tensor], Tensor]

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except Exception:  # noqa: BLE001 - an odd config: read the top level
        return config


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def final_logit_transform(config: Any) -> FinalTransform | None:
    """The post-head transform a Hugging Face config declares, for the hidden-state path.

    The families' own forwards (``transformers``' modeling code), in the order they apply them, the table TRL's
    fused LM head uses too: first a scale, the first of ``logit_scale`` (Cohere), ``output_multiplier`` (Muse
    Glimmer), ``lm_head_multiplier`` (Falcon-H1), which multiply, else ``logits_scaling``, which Granite and
    MiniCPM3 divide by and HyperCLOVA X (``model_type="hyperclovax"``) multiplies by; then
    ``final_logit_softcapping`` (Gemma 2/3/4: ``cap * tanh(x / cap)``). On the logits path none of this matters
    (the model's own ``outputs.logits`` are measured); on the hidden-state path
    :class:`~headwatch.model.capture.LogitsCapture` also checks the transform against the model's logits whenever
    the head runs on some positions.

    Returns:
        the transform, or None when the config declares none (or is None).
    """
    if config is None:
        return None
    text = _text_config(config)
    steps: list[tuple[str, Callable[[Tensor], Tensor]]] = []
    key = next((k for k in ("logit_scale", "output_multiplier", "lm_head_multiplier") if _number(getattr(text, k, None)) is not None), None)
    scale, div = (_number(getattr(text, key, None)), None) if key else (None, _number(getattr(text, "logits_scaling", None)))
    if div is not None and div not in (0.0, 1.0):
        key = "logits_scaling"
        if getattr(text, "model_type", None) == "hyperclovax":  # the one family that multiplies by it
            scale, div = div, None
        else:
            steps.append((f"x / {div} (logits_scaling)", lambda x, d=div: x / d))
    if scale is not None and scale != 1.0:
        steps.append((f"x * {scale} ({key})", lambda x, s=scale: x * s))
    cap = _number(getattr(text, "final_logit_softcapping", None))
    if cap is not None and cap > 0:
        steps.append((f"{cap} * tanh(x / {cap}) (final_logit_softcapping)", lambda x, c=cap: torch.tanh(x / c) * c))
    if not steps:
        return None

    def apply(x: Tensor) -> Tensor:
        for _, f in steps:
            x = f(x)
        return x

    return FinalTransform(" then ".join(d for d, _ in steps), apply)


@dataclass(frozen=True)
class LogitsSource:
    """Where the measured logits come from; built by :func:`resolve_logits_source`."""

    head_name: str
    head: nn.Module
    owner_name: str
    """Dotted name of the module whose forward output holds the logits ('' for the root)."""
    owner: nn.Module
    kind: Literal["model_logits", "head_output", "named_module"]
    alignment: Alignment
    transform: FinalTransform | None
    """Post-head transform for the hidden-state path (None: the identity)."""
    base_name: str | None
    """Hugging Face inner model whose ``last_hidden_state`` is the head's full input, if any."""
    base: nn.Module | None
    hidden_name: str | None
    """User-named module whose first input is the final hidden states (e.g. a fused loss)."""
    hidden_module: nn.Module | None
    embedding: nn.Module | None = None
    """The input embedding, when found: its forward proves the model ran although the head did not."""

    def describe(self) -> str:
        """One sentence for the set-up message and the README: which tensor, which targets."""
        where = {
            "model_logits": f"the `logits` returned by `{self.owner_name or '<root>'}` ({type(self.owner).__name__}, "
            f"the module owning the head `{self.head_name}`): the distribution the loss uses, after any post-head "
            "transform",
            "head_output": f"the output of the head `{self.head_name}` ({type(self.head).__name__})",
            "named_module": f"the output of `{self.owner_name or '<root>'}` ({type(self.owner).__name__}, "
            "named by logits_module=)",
        }[self.kind]
        targets = {
            "causal": "targets are the labels shifted by one (logits at t score labels[t + 1]), masked by attention_mask",
            "seq2seq": "targets are the labels as given (encoder-decoder: aligned with the decoder's logits), masked by "
            "decoder_attention_mask when present (never by the encoder's attention_mask)",
            "aligned": "targets are the labels as given (already aligned with the logits), masked by attention_mask",
        }[self.alignment]
        return f"{where}; {targets}"


def _resolve_module(model: nn.Module, value: str | nn.Module, argument: str) -> tuple[str, nn.Module]:
    if isinstance(value, nn.Module):
        name = name_of(model, value)
        if name is None:
            raise HeadwatchError(f"`{argument}` is a {type(value).__name__} that is not a submodule of the model")
        return name, value
    if isinstance(value, str):
        try:
            return value, model.get_submodule(value)
        except AttributeError as err:
            raise HeadwatchError(f"`{argument}={value!r}` names no submodule of {type(model).__name__}: {err}") from err
    raise HeadwatchError(f"`{argument}` must be None, an nn.Module or its dotted name, got {type(value).__name__}")


def _owner_of(model: nn.Module, head: nn.Module) -> tuple[str, nn.Module] | None:
    """The innermost module whose ``get_output_embeddings()`` returns ``head``."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        getter = getattr(type(module), "get_output_embeddings", None)
        if getter is None or not callable(getter):
            continue
        try:
            out = module.get_output_embeddings()
        except Exception:  # noqa: BLE001 - a model's own getter may fail; it is then not the owner
            continue
        if out is head:
            found.append((name, module))
    # wrappers (PEFT, a LightningModule forwarding the getter) enclose the owner: the deepest one is it
    return max(found, key=lambda item: (item[0].count(".") + 1) if item[0] else 0, default=None)


def _base_of(owner: nn.Module, model: nn.Module) -> tuple[str, nn.Module] | tuple[None, None]:
    """The HF inner model (``owner.base_model``) when it is a distinct submodule returning ``last_hidden_state``."""
    base = getattr(owner, "base_model", None) if hasattr(owner, "base_model_prefix") else None
    if not isinstance(base, nn.Module) or base is owner:
        return None, None
    name = name_of(model, base)
    return (name, base) if name is not None else (None, None)


def model_alignment(owner: nn.Module) -> Alignment:
    """``"seq2seq"`` when the owner's config says ``is_encoder_decoder``, else ``"causal"``."""
    config = getattr(owner, "config", None)
    return "seq2seq" if bool(getattr(config, "is_encoder_decoder", False)) else "causal"


def resolve_logits_source(
    model: nn.Module,
    head: str | nn.Module | None = None,
    logits_module: str | nn.Module | None = None,
    hidden_module: str | nn.Module | None = None,
    alignment: Alignment | None = None,
) -> LogitsSource:
    """Decide which tensor is measured (see the module docstring for the rule).

    Args:
        model: the model being trained (a LightningModule or any ``nn.Module``).
        head: the output head (module or dotted name); found by
            :func:`headwatch.find_output_head` if None.
        logits_module: a module whose forward output is the logits to measure (a tensor,
            ``.logits`` or ``output[0]``), overriding the automatic choice.
        hidden_module: a module whose first positional input is the final hidden states
            ``(B, T, d_model)`` (e.g. a fused linear cross-entropy module), for the
            hidden-state path.
        alignment: ``"causal"`` (shift labels by one), ``"seq2seq"`` (labels aligned with
            the decoder, ``decoder_attention_mask``) or ``"aligned"`` (labels aligned,
            ``attention_mask``); None: from the owner's ``config.is_encoder_decoder``.

    Returns:
        :class:`LogitsSource`.

    Raises:
        HeadwatchError: the head cannot be found, a named module is not in ``model``, or
            ``alignment`` is not one of the values above.
    """
    if alignment is not None and alignment not in ALIGNMENTS:
        raise HeadwatchError(f"`alignment` must be None or one of {ALIGNMENTS}, got {alignment!r}")
    head_name, head_module = find_output_head(model, head)
    hidden_name, hidden = _resolve_module(model, hidden_module, "hidden_module") if hidden_module is not None else (None, None)
    owned = _owner_of(model, head_module)
    config_holder = owned[1] if owned is not None else head_module
    if logits_module is not None:
        owner_name, owner = _resolve_module(model, logits_module, "logits_module")
        kind: Literal["model_logits", "head_output", "named_module"] = "named_module"
    elif owned is not None:
        (owner_name, owner), kind = owned, "model_logits"
    else:
        owner_name, owner, kind = head_name, head_module, "head_output"
    base_name, base = _base_of(owned[1], model) if owned is not None else (None, None)
    return LogitsSource(
        head_name=head_name,
        head=head_module,
        owner_name=owner_name,
        owner=owner,
        kind=kind,
        alignment=alignment or model_alignment(config_holder),
        transform=final_logit_transform(getattr(config_holder, "config", None)),
        base_name=base_name,
        base=base,
        hidden_name=hidden_name,
        hidden_module=hidden,
        embedding=_embedding_or_none(model, head_module),
    )


def _embedding_or_none(model: nn.Module, head: nn.Module) -> nn.Module | None:
    weight = getattr(head, "weight", None)
    try:
        return find_input_embedding(model, vocab_size=weight.shape[0] if isinstance(weight, Tensor) else None)[1]
    except HeadwatchError:  # ambiguous or absent: only a diagnosis is less precise
        return None


def compiled_modules(model: nn.Module) -> list[str]:
    """Dotted names of modules compiled with ``torch.compile`` (wrapped or in place) inside ``model``."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None:
            found.append(name or "<root>")
    return found
