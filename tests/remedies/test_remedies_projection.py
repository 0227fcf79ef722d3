"""TiedOutputProjection: unchanged logits at the identity; the monitors still see a tied head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwatch import HeadwatchError, SynonymCollisionMonitor
from headwatch.model.find import find_head_and_embedding
from headwatch.remedies import TiedOutputProjection, install_tied_projection
from tests.helpers import TinyCausalLM, loader
from tests.helpers.gradients import GradRecorder, Recording
from tests.helpers.lightning_runs import make_trainer

V, D = 64, 16


def test_identity_projection_leaves_logits_exactly_unchanged():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    ids = torch.randint(0, V, (4, 12))
    before = model(ids).detach()
    n_before = sum(p.numel() for p in model.parameters())
    proj = install_tied_projection(model)
    assert model.lm_head is proj and proj.weight is model.embed_tokens.weight
    assert torch.equal(proj.projection, torch.eye(D))
    assert (model(ids).detach() - before).abs().max().item() == 0.0
    assert sum(p.numel() for p in model.parameters()) == n_before + D * D


def test_forward_is_h_p_e_transpose_in_float64():
    torch.manual_seed(0)
    E = nn.Parameter(torch.randn(V, D))
    proj = TiedOutputProjection(E, nn.Parameter(torch.randn(V)))
    with torch.no_grad():
        proj.projection.copy_(torch.randn(D, D))
    h = torch.randn(3, 5, D)
    expected = (h.double() @ proj.projection.double()) @ E.double().T + proj.bias.double()
    torch.testing.assert_close(proj(h).double(), expected, rtol=1e-5, atol=1e-5)


def test_hf_model_get_output_embeddings_returns_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, V, (2, 7))
    before = model(ids, labels=ids)
    proj = install_tied_projection(model)
    after = model(ids, labels=ids)
    assert model.get_output_embeddings() is proj
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    found = find_head_and_embedding(model)
    assert found.head is proj and found.tied


def test_refuses_untied_and_double_install():
    with pytest.raises(HeadwatchError, match="not tied.*keeps a tie"):
        install_tied_projection(TinyCausalLM(V, D, tie_weights=False))
    model = TinyCausalLM(V, D, tie_weights=True)
    install_tied_projection(model)
    with pytest.raises(HeadwatchError, match="already a TiedOutputProjection"):
        install_tied_projection(model)
    with pytest.raises(HeadwatchError, match=r"`bias` must have shape \(64,\)"):
        TiedOutputProjection(model.embed_tokens.weight, nn.Parameter(torch.zeros(3)))


def _projected_twins():
    """A tied model with a projection P (not the identity), and its untied twin: same values, two E's."""
    torch.manual_seed(0)
    tied = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=True)
    install_tied_projection(tied)
    with torch.no_grad():
        tied.lm_head.projection.add_(0.1 * torch.randn(D, D))
    untied = TinyCausalLM(vocab_size=V, d_model=D, tie_weights=False)
    untied.lm_head = TiedOutputProjection(nn.Parameter(tied.embed_tokens.weight.detach().clone()))
    untied.load_state_dict(tied.state_dict())
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    return tied, untied


def test_gradient_density_tied_split_is_still_exact(tmp_path):
    """The monitor's lookup/scoring split of E's gradient equals the untied twin's two gradients (autograd)."""
    tied, untied = _projected_twins()
    data = loader(n=8, batch_size=8)
    rec = Recording(log_every_n_steps=1)
    make_trainer(tmp_path, [rec], max_steps=1).fit(tied, data)
    assert rec.tied
    twin = GradRecorder()
    make_trainer(tmp_path, [twin], max_steps=1).fit(untied, data)
    flows = rec.recorded[0]
    assert twin.grads[0]["head"].abs().sum() > 0
    torch.testing.assert_close(flows["embedding"], twin.grads[0]["embedding"], rtol=0, atol=1e-6)
    torch.testing.assert_close(flows["head"], twin.grads[0]["head"], rtol=0, atol=1e-6)


def test_collision_monitor_measures_e(tmp_path):
    tied, _ = _projected_twins()
    monitor = SynonymCollisionMonitor(every_n_steps=1)
    make_trainer(tmp_path, [monitor], max_steps=1).fit(tied, loader(n=8, batch_size=8))
    assert monitor.tied
    matrices = monitor._matrices()
    assert list(matrices) == ["head"]
    assert matrices["head"].data_ptr() == tied.embed_tokens.weight.data_ptr()  # E itself (the effective weight, no copy)
