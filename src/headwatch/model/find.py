"""Where the logits come from: finding the output head, and which positions are predictions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor, nn

from headwatch.errors import HeadwatchError
from headwatch.model.adapters import Trainability, storage_weight, trainable_matrices
from headwatch.model.weights import (
    EmbeddingGroup,
    TieState,
    config_tie_mismatch,
    effective_tie,
    find_embedding_group,
)

HEAD_NAMES = ("lm_head", "output", "head")
"""Leaf module names taken as the output head when the model has no ``get_output_embeddings()``."""


def _describe(name: str, module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return f"{name or '<root>'} (Linear {module.in_features} -> {module.out_features})"
    if isinstance(module, nn.Embedding):
        return f"{name or '<root>'} (Embedding {module.num_embeddings} x {module.embedding_dim})"
    return f"{name or '<root>'} ({type(module).__name__})"


def name_of(model: nn.Module, target: nn.Module) -> str | None:
    for name, module in model.named_modules(remove_duplicate=False):
        if module is target:
            return name
    return None


def _from_getter(model: nn.Module, getter_name: str) -> dict[int, tuple[str, nn.Module]]:
    """Distinct submodules returned by a Hugging Face getter on ``model`` or any submodule."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for _, module in model.named_modules():
        getter = getattr(module, getter_name, None)
        if callable(getter):
            try:
                out = getter()
            except Exception:  # noqa: BLE001 - a model's own getter may fail; fall through to other rules
                out = None
            if isinstance(out, nn.Module):
                name = name_of(model, out)
                if name is not None:
                    found[id(out)] = (name, out)
    return found


def find_output_head(model: nn.Module, head: str | nn.Module | None = None) -> tuple[str, nn.Module]:
    """Find the module whose output is the logits ``(..., vocab_size)``.

    Search order, the first rule that gives exactly one module wins:

    1. ``head`` if given: a submodule of ``model`` or its dotted name (``"model.lm_head"``);
    2. Hugging Face ``get_output_embeddings()`` on ``model`` or any submodule;
    3. a submodule with a 2-D ``weight`` whose own name is ``lm_head``, ``output`` or ``head``;
    4. the single ``nn.Linear`` whose ``out_features`` equals an input embedding's
       ``num_embeddings``.

    Args:
        model: the LightningModule (or any ``nn.Module``) being trained.
        head: optional explicit head, a module or a dotted name.

    Returns:
        ``(dotted_name, module)``.

    Raises:
        HeadwatchError: ``head`` names no submodule; or no rule, or a rule with several
            matches, decides. The message lists the candidates and how to pass ``head=``.
    """
    if isinstance(head, nn.Module):
        name = name_of(model, head)
        if name is None:
            raise HeadwatchError(
                f"`head` is a {type(head).__name__} that is not a submodule of {type(model).__name__}; "
                "pass a module of the model being trained, or its dotted name"
            )
        return name, head
    if isinstance(head, str):
        try:
            return head, model.get_submodule(head)
        except AttributeError as err:
            raise HeadwatchError(
                f"`head={head!r}` names no submodule of {type(model).__name__}: {err}. "
                f"Linear layers found: {_linear_list(model)}"
            ) from err
    if head is not None:
        raise HeadwatchError(f"`head` must be None, an nn.Module or a dotted name (str), got {type(head).__name__}")

    # 2. Hugging Face models say which module is their head.
    found = _from_getter(model, "get_output_embeddings")
    if len(found) == 1:
        return next(iter(found.values()))
    if len(found) > 1:
        _raise_ambiguous(model, list(found.values()), "several get_output_embeddings() results")

    # 3. Conventional names.
    named = [
        (n, m)
        for n, m in model.named_modules()
        if n and n.rsplit(".", 1)[-1] in HEAD_NAMES and _has_matrix_weight(m)
    ]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        _raise_ambiguous(model, named, f"several modules named like {'/'.join(HEAD_NAMES)}")

    # 4. A Linear layer producing one score per vocabulary entry.
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features in vocab_sizes
    ]
    if len(linears) == 1:
        return linears[0]
    if len(linears) > 1:
        _raise_ambiguous(model, linears, "several Linear layers with out_features equal to an embedding's size")
    raise HeadwatchError(
        f"could not find the output head (lm_head) of {type(model).__name__}: no get_output_embeddings(), "
        f"no module named {'/'.join(HEAD_NAMES)}, and no nn.Linear whose out_features equals an "
        f"nn.Embedding's num_embeddings (embeddings: {sorted(vocab_sizes) or 'none'}). "
        f"Linear layers found: {_linear_list(model)}. Pass the head explicitly, "
        "e.g. LogitStatsMonitor(head='model.lm_head') or head=<the module>."
    )


def find_input_embedding(
    model: nn.Module, embedding: str | nn.Module | None = None, vocab_size: int | None = None
) -> tuple[str, nn.Module]:
    """Find the input token embedding, an ``nn.Embedding``-like module with a ``(V, d_model)`` weight.

    Search order, the first rule that gives exactly one module wins:

    1. ``embedding`` if given: a submodule of ``model`` or its dotted name;
    2. Hugging Face ``get_input_embeddings()`` on ``model`` or any submodule;
    3. an ``nn.Embedding`` named ``embed_tokens``, ``wte``, ``tok_embeddings``,
       ``word_embeddings``, ``embedding``, ``embeddings`` or ``shared``;
    4. the single ``nn.Embedding`` (or the single one with ``num_embeddings == vocab_size``
       when ``vocab_size``, typically the head's ``out_features``, is given).

    Returns:
        ``(dotted_name, module)``.

    Raises:
        HeadwatchError: no rule or a rule with several matches decides; the message lists
            the embeddings found and how to pass ``embedding=``.

    Modules that share one stored weight (a tied T5's ``shared``, ``encoder.embed_tokens`` and
    ``decoder.embed_tokens``) are one embedding, not an ambiguity: this returns the primary one;
    :func:`headwatch.model.weights.find_embedding_group` returns them all (hook all of them).
    """
    group = find_embedding_group(model, embedding, vocab_size)
    return group.name, group.module


class HeadAndEmbedding(NamedTuple):
    head_name: str
    head: nn.Module
    embedding_name: str
    embedding: nn.Module
    tied: bool
    """One effective matrix (:func:`headwatch.model.weights.effective_tie`): one stored Parameter and no
    adapter changing one side only (LoRA on a tied ``lm_head`` unties it)."""


def find_head_and_embedding(
    model: nn.Module, head: str | nn.Module | None = None, embedding: str | nn.Module | None = None
) -> HeadAndEmbedding:
    """The output head and the input embedding, both ``(vocab_size, d_model)`` matrices.

    Raises:
        HeadwatchError: either cannot be found, the head has no 2-D ``weight``, or the two
            weights differ in shape (a vocabulary mismatch).
    """
    head_name, head_module = find_output_head(model, head)
    weight = getattr(head_module, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise HeadwatchError(f"the output head `{head_name}` has no 2-D `weight`; pass head= explicitly")
    emb_name, emb = find_input_embedding(model, embedding, vocab_size=weight.shape[0])
    if emb.weight.shape != weight.shape:
        raise HeadwatchError(
            f"vocabulary mismatch: the input embedding `{emb_name}` has weight {tuple(emb.weight.shape)} but "
            f"the output head `{head_name}` has weight {tuple(weight.shape)}; per-row comparisons need "
            "both to be (vocab_size, d_model)"
        )
    return HeadAndEmbedding(head_name, head_module, emb_name, emb, effective_tie(head_module, emb).tied)


def _has_matrix_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.ndim == 2


def _linear_list(model: nn.Module, limit: int = 20) -> str:
    items = [_describe(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not items:
        return "none"
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _raise_ambiguous(
    model: nn.Module, candidates: list[tuple[str, nn.Module]], why: str, argument: str = "head"
) -> None:
    listing = ", ".join(_describe(n, m) for n, m in candidates)
    what = "output head" if argument == "head" else "input embedding"
    raise HeadwatchError(
        f"the {what} of {type(model).__name__} is ambiguous ({why}): {listing}. "
        f"Pass one explicitly, e.g. {argument}={candidates[0][0]!r}."
    )


def logits_from_output(output: Any) -> Tensor | None:
    """The logits tensor in a head's output: the tensor itself, ``output.logits``, or ``output[0]``."""
    logits = output
    if not isinstance(logits, Tensor):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
    return logits if isinstance(logits, Tensor) and logits.is_floating_point() else None


MaskFn = Callable[[Any], Tensor]
TargetsFn = Callable[[Any], Tensor]


# ---------------------------------------------------------------- one call for a monitor's attach
class Matrices(NamedTuple):
    """What a monitor needs to know about the two vocabulary-sized matrices of a model."""

    head_name: str
    head: nn.Module
    embedding: EmbeddingGroup
    tie: TieState
    trains: dict[str, Trainability]
    """``{"head": ..., "embedding": ...}`` from :func:`~headwatch.model.weights.trainable_matrices`."""
    config_message: str | None
    """:func:`~headwatch.model.weights.config_tie_mismatch` (warn it once), None when config and storage agree."""

    def text(self) -> str:
        """One paragraph for the console and the TensorBoard text (say it once)."""
        shape = tuple(self.embedding.weight.shape)
        members = ", ".join(f"`{n}`" for n, _ in self.embedding.modules)
        parts = [f"head `{self.head_name}` and embedding {members} {shape}: {self.tie.reason}."]
        for role, state in self.trains.items():
            name = self.head_name if role == "head" else self.embedding.name
            if not state.trains:
                parts.append(f"`{name}` is FROZEN: it gets no gradient, so its gradient density is not measured.")
            elif state.kind == "trainable_tokens" and state.gradient_parameter is None:
                parts.append(
                    f"`{name}` trains only the rows listed in PEFT's token_indices (trainable tokens: a separate "
                    "(k, d_model) delta written over a frozen matrix), so per-row gradient statistics over its "
                    "vocabulary are not computed; its update statistics are those of the effective matrix."
                )
            elif state.gradient_parameter is None:
                parts.append(f"`{name}` trains through {state.kind}: its row gradient is the effective matrix's.")
        if self.config_message:
            parts.append(self.config_message)
        return " ".join(parts)


def resolve_matrices(
    model: nn.Module, head: str | nn.Module | None = None, embedding: str | nn.Module | None = None
) -> Matrices:
    """The head, the embedding group, their effective tie and what trains, in one call (``attach``).

    Raises:
        HeadwatchError: as :func:`find_output_head` (``head=``) and
            :func:`~headwatch.model.weights.find_embedding_group` (``embedding=``); or the two matrices differ in vocabulary size.
    """
    head_name, head_module = find_output_head(model, head)
    head_weight = storage_weight(head_module)
    if head_weight is None:
        raise HeadwatchError(f"the output head `{head_name}` has no 2-D `weight`; pass head= explicitly")
    rows = head_weight.shape[1] if getattr(head_module, "fan_in_fan_out", False) else head_weight.shape[0]
    group = find_embedding_group(model, embedding, vocab_size=rows)
    if group.weight.shape[0] != rows:
        raise HeadwatchError(
            f"vocabulary mismatch: the input embedding `{group.name}` has {group.weight.shape[0]} rows but the "
            f"output head `{head_name}` has {rows}; per-row comparisons need both to be (vocab_size, d_model)"
        )
    tie = effective_tie(head_module, group.module)
    trains = trainable_matrices(head_module, group.module)
    return Matrices(head_name, head_module, group, tie, trains, config_tie_mismatch(model, tie.storage_tied, head_module))
