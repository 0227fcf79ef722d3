"""Untie an already-tied output head: one new ``(vocab_size, d_model)`` Parameter for ``lm_head``."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from headwatch.model.find import find_head_and_embedding
from headwatch.errors import (
    HeadwatchError,
    argument_error,
    check_choice,
    check_instance,
    check_module_or_name,
    check_optional,
    check_range,
    check_sequence,
)

INITS = ("copy", "normal")
"""Allowed values of ``untie_output_head(init=...)``."""
OPTIMIZER_STATES = ("copy", "reset")
"""Allowed values of ``untie_output_head(optimizer_state=...)``: what the new head's optimizer state starts from."""

_FLOAT8 = {getattr(torch, n) for n in dir(torch) if n.startswith("float8_")}


@dataclass(frozen=True)
class UntieReport:
    """What :func:`untie_output_head` did.

    ``params_added = vocab_size * d_model`` (the new head matrix; a bias, if any, was never
    tied and is kept as it was); ``bytes_added = params_added * element size of the weight
    dtype`` (weights only: gradients and optimizer state come on top, see ``headwatch cost``).
    """

    head_name: str
    embedding_name: str
    vocab_size: int
    d_model: int
    params_added: int
    bytes_added: int
    dtype: torch.dtype
    init: str
    std: float | None
    hf_config_updated: bool
    optimizers_updated: int = 0
    """How many of the given optimizers now hold the new head (0: none was given)."""
    optimizer_state: str | None = None
    """``"copy"`` (the shared matrix's state cloned for the new head) or ``"reset"`` (empty: the
    optimizer initialises it at the head's first step); None when no optimizer was given."""

    def __str__(self) -> str:
        how = "a copy of the shared matrix" if self.init == "copy" else f"N(0, {self.std:g}^2)"
        if self.optimizers_updated:
            state = "a copy of the shared matrix's state" if self.optimizer_state == "copy" else "an empty state"
            where = (f"added to the param group of the shared matrix in {self.optimizers_updated} optimizer(s), "
                     f"with {state}; the embedding keeps its own state")
        else:
            where = ("in no optimizer yet: build the optimizer after this call, or pass optimizer= "
                     "(an optimizer that steps the old tied matrix without it warns at its first step)")
        return (
            f"headwatch: untied `{self.head_name}` from `{self.embedding_name}`: new head "
            f"({self.vocab_size} x {self.d_model}, {str(self.dtype).removeprefix('torch.')}) initialised with {how}; "
            f"+{self.params_added:,} parameters, +{self.bytes_added:,} bytes of weights; {where}"
        )


def _check_plain_weight(name: str, weight: Tensor) -> None:
    """Refuse a sharded (DTensor, FSDP flat parameter) or quantised head weight."""
    kind = type(weight).__name__
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        DTensor = ()  # type: ignore[assignment,misc]
    if isinstance(weight, DTensor) or getattr(weight, "_is_flat_param", False) or "FlatParam" in kind:
        raise HeadwatchError(
            f"the output head `{name}` has a sharded weight ({kind}); untie before sharding "
            "(before FSDP/fully_shard wraps the model, e.g. at the start of LightningModule.configure_model)"
        )
    quantised = (
        not weight.is_floating_point()
        or weight.dtype in _FLOAT8
        or any(k in kind for k in ("4bit", "Int8", "Quant", "quant", "Float8"))
        or hasattr(weight, "quant_state")
    )
    if quantised:
        raise HeadwatchError(
            f"the output head `{name}` has a quantised weight ({kind}, dtype {weight.dtype}); untie the "
            "full-precision model, then quantise"
        )


def _hf_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` of every Hugging Face ``PreTrainedModel`` in ``model`` (itself included)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel)]


def _check_hf_mapping(model: nn.Module, head_weight_name: str) -> None:
    """Refuse a model whose tie mapping ties more than the head (T5's encoder/decoder embeddings)."""
    for prefix, sub in _hf_models(model):
        if not hasattr(sub, "get_expanded_tied_weights_keys"):  # transformers < 5: the config flag alone decides
            continue
        mapping = sub.get_expanded_tied_weights_keys(all_submodels=True)
        full = {f"{prefix}.{k}" if prefix else k for k in mapping}
        others = sorted(full - {head_weight_name})
        if others:
            raise HeadwatchError(
                f"{type(sub).__name__} ties more than its output head (also {', '.join(others)}); "
                "untie_output_head only handles a model whose one tie is lm_head <- input embedding"
            )


def _untie_hf_config(model: nn.Module) -> bool:
    """Set ``tie_word_embeddings = False`` on every config transformers reads, refresh the tie maps."""
    subs = _hf_models(model)
    for _, sub in subs:
        configs = [sub.config]
        text = getattr(sub.config, "get_text_config", None)
        if callable(text):
            configs.append(text())
        for cfg in configs:
            cfg.tie_word_embeddings = False
    for _, sub in subs:
        # transformers >= 5 ties from this cached {target: source} map in from_pretrained/save_pretrained
        if hasattr(sub, "all_tied_weights_keys"):
            sub.all_tied_weights_keys = sub.get_expanded_tied_weights_keys(all_submodels=True)
    return bool(subs)


def _init_std(model: nn.Module, head: nn.Module, std: float | None) -> float:
    """``std``, else ``initializer_range`` of the config of the innermost module holding ``head``
    (a LightningModule wrapping a Hugging Face model: the wrapped model's), else of any config
    in ``model``; each config's text sub-config is read too (multimodal models)."""
    if std is not None:
        return std
    owners = [m for m in model.modules() if getattr(m, "config", None) is not None]
    holding = [m for m in owners if any(sub is head for sub in m.modules())]
    for owner in [*reversed(holding), *owners]:
        config = owner.config
        text = getattr(config, "get_text_config", None)
        for cfg in (config, text() if callable(text) else None):
            value = getattr(cfg, "initializer_range", None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return float(value)
    raise HeadwatchError(
        f'untie_output_head(init="normal") needs the init std: neither {type(model).__name__} nor a submodule '
        "has a config.initializer_range, so pass std= (e.g. std=0.02, GPT-2's)"
    )


def _optimizers(optimizer: Any) -> list[Optimizer]:
    """``optimizer=`` as a list of ``torch.optim.Optimizer`` (a Lightning ``LightningOptimizer`` is unwrapped)."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    items = [getattr(o, "optimizer", o) if not isinstance(o, Optimizer) else o for o in items]  # LightningOptimizer
    return check_sequence("optimizer", items, "torch.optim.Optimizer objects", lambda o: isinstance(o, Optimizer), empty=False)


def _unwrap(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (the Hugging Face Trainer's), else itself."""
    inner = getattr(optimizer, "optimizer", None)
    return _unwrap(inner) if isinstance(inner, Optimizer) and inner is not optimizer else optimizer


def _trainer_optimizers(trainer: Any, model: nn.Module) -> tuple[list[Optimizer], str | None]:
    """The optimizers a trainer has built (none yet: an empty list) and what the trainer is, from ``trainer``, else
    from a LightningModule attached to one (``model.trainer``): a Lightning ``Trainer`` (``trainer.optimizers``) or
    a Hugging Face ``Trainer`` (``trainer.optimizer``, None until training starts)."""
    if trainer is None:
        try:  # a LightningModule attached to a trainer; raises (RuntimeError) when not attached
            trainer = getattr(model, "trainer", None) if hasattr(type(model), "configure_optimizers") else None
        except RuntimeError:
            trainer = None
        if trainer is None:
            return [], None
    if isinstance(getattr(trainer, "optimizers", None), (list, tuple)):  # Lightning
        found, kind = list(trainer.optimizers), "the Lightning Trainer"
    elif hasattr(trainer, "optimizer") and hasattr(trainer, "create_optimizer"):  # Hugging Face
        found, kind = [trainer.optimizer] if trainer.optimizer is not None else [], "the Hugging Face Trainer"
    else:
        raise argument_error("trainer", "a Lightning Trainer (with .optimizers) or a Hugging Face Trainer (with "
                                        ".optimizer)", trainer)  # fmt: skip
    return [_unwrap(o) for o in _optimizers(found or None)], kind


def _groups_holding(optimizers: Sequence[Optimizer], weight: Tensor) -> list[tuple[Optimizer, dict[str, Any]]]:
    return [(o, g) for o in optimizers for g in o.param_groups if any(p is weight for p in g["params"])]


def _add_to_optimizers(
    holding: list[tuple[Optimizer, dict[str, Any]]], old: nn.Parameter, new: nn.Parameter, state: str
) -> None:
    """Put ``new`` into every group that holds ``old``; its state a clone of ``old``'s, or empty."""
    for optimizer, group in holding:
        group["params"].append(new)
        old_state = optimizer.state.get(old)
        if state == "copy" and old_state:
            optimizer.state[new] = {
                k: v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in old_state.items()
            }


@dataclass(eq=False)  # identity: a generated __eq__ would compare the weakly referenced tensors
class _Watch:
    """An untie without ``optimizer=``: weak references to the old tied matrix and the new head."""

    old: weakref.ref[nn.Parameter]
    new: weakref.ref[nn.Parameter]
    head_name: str
    embedding_name: str
    checked: weakref.WeakSet[Optimizer]


_WATCHES: list[_Watch] = []
_HOOK: list[Any] = []  # the one global step pre-hook's handle, registered at the first watch


def _check_stale(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """Global ``torch.optim`` step pre-hook: warn once per untie whose old matrix an optimizer steps without the new head.

    Each optimizer is checked once per pending untie (O(its parameters)); afterwards a step costs
    one weak-set lookup, and nothing once every untie is settled (the hook stays registered:
    removing a global hook while torch iterates over them is not allowed).
    """
    for watch in list(_WATCHES):
        if optimizer in watch.checked:
            continue
        watch.checked.add(optimizer)
        old, new = watch.old(), watch.new()
        if old is None or new is None:
            _WATCHES.remove(watch)
            continue
        params = [p for g in optimizer.param_groups for p in g["params"]]
        has_old, has_new = any(p is old for p in params), any(p is new for p in params)
        if has_old and not has_new:
            warnings.warn(
                f"headwatch: {type(optimizer).__name__} steps the matrix `{watch.embedding_name}.weight` that "
                f"`{watch.head_name}` shared before untie_output_head, but not the new `{watch.head_name}.weight`: "
                "unless another optimizer holds it, the head will never move. Pass optimizer= to untie_output_head, "
                "or build the optimizer after untying. (warned once)",
                UserWarning,
                stacklevel=3,
            )
        if has_old or has_new:
            _WATCHES.remove(watch)


def _watch_for_a_stale_optimizer(old: nn.Parameter, new: nn.Parameter, head_name: str, embedding_name: str) -> None:
    """At the first step of an optimizer that holds ``old`` but not ``new``, warn once (see :func:`_check_stale`)."""
    _WATCHES.append(_Watch(weakref.ref(old), weakref.ref(new), head_name, embedding_name, weakref.WeakSet()))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_stale))  # public torch API, process-wide


def untie_output_head(
    model: nn.Module,
    init: str = "copy",
    std: float | None = None,
    *,
    head: str | nn.Module | None = None,
    embedding: str | nn.Module | None = None,
    optimizer: Optimizer | Sequence[Optimizer] | None = None,
    optimizer_state: str | None = None,
    trainer: Any = None,
) -> UntieReport:
    """Give the output head its own weight matrix, in place.

    The head module is kept (its class, bias, hooks); only its ``weight`` becomes a new
    ``nn.Parameter`` of the same shape ``(vocab_size, d_model)``, dtype, device and
    ``requires_grad``. With ``init="copy"`` it is a copy of the shared matrix, so the model
    computes the same logits as before, bit for bit; with ``"normal"`` it is drawn from
    ``N(0, std^2)``, ``std`` defaulting to ``config.initializer_range`` of the Hugging Face model
    that holds the head (itself, or a submodule of a wrapper such as a LightningModule).

    For a Hugging Face ``PreTrainedModel`` it also sets ``tie_word_embeddings = False`` on
    the config of every ``PreTrainedModel`` inside (and on its text sub-config, for
    multimodal models) and recomputes ``all_tied_weights_keys``, so ``tie_weights()``,
    ``save_pretrained`` + ``from_pretrained`` and ``resize_token_embeddings`` keep it untied.

    Optimizer: best, call this before the optimizer is built (with Lightning, in
    ``LightningModule.configure_model`` or ``__init__``, both before ``configure_optimizers``).
    An optimizer built earlier holds the old tied Parameter, which stays the embedding's: it
    would keep training the embedding and never the new head. Pass it as ``optimizer=`` (one or
    several; a Lightning ``LightningOptimizer`` is unwrapped): the new head is appended to every
    param group that holds the shared matrix (same learning rate, weight decay, schedule), and
    its state is, by ``optimizer_state``:

    - ``"copy"`` (the default with ``init="copy"``): a clone of the shared matrix's state
      (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``). The new head *is* the shared matrix at this
      instant, so it continues the same trajectory: its first step has the step size the tied
      matrix had, not Adam's first-step jump (an empty state makes every element move by about
      ``lr``, rare rows included). The moments hold the sum of both flows' history and fade
      towards the head's own at the rate ``beta2``.
    - ``"reset"`` (the default with ``init="normal"``): no state; the optimizer initialises it at
      the head's first step, as for any new Parameter. A freshly drawn head has nothing in
      common with the old moments.

    The embedding keeps the old Parameter and its own state unchanged. A late untie (training
    under way) finds the optimizers itself where headwatch knows them: ``trainer=`` a Hugging Face
    ``Trainer`` (its ``optimizer``, once built) or a Lightning ``Trainer`` (its ``optimizers``), or a
    LightningModule attached to its trainer. Where it knows none and the tied matrix already holds a
    gradient (training has started), it raises, naming the fix, instead of leaving the new head out
    of every optimizer. Otherwise (no gradient yet: a loop that sets gradients to None after each
    step looks the same), the first step of an optimizer that holds the old matrix but not the new
    head warns once ("the head will never move").

    Args:
        model: a tied model (``head.weight is embedding.weight``).
        init: ``"copy"`` or ``"normal"``.
        std: standard deviation for ``init="normal"``.
        head: explicit module or dotted name, as for the monitors.
        embedding: explicit module or dotted name, as for the monitors.
        optimizer: an optimizer (or several) that already holds the tied matrix.
        optimizer_state: ``"copy"`` or ``"reset"`` (see above); None: ``"copy"`` for
            ``init="copy"``, ``"reset"`` for ``init="normal"``. Only with an optimizer.
        trainer: a Hugging Face ``Trainer`` or a Lightning ``Trainer`` whose optimizers (already
            built, if any) receive the new head; None: ``model.trainer`` for an attached LightningModule.

    Returns:
        An :class:`UntieReport` (also logged once, on rank zero).

    Raises:
        HeadwatchError: bad ``init``/``std``; the head and embedding are not tied; the head
            weight is sharded (DTensor, FSDP flat parameter) or quantised; a Hugging Face model
            ties more than its head; ``init="normal"`` without a known std; ``optimizer`` not
            optimizers, or none of them (nor of ``trainer``'s) holds the tied matrix; ``trainer``
            not a trainer; ``optimizer_state`` without an optimizer; a late untie (the tied matrix has
            a gradient) with no optimizer known. The model is left tied whenever it raises.
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    check_choice("init", init, INITS)
    check_optional(check_range, "std", std, 0, low_open=True)
    check_module_or_name("head", head)
    check_module_or_name("embedding", embedding)
    optimizers = [_unwrap(o) for o in _optimizers(optimizer)]
    from_trainer, trainer_kind = _trainer_optimizers(trainer, model)
    optimizers += [o for o in from_trainer if all(o is not known for known in optimizers)]
    check_optional(check_choice, "optimizer_state", optimizer_state, OPTIMIZER_STATES)
    if optimizer_state is not None and not optimizers:
        raise HeadwatchError("`optimizer_state` needs `optimizer` (or `trainer=` once it has built its optimizer): the "
                             "optimizer whose state it sets")
    found = find_head_and_embedding(model, head, embedding)
    weight = found.head.weight
    if not found.tied:
        raise HeadwatchError(
            f"the output head `{found.head_name}` and the input embedding `{found.embedding_name}` are not tied "
            f"(`{found.head_name}.weight is {found.embedding_name}.weight` is False): nothing to untie"
        )
    _check_plain_weight(found.head_name, weight)
    _check_hf_mapping(model, f"{found.head_name}.weight")
    sigma = _init_std(model, found.head, std) if init == "normal" else None
    holding = _groups_holding(optimizers, weight)
    if optimizers and not holding:
        given = f"{trainer_kind}'s" if trainer_kind and not optimizer else "given"
        raise HeadwatchError(
            f"none of the {len(optimizers)} optimizer(s) {given} holds the tied matrix `{found.head_name}.weight`; "
            "pass the optimizer that trains it (or build the optimizer after untying, without optimizer=)"
        )
    if not optimizers and weight.grad is not None:
        raise HeadwatchError(
            f"untie_output_head during training (`{found.head_name}.weight` already has a gradient) with no optimizer "
            "known: the optimizer built before holds the old tied matrix, which stays the embedding's, and would never "
            "train the new head. Pass optimizer=<the optimizer that trains the model> or trainer=<the Hugging Face or "
            "Lightning Trainer>, or untie before the optimizer is built (Lightning: in configure_model)"
        )
    state = optimizer_state or ("copy" if init == "copy" else "reset")
    with torch.no_grad():
        if init == "copy":
            data = weight.detach().clone()
        else:
            data = torch.empty_like(weight).normal_(0.0, sigma)
    new = nn.Parameter(data, requires_grad=weight.requires_grad)
    found.head.weight = new
    if holding:
        _add_to_optimizers(holding, weight, new, state)
    else:
        _watch_for_a_stale_optimizer(weight, new, found.head_name, found.embedding_name)
    hf = _untie_hf_config(model)
    V, d = weight.shape
    report = UntieReport(
        head_name=found.head_name,
        embedding_name=found.embedding_name,
        vocab_size=V,
        d_model=d,
        params_added=V * d,
        bytes_added=V * d * weight.element_size(),
        dtype=weight.dtype,
        init=init,
        std=sigma,
        hf_config_updated=hf,
        optimizers_updated=len({id(o) for o, _ in holding}),
        optimizer_state=state if holding else None,
    )
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(str(report))
    return report
