"""Measured at the loss under TRL's fused LM head: its own per-token values, under ``bf16=True`` (TRL's default, the CPU
autocast) as in float32, for SFT (a Llama, and the families whose final transform scales the head's output) and GRPO.

References, independent of headwatch: TRL's logged ``entropy`` / ``eval_entropy`` and ``loss`` / ``eval_loss``; the
fused head's ``log_probs`` and ``label_mask`` of each training forward (a hook of the test's own); the top-1
probability of the tensor the loss scored, rebuilt in float64 from the final hidden states and the head at the
loss's precision (the hidden states rounded to bf16 under autocast, the product rounded to bf16, TRL's scale).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from headwatch.integrations.transformers import HeadwatchCallback  # noqa: E402
from tests.helpers.hf import V, tiny_llama, word_tokenizer  # noqa: E402
from tests.helpers.rl import Recorder, by_step, grpo  # noqa: E402

P = "headwatch"
STEPS = 3


def sft_data(n: int = 8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    rows = [(torch.randint(0, V - 2, (4,), generator=g), torch.randint(0, V - 2, (5,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({
        "prompt": [" ".join(f"w{i}" for i in p.tolist()) for p, _ in rows],
        "completion": [" " + " ".join(f"w{i}" for i in c.tolist()) for _, c in rows],
    })  # fmt: skip


def family(name: str):
    """A tiny model of a family whose final transform scales the head's output: HyperCLOVA X multiplies the logits
    by ``logits_scaling``, Granite divides them by it (TRL's table, the models' own forwards)."""
    from transformers import GraniteConfig, GraniteForCausalLM, HyperCLOVAXConfig, HyperCLOVAXForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    if name == "hyperclovax":
        return HyperCLOVAXForCausalLM(HyperCLOVAXConfig(logits_scaling=4.0, **kw))
    return GraniteForCausalLM(GraniteConfig(logits_scaling=0.25, **kw))


class Fused:
    """Each training forward of TRL's fused head: its log-probabilities, label mask and the final hidden states."""

    def __init__(self, model):
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.Tensor]] = []
        self.hidden: tuple[torch.Tensor, bool] | None = None  # with whether autocast ran the forward (read inside it)
        model.base_model.register_forward_hook(
            lambda m, a, out: setattr(self, "hidden", (out.last_hidden_state.detach(), torch.is_autocast_enabled("cpu")))
        )
        model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, out):
        if kwargs.get("fused_lm_head") and torch.is_grad_enabled():
            weight = module.get_output_embeddings().weight.detach().clone()  # as the step scored it (it trains after)
            self.records.append((out.log_probs.detach().double(), out.label_mask.clone(), *self.hidden, weight))

    def nll(self, i: int) -> float:
        log_probs, mask, *_ = self.records[i]
        return float(-log_probs.sum() / mask.sum())

    def max_prob(self, i: int, scale: float) -> float:
        """The mean top-1 probability of the tensor the loss scored, in float64."""
        _, mask, hidden, cast, w = self.records[i]
        h = hidden[:, :-1]
        if cast:
            h, w = h.bfloat16(), w.bfloat16()
        logits = (h @ w.T).double() * scale  # the product rounded as the loss rounds it, then TRL's scale
        return float(logits.softmax(-1).amax(-1)[mask].mean())


def sft(tmp_path, model, bf16: bool, **kw):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, logging_steps=1, per_device_train_batch_size=4,
                       report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2,
                       bf16=bf16, **kw)  # fmt: skip
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=sft_data(), processing_class=word_tokenizer(), callbacks=[cb])
    return trainer, cb, Fused(model)


def no_headwatch_warning(record) -> bool:
    return not [w for w in record if "headwatch" in str(w.message) and "NaN" in str(w.message)]


@pytest.mark.parametrize("bf16", [True, False])
def test_sft_fused_head_entropy_and_nll_are_trls_own_values(tmp_path, bf16):
    """At each logging step (one micro-batch a step): ``logits/entropy`` equals TRL's logged ``entropy`` to 1e-4
    relative, ``logits/target_nll`` the fused head's per-token log-probabilities to 1e-6, the token accuracy TRL's;
    the top-1 probability is the loss's tensor's (reproduced at its precision), also in bf16."""
    model = tiny_llama(tie=True)
    trainer, cb, fused = sft(tmp_path, model, bf16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert no_headwatch_warning(record)
    history = trainer.state.log_history
    ours = {r["step"]: r for r in history if f"{P}/logits/entropy" in r}
    trl = {r["step"]: r for r in history if "entropy" in r}
    assert sorted(ours) == sorted(trl) == list(range(1, STEPS + 1)) and len(fused.records) == STEPS
    assert all(r[3] == bf16 for r in fused.records)  # the loss ran under autocast exactly when bf16
    for i, step in enumerate(sorted(ours)):
        got = ours[step]
        assert abs(got[f"{P}/logits/entropy"] - trl[step]["entropy"]) <= 1e-4 * trl[step]["entropy"]
        assert abs(got[f"{P}/logits/target_nll"] - fused.nll(i)) <= 1e-6 * fused.nll(i)
        assert got[f"{P}/logits/target_argmax_rate"] == pytest.approx(trl[step]["mean_token_accuracy"], abs=1e-6)
        assert got[f"{P}/logits/max_prob"] == pytest.approx(fused.max_prob(i, 1.0), abs=1e-5)
        assert got[f"{P}/logits/kl_to_uniform"] == pytest.approx(math.log(V) - got[f"{P}/logits/entropy"], abs=1e-6)
        assert math.isfinite(got[f"{P}/logits/ece"]) and got[f"{P}/check/mismatch"] == 0


@pytest.mark.parametrize("name, scale", [("hyperclovax", 4.0), ("granite", 1 / 0.25)])
def test_a_family_that_scales_its_logits_is_measured_exactly_in_training_and_evaluation(tmp_path, name, scale):
    """HyperCLOVA X multiplies the head's output by ``logits_scaling``, Granite divides by it: under SFT's fused head
    (bf16) the entropy and NLL are TRL's own in training and in ``evaluate()``, and the figures reproduced at the
    loss's precision (the top-1 probability) use the family's own scale: published, equal to the loss's tensor's."""
    model = family(name)
    trainer, cb, fused = sft(tmp_path, model, bf16=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
        metrics = trainer.evaluate(trainer.train_dataset)
    assert no_headwatch_warning(record)
    history = trainer.state.log_history
    ours = {r["step"]: r for r in history if f"{P}/logits/entropy" in r}
    trl = {r["step"]: r for r in history if "entropy" in r and "loss" in r}
    for i, step in enumerate(sorted(ours)):
        got = ours[step]
        assert abs(got[f"{P}/logits/entropy"] - trl[step]["entropy"]) <= 1e-4 * trl[step]["entropy"]
        assert abs(got[f"{P}/logits/target_nll"] - fused.nll(i)) <= 1e-6 * fused.nll(i)
        assert got[f"{P}/logits/max_prob"] == pytest.approx(fused.max_prob(i, scale), abs=1e-5)
    val = f"eval_{P}/val/logits"
    assert abs(metrics[f"{val}/entropy"] - metrics["eval_entropy"]) <= 1e-4 * metrics["eval_entropy"]
    assert abs(metrics[f"{val}/target_nll"] - metrics["eval_loss"]) <= 1e-6 * metrics["eval_loss"]
    assert math.isfinite(metrics[f"{val}/max_prob"]) and math.isfinite(metrics[f"{val}/ece"])


@pytest.mark.parametrize("bf16", [True, False])
def test_grpo_entropy_equals_trls_under_bf16_as_in_float32(tmp_path, bf16):
    """GRPO at T = 0.7, one micro-batch a step: ``logits/entropy`` equals TRL's logged ``entropy`` to 1e-4 relative
    and ``rl/sampled_nll`` its fused head's log-probabilities to 1e-6, under bf16 as in float32."""
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = grpo(tmp_path, 0.7, cb, bf16=bf16, max_steps=STEPS)
    rec = Recorder(trainer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert no_headwatch_warning(record)
    history = trainer.state.log_history
    theirs, ours, nll = (by_step(history, k) for k in ("entropy", f"{P}/logits/entropy", f"{P}/rl/sampled_nll"))
    assert sorted(theirs) == sorted(ours) == list(range(1, STEPS + 1))
    assert max(abs(ours[s] - theirs[s]) / theirs[s] for s in theirs) <= 1e-4
    want = [float(-lp.double().sum() / mask.sum()) for lp, mask in rec.fused]
    assert max(abs(nll[s] - w) / w for s, w in zip(sorted(nll), want)) <= 1e-6
    assert all(0 < v <= 1 for v in by_step(history, f"{P}/logits/max_prob").values())
