"""The trainer matrix's rows for a family that scales its logits under a fused linear cross-entropy, and for fused
heads under bf16 (docs/supported.md): a tiny Granite (its forward divides the head's output by ``logits_scaling``)
whose forward is replaced as Cut Cross-Entropy's Granite patch replaces it (the final hidden states divided by
``logits_scaling`` before ``linear_cross_entropy``, so no logits exist), through the Hugging Face ``Trainer``,
Lightning and the plain loop, under bf16 autocast (``bf16=True``, ``precision="bf16-mixed"``, ``torch.autocast``)
and, in the loop, in float32.

References, independent of headwatch: the arguments of each ``linear_cross_entropy`` call of a training forward,
recorded by the patch itself (the scaled hidden states ``e``, the head's weight); in float32, float64 statistics of
``e @ W.T`` against the step's labels (shifted as the causal loss does); under bf16, the target NLL equals the loss's
own per-token values (``reduction="none"`` on the same ``e`` under the same autocast) and the other statistics equal
float64 statistics of the product as the loss's ``torch_compile`` implementation forms it (bf16 operands, a bf16
result); the gradients of an identical copy (the same patch,
the same autocast) by autograd on the batches the door trained on; the HF door's ``evaluate()`` (the patch's unfused
path): float64 statistics of a fresh forward of the evaluation rows under the same autocast.
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from types import MethodType

import lightning.pytorch as pl
import pytest
import torch

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from headwatch.model.at_loss import LossCalls
from tests.helpers.capture import assert_published, reference
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.matrices import GRANITE_SCALING as SCALING
from tests.helpers.matrices import granite
from tests.helpers.trainer_matrix import (
    STEPS,
    B,
    H,
    LitLoss,
    Rows,
    SeenCollator,
    assert_grads,
    assert_logits,
    headwatch_warnings,
    hf_args,
    logits_reference,
    transformers_trainer,
)  # fmt: skip

transformers = pytest.importorskip("transformers")
pytest.importorskip("cut_cross_entropy")

EVALUATIONS: list[dict] = []  # the HF door's evaluate() metrics, newest last

# Cut Cross-Entropy's Granite patch (``cut_cross_entropy/transformers/granite.py`` in its repository): the hidden
# states divided by ``logits_scaling`` "in place of the logits", then ``linear_cross_entropy``. The release on the
# package index ships no ``transformers`` subpackage: the test puts the same code in a module of that name, and
# records each training call's scaled hidden states (the reference's input).
PATCH = """
from transformers.modeling_outputs import CausalLMOutputWithPast
from cut_cross_entropy import linear_cross_entropy

CALLS = []

def cce_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    loss = logits = None
    if labels is not None and self.training:
        e = hidden_states / self.config.logits_scaling
        CALLS.append(e.detach().clone())
        loss = linear_cross_entropy(e, self.lm_head.weight, labels.to(e.device), shift=True, impl="torch_compile")
    else:
        logits = self.lm_head(hidden_states) / self.config.logits_scaling
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
    return CausalLMOutputWithPast(loss=loss, logits=logits)
"""


@pytest.fixture
def cce_granite(monkeypatch):
    """The patch's module; ``module.patch(model)`` replaces the model's forward."""
    LossCalls.restore()  # an earlier test's model may still listen: the patch binds the real function, unwrapped
    module = types.ModuleType("cut_cross_entropy.transformers.granite")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    code = compile(PATCH, "<cut_cross_entropy.transformers.granite>", "exec")
    exec(code, module.__dict__)  # noqa: S102 - the test's patch
    module.patch = lambda model: setattr(
        model, "forward", MethodType(module.cce_forward, model)
    )
    yield module
    LossCalls.restore()




def run(door: str, model, out, bf16: bool) -> tuple[list[dict], list[dict]]:
    """``STEPS`` steps of ``door`` (lr 0, every step a logging step): (published values per step, batches)."""
    rows = Rows(B * STEPS, seed=3)
    if door == "loop":
        data = list(torch.utils.data.DataLoader(rows, batch_size=B))
        values = []
        with Headwatch(
            model,
            monitors=["tokens", "logits", "gradients"],
            log_every_n_steps=1,
            figure_every_n_steps=0,
        ) as hw:
            for step, batch in enumerate(data):
                hw.step_start(batch, step)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(**batch).loss
                loss.backward()
                hw.before_optimizer_step()
                hw.after_optimizer_step()
                model.zero_grad()
                values.append(hw.step_end())
        return values, data
    if door == "lightning":
        logger = StepLogger()
        callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0, compare_loss="train_loss"),
                     GradientDensityMonitor(log_every_n_steps=1)]  # fmt: skip
        trainer = pl.Trainer(default_root_dir=out, max_steps=STEPS, log_every_n_steps=1, logger=logger, callbacks=callbacks,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                             devices=1, limit_val_batches=0, precision="bf16-mixed" if bf16 else "32-true")  # fmt: skip
        data = torch.utils.data.DataLoader(rows, batch_size=B)
        trainer.fit(LitLoss(model), data)
        return [
            {k: v[i] for k, v in logger.values.items() if k.startswith(f"{H}/")}
            for i in range(STEPS)
        ], list(data)
    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    trainer = transformers_trainer(model, hf_args(out, bf16=bf16), cb)
    seen = SeenCollator(trainer.data_collator)
    trainer.data_collator = seen
    trainer.train()
    logged = [r for r in trainer.state.log_history if f"{H}/logits/entropy" in r]
    EVALUATIONS.append(trainer.evaluate(Rows(4, seed=5)))
    return logged, seen.seen


def twin_grads(twin, batches, bf16: bool) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = twin(**batch).loss
        loss.backward()
        out.append(
            {
                "embedding": twin.get_input_embeddings().weight.grad.clone(),
                "head": twin.lm_head.weight.grad.clone(),
            }
        )
        twin.zero_grad()
    return out


@pytest.mark.parametrize(
    "door, bf16",
    [("hf_trainer", True), ("lightning", True), ("loop", True), ("loop", False)],
)
def test_a_scaled_family_under_a_fused_linear_cross_entropy(
    tmp_path, cce_granite, door, bf16
):
    from cut_cross_entropy import linear_cross_entropy

    model = granite()
    cce_granite.patch(model)
    twin = copy.deepcopy(model)  # the same patch, bound to the copy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, seen = run(door, model, tmp_path, bf16)
    calls = list(cce_granite.CALLS)
    if (
        door == "hf_trainer"
    ):  # evaluate(): the patch's unfused path, the logits over logits_scaling, under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            want = reference(model, Rows(4, seed=5).batch())
        assert_published(EVALUATIONS[-1], f"eval_{H}/val/logits", want)
    assert headwatch_warnings(caught) == []
    assert (
        len(values) == STEPS and len(calls) == STEPS
    )  # one fused call a step: no logits anywhere
    expected = twin_grads(twin, seen[:STEPS], bf16)
    weight = model.lm_head.weight.detach()
    for step in range(STEPS):
        got, e, labels = values[step], calls[step], seen[step]["labels"]
        if bf16:  # the product as the loss's torch_compile implementation forms it: bf16 operands, a bf16 result
            logits = (e.bfloat16() @ weight.bfloat16().T).double()
        else:
            logits = e.double() @ weight.double().T
        want = logits_reference([logits], [seen[step]])
        unscaled = logits_reference(
            [SCALING * logits], [seen[step]]
        )  # what the head itself would return
        assert (
            abs(unscaled["entropy"] - got[f"{H}/logits/entropy"]) > 1e-2
        )  # the scaling matters here
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                own = linear_cross_entropy(
                    e,
                    weight,
                    labels,
                    shift=True,
                    reduction="none",
                    impl="torch_compile",
                )
            keep = labels[:, 1:] != -100
            nll = (
                own[..., : keep.shape[1]][keep].double().mean().item()
            )  # the loss's own per-token values
            assert abs(got[f"{H}/logits/target_nll"] - nll) <= 1e-6 * nll
            want["nll"] = nll
        assert_logits(got, want)
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        assert_grads(
            got, expected[step], None, model.get_input_embeddings().padding_idx
        )
