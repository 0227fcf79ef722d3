"""PEFT adapters: the effective matrix is what the adapted module computes (its own forward is the
reference), ties are of effective matrices, and the effective head's gradient is autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwatch.functional.neighbors import nearest_neighbours
from headwatch.model.flows import HeadFlowCapture
from headwatch.model.weights import (
    effective_tie,
    effective_weight,
    find_embedding_group,
    trainable_matrices,
)
from tests.helpers.adapters import D, V, adapted, tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def head_rows_by_forward(head) -> torch.Tensor:
    """``(V, D)`` rows of the head as its forward computes them: ``head(I) = I @ W_eff.T``."""
    with torch.no_grad():
        return head(torch.eye(D)).T


def test_lora_on_tied_head_is_effectively_untied():
    model = adapted(target_modules=["lm_head"])
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    w = effective_weight(head)
    torch.testing.assert_close(w, head_rows_by_forward(head), atol=1e-5, rtol=1e-5)
    assert (
        (w - head.get_base_layer().weight).abs().amax(dim=1).gt(0).all()
    )  # every row differs from the base
    state = effective_tie(head, emb)
    assert not state.tied and state.storage_tied and "LoRA on the head" in state.reason
    trains = trainable_matrices(head, emb)
    assert (
        trains["head"].trains
        and trains["head"].kind == "lora"
        and trains["head"].gradient_parameter is None
    )
    assert not trains[
        "embedding"
    ].trains  # PEFT froze the base: no lookup-flow gradient at all


def test_rare_row_planted_through_the_adapter_is_found_with_cosine_one():
    model = adapted(target_modules=["lm_head"])
    head = model.get_output_embeddings()
    A, B, s = (
        head.lora_A["default"].weight,
        head.lora_B["default"].weight,
        head.scaling["default"],
    )
    base = head.get_base_layer().weight
    rare, other = 61, 7
    with torch.no_grad():  # W_eff[rare] = base[rare] + s B[rare] A := base[other] + s B[other] A = W_eff[other]
        A[0] = base[other] - base[rare]
        B[other, 0] = 0.0
        B[rare] = B[other]
        B[rare, 0] = 1.0 / s
    rows = head_rows_by_forward(head)
    torch.testing.assert_close(
        rows[rare], rows[other], atol=1e-5, rtol=1e-5
    )  # the head scores them alike
    found = nearest_neighbours(effective_weight(head), torch.tensor([rare]))
    assert found.index.item() == other and found.cosine.item() == pytest.approx(
        1.0, abs=1e-5
    )
    assert (
        nearest_neighbours(base, torch.tensor([rare])).cosine.item() < 0.9
    )  # what reading .weight reports


def test_effective_head_gradient_and_update_under_lora():
    model = adapted(target_modules=["lm_head"])
    head = model.get_output_embeddings()
    capture = HeadFlowCapture(head).attach()
    capture.active = True
    seen = {}

    def keep_input(module, args, output):
        seen["h"] = args[0].detach()

    handle = head.register_forward_hook(keep_input)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    handle.remove()
    # reference: autograd on an explicit leaf W_eff, same hidden states, same loss
    w_eff = effective_weight(head, copy=True).requires_grad_(True)
    logits = F.linear(seen["h"], w_eff)  # (B, T, V)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, out.loss.detach(), atol=1e-6, rtol=1e-6)
    loss.backward()
    torch.testing.assert_close(capture.gradient, w_eff.grad, atol=1e-6, rtol=1e-5)
    assert (
        head.get_base_layer().weight.grad is None
    )  # what reading .weight.grad would give

    before, base_before = (
        effective_weight(head, copy=True),
        head.get_base_layer().weight.detach().clone(),
    )
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    changed = (effective_weight(head) - before).abs().amax(dim=1) > 0
    assert (
        changed.float().mean().item() == 1.0
    )  # update/head_row_density of the effective head
    assert torch.equal(
        head.get_base_layer().weight, base_before
    )  # 0.0 when measured on .weight


def test_several_active_adapters_merged_and_disabled():
    model = adapted(target_modules=["lm_head"])
    model.add_adapter(
        "other",
        peft.LoraConfig(
            r=2, lora_alpha=2, target_modules=["lm_head"], init_lora_weights=False
        ),
    )
    model.base_model.set_adapter(["default", "other"])
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.active_adapters == ["default", "other"]
    torch.testing.assert_close(
        effective_weight(head), head_rows_by_forward(head), atol=1e-5, rtol=1e-5
    )
    expected = effective_weight(head)
    model.merge_adapter()  # writes the deltas into the Parameter the embedding shares
    torch.testing.assert_close(effective_weight(head), expected, atol=1e-5, rtol=1e-5)
    assert effective_tie(head, emb).tied
    torch.testing.assert_close(effective_weight(emb), expected, atol=1e-5, rtol=1e-5)
    with model.disable_adapter():
        disabled = effective_weight(
            head
        )  # merged and disabled: the forward unmerges first
        torch.testing.assert_close(
            disabled, head_rows_by_forward(head), atol=1e-5, rtol=1e-5
        )


def test_fan_in_fan_out_lora_rows():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_embd=D, n_layer=1, n_head=2, n_positions=16
        )
    )
    model = peft.get_peft_model(
        gpt2,
        peft.LoraConfig(
            r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
        ),
    )
    layer = model.base_model.model.transformer.h[0].attn.c_attn
    assert layer.fan_in_fan_out
    with torch.no_grad():
        rows = (
            layer(torch.eye(D)) - layer.get_base_layer().bias
        ).T  # Conv1D: x @ W + b, W (in, out)
    torch.testing.assert_close(effective_weight(layer), rows, atol=1e-5, rtol=1e-5)


def test_lora_on_the_embedding():
    model = adapted(target_modules=["embed_tokens"])
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        looked_up = emb(torch.arange(V))  # (V, D): the rows as the forward reads them
    torch.testing.assert_close(effective_weight(emb), looked_up, atol=1e-5, rtol=1e-5)
    group = find_embedding_group(model)
    assert [m for _, m in group.modules] == [
        emb
    ]  # the wrapper, not also its base layer: no double count
    state = effective_tie(head, emb)
    assert (
        not state.tied
        and state.storage_tied
        and "LoRA on the embedding" in state.reason
    )
    trains = trainable_matrices(head, emb)
    assert (
        trains["embedding"].trains and not trains["head"].trains
    )  # the tied head is the frozen base


def test_modules_to_save_head_is_the_trained_copy():
    model = adapted(target_modules=["q_proj"], modules_to_save=["lm_head"])
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    copy = head.modules_to_save["default"]
    with torch.no_grad():
        copy.weight[3] += 1.0
    torch.testing.assert_close(effective_weight(head), head_rows_by_forward(head))
    assert torch.equal(effective_weight(head), copy.weight.detach())
    state = effective_tie(head, emb)
    assert not state.tied and "modules_to_save" in state.reason
    trains = trainable_matrices(head, emb)
    assert (
        trains["head"].kind == "modules_to_save"
        and trains["head"].gradient_parameter is copy.weight
    )
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    assert copy.weight.grad is not None and head.original_module.weight.grad is None


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": ["lm_head"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    ],
)
def test_ensure_weight_tying_keeps_the_adapted_matrices_tied(lora):
    model = adapted(ensure_weight_tying=True, **lora)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    with torch.no_grad():
        looked_up = emb(torch.arange(V))
    torch.testing.assert_close(
        head_rows_by_forward(head), looked_up, atol=1e-5, rtol=1e-5
    )  # one matrix, by forward
    state = effective_tie(head, emb)
    assert state.tied and "share it too" in state.reason
    torch.testing.assert_close(
        effective_weight(head), effective_weight(emb), atol=1e-5, rtol=1e-5
    )


def test_resolve_matrices_says_what_trains_once():
    from headwatch.model.find import resolve_matrices

    lora_emb = resolve_matrices(adapted(target_modules=["embed_tokens"]))
    assert lora_emb.head_name.endswith("lm_head") and not lora_emb.tie.tied
    text = lora_emb.text()
    assert "lm_head` is FROZEN" in text and "embed_tokens` trains through lora" in text
    plain = resolve_matrices(tiny_llama())
    assert (
        plain.tie.tied and plain.config_message is None and "FROZEN" not in plain.text()
    )


def test_tied_split_holds_for_adapted_matrices_that_stay_tied():
    """ensure_weight_tying LoRA: lookup flow (all lookups) + scoring flow (g.T h) of the ONE effective
    matrix, each against autograd on a functional twin with two leaf copies of W_eff."""
    from headwatch.model.flows import LookupFlowCapture

    model = adapted(target_modules=["lm_head"], ensure_weight_tying=True)
    head = model.get_output_embeddings()
    assert effective_tie(head, model.get_input_embeddings()).tied
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    lookup, scoring = (
        LookupFlowCapture(find_embedding_group(model)).attach(),
        HeadFlowCapture(head).attach(),
    )
    lookup.active = scoring.active = True
    model(input_ids=ids, labels=ids).loss.backward()
    lookup.detach(), scoring.detach()

    w_eff = effective_weight(head, copy=True)
    w_lookup, w_scoring = (
        w_eff.clone().requires_grad_(True),
        w_eff.clone().requires_grad_(True),
    )
    seen = {}

    def keep_input(module, args, output):
        seen["h"] = args[0]  # not detached: the scoring path's h depends on the lookup

    handle = head.register_forward_hook(keep_input)
    model(inputs_embeds=w_lookup[ids])
    handle.remove()
    logits = F.linear(seen["h"], w_scoring)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    torch.testing.assert_close(lookup.gradient, w_lookup.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(scoring.gradient, w_scoring.grad, atol=1e-6, rtol=1e-5)


def test_gpt2_wte_and_lm_head_are_one_tied_matrix():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_embd=D, n_layer=1, n_head=2, n_positions=16
        )
    )
    group = find_embedding_group(gpt2)
    assert [n for n, _ in group.modules] == [
        "transformer.wte"
    ] and group.weight is gpt2.lm_head.weight
    assert effective_tie(gpt2.lm_head, group.module).tied


# each PEFT method that can adapt the head (a Linear) or the embedding, other than LoRA: (config, target, method named)
OTHER_ADAPTERS = {
    "dora_head": (
        lambda t: peft.LoraConfig(
            target_modules=t, r=4, use_dora=True, init_lora_weights=False
        ),
        "lm_head",
        "DoraLinearVariant",
    ),
    "dora_embedding": (
        lambda t: peft.LoraConfig(target_modules=t, r=4, use_dora=True),
        "embed_tokens",
        "DoraEmbeddingVariant",
    ),
    "ia3": (
        lambda t: peft.IA3Config(target_modules=t, feedforward_modules=[]),
        "lm_head",
        "PEFT ia3",
    ),
    "vera": (lambda t: peft.VeraConfig(target_modules=t, r=4), "lm_head", "PEFT vera"),
    "boft": (
        lambda t: peft.BOFTConfig(target_modules=t, boft_block_size=4),
        "lm_head",
        "PEFT boft",
    ),
    "oft": (lambda t: peft.OFTConfig(target_modules=t), "lm_head", "PEFT oft"),
    "oft_embedding": (
        lambda t: peft.OFTConfig(target_modules=t),
        "embed_tokens",
        "PEFT oft",
    ),
    "adalora": (
        lambda t: peft.AdaLoraConfig(target_modules=t, total_step=10),
        "lm_head",
        "PEFT adalora",
    ),
    "loha": (lambda t: peft.LoHaConfig(target_modules=t), "lm_head", "PEFT loha"),
    "lokr": (lambda t: peft.LoKrConfig(target_modules=t), "lm_head", "PEFT lokr"),
    "hra": (lambda t: peft.HRAConfig(target_modules=t), "lm_head", "PEFT hra"),
    "fourierft": (
        lambda t: peft.FourierFTConfig(target_modules=t),
        "lm_head",
        "PEFT fourierft",
    ),
    "hira_embedding": (
        lambda t: peft.HiraConfig(target_modules=t),
        "embed_tokens",
        "PEFT hira",
    ),
    "tinylora_embedding": (
        lambda t: peft.TinyLoraConfig(target_modules=t),
        "embed_tokens",
        "PEFT tinylora",
    ),
    "ln_tuning": (
        lambda t: peft.LNTuningConfig(target_modules=t),
        "lm_head",
        "PEFT ln_tuning",
    ),
}


@pytest.mark.parametrize("method", list(OTHER_ADAPTERS))
def test_other_peft_adapters_are_refused_naming_the_method(method):
    """IA3 scales the head, BOFT/OFT rotate it, DoRA rescales its columns, VeRA/AdaLoRA/LoHa/... add deltas of their
    own: the matrix that computes is not the base (checked: the adapted module's rows differ from it), and headwatch
    does not compute it, so attach refuses it with the method's name instead of measuring the base."""
    import warnings

    from headwatch.errors import HeadwatchError
    from headwatch.model.find import resolve_matrices

    config, target, named = OTHER_ADAPTERS[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own notes about tied layers
        model = peft.get_peft_model(tiny_llama(), config([target]))
    module = (
        model.get_output_embeddings()
        if target == "lm_head"
        else model.get_input_embeddings()
    )
    torch.manual_seed(1)
    with (
        torch.no_grad()
    ):  # a trained adapter: its parameters away from their identity initialisation
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
        rows = (
            head_rows_by_forward(module)
            if target == "lm_head"
            else module(torch.arange(V))
        )
    base = module.get_base_layer().weight if hasattr(module, "get_base_layer") else None
    assert base is not None and not torch.allclose(rows, base), (
        method
    )  # measuring the base would be wrong
    with pytest.raises(HeadwatchError, match=named):
        resolve_matrices(model)


def test_find_head_and_embedding_reports_the_effective_tie():
    from headwatch.model.find import find_head_and_embedding

    assert find_head_and_embedding(tiny_llama()).tied
    assert not find_head_and_embedding(
        adapted(target_modules=["lm_head"])
    ).tied  # was 1.0: the frozen base is shared
