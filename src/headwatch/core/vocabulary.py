"""The vocabulary a run really has: the tokenizer's size handed to the monitors, and the vocabulary-sized matrices
watched for a change after attach (``resize_token_embeddings``, an untie), re-resolved and said once.

The layout compared on a logging step (:func:`layout`) is read from the modules' declarations (an ``nn.Linear``'s
``out_features``, an ``nn.Embedding``'s ``num_embeddings``: :func:`~headwatch.model.weights.declared_shape`), the
modules' names and whether the head and the embedding hold one Parameter (a module replaced by one of the same name,
rows and tie is not told apart; a getter that builds a new wrapper at each call does not read as a change): host-side facts, the same on every
process whatever shards the weights, so every process re-resolves on the same step (no collective decides it, no
host-device sync).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import nn

from headwatch.core.frequency import TokenCounts
from headwatch.core.logits import LogitStats
from headwatch.core.monitor import Monitor
from headwatch.errors import HeadwatchError
from headwatch.model.find import find_input_embedding, find_output_head
from headwatch.model.weights import declared_shape


class Layout(NamedTuple):
    """The vocabulary-sized matrices of a model as resolved: which modules, how many rows, one Parameter or two."""

    head: str  # the head module's dotted name
    head_rows: int | None
    embedding: str  # the input embedding module's dotted name
    embedding_rows: int | None
    tied: bool

    def describe(self) -> str:
        tie = "tied" if self.tied else "untied"
        return f"head {self.head_rows} rows, embedding {self.embedding_rows} rows, {tie}"


def layout(model: nn.Module) -> Layout | None:
    """The :class:`Layout` of ``model`` as the default search finds it (:func:`find_output_head`,
    :func:`find_input_embedding`); None when it cannot be resolved (the monitors then say why at attach; a weight
    partitioned outside a gathering context, as DeepSpeed ZeRO-3 holds it between steps, is not read here)."""
    try:
        head_name, head = find_output_head(model)
        rows = (declared_shape(head) or (None, None))[0]
        emb_name, emb = find_input_embedding(model, vocab_size=rows)
    except (HeadwatchError, AttributeError, RuntimeError):
        return None
    weight = getattr(head, "weight", None)
    tied = weight is not None and weight is getattr(emb, "weight", None)
    return Layout(head_name, rows, emb_name, (declared_shape(emb) or (None, None))[0], tied)


class VocabularyWatch:
    """Re-resolve the monitors when the model's vocabulary-sized matrices change after attach.

    A door calls :meth:`remember` when it attaches (with how to attach again); the orchestrator calls :meth:`check`
    on each logging step: a changed :class:`Layout` is said once per change (a warning, never raised: what is measured changes)
    and every monitor is attached again. Nothing is checked between logging steps.
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.layout: Layout | None = None
        self.again: Callable[[], Any] | None = None

    def remember(self, model: nn.Module, again: Callable[[], Any]) -> None:
        """``model`` was just attached; ``again()`` attaches every monitor to it anew."""
        self.model, self.again, self.layout = model, again, layout(model)

    def check(self, warn_once: Callable[[str, str], None]) -> bool:
        """Whether the layout changed since :meth:`remember`; if so, say it once (``warn_once(key, message)``) and
        attach again. A model whose layout could not be resolved at attach is not watched."""
        if self.model is None or self.layout is None or self.again is None:
            return False
        now = layout(self.model)
        if now is None or now == self.layout:  # None: not resolvable now (a partitioned weight), not a change
            return False
        before = self.layout
        what = now.describe()
        warn_once(
            f"vocabulary:{before}->{now}",
            f"headwatch: the model's vocabulary-sized matrices changed after attach ({before.describe()} -> {what}: "
            "resize_token_embeddings, an untie or a replaced module); every monitor resolves them again on this step "
            "and measures the new rows from now on (row figures before and after cover different rows). (warned once)",
        )
        self.again()
        self.layout = layout(self.model)
        return True


def set_vocab_size(monitors: Sequence[Monitor], vocab_size: int, door_set: dict[int, int]) -> None:
    """Give ``vocab_size`` (the tokenizer's) to every :class:`TokenCounts` and :class:`LogitStats` that was not
    given one by the user (``door_set``: the values a door set before, by ``id`` of the monitor, updated here):
    rows ``>= vocab_size`` are then left out of the row figures and ``logits/padded_mass`` is published."""
    for m in monitors:
        attr = "vocab_size" if isinstance(m, TokenCounts) else "tokenizer_vocab_size" if isinstance(m, LogitStats) else None
        if attr is None:
            continue
        current = getattr(m, attr)
        if current is None or door_set.get(id(m)) == current:
            setattr(m, attr, vocab_size)
            door_set[id(m)] = vocab_size
