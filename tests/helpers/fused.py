"""Cut Cross-Entropy's transformers patch, for the tests of every door: a fused linear cross-entropy that never holds
the logits.

The patch (``cut_cross_entropy/transformers/llama.py`` with ``utils.apply_lce`` in its repository) replaces the causal
LM's forward with one that calls ``linear_cross_entropy`` (bound in the patch's module at import) on the final hidden
states and the head's weight, ``shift=True``. The release on the package index ships no ``transformers``
subpackage: the same code is put in a module of that name.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from types import MethodType

import pytest
import torch

from headwatch.model.at_loss import LossCalls

PATCH = """
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from cut_cross_entropy import linear_cross_entropy

def cce_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    loss = logits = None
    if labels is not None and self.training:
        loss = linear_cross_entropy(hidden_states, self.lm_head.weight, labels.to(hidden_states.device), shift=True,
                                    impl="torch_compile")
    else:
        logits = self.lm_head(hidden_states)
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
    return CausalLMOutputWithPast(loss=loss, logits=logits)
"""


def cut_cross_entropy_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[torch.nn.Module], None]]:
    """The body of a fixture: yields ``patch(model)``, which replaces a Llama's forward as Cut Cross-Entropy's
    transformers patch does; the loss-call wrappers are put back before and after."""
    pytest.importorskip("cut_cross_entropy")
    LossCalls.restore()  # an earlier test's model may still listen: the patch binds the real function, unwrapped
    module = types.ModuleType("cut_cross_entropy.transformers.llama")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    code = compile(PATCH, "<cut_cross_entropy.transformers.llama>", "exec")
    exec(code, module.__dict__)  # noqa: S102 - the test's patch
    yield lambda model: setattr(model, "forward", MethodType(module.cce_forward, model))
    LossCalls.restore()


def cce_token_nll(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The loss's own per-token values (``reduction="none"``, the same call) averaged in float64 over the positions
    it scores (``labels[t + 1] != -100``), and how many: ``(mean, positions)``."""
    import inspect

    from cut_cross_entropy import linear_cross_entropy

    # the function itself, not headwatch's listener around it: this reference call is no loss call of the step
    linear_cross_entropy = inspect.unwrap(linear_cross_entropy)
    own = linear_cross_entropy(
        hidden,
        weight.detach(),
        labels,
        shift=True,
        reduction="none",
        impl="torch_compile",
    )
    keep = labels[:, 1:] != -100
    return own[..., : keep.shape[1]][keep].double().mean(), int(keep.sum())
