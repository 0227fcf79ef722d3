"""Remedies against twins and autograd, and the paths other tests leave out.

- untie: the untied model trains exactly as a twin built untied; the tied gradient is the sum of the
  twin's two gradients (autograd on a shared leaf); the Llama 3 8B head's size on the meta device
  (BACKGROUND.md: 128,256 x 4,096 = 525,336,576); a T5 (more than one tie) is refused.
- projection: gradients of ``P`` and ``E`` against the closed forms in float64.
- warm-up: ``head_lr`` under an LR scheduler against a twin optimizer without the warm-up; a
  restored phase 1 drops the hooks; ``setup`` refusals.
- cost: the optional parameter count, folders, multimodal configs without ``--params``.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwatch import HeadwatchError
from headwatch.remedies import HeadWarmup, HeadWarmupCore, TiedOutputProjection, install_tied_projection, untie_output_head
from headwatch.remedies.cost import count_parameters, main as cost_main, read_config, shape_from_config, untie_cost

V, D = 32, 8


class Tiny(nn.Module):
    """Embedding -> tanh(Linear) -> head; ``tie`` shares one Parameter."""

    def __init__(self, tie: bool, bias: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=bias)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        h = self.embed_tokens(ids)  # (B, T, D)
        return self.lm_head(h + torch.tanh(self.mix(h)))  # (B, T, V)


def loss_of(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def batch(seed):
    return torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- untie


def test_an_untied_copy_trains_exactly_as_a_model_built_untied():
    torch.manual_seed(0)
    model = Tiny(tie=True).double()
    twin = Tiny(tie=False).double()
    twin.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # the head gets a copy of E
    assert torch.equal(twin.lm_head.weight, twin.embed_tokens.weight)
    # before: the shared leaf's gradient is the sum of the lookup's and the scoring's (autograd)
    loss_of(model, batch(0)).backward()
    loss_of(twin, batch(0)).backward()
    torch.testing.assert_close(model.embed_tokens.weight.grad, twin.embed_tokens.weight.grad + twin.lm_head.weight.grad,
                               rtol=1e-12, atol=1e-15)
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    untie_output_head(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    for step in range(3):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            loss_of(m, batch(step)).backward()
            o.step()
    for (name, a), (_, b) in zip(sorted(model.named_parameters()), sorted(twin.named_parameters())):
        assert torch.equal(a, b), name
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)  # they moved apart


def test_llama_3_8b_head_size_on_the_meta_device():
    class Meta(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.embed_tokens = nn.Embedding(128_256, 4_096, device="meta", dtype=dtype)
            self.lm_head = nn.Linear(4_096, 128_256, bias=False, device="meta", dtype=dtype)
            self.lm_head.weight = self.embed_tokens.weight

    for dtype, bytes_added in ((torch.float32, 2_101_346_304), (torch.bfloat16, 1_050_673_152)):
        model = Meta(dtype)
        report = untie_output_head(model)
        assert (report.vocab_size, report.d_model, report.params_added) == (128_256, 4_096, 525_336_576)  # V * d
        assert report.bytes_added == bytes_added and report.dtype == dtype  # 4 or 2 bytes a parameter
        assert model.lm_head.weight is not model.embed_tokens.weight and model.lm_head.weight.is_meta
    assert "+525,336,576 parameters, +1,050,673,152 bytes of weights" in str(report)
    assert "(128256 x 4096, bfloat16) initialised with a copy of the shared matrix" in str(report)
    assert untie_cost(128_256, 4_096).params_added == report.params_added  # headwatch cost agrees


def test_a_model_that_ties_more_than_its_head_is_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=V, d_model=D, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                   tie_word_embeddings=True)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(HeadwatchError, match=r"T5ForConditionalGeneration ties more than its output head \(also "
                                             r"decoder.embed_tokens.weight, encoder.embed_tokens.weight\)"):
        untie_output_head(model)
    assert model.lm_head.weight is model.shared.weight and model.config.tie_word_embeddings  # left as it was


def test_normal_init_std_from_a_text_sub_config():
    class TextConfig:
        initializer_range = 0.25

    class Config:
        initializer_range = None  # not a number: the text sub-config is read

        def get_text_config(self):
            return TextConfig()

    torch.manual_seed(0)
    model = nn.Module()
    model.inner = Tiny(tie=True)
    model.inner.embed_tokens = nn.Embedding(512, 64)  # a larger matrix: 32,768 draws
    model.inner.lm_head = nn.Linear(64, 512, bias=False)
    model.inner.lm_head.weight = model.inner.embed_tokens.weight
    model.inner.config = Config()
    report = untie_output_head(model, init="normal")
    w = model.inner.lm_head.weight.detach().double()
    # the sample std of 32,768 N(0, 0.25^2) draws: standard error 0.25 / sqrt(2 * 32768) = 0.001
    assert report.std == 0.25 and abs(w.std().item() - 0.25) < 0.005 and abs(w.mean().item()) < 0.01


# --------------------------------------------------------------------------- projection


def test_projection_gradients_match_the_closed_forms():
    torch.manual_seed(0)
    model = Tiny(tie=True, bias=True).double()
    proj = install_tied_projection(model)
    with torch.no_grad():
        proj.projection.add_(0.1 * torch.randn(D, D, dtype=torch.float64))
    ids = batch(1)
    loss_of(model, ids).backward()
    # the same function from fresh leaves: h, then logits = (h P) E^T + b
    E = model.embed_tokens.weight.detach().clone().requires_grad_(True)
    P = proj.projection.detach().clone()
    emb = E[ids]
    h = emb + torch.tanh(model.mix(emb))  # (B, T, D)
    logits = (h @ P) @ E.T + proj.bias.detach()  # (B, T, V)
    G = torch.autograd.grad(F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)), logits, retain_graph=True)[0]
    hf, Gf = h.detach().reshape(-1, D), G.reshape(-1, V)
    # dL/dP = h^T (G E); the scoring flow into E is G^T (h P); the lookup flow comes on top (tied)
    torch.testing.assert_close(proj.projection.grad, hf.T @ (Gf @ E.detach()), rtol=1e-10, atol=1e-12)
    scoring = Gf.T @ (hf @ P)
    lookup = torch.autograd.grad(h, E, grad_outputs=(G @ E.detach()) @ P.T)[0]
    torch.testing.assert_close(model.embed_tokens.weight.grad, scoring + lookup, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(proj.bias.grad, Gf.sum(0), rtol=1e-10, atol=1e-12)


def test_projection_keeps_the_bias_parameter_and_reads_like_a_linear():
    model = Tiny(tie=True, bias=True)
    bias = model.lm_head.bias
    proj = install_tied_projection(model, head="lm_head", embedding="embed_tokens")
    assert proj.bias is bias and (proj.in_features, proj.out_features) == (D, V)
    assert repr(proj) == f"TiedOutputProjection(in_features={D}, out_features={V}, bias=True)"


@pytest.mark.parametrize(("weight", "bias", "match"), [
    (torch.zeros(V, D), None, r"`weight` must be a 2-D nn.Parameter, got a float32 tensor of shape \(32, 8\)"),
    (nn.Parameter(torch.zeros(V)), None, r"got a float32 nn.Parameter of shape \(32,\)"),
    (nn.Parameter(torch.zeros(V, D)), nn.Parameter(torch.zeros(V + 1)), r"`bias` must have shape \(32,\), got \(33,\)"),
])
def test_projection_argument_errors(weight, bias, match):
    with pytest.raises(HeadwatchError, match=match):
        TiedOutputProjection(weight, bias)


def test_a_model_that_is_its_own_head_is_refused():
    class SelfHead(nn.Linear):
        def __init__(self):
            super().__init__(D, V, bias=False)
            self.emb = nn.Embedding(V, D)
            self.weight = self.emb.weight

    model = SelfHead()
    with pytest.raises(HeadwatchError, match="the model itself is the head"):
        install_tied_projection(model, head=model, embedding=model.emb)


# --------------------------------------------------------------------------- warm-up


def two_layer():
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 3)
    return nn.Sequential(body, head), body, head


def sgd_step(model, opt):
    opt.zero_grad()
    model(torch.ones(2, 4)).square().sum().backward()
    opt.step()


def test_head_lr_leaves_the_schedule_as_a_twin_without_warmup_sees_it():
    model, body, head = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    twin_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_opt, step_size=1, gamma=0.5)
    core = HeadWarmupCore(warmup_steps=2, head_lr=0.05)
    core.freeze(model, head.parameters())
    assert core.attach(opt, list(head.parameters()))
    body_before = body.weight.detach().clone()
    for step in range(4):
        core.step(step, [opt])
        before = head.weight.detach().clone()
        sgd_step(model, opt)
        # the head moved at head_lr during the warm-up, then at the scheduler's lr (0.4 * 0.5^step)
        used = 0.05 if step < 2 else 0.4 * 0.5**step
        torch.testing.assert_close(head.weight.detach(), before - used * head.weight.grad, rtol=0, atol=1e-6)
        if step < 2:
            assert torch.equal(body.weight, body_before) and body.weight.grad is None
        sched.step()
        twin_opt.step()
        twin_sched.step()
        assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"]  # the schedule never saw head_lr
    assert not torch.equal(body.weight, body_before) and core.switched_at_step == 2


def test_attach_only_where_it_can_act():
    model, body, head = two_layer()
    core = HeadWarmupCore(warmup_steps=3, head_lr=0.1)
    only_body = torch.optim.SGD(body.parameters(), lr=1.0)
    assert not core.attach(only_body, list(head.parameters()))  # no group holds a head parameter
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert core.attach(opt, list(head.parameters())) and not core.attach(opt, list(head.parameters()))  # once
    assert not HeadWarmupCore(warmup_steps=3).attach(opt, list(head.parameters()))  # no head_lr: nothing to do
    assert not HeadWarmupCore(warmup_steps=0, head_lr=0.1).attach(opt, list(head.parameters()))  # no warm-up


def test_freeze_is_done_once_and_never_after_the_warmup():
    model, body, head = two_layer()
    core = HeadWarmupCore(warmup_steps=2)
    frozen = core.freeze(model, head.parameters())
    assert [id(p) for p in frozen] == [id(body.weight), id(body.bias)]
    assert core.freeze(model, []) is frozen  # a second call changes nothing
    core.release()
    assert all(p.requires_grad for p in model.parameters())
    done = HeadWarmupCore(warmup_steps=0)
    assert done.phase == 1 and done.freeze(model, head.parameters()) == [] and body.weight.requires_grad


def test_a_restored_phase_1_releases_and_unhooks():
    model, body, head = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    core = HeadWarmupCore(warmup_steps=10, head_lr=0.05)
    core.freeze(model, head.parameters())
    core.attach(opt, list(head.parameters()))
    core.load_state_dict({"phase": 1, "switched_at_step": 7, "warmup_steps": 10, "head_lr": 0.05})
    assert core.phase == 1 and core.switched_at_step == 7 and body.weight.requires_grad
    before = head.weight.detach().clone()
    sgd_step(model, opt)  # the group's own lr: the hooks are gone
    torch.testing.assert_close(head.weight.detach(), before - 0.4 * head.weight.grad, rtol=0, atol=1e-6)
    assert core.state_dict() == {"phase": 1, "switched_at_step": 7, "warmup_steps": 10, "head_lr": 0.05}
    fresh = HeadWarmupCore(warmup_steps=4)
    fresh.load_state_dict({})  # an empty state keeps the constructor's phase
    assert fresh.phase == 0 and fresh.switched_at_step is None


def test_setup_refuses_several_processes_and_deepspeed():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    callback = HeadWarmup(warmup_steps=2)
    with pytest.raises(HeadwatchError, match=r"one process only \(world_size=1\), got world_size=2"):
        callback.setup(SimpleNamespace(world_size=2, strategy=None), None, "fit")
    deepspeed = object.__new__(DeepSpeedStrategy)  # an instance for isinstance, without deepspeed installed
    with pytest.raises(HeadwatchError, match="does not support the DeepSpeed strategy"):
        callback.setup(SimpleNamespace(world_size=1, strategy=deepspeed), None, "fit")
    assert callback.setup(SimpleNamespace(world_size=2, strategy=None), None, "validate") is None  # fit only
    assert callback.state_key != HeadWarmup(warmup_steps=3).state_key  # two warm-ups can share a checkpoint


def test_remedies_names_load_lazily():
    import headwatch.remedies as remedies

    assert dir(remedies) == sorted(["HeadWarmup", "HeadWarmupCore", "TiedOutputProjection", "UntieReport",
                                    "install_tied_projection", "untie_output_head"])
    with pytest.raises(AttributeError, match="module 'headwatch.remedies' has no attribute 'cost_of'"):
        remedies.cost_of  # noqa: B018


# --------------------------------------------------------------------------- cost


def test_the_parameter_count_is_optional(monkeypatch):
    assert count_parameters({"vocab_size": 10, "hidden_size": 4}) is None  # no model_type
    assert count_parameters({"model_type": "no_such_architecture", "vocab_size": 10}) is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # transformers not installed
    assert count_parameters({"model_type": "gpt2", "vocab_size": 10, "n_embd": 4, "n_layer": 1, "n_head": 1}) is None


def test_cost_from_a_folder_and_a_multimodal_config(tmp_path, capsys):
    config = {"model_type": "llava", "text_config": {"vocab_size": 1000, "hidden_size": 64, "tie_word_embeddings": False},
              "vision_config": {"hidden_size": 32}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path) == config  # a folder: its config.json
    assert cost_main(["--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"untying the output head of {tmp_path.name}: vocab_size 1,000 x d_model 64")
    assert "parameters added        64,000" in out and "share" not in out  # vision towers: no share without --params
    assert cost_main(["--config", str(tmp_path), "--params", "1064000", "--world-size", "3"]) == 0
    out = capsys.readouterr().out
    # shipped untied (the text config says so): N_tied = 1,064,000 - 64,000 = 1,000,000; share 64,000 / 1,064,000
    assert "model, tied             1,000,000" in out and "(ships untied)" in out and "6.02%" in out
    # FSDP over 3: ceil(64,000 / 3) = 21,334 parameters a GPU, 16 bytes each (fp32 AdamW)
    assert "1,024,000 (0.00 GB)  |  341,344 (0.00 GB)" in out


def test_shape_from_config_reads_the_hidden_size_under_any_of_its_names():
    assert shape_from_config({"vocab_size": 7, "dim": 3}) == (7, 3, True)  # tied unless the config says not
    assert shape_from_config({"vocab_size": 7, "n_embd": 5, "tie_word_embeddings": False}) == (7, 5, False)
    with pytest.raises(HeadwatchError, match=r"no int `vocab_size` and hidden size \(hidden_size/d_model/n_embd/dim\); "
                                             r"got vocab_size=None, keys \['hidden_size'\]"):
        shape_from_config({"hidden_size": 4})
    with pytest.raises(HeadwatchError, match="got vocab_size=7"):
        shape_from_config({"vocab_size": 7, "hidden_size": "4"})  # a hidden size that is not an int
