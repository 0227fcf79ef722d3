"""Remedies tell the truth: ``HeadWarmup`` never trains a tied model's shared matrix as
"the head only" (it refuses, or unties first with ``untie=True`` and says so), and ``untie_output_head``
after an optimizer exists either puts the new head into it (``optimizer=``, state copied or reset) or a
warning says the head will never move.

Every claim is checked on the parameter values themselves (bit for bit where nothing should move) and
on an AdamW step recomputed by hand in float64 from the gradients autograd gave, not on what the
functions report.
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from headwatch import HeadwatchError
from headwatch.remedies import HeadWarmup, HeadWarmupCore, install_tied_projection, untie_output_head
from tests.helpers import loader
from tests.helpers.lightning_runs import make_trainer

transformers = pytest.importorskip("transformers")

V, D = 64, 16
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8


def _tied(family: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2, n_positions=32,
                                         tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------- HeadWarmup (Lightning)
class Lit(pl.LightningModule):
    def __init__(self, family: str, build_in_configure_model: bool = False):
        super().__init__()
        self.family = family
        self.model = None if build_in_configure_model else _tied(family)

    def configure_model(self):
        if self.model is None:
            self.model = _tied(self.family)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        return self.optimizer


class Values(Callback):
    """The embedding and head matrices (values) before the fit and after every optimizer step."""

    def __init__(self):
        self.embedding, self.head = [], []

    def on_train_start(self, trainer, pl_module):
        self._take(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._take(pl_module)

    def _take(self, pl_module):
        self.embedding.append(pl_module.model.get_input_embeddings().weight.detach().clone())
        self.head.append(pl_module.model.get_output_embeddings().weight.detach().clone())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_warmup_on_a_tied_model_is_refused_and_nothing_trains(tmp_path, family):
    module = Lit(family)
    start = module.model.get_input_embeddings().weight.detach().clone()
    trainer = make_trainer(tmp_path, [HeadWarmup(warmup_steps=2)], max_steps=3)
    with pytest.raises(HeadwatchError, match="is tied to .* a head-only warm-up would train the input embedding too"):
        trainer.fit(module, loader(n=24))
    assert torch.equal(module.model.get_input_embeddings().weight.detach(), start)  # the shared matrix never stepped
    assert all(p.requires_grad for p in module.parameters())


@pytest.mark.parametrize(("family", "built_late"), [("gpt2", False), ("llama", False), ("llama", True)])
def test_warmup_with_untie_keeps_the_embedding_unchanged_then_trains_it(tmp_path, caplog, family, built_late):
    """``untie=True``: untied in ``setup`` (model built in ``__init__``) or, for a model built in
    ``configure_model``, in ``on_fit_start`` with the trainer's optimizer (the new head put into it)."""
    module = Lit(family, build_in_configure_model=built_late)
    values = Values()
    trainer = make_trainer(tmp_path, [HeadWarmup(warmup_steps=2, untie=True), values], max_steps=4)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, loader(n=32))
    said = caplog.text
    emb_name = "transformer.wte" if family == "gpt2" else "model.embed_tokens"
    if built_late:  # no head at setup: untied at fit start, into the trainer's optimizer
        assert f"HeadWarmup trains only `model.lm_head`, untied from `model.{emb_name}` first (untie=True" in said
        assert "the new head joined 1 optimizer(s) with a copy of the shared matrix's state" in said
    else:
        assert f"HeadWarmup(untie=True) untied `model.lm_head` from `model.{emb_name}` before the optimizer is built" in said
        assert "HeadWarmup trains only `model.lm_head` until step 2" in said
    model = module.model
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is not emb  # untied
    assert any(p is head for g in module.optimizer.param_groups for p in g["params"])
    # the values: during the warm-up (steps 0, 1) the embedding is bit for bit its start; the head moves every step
    assert torch.equal(values.embedding[1], values.embedding[0]) and torch.equal(values.embedding[2], values.embedding[0])
    for s in range(4):
        assert not torch.equal(values.head[s + 1], values.head[s]), s
    assert not torch.equal(values.embedding[3], values.embedding[2])  # after the switch the embedding trains
    assert torch.equal(values.head[0], values.embedding[0])  # untied as a copy: the same function at the start


def test_warmup_with_untie_on_a_resumed_fit_of_a_late_built_model_is_refused():
    core = HeadWarmupCore(warmup_steps=2, untie=True)
    model = _tied("llama")
    with pytest.raises(HeadwatchError, match="resumed fit.*configure_model"):
        core.head_parameters(model, resumed=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied, untouched


def test_core_refuses_a_shared_matrix_passed_as_a_head_parameter():
    model = _tied("llama")
    core = HeadWarmupCore(warmup_steps=2)
    with pytest.raises(HeadwatchError, match="shared by `lm_head`, `model.embed_tokens`"):
        core.freeze(model, [model.lm_head.weight])
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(HeadwatchError, match="would train the input embedding too"):
        core.head_parameters(model)


def test_a_tied_projection_warms_up_its_projection_not_the_embedding():
    model = _tied("llama")
    proj = install_tied_projection(model)
    core = HeadWarmupCore(warmup_steps=2)
    params, what = core.head_parameters(model)
    assert [id(p) for p in params] == [id(proj.projection)] and "stays frozen" in what
    core.freeze(model, params)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    emb0, p0 = model.model.embed_tokens.weight.detach().clone(), proj.projection.detach().clone()
    for step in range(2):
        opt.zero_grad()
        model(**_batch(step)).loss.backward()
        opt.step()
    assert torch.equal(model.model.embed_tokens.weight.detach(), emb0)  # E: bit for bit
    assert not torch.equal(proj.projection.detach(), p0)


# ----------------------------------------------------------------------------- untie_output_head + optimizer
def _adamw_by_hand(p: torch.Tensor, g: torch.Tensor, state: dict | None) -> tuple[torch.Tensor, dict]:
    """One AdamW step (Loshchilov & Hutter) in float64 from the state before it (None: a fresh state)."""
    b1, b2 = BETAS
    t = 1 if state is None else int(state["step"]) + 1
    m = (0 if state is None else state["exp_avg"].double()) * b1 + (1 - b1) * g.double()
    v = (0 if state is None else state["exp_avg_sq"].double()) * b2 + (1 - b2) * g.double() ** 2
    new = p.double() * (1 - LR * WD) - LR * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)
    return new, {"step": t, "exp_avg": m, "exp_avg_sq": v}


def _snapshot(optimizer, p):
    st = optimizer.state.get(p)
    return None if not st else {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}


@pytest.mark.parametrize(("family", "state"), [("gpt2", None), ("llama", "copy"), ("llama", "reset")])
def test_untie_with_the_optimizer_moves_the_new_head_and_keeps_the_embedding_state(family, state):
    model = _tied(family, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    model(**_batch(0)).loss.backward()
    opt.step()  # AdamW state exists for the tied matrix
    opt.zero_grad()
    shared = model.get_input_embeddings().weight
    tied_state = _snapshot(opt, shared)
    report = untie_output_head(model, optimizer=opt, optimizer_state=state)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert emb is shared and head is not emb
    assert report.optimizers_updated == 1 and report.optimizer_state == (state or "copy")
    group = next(g for g in opt.param_groups if any(p is emb for p in g["params"]))
    assert any(p is head for p in group["params"])  # the shared matrix's group: same lr, weight decay
    head_state = _snapshot(opt, head)
    if report.optimizer_state == "copy":
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(head_state[k], tied_state[k])
            assert opt.state[head][k].data_ptr() != opt.state[emb][k].data_ptr()  # a clone, not shared
    else:
        assert head_state is None
    assert torch.equal(_snapshot(opt, emb)["exp_avg"], tied_state["exp_avg"])  # the embedding's state untouched
    # one more step: both move, each by AdamW from its own state and its own gradient
    head0, emb0 = head.detach().clone(), emb.detach().clone()
    model(**_batch(1)).loss.backward()
    g_head, g_emb = head.grad.detach().clone(), emb.grad.detach().clone()
    opt.step()
    want_head, _ = _adamw_by_hand(head0, g_head, head_state)
    want_emb, _ = _adamw_by_hand(emb0, g_emb, tied_state)
    assert not torch.equal(head.detach(), head0) and not torch.equal(emb.detach(), emb0)
    torch.testing.assert_close(head.detach(), want_head, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(emb.detach(), want_emb, rtol=1e-10, atol=1e-12)
    assert int(opt.state[emb]["step"]) == 2 and int(opt.state[head]["step"]) == (2 if report.optimizer_state == "copy" else 1)


def test_untie_without_the_optimizer_that_holds_the_tied_matrix_warns_and_the_head_really_stays():
    model = _tied("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    report = untie_output_head(model)
    assert report.optimizers_updated == 0 and "pass optimizer=" in str(report)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    head0, emb0 = head.detach().clone(), emb.detach().clone()
    model(**_batch(0)).loss.backward()
    with pytest.warns(UserWarning, match="steps the matrix `model.embed_tokens.weight`.*not the new `lm_head.weight`.*the head will never move"):
        opt.step()
    assert torch.equal(head.detach(), head0) and not torch.equal(emb.detach(), emb0)  # what the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once


def test_an_optimizer_built_after_the_untie_gets_no_warning():
    model = _tied("gpt2")
    untie_output_head(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    head0 = model.get_output_embeddings().weight.detach().clone()
    model(**_batch(0)).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert not torch.equal(model.get_output_embeddings().weight.detach(), head0)


def test_untie_refuses_an_optimizer_that_does_not_hold_the_tied_matrix():
    model = _tied("llama")
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=LR)
    with pytest.raises(HeadwatchError, match="none of the 1 optimizer\\(s\\) given holds the tied matrix `lm_head.weight`"):
        untie_output_head(model, optimizer=other)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # left tied
    with pytest.raises(HeadwatchError, match="`optimizer_state` needs `optimizer`"):
        untie_output_head(model, optimizer_state="copy")
    with pytest.raises(HeadwatchError, match="`optimizer_state` must be None or one of \\(.copy., .reset.\\), got .moved."):
        untie_output_head(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), optimizer_state="moved")
    with pytest.raises(HeadwatchError, match="`optimizer` must be a non-empty sequence of torch.optim.Optimizer objects"):
        untie_output_head(model, optimizer=[object()])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
