"""GradientDensity (core, through the plain loop) on the matrices that really train: a tied T5
(every lookup of the shared weight) and a LoRA head (the effective head's gradient and update)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwatch import Headwatch
from tests.test_weights import V as T5_V
from tests.test_weights import t5_batch, tiny_t5, untied_twin

peft = pytest.importorskip("peft")


def _one_step(model, batch, lr=0.0):
    hw = Headwatch(model, monitors=["gradients"], log_every_n_steps=1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    hw.step_start(batch, 0)
    model(**batch).loss.backward()
    hw.before_optimizer_step()
    opt.step()
    hw.after_optimizer_step()
    values = hw.step_end()
    hw.close()
    return values


def test_tied_t5_lookup_flow_counts_encoder_and_decoder_lookups():
    model, batch = tiny_t5(), t5_batch()
    twin = untied_twin(model)
    twin(**batch).loss.backward()
    values = _one_step(model, batch)
    decoder_ids = model._shift_right(batch["labels"])
    distinct = torch.cat([batch["input_ids"].flatten(), decoder_ids.flatten()]).unique().numel()
    assert values["headwatch/grad/tied"] == 1.0
    assert values["headwatch/grad/embedding_row_density"] == pytest.approx(distinct / T5_V, abs=1e-7)
    lookup = twin.encoder.embed_tokens.weight.grad + twin.decoder.embed_tokens.weight.grad
    norm_max = torch.linalg.vector_norm(lookup, dim=1).max().item()
    assert values["headwatch/grad/embedding_row_norm_max"] == pytest.approx(norm_max, rel=1e-5)
    head_max = torch.linalg.vector_norm(twin.lm_head.weight.grad, dim=1).max().item()
    assert values["headwatch/grad/head_row_norm_max"] == pytest.approx(head_max, rel=1e-5)


def test_lora_head_gradient_and_update_are_of_the_effective_head():
    from tests.test_adapters import V, adapted

    from headwatch.weights import effective_weight

    model = adapted(target_modules=["lm_head"])
    head = model.get_output_embeddings()
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    seen = {}

    def keep_input(module, args, output):
        seen["h"] = args[0].detach()

    handle = head.register_forward_hook(keep_input)
    w_eff = effective_weight(head, copy=True).requires_grad_(True)
    with pytest.warns(UserWarning, match="embed_tokens` is FROZEN"):
        values = _one_step(model, {"input_ids": ids, "labels": ids}, lr=0.1)
    handle.remove()
    logits = F.linear(seen["h"], w_eff)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    assert values["headwatch/grad/tied"] == 0.0  # was 1.0: the frozen base is shared, the effective head is not
    assert "headwatch/grad/embedding_row_density" not in values  # frozen: not logged as zeros
    assert values["headwatch/grad/head_row_density"] == 1.0
    norm_max = torch.linalg.vector_norm(w_eff.grad, dim=1).max().item()
    assert values["headwatch/grad/head_row_norm_max"] == pytest.approx(norm_max, rel=1e-5)
    assert values["headwatch/update/head_row_density"] == 1.0  # was 0.0 on the frozen .weight
