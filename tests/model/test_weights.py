"""One weight held by several modules (tied T5), config vs storage, rows never trained, the
effective head's row gradient: each checked against autograd or a value computed from the batch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwatch.model.find import find_input_embedding
from headwatch.errors import HeadwatchError
from headwatch.functional.adapters import add_low_rank_, head_weight_gradient, zero_rows
from headwatch.functional.neighbors import nearest_neighbours
from headwatch.model.flows import HeadFlowCapture, LookupFlowCapture
from headwatch.model.weights import (
    config_tie,
    config_tie_mismatch,
    effective_tie,
    find_embedding_group,
    warn_config_tie_once,
)
from tests.helpers.weights import D, T5_MEMBERS, V, t5_batch, tiny_t5, untied_twin

transformers = pytest.importorskip("transformers")

def test_tied_t5_is_one_embedding_of_three_modules():
    model = tiny_t5()
    group = find_embedding_group(model)
    assert {n for n, _ in group.modules} == T5_MEMBERS
    assert group.name == "shared" and group.weight is model.lm_head.weight
    assert find_input_embedding(model)[0] == "shared"  # was: "ambiguous embedding"
    told = find_embedding_group(model, embedding="decoder.embed_tokens")
    assert told.name == "decoder.embed_tokens" and {n for n, _ in told.modules} == T5_MEMBERS
    assert effective_tie(model.lm_head, group.module).tied


def test_untied_t5_has_two_weights_and_asks_which():
    model = untied_twin(tiny_t5())
    with pytest.raises(HeadwatchError, match=r"ambiguous .*Pass one explicitly, e\.g\. embedding="):
        find_embedding_group(model)
    assert {n for n, _ in find_embedding_group(model, embedding="encoder.embed_tokens").modules} == {"encoder.embed_tokens"}


@pytest.mark.parametrize("name", ["encoder.embed_tokenz", "decoder"])
def test_wrong_embedding_name_says_embedding(name):
    with pytest.raises(HeadwatchError, match=rf"`embedding={name!r}`.*Embeddings found: shared"):
        find_input_embedding(tiny_t5(), embedding=name)


@pytest.mark.parametrize("encoder_length", [8, 12])
def test_tied_t5_lookup_flow_over_all_lookups_matches_untied_twin(encoder_length):
    model = tiny_t5()
    twin = untied_twin(model)
    batch = t5_batch(encoder_length)
    capture = LookupFlowCapture(find_embedding_group(model)).attach()
    capture.active = True
    model(**batch).loss.backward()
    twin(**batch).loss.backward()

    # expected density from the batch: distinct ids over the encoder and the decoder inputs
    decoder_ids = model._shift_right(batch["labels"])
    expected = torch.cat([batch["input_ids"].flatten(), decoder_ids.flatten()]).unique().numel()
    lookup = capture.gradient
    rows = int((lookup.abs().amax(dim=1) > 0).sum())
    assert rows == expected and int(capture.looked_up.sum()) == expected  # density rows / V
    assert rows > batch["input_ids"].unique().numel()  # one hooked module would miss the decoder's lookups

    # the split against autograd on the untied twin: E = sum of the lookup modules' grads, H = lm_head's
    e_ref = twin.encoder.embed_tokens.weight.grad + twin.decoder.embed_tokens.weight.grad
    assert twin.shared.weight.grad is None
    torch.testing.assert_close(lookup, e_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.shared.weight.grad - lookup, twin.lm_head.weight.grad, atol=1e-6, rtol=1e-5)
    capture.detach()
    assert capture.error is None


def test_capture_is_idle_when_inactive():
    model = tiny_t5()
    capture = LookupFlowCapture(find_embedding_group(model)).attach()
    model(**t5_batch()).loss.backward()
    assert capture.gradient is None and capture.looked_up is None


def test_config_says_tied_storage_untied_warns_once_storage_wins():
    model = tiny_t5(tie=True)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untie the storage only
    storage = effective_tie(model.lm_head, find_embedding_group(model).module)
    assert not storage.tied and not storage.storage_tied and config_tie(model) is True
    with pytest.warns(UserWarning, match=r"tie_word_embeddings=True.*two separate Parameters.*tied=False"):
        warn_config_tie_once(model, storage.storage_tied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_config_tie_once(model, storage.storage_tied) is not None  # same message, not warned again


def test_config_says_untied_storage_tied():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    assert config_tie(model) is False and model.lm_head.weight is not model.model.embed_tokens.weight
    model.lm_head.weight = model.model.embed_tokens.weight  # tied by hand after loading
    state = effective_tie(model.lm_head, find_embedding_group(model).module)
    assert state.tied
    with pytest.warns(UserWarning, match=r"tie_word_embeddings=False.*one shared Parameter.*tied=True"):
        warn_config_tie_once(model, state.storage_tied)
    assert config_tie_mismatch(tiny_t5(tie=True), True) is None
    assert config_tie(nn.Linear(2, 2)) is None


def test_zero_rows_are_their_own_group_and_nobodys_collision():
    torch.manual_seed(0)
    w = torch.randn(10, 4)
    w[[2, 5, 7]] = 0.0  # never trained (reserved tokens)
    w[8] = 1e-30  # below float32 squares' underflow, but not zero
    w[9] = w[3]  # a real duplicate
    assert zero_rows(w).nonzero().flatten().tolist() == [2, 5, 7]
    assert zero_rows(w, rtol=1e-3).nonzero().flatten().tolist() == [2, 5, 7, 8]
    valid = ~zero_rows(w, rtol=1e-3)  # tiny rows too: their cosine is meaningless in float32
    found = nearest_neighbours(w, torch.arange(10), valid)
    assert set(found.index.tolist()).isdisjoint({2, 5, 7, 8})
    assert found.cosine[[2, 5, 7]].tolist() == [0.0, 0.0, 0.0]  # a zero row collides with nobody
    assert found.index[9].item() == 3 and found.cosine[9].item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(HeadwatchError, match="rtol"):
        zero_rows(w, rtol=-1.0)


def test_head_weight_gradient_matches_autograd_in_chunks():
    torch.manual_seed(0)
    h = torch.randn(3, 5, D, dtype=torch.float64)
    w_eff = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (3, 5))
    logits = h @ w_eff.T  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
    loss.backward()
    acc = torch.zeros(V, D)
    for half in (slice(0, 2), slice(2, 3)):  # micro-batches add into one accumulator
        head_weight_gradient(h[half], g[half], out=acc, max_chunk_bytes=4 * (V + D) * 2)
    torch.testing.assert_close(acc.double(), w_eff.grad, atol=1e-7, rtol=1e-5)
    with pytest.raises(HeadwatchError, match=r"same leading shape"):
        head_weight_gradient(h[:, :4], g)


def test_head_flow_capture_equals_weight_grad_of_a_plain_head():
    model = tiny_t5()
    capture = HeadFlowCapture(model.lm_head).attach()
    capture.active = True
    model(**t5_batch()).loss.backward()
    twin_head_grad = untied_twin(tiny_t5())
    twin_head_grad(**t5_batch()).loss.backward()
    torch.testing.assert_close(capture.gradient, twin_head_grad.lm_head.weight.grad, atol=1e-6, rtol=1e-5)


def test_add_low_rank_chunks_match_one_product():
    torch.manual_seed(0)
    base, left, right = torch.randn(V, D), torch.randn(V, 3), torch.randn(3, D)
    out = add_low_rank_(base.clone(), left, right, 0.5, max_chunk_bytes=4 * (D + 3) * 5)
    torch.testing.assert_close(out.double(), base.double() + 0.5 * left.double() @ right.double(), atol=1e-5, rtol=1e-6)
    with pytest.raises(HeadwatchError, match=r"left \[V, r\]"):
        add_low_rank_(base, left, right.T, 1.0)


def test_resolve_matrices_on_tied_t5():
    from headwatch.model.find import resolve_matrices

    found = resolve_matrices(tiny_t5())
    assert found.head_name == "lm_head" and found.tie.tied and found.tie.storage_tied
    assert {n for n, _ in found.embedding.modules} == T5_MEMBERS
    assert found.trains["head"].gradient_parameter is found.embedding.weight
    with pytest.raises(HeadwatchError, match=r"`embedding='encoder'`"):
        resolve_matrices(tiny_t5(), embedding="encoder")


def test_config_of_the_model_that_holds_the_head():
    class Distill(nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher, self.student = tiny_t5(tie=True), tiny_t5(tie=True)
            self.student.config.tie_word_embeddings = False  # says untied, stored tied

    both = Distill()
    assert config_tie(both, both.teacher.lm_head) is True
    assert config_tie(both, both.student.lm_head) is False
    assert config_tie_mismatch(both, True, both.teacher.lm_head) is None
    assert "tie_word_embeddings=False" in config_tie_mismatch(both, True, both.student.lm_head)
    llava = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(
            vocab_size=V, hidden_size=D, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False
        ).to_dict()
    )
    holder = nn.Module()
    holder.config = llava
    assert config_tie(holder) is False  # a multimodal config: its text model's setting


def test_scaled_embedding_lookup_flow_matches_untied_twin():
    # Gemma 2 multiplies the looked-up rows by sqrt(d_model) inside its embedding's forward: the
    # lookup flow is sqrt(d_model) times the scattered output gradient (it was 1/sqrt(d_model) of the truth)
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, final_logit_softcapping=30.0,
    )
    model = transformers.Gemma2ForCausalLM(config).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    twin = copy.deepcopy(model)
    twin.lm_head.weight = nn.Parameter(twin.lm_head.weight.detach().clone())
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    capture = LookupFlowCapture(find_embedding_group(model)).attach()
    capture.active = True
    model(input_ids=ids, labels=ids).loss.backward()
    twin(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(capture.gradient, twin.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.lm_head.weight.grad - capture.gradient, twin.lm_head.weight.grad, atol=1e-6, rtol=1e-5)
    assert capture.error is None
    capture.detach()
