"""The matrices that really train: one weight held by several modules, adapters, tie state.

Three facts the monitors need and ``module.weight`` alone does not give:

- **One weight, several modules.** A tied T5 holds one Parameter in ``shared``,
  ``encoder.embed_tokens`` and ``decoder.embed_tokens`` (and ``lm_head``). Modules that look rows
  up in the same stored Parameter are ONE embedding (:class:`EmbeddingGroup`); its lookup flow
  is every lookup of that weight, so every member must be hooked.
- **Adapters.** Under PEFT LoRA the matrix that scores is ``W + s * B @ A`` while ``.weight``
  is the frozen base; ``modules_to_save`` trains a copy (:func:`effective_weight`,
  :func:`trainable_matrices`). Tie detection compares effective matrices
  (:func:`effective_tie`): LoRA on a tied ``lm_head`` unties it.
- **Config vs storage.** ``config.tie_word_embeddings`` may disagree with what is stored;
  storage wins (:func:`config_tie_mismatch`).

PEFT is duck-typed (``lora_A``/``lora_embedding_A``, ``modules_to_save``/``original_module``):
headwatch does not import it. Layouts are those of PEFT 0.21.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from torch import Tensor, nn

from headwatch.errors import HeadwatchError
from headwatch.model.adapters import (
    Trainability,  # noqa: F401 - re-exported
    is_saved_copy,
    adapter_kind,
    effective_weight,
    matrix_signature,  # noqa: F401 - re-exported
    storage_weight,
    trainable_matrices,  # noqa: F401 - re-exported
)

EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embedding", "embeddings", "shared")
"""Leaf names taken as the input embedding when the model has no ``get_input_embeddings()``."""


class EmbeddingGroup(NamedTuple):
    """The input embedding: every module that looks rows up in one stored weight."""

    name: str
    """Dotted name of the primary module (the one ``get_input_embeddings()`` returns, if any)."""
    weight: Tensor
    """``(V, d_model)`` the stored Parameter the members share (the base weight under an adapter)."""
    modules: tuple[tuple[str, nn.Module], ...]
    """``(dotted name, module)`` of each distinct outermost member, primary first: hook all of them."""

    @property
    def module(self) -> nn.Module:
        """The primary module."""
        return self.modules[0][1]


def _is_lookup(module: nn.Module) -> bool:
    inner = module
    if is_saved_copy(inner):
        inner = inner.original_module
    if hasattr(inner, "get_base_layer"):
        inner = inner.get_base_layer()
    return isinstance(inner, nn.Embedding)


# ---------------------------------------------------------------- the embedding group
def _describe(name: str, module: nn.Module) -> str:
    w = storage_weight(module)
    shape = f" {tuple(w.shape)}" if w is not None else ""
    return f"{name or '<root>'} ({type(module).__name__}{shape})"


def _members(model: nn.Module, weight: Tensor, also: dict[int, tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Distinct outermost lookup modules whose storage is ``weight`` (plus ``also``)."""
    found: dict[int, tuple[str, nn.Module]] = dict(also)
    for name, module in model.named_modules():
        if id(module) not in found and _is_lookup(module) and storage_weight(module) is weight:
            found[id(module)] = (name, module)
    names = {n for n, _ in found.values()}
    return [(n, m) for n, m in found.values() if not any(n.startswith(p + ".") for p in names if p != n)]


def _getter_results(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    found: dict[int, tuple[str, nn.Module]] = {}
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            try:
                out = getter()
            except Exception:  # noqa: BLE001 - a model's own getter may fail; other rules follow
                out = None
            if isinstance(out, nn.Module) and id(out) in names and storage_weight(out) is not None:
                found[id(out)] = (names[id(out)], out)
    return found


def _explicit(model: nn.Module, embedding: str | nn.Module) -> tuple[str, nn.Module]:
    lookups = ", ".join(_describe(n, m) for n, m in model.named_modules() if _is_lookup(m)) or "none"
    if isinstance(embedding, nn.Module):
        for name, module in model.named_modules(remove_duplicate=False):
            if module is embedding:
                return name, module
        raise HeadwatchError(
            f"`embedding` is a {type(embedding).__name__} that is not a submodule of {type(model).__name__}; "
            f"pass a module of the model being trained or its dotted name. Embeddings found: {lookups}"
        )
    if not isinstance(embedding, str):
        raise HeadwatchError(f"`embedding` must be None, an nn.Module or a dotted name (str), got {type(embedding).__name__}")
    try:
        module = model.get_submodule(embedding)
    except AttributeError as err:
        raise HeadwatchError(
            f"`embedding={embedding!r}` names no submodule of {type(model).__name__}. Embeddings found: {lookups}"
        ) from err
    if storage_weight(module) is None:
        raise HeadwatchError(
            f"`embedding={embedding!r}` has no 2-D `weight` (got {_describe(embedding, module)}). "
            f"Embeddings found: {lookups}"
        )
    return embedding, module


def find_embedding_group(
    model: nn.Module, embedding: str | nn.Module | None = None, vocab_size: int | None = None
) -> EmbeddingGroup:
    """The input embedding as the group of modules sharing its stored weight.

    The primary module is ``embedding`` if given, else the first rule that gives exactly one
    stored weight wins: (1) Hugging Face ``get_input_embeddings()`` on ``model`` or any
    submodule; (2) ``nn.Embedding`` modules named ``embed_tokens``, ``wte``, ``tok_embeddings``,
    ``word_embeddings``, ``embedding``, ``embeddings`` or ``shared``; (3) ``nn.Embedding`` modules
    with ``num_embeddings == vocab_size`` (or all, when ``vocab_size`` is None). Several modules
    on ONE weight (tied T5) are not ambiguous. The group then holds every outermost lookup
    module (``nn.Embedding``, or a PEFT wrapper of one) whose stored weight is that one.

    Returns:
        :class:`EmbeddingGroup`.

    Raises:
        HeadwatchError: ``embedding`` names no submodule or one without a 2-D weight (the
            message says ``embedding=``); no rule decides; or a rule finds several weights.
    """
    if embedding is not None:
        name, module = _explicit(model, embedding)
        weight = storage_weight(module)
        members = _members(model, weight, {id(module): (name, module)})
        return EmbeddingGroup(name, weight, tuple(sorted(members, key=lambda nm: nm[1] is not module)))
    lookups = [(n, m) for n, m in model.named_modules() if _is_lookup(m)]
    rules = (
        ("get_input_embeddings() results", list(_getter_results(model).values())),
        (f"embeddings named like {'/'.join(EMBEDDING_NAMES)}", [(n, m) for n, m in lookups if n.rsplit(".", 1)[-1] in EMBEDDING_NAMES]),
        ("nn.Embedding modules", [(n, m) for n, m in lookups if vocab_size is None or storage_weight(m).shape[0] == vocab_size]),
    )
    for why, candidates in rules:
        weights = {id(storage_weight(m)): storage_weight(m) for _, m in candidates}
        if len(weights) == 1:
            primary = candidates[0]
            weight = next(iter(weights.values()))
            members = _members(model, weight, {id(m): (n, m) for n, m in candidates})
            members.sort(key=lambda nm: nm[1] is not primary[1])
            return EmbeddingGroup(primary[0], weight, tuple(members))
        if len(weights) > 1:
            listing = "; ".join(
                " = ".join(_describe(n, m) for n, m in candidates if storage_weight(m) is w) for w in weights.values()
            )
            raise HeadwatchError(
                f"the input embedding of {type(model).__name__} is ambiguous (several weights among {why}): "
                f"{listing}. Pass one explicitly, e.g. embedding={candidates[0][0]!r}."
            )
    raise HeadwatchError(
        f"could not find the input embedding of {type(model).__name__}: no get_input_embeddings(), no "
        f"nn.Embedding named {'/'.join(EMBEDDING_NAMES)}"
        + (f", no nn.Embedding with num_embeddings == {vocab_size}" if vocab_size is not None else "")
        + f". Embeddings found: {', '.join(_describe(n, m) for n, m in lookups) or 'none'}. "
        "Pass it explicitly, e.g. embedding='model.embed_tokens'."
    )


# ---------------------------------------------------------------- tie state
class TieState(NamedTuple):
    tied: bool
    """The effective head and the effective embedding are one matrix (report ``grad/tied``)."""
    storage_tied: bool
    """``storage_weight(head) is storage_weight(embedding)``: one stored Parameter."""
    reason: str
    """One sentence for the console and the TensorBoard text."""


def effective_tie(head: nn.Module, embedding: nn.Module) -> TieState:
    """Whether head and embedding are tied as they really compute: their effective matrices are
    made of the same memory (:func:`~headwatch.model.adapters.matrix_signature`). An unmerged LoRA delta
    on one side or a ``modules_to_save`` copy unties them; a merged LoRA writes into the shared
    Parameter, and PEFT's ``ensure_weight_tying`` shares the adapters too: both stay tied.

    Raises:
        HeadwatchError: either has no 2-D weight, or an unknown adapter type.
    """
    hw, ew = storage_weight(head), storage_weight(embedding)
    if hw is None or ew is None:
        raise HeadwatchError("both the head and the embedding need a 2-D `weight` to compare")
    storage_tied = hw is ew
    if matrix_signature(head) == matrix_signature(embedding):
        kinds = {adapter_kind(head), adapter_kind(embedding)} - {"plain", "lora_merged"}
        how = f" (their {'/'.join(sorted(kinds))} adapters share it too)" if kinds else ""
        return TieState(True, storage_tied, f"one effective matrix{how}: tied")
    if not storage_tied:
        return TieState(False, False, "separate Parameters: untied")
    for role, module in (("head", head), ("embedding", embedding)):
        if adapter_kind(module) == "lora":
            return TieState(
                False, True, f"one stored Parameter, but LoRA on the {role} adds s * B @ A in its forward: the "
                "effective head differs from the effective embedding (effectively untied)"
            )
        if adapter_kind(module) == "modules_to_save":
            return TieState(False, True, f"one stored Parameter, but modules_to_save trains a copy of the {role}: untied")
    return TieState(False, True, "one stored Parameter, but the adapters on the two sides differ: untied")


def config_tie(model: nn.Module, head: nn.Module | None = None) -> bool | None:
    """What the (Hugging Face) config says: ``tie_word_embeddings`` of the config of the innermost
    module holding ``head`` (the first config found when ``head`` is None), as transformers reads it
    (the top-level attribute; the text sub-config's when the top level lacks it). None when no
    config says.
    """
    owners = [
        m for m in model.modules()
        if getattr(m, "config", None) is not None and (head is None or any(sub is head for sub in m.modules()))
    ]
    if not owners:
        return None
    config = owners[-1].config if head is not None else owners[0].config
    value = getattr(config, "tie_word_embeddings", None)
    if not isinstance(value, bool) and callable(getattr(config, "get_text_config", None)):
        value = getattr(config.get_text_config(), "tie_word_embeddings", None)
    return value if isinstance(value, bool) else None


def config_tie_mismatch(model: nn.Module, storage_tied: bool, head: nn.Module | None = None) -> str | None:
    """A message when the config's ``tie_word_embeddings`` disagrees with the storage, else None.

    Storage wins: headwatch measures what is stored (``storage_tied``, from :func:`effective_tie`).
    """
    said = config_tie(model, head)
    if said is None or said == storage_tied:
        return None
    stored = "one shared Parameter" if storage_tied else "two separate Parameters"
    return (
        f"headwatch: the model's config says tie_word_embeddings={said}, but the head and the embedding are "
        f"stored as {stored}; headwatch measures the storage (tied={storage_tied}). A checkpoint saved "
        "from this model may load differently than it trains."
    )


_WARNED: set[tuple[int, str]] = set()


def warn_config_tie_once(model: nn.Module, storage_tied: bool, head: nn.Module | None = None) -> str | None:
    """:func:`config_tie_mismatch`, warned once per model (``UserWarning``); returns the message."""
    message = config_tie_mismatch(model, storage_tied, head)
    if message is not None and (id(model), message) not in _WARNED:
        _WARNED.add((id(model), message))
        warnings.warn(message, UserWarning, stacklevel=2)
    return message


def declared_shape(module: nn.Module | None) -> tuple[int, int] | None:
    """``(vocab_size, hidden_size)`` as ``module`` declares them (an ``nn.Linear``'s ``out_features`` /
    ``in_features``, an ``nn.Embedding``'s ``num_embeddings`` / ``embedding_dim``, a PEFT adapter's base layer's),
    the same on every process whatever shards the weight; None for another kind of module."""
    inner = getattr(module, "base_layer", module)
    for rows, cols in (("out_features", "in_features"), ("num_embeddings", "embedding_dim")):
        v, d = getattr(inner, rows, None), getattr(inner, cols, None)
        if isinstance(v, int) and isinstance(d, int):
            return v, d
    return None


def refused_kind(state: Any) -> bool:
    """A matrix that trains through PEFT trainable tokens (no Parameter holds its ``(V, d)`` gradient)."""
    return bool(state.trains and state.kind == "trainable_tokens" and state.gradient_parameter is None)
