"""The plain-loop front door: same values as the Lightning path and as a float64 recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from headwatch import GradientDensityMonitor, Headwatch, HeadwatchError, LogitStatsMonitor
from tests.helpers import TinyCausalLM, TokenDataset, ids_loader
from tests.helpers.lightning_runs import make_trainer

KEYS = (
    "headwatch/logits/entropy",
    "headwatch/logits/target_nll",
    "headwatch/logits/kl_to_uniform",
    "headwatch/logits/positions",
    "headwatch/grad/embedding_row_density",
    "headwatch/grad/head_row_density",
    "headwatch/tokens/total",
)


def _batch():
    ds = TokenDataset(n=8, pad=False)
    return {"input_ids": ds.input_ids, "labels": ds.labels}


def _plain(model, batch, writer=None):
    hw = Headwatch(model, monitors=["logits", "gradients"], writer=writer, log_every_n_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hw.step_start(batch, 0)
    logits = model(batch["input_ids"])
    V = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1))
    loss.backward()
    hw.before_optimizer_step()
    opt.step()
    hw.after_optimizer_step()
    values = hw.step_end()
    hw.close()
    return values


def _float64(model, batch):
    twin = copy.deepcopy(model).double()
    logits = twin(batch["input_ids"])  # (B, T, V) float64
    V = logits.shape[-1]
    logp = logits[:, :-1].log_softmax(-1)  # positions with a target (the last has none)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1))
    loss.backward()
    emb, head = twin.embed_tokens.weight.grad, twin.lm_head.weight.grad
    return {
        "headwatch/logits/entropy": entropy.mean().item(),
        "headwatch/logits/target_nll": loss.item(),
        "headwatch/logits/kl_to_uniform": (torch.log(torch.tensor(float(V), dtype=torch.float64)) - entropy).mean().item(),
        "headwatch/logits/positions": float(entropy.numel()),
        "headwatch/grad/embedding_row_density": (emb != 0).any(1).double().mean().item(),
        "headwatch/grad/head_row_density": (head != 0).any(1).double().mean().item(),
        "headwatch/tokens/total": float(batch["input_ids"].numel()),
    }


def test_plain_loop_equals_lightning_and_float64(tmp_path):
    torch.manual_seed(0)
    model = TinyCausalLM(lr=0.0)
    batch = _batch()
    reference = _float64(model, batch)
    writer = SummaryWriter(str(tmp_path / "plain"))
    plain = _plain(copy.deepcopy(model), batch, writer)
    writer.close()
    callbacks = [LogitStatsMonitor(validation=False, figure_every_n_steps=0), GradientDensityMonitor(figure_every_n_steps=0)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=1, log_every_n_steps=1)
    trainer.fit(copy.deepcopy(model), ids_loader(batch["input_ids"], 8))
    lightning = {k: float(trainer.callback_metrics[k]) for k in KEYS}
    assert 0 < reference["headwatch/grad/embedding_row_density"] < 1
    for key in KEYS:
        assert plain[key] == pytest.approx(reference[key], abs=1e-6), key
        assert lightning[key] == pytest.approx(plain[key], abs=1e-6), key
    # written to the SummaryWriter it was given, at step 0, with the dashboard layout
    acc = EventAccumulator(str(tmp_path / "plain"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("headwatch/logits/entropy")] == [0]
    assert acc.Scalars("headwatch/logits/entropy")[0].value == pytest.approx(plain["headwatch/logits/entropy"], rel=1e-6)
    assert "headwatch/grad/head_row_norm_histogram" in acc.Tags()["histograms"]


def test_plain_loop_schedule_context_manager_and_errors():
    torch.manual_seed(0)
    model = TinyCausalLM()
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=2)
    batch = _batch()
    logged = []
    for step in range(4):
        with hw.step(batch):
            model(batch["input_ids"])
        logged.append(bool(hw.latest) and hw.step_index - 1 == step and step % 2 == 1)
    assert hw.step_index == 4 and logged == [False, True, False, True]
    with pytest.raises(HeadwatchError, match="`monitors` must be a sequence of core monitors or names among"):
        Headwatch(model, monitors=["entropy"])
    with pytest.raises(HeadwatchError, match="`log_every_n_steps` must be an int >= 1, got 0"):
        Headwatch(model, log_every_n_steps=0)


def _llama(tie: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


@pytest.mark.parametrize("tie", [False, True])
def test_plain_loop_on_a_tiny_llama_equals_float64_and_an_untied_twin(tie):
    model = _llama(tie)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 64, (2, 10), generator=g)}
    batch["labels"] = batch["input_ids"].clone()
    hw = Headwatch(model, monitors=["logits", "gradients"], log_every_n_steps=1)
    hw.step_start(batch, 0)
    model(**batch).loss.backward()
    hw.before_optimizer_step()
    got = hw.step_end()
    # float64 reference: an untied twin holds the lookup flow in its embedding, the scoring flow in its head
    twin = _llama(False, torch.float64)
    state = {k: v.double() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.get_output_embeddings().weight.detach().double().clone()
    twin.load_state_dict(state)
    out = twin(**batch)
    out.loss.backward()
    logp = out.logits[:, :-1].log_softmax(-1)
    assert got["headwatch/logits/entropy"] == pytest.approx(-(logp.exp() * logp).sum(-1).mean().item(), abs=1e-6)
    assert got["headwatch/logits/target_nll"] == pytest.approx(out.loss.item(), abs=1e-6)
    lookup, scoring = twin.model.embed_tokens.weight.grad, twin.lm_head.weight.grad
    assert got["headwatch/grad/embedding_row_density"] == pytest.approx((lookup != 0).any(1).double().mean().item(), abs=1e-12)
    assert got["headwatch/grad/head_row_density"] == pytest.approx((scoring != 0).any(1).double().mean().item(), abs=1e-12)
    assert got["headwatch/grad/tied"] == float(tie)
    if tie:
        both = (lookup != 0).any(1) & (scoring != 0).any(1)
        cos = F.cosine_similarity(lookup[both], scoring[both], dim=1)
        assert got["headwatch/grad/tied_flow_rows"] == both.sum().item()
        assert got["headwatch/grad/tied_flow_cosine_mean"] == pytest.approx(cos.mean().item(), abs=1e-5)
    hw.close()


def _run_plain(model, batch, writer, steps, **kw):
    hw = Headwatch(model, monitors=["logits", "gradients"], writer=writer, log_every_n_steps=1, **kw)
    for step in range(steps):
        hw.step_start(batch, step)
        logits = model(batch["input_ids"])
        V = logits.shape[-1]
        F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1)).backward()
        hw.before_optimizer_step()
        hw.after_optimizer_step()
        model.zero_grad()
        hw.step_end()
    hw.close()
    return hw


def test_plain_loop_draws_figures_every_10_logging_steps_without_a_budget(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    batch = _batch()
    writer = SummaryWriter(str(tmp_path / "auto"))
    # default "auto": 10 logging intervals of 1 step (under the default budget: the probe steps, tests/core/test_overhead.py)
    hw = _run_plain(TinyCausalLM(lr=0.0), batch, writer, 10, overhead_budget=None)
    writer.close()
    assert [m.figure_every for m in hw.monitors if hasattr(m, "figure_every")] == [10, 10]
    acc = EventAccumulator(str(tmp_path / "auto"), size_guidance={"images": 0}).Reload()
    for tag in ("headwatch/logits/entropy_over_run", "headwatch/grad/row_norm_vs_frequency"):
        assert [e.step for e in acc.Images(tag)] == [9], tag  # the 10th step (0-based 9), once
    writer = SummaryWriter(str(tmp_path / "off"))
    _run_plain(TinyCausalLM(lr=0.0), batch, writer, 10, figure_every_n_steps=None)
    writer.close()
    assert EventAccumulator(str(tmp_path / "off")).Reload().Tags()["images"] == []
    with pytest.raises(HeadwatchError, match="`figure_every_n_steps` must be 'auto', None, or an int >= 0, got -1"):
        Headwatch(TinyCausalLM(), figure_every_n_steps=-1)
