"""The plain-loop door under a loop that a library drives (docs/supported.md, "Accelerate loop" and "Fabric loop"):
``headwatch.Headwatch`` on the model that ``accelerate.Accelerator.prepare`` (gradient accumulation through
``accelerator.accumulate``, the backward through ``accelerator.backward``) or ``lightning.fabric.Fabric.setup``
(``fabric.backward``) returned; every published figure against an independent reference.

References: float64 statistics of the model's own ``outputs.logits`` of every loss forward scored against the
step's labels (shifted as the causal loss does); the real ``.grad`` at the optimizer step and the two ``.grad`` of
an untied twin trained on the same micro-batches by autograd (the tied matrix's lookup and scoring flows); the
model's own losses for the self-check.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from headwatch.integrations.loop import Headwatch
from tests.helpers.matrices import untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    B,
    H,
    LogitsRecorder,
    Rows,
    T,
    assert_grads,
    assert_logits,
    family,
    headwatch_warnings,
    logits_reference,
)  # fmt: skip

MICRO = 2  # micro-batches per optimizer step under accelerate


def twin_grads(twin, micro: list[list[dict]]) -> list[dict[str, torch.Tensor]]:
    """Autograd on the untied twin: each step's micro-batch losses, each divided by their count, accumulated."""
    out = []
    for group in micro:
        for batch in group:
            (twin(**batch).loss / len(group)).backward()
        out.append(
            {
                "embedding": twin.get_input_embeddings().weight.grad.clone(),
                "head": twin.lm_head.weight.grad.clone(),
            }
        )
        twin.zero_grad()
    return out


def accelerate_loop(model, rows) -> tuple[list[dict], list[dict], list[dict]]:
    """``MICRO`` micro-batches per optimizer step through ``accelerator.accumulate``; headwatch's step calls once
    per optimizer step, where ``accelerator.sync_gradients`` says the step is taken."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader(rows, batch_size=B, shuffle=False)
    prepared, opt, loader = accelerator.prepare(model, opt, loader)
    values, grads, seen = [], [], []
    try:
        with Headwatch(
            prepared,
            monitors=["tokens", "logits", "gradients"],
            log_every_n_steps=1,
            figure_every_n_steps=0,
        ) as hw:
            for i, batch in enumerate(loader):
                step = i // MICRO
                with accelerator.accumulate(prepared):
                    hw.step_start(batch, step)
                    seen.append(batch)
                    accelerator.backward(prepared(**batch).loss)
                    if accelerator.sync_gradients:
                        hw.before_optimizer_step()
                        grads.append(
                            {
                                "embedding": model.get_input_embeddings().weight.grad.clone(),
                                "head": model.lm_head.weight.grad.clone(),
                            }
                        )
                    opt.step()
                    if accelerator.sync_gradients:
                        hw.after_optimizer_step()
                    opt.zero_grad()
                    if accelerator.sync_gradients:
                        values.append(hw.step_end())
    finally:  # the Accelerator's state is process-wide: leave none to the next test's Trainer
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return values, grads, seen


def fabric_loop(model, rows) -> tuple[list[dict], list[dict], list[dict]]:
    """One batch per optimizer step: ``fabric.setup``, ``fabric.backward``."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(rows, batch_size=B, shuffle=False)
    )
    values, grads, seen = [], [], []
    with Headwatch(
        wrapped,
        monitors=["tokens", "logits", "gradients"],
        log_every_n_steps=1,
        figure_every_n_steps=0,
    ) as hw:
        for step, batch in enumerate(loader):
            hw.step_start(batch, step)
            seen.append(batch)
            fabric.backward(wrapped(**batch).loss)
            hw.before_optimizer_step()
            grads.append(
                {
                    "embedding": model.get_input_embeddings().weight.grad.clone(),
                    "head": model.lm_head.weight.grad.clone(),
                }
            )
            opt.step()
            hw.after_optimizer_step()
            opt.zero_grad()
            values.append(hw.step_end())
    return values, grads, seen


@pytest.mark.parametrize(
    "driver, name", [("accelerate", "llama_tied"), ("fabric", "gemma2_softcap")]
)  # a tied matrix under accumulation; an untied, soft-capped one
def test_a_loop_driven_by_accelerate_or_fabric_is_measured_exactly(driver, name):
    pytest.importorskip(driver if driver == "accelerate" else "lightning")
    model = family(name)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    twin = untied_twin(model) if tied else None
    per_step = MICRO if driver == "accelerate" else 1
    rows = Rows(B * STEPS * per_step, seed=3)
    recorder = LogitsRecorder(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, grads, seen = (
            accelerate_loop if driver == "accelerate" else fabric_loop
        )(model, rows)
    recorder.remove()
    assert headwatch_warnings(caught) == []
    assert (
        len(values) == STEPS
        and len(seen) == STEPS * per_step
        and len(recorder.logits) == STEPS * per_step
    )
    micro = [seen[s * per_step : (s + 1) * per_step] for s in range(STEPS)]
    expected = twin_grads(twin, micro) if twin is not None else None
    pad = model.get_input_embeddings().padding_idx
    for step, group in enumerate(micro):
        got = values[step]
        want = logits_reference(
            recorder.logits[step * per_step : (step + 1) * per_step], group
        )
        assert_logits(got, want)
        assert got[f"{H}/debug/capture/forwards"] == per_step
        assert got[f"{H}/tokens/total"] == B * T * per_step * (step + 1)
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(
            want["nll"], abs=2e-5
        )
        assert_grads(got, grads[step], expected[step] if expected else None, pad)
    if not tied:  # the premise (tied: assert_grads checks it): the real gradients are the loss's (over MICRO)
        plain = twin_grads(copy.deepcopy(model), micro)
        for step in range(STEPS):
            torch.testing.assert_close(
                grads[step]["head"], plain[step]["head"], rtol=1e-4, atol=1e-7
            )
