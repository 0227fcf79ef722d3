"""Keep the tie, add a learnable ``d_model x d_model`` projection before the tied head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headwatch.model.find import find_head_and_embedding
from headwatch.errors import HeadwatchError, check_instance, check_module_or_name, check_optional, check_tensor


class TiedOutputProjection(nn.Module):
    """Scores ``logits = (h P) E^T (+ bias)`` with the tied matrix ``E`` and a learnable ``P``.

    ``E`` is the input embedding's own Parameter, registered here as ``weight`` (exactly as a
    tied ``nn.Linear`` head holds it), so ``module.weight is embedding.weight``: the model stays
    tied, the monitors find ``weight`` like any head's, ``named_parameters()`` lists ``E`` once.
    ``P`` (``projection``, ``(d_model, d_model)``) starts at the identity, so adding the module
    changes no logit: ``h @ I`` multiplies by exact ones and adds exact zeros. Parameters added:
    ``d_model ** 2``.

    Shapes: ``h`` ``(..., d_model)`` -> logits ``(..., vocab_size)``.

    Args:
        weight: the tied ``(vocab_size, d_model)`` Parameter ``E``.
        bias: the old head's bias ``(vocab_size,)`` or None (kept as it was).

    Raises:
        HeadwatchError: ``weight`` is not a 2-D Parameter, or ``bias`` has the wrong shape.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        check_tensor("weight", weight, ndim=2, parameter=True)  # the tied (vocab_size, d_model) matrix
        V, d = weight.shape
        check_optional(check_tensor, "bias", bias, ndim=1)
        if bias is not None and tuple(bias.shape) != (V,):
            raise HeadwatchError(f"`bias` must have shape ({V},), got {tuple(bias.shape)}")
        self.weight = weight
        self.bias = bias
        self.projection = nn.Parameter(torch.eye(d, dtype=weight.dtype, device=weight.device))
        self.in_features = d  # nn.Linear's names, read by transformers' _adjust_bias / resizing code
        self.out_features = V

    def forward(self, hidden: Tensor) -> Tensor:
        projected = F.linear(hidden, self.projection.T)  # (..., d): h @ P
        return F.linear(projected, self.weight, self.bias)  # (..., V): (h P) E^T + b

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def install_tied_projection(
    model: nn.Module, *, head: str | nn.Module | None = None, embedding: str | nn.Module | None = None
) -> TiedOutputProjection:
    """Replace a tied model's output head by a :class:`TiedOutputProjection`, in place.

    The head is found as the monitors find it (``get_output_embeddings()`` for Hugging Face,
    then ``lm_head``-like names) and replaced under the same name, so Hugging Face's
    ``get_output_embeddings()`` returns the new module. Logits are unchanged at this moment.
    Build the optimizer after this call (``P`` is a new Parameter) and attach the monitors
    after it too (they hook the head module). A Hugging Face model so changed does not reload
    with ``from_pretrained`` (its class has no ``projection``): save its ``state_dict``.

    Returns:
        The installed module.

    Raises:
        HeadwatchError: an invalid argument; the head and the embedding are not tied, or the head is not a
            ``Linear``-like module holding ``weight`` (and optionally ``bias``).
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    check_module_or_name("head", head)
    check_module_or_name("embedding", embedding)
    found = find_head_and_embedding(model, head, embedding)
    if not found.tied:
        raise HeadwatchError(
            f"the output head `{found.head_name}` is not tied to `{found.embedding_name}`: a TiedOutputProjection "
            "keeps a tie, so there must be one (use an untied head as it is)"
        )
    if isinstance(found.head, TiedOutputProjection):
        raise HeadwatchError(f"`{found.head_name}` is already a TiedOutputProjection")
    if not found.head_name:
        raise HeadwatchError("the model itself is the head; install the projection on the model that contains it")
    bias = getattr(found.head, "bias", None)
    new = TiedOutputProjection(found.embedding.weight, bias if isinstance(bias, nn.Parameter) else None)
    parent_name, _, leaf = found.head_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)
    return new
