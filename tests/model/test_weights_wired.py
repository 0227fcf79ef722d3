"""GradientDensity (core, through the plain loop) on the matrices that really train: a tied T5
(every lookup of the shared weight) and a LoRA head (the effective head's gradient and update)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwatch import Headwatch
from tests.helpers.weights import V as T5_V, t5_batch, tiny_t5, untied_twin

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
    from tests.helpers.adapters import V, adapted

    from headwatch.model.weights import effective_weight

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


def _collision(model, ids):
    from headwatch.core import NoReducer, Schedule, SynonymCollision, TokenCounts

    counts = TokenCounts(rare_max_count=1)
    collision = SynonymCollision(frequency=counts)
    for monitor in (counts, collision):
        monitor.configure(Schedule(1), NoReducer())
        monitor.attach(model)
    counts.step_start({"input_ids": ids}, 0, True)
    scalars, _ = collision.measure(counts.snapshot())
    return scalars, collision.last_result


def _ids(rare):
    """(2, 31): tokens 0-9 six times each (not rare), and each id of ``rare`` once (rare)."""
    return torch.cat([torch.arange(10).repeat(2, 3), torch.tensor(rare).reshape(2, 1)], dim=1)


def test_untrained_rows_are_counted_and_nobodys_collision():
    from tests.helpers.adapters import tiny_llama

    model = tiny_llama(tie=False)
    with torch.no_grad():
        for weight in (model.lm_head.weight, model.model.embed_tokens.weight):
            weight[60:] = 0.0  # reserved tokens, never trained
    scalars, result = _collision(model, _ids([60, 61]))
    for name in ("head", "embedding"):
        assert scalars[f"headwatch/collision/untrained_count_{name}"].item() == 4
        assert not set(result[name]["queries"].tolist()) & {60, 61, 62, 63}  # rare but untrained: not measured
        assert not set(result[name]["neighbour"].tolist()) & {60, 61, 62, 63}


def test_rare_row_planted_through_lora_collides_in_the_monitor():
    from tests.helpers.adapters import adapted

    model = adapted(target_modules=["lm_head"])
    head = model.get_output_embeddings()
    A, B, s = head.lora_A["default"].weight, head.lora_B["default"].weight, head.scaling["default"]
    base = head.get_base_layer().weight
    rare, other = 61, 7
    with torch.no_grad():
        A[0] = base[other] - base[rare]
        B[other, 0] = 0.0
        B[rare] = B[other]
        B[rare, 0] = 1.0 / s
    scalars, result = _collision(model, _ids([rare, 62]))
    rows = result["head"]["queries"].tolist()
    at = rows.index(rare)
    assert result["head"]["neighbour"][at].item() == other
    assert result["head"]["cosine"][at].item() == pytest.approx(1.0, abs=1e-5)  # was 0.75 on the frozen base
    assert "headwatch/collision/rare_rate_embedding" in scalars  # untied in effect: both matrices measured


def test_auto_added_token_frequency_follows_the_monitors_embedding(tmp_path):
    from torch import nn

    from headwatch import GradientDensityMonitor, HeadwatchError, TokenFrequency
    from headwatch.model.find import find_input_embedding
    from tests.helpers import TinyCausalLM, loader
    from tests.helpers.lightning_runs import make_trainer

    model = TinyCausalLM(vocab_size=64)
    model.extra = nn.Module()
    model.extra.embed_tokens = nn.Embedding(64, 16)  # a second embedding weight, unused in the forward
    with pytest.raises(HeadwatchError, match="ambiguous"):
        find_input_embedding(model)
    monitor = GradientDensityMonitor(embedding="embed_tokens", log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [monitor], max_steps=1)
    trainer.fit(model, loader())  # raised "ambiguous" before: the tracker ignored embedding=
    tracker = next(c for c in trainer.callbacks if isinstance(c, TokenFrequency))
    assert tracker.embedding == "embed_tokens"
    assert trainer.callback_metrics["headwatch/grad/embedding_row_density"] > 0
