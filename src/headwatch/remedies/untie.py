"""Untie an already-tied output head: one new ``(vocab_size, d_model)`` Parameter for ``lm_head``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from headwatch.model.find import find_head_and_embedding
from headwatch.errors import HeadwatchError, check_choice, check_instance, check_module_or_name, check_optional, check_range

INITS = ("copy", "normal")
"""Allowed values of ``untie_output_head(init=...)``."""

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

    def __str__(self) -> str:
        how = "a copy of the shared matrix" if self.init == "copy" else f"N(0, {self.std:g}^2)"
        return (
            f"headwatch: untied `{self.head_name}` from `{self.embedding_name}`: new head "
            f"({self.vocab_size} x {self.d_model}, {str(self.dtype).removeprefix('torch.')}) initialised with {how}; "
            f"+{self.params_added:,} parameters, +{self.bytes_added:,} bytes of weights "
            "(add it to an optimizer param group: build the optimizer after this call)"
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


def untie_output_head(
    model: nn.Module,
    init: str = "copy",
    std: float | None = None,
    *,
    head: str | nn.Module | None = None,
    embedding: str | nn.Module | None = None,
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

    Optimizer: the new Parameter is in no optimizer yet. Call this before the optimizer is
    built; with Lightning, in ``LightningModule.configure_model`` or ``__init__`` (both run
    before ``configure_optimizers``), or rebuild the optimizer (``trainer.strategy.setup_optimizers``).

    Args:
        model: a tied model (``head.weight is embedding.weight``).
        init: ``"copy"`` or ``"normal"``.
        std: standard deviation for ``init="normal"``.
        head, embedding: explicit modules or dotted names, as for the monitors.

    Returns:
        An :class:`UntieReport` (also logged once, on rank zero).

    Raises:
        HeadwatchError: bad ``init``/``std``; the head and embedding are not tied; the head
            weight is sharded (DTensor, FSDP flat parameter) or quantised; a Hugging Face model
            ties more than its head; ``init="normal"`` without a known std.
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    check_choice("init", init, INITS)
    check_optional(check_range, "std", std, 0, low_open=True)
    check_module_or_name("head", head)
    check_module_or_name("embedding", embedding)
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
    with torch.no_grad():
        if init == "copy":
            data = weight.detach().clone()
        else:
            data = torch.empty_like(weight).normal_(0.0, sigma)
    found.head.weight = nn.Parameter(data, requires_grad=weight.requires_grad)
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
    )
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(str(report))
    return report
