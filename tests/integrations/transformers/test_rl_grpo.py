"""TRL's GRPOTrainer through the Hugging Face door (docs/rl.md).

A tiny Llama (vocab 256, hidden 32, one layer, float32) trained by GRPO on CPU for 4 steps, one micro-batch
per logging step: headwatch's entropy is that of the policy's sampling distribution softmax(logits / T)
over the completion tokens of the training forward, equal to TRL's own logged ``entropy`` at every
logging step, at T = 1 and T = 0.7. References, independent of headwatch: TRL's logged ``entropy``;
TRL's fused head's ``log_probs`` and ``label_mask`` of the training forward (the sampled tokens' NLL);
the ``completion_mask`` TRL computes the loss with; forwards counted by a hook of the test's own.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from headwatch.core.rl import DROP_FLOOR  # noqa: E402
from headwatch.integrations.transformers import HeadwatchCallback  # noqa: E402

from examples.grpo_collapse import EOS, PAD, V, word_tokenizer  # noqa: E402, F401 - the example's ids and tokenizer
from examples.grpo_collapse import tiny_policy as _example_policy  # noqa: E402
from tests.helpers.rl import STEPS, Recorder, by_step, grpo, prompts, reward_w7, tiny_policy  # noqa: E402


def reward_varied(completions, **kwargs):
    """Never the same for two completions of a group: the advantages, hence the gradient, are never all zero."""
    return [float(c.count("w7")) + 0.1 * i for i, c in enumerate(completions)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_entropy_equals_trls_at_every_logging_step(tmp_path, temperature):
    """headwatch/logits/entropy == TRL's logged entropy (1e-4 relative) at each of the 4 logging steps; the
    positions are exactly the completion tokens (padding after the end of sequence left out); the sampled tokens'
    NLL equals TRL's fused head's; generation forwards are counted, not measured."""
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = grpo(tmp_path, temperature, cb)
    rec = Recorder(trainer)
    trainer.train()
    history = trainer.state.log_history
    trl_entropy, ours = by_step(history, "entropy"), by_step(history, "headwatch/logits/entropy")
    assert sorted(trl_entropy) == sorted(ours) == list(range(1, STEPS + 1))
    rel = [abs(ours[s] - trl_entropy[s]) / abs(trl_entropy[s]) for s in trl_entropy]
    assert max(rel) <= 1e-4, (rel, ours, trl_entropy)
    assert max(trl_entropy.values()) < math.log(V) - 1.0  # a peaked policy: the temperature changes the figure

    positions = by_step(history, "headwatch/logits/positions")
    completion = [int(m.sum()) for m in rec.masks]
    assert [positions[s] for s in sorted(positions)] == completion
    assert any(int(m.numel()) > int(m.sum()) for m in rec.masks)  # some completions ended early: padding left out

    nll = by_step(history, "headwatch/rl/sampled_nll")
    want = [float(-lp.double().sum() / mask.sum()) for lp, mask in rec.fused]
    assert [nll[s] for s in sorted(nll)] == pytest.approx(want, rel=1e-5)
    assert set(by_step(history, "headwatch/rl/temperature").values()) == {temperature}

    generation = by_step(history, "headwatch/debug/capture/generation_forwards")
    assert [generation[s] for s in sorted(generation)] == rec.no_grad  # every no-grad forward is generate()'s
    assert min(rec.no_grad) >= 2  # the prompt pass and decoding steps
    assert set(by_step(history, "headwatch/debug/capture/forwards").values()) == {1.0}  # only the training forward
    assert set(by_step(history, "headwatch/debug/capture/no_grad_forwards").values()) == {0.0}


def test_the_temperature_is_what_makes_the_figure_equal(tmp_path):
    """Negative control: the same run at T = 0.7 measured at T = 1 (headwatch without the RL reading). The entropy
    and the NLL are TRL's own values (still equal), but the figures reproduced from the hidden states (the top-1
    probability, the calibration) would be those of another distribution: they are refused (NaN) with a warning
    naming the cause, never published wrong."""

    class WithoutRL(HeadwatchCallback):
        def understand_trainer(self) -> None:  # the door's RL reading switched off
            pass

    cb = WithoutRL(monitors=["logits"], figure_every_n_steps=0)
    trainer = grpo(tmp_path, 0.7, cb, max_steps=1)
    with pytest.warns(UserWarning, match=r"published as NaN because a reproduction .* differs from the loss's own NLL by .*temperature"):
        trainer.train()
    history = trainer.state.log_history
    ours, theirs = by_step(history, "headwatch/logits/entropy")[1], by_step(history, "entropy")[1]
    assert abs(ours - theirs) / theirs <= 1e-6
    assert math.isnan(cb.latest["headwatch/logits/max_prob"]) and math.isnan(cb.latest["headwatch/logits/ece"])
    assert "headwatch/rl/sampled_nll" not in cb.latest


def test_rl_steps_publish_what_only_headwatch_shows(tmp_path):
    """Entropy by the sampled token's frequency bucket and each bucket's share (they add up to the entropy),
    top-1 probability quantiles, the sampled tokens' NLL, the head/embedding gradient statistics and the tied
    split under the policy-gradient loss: published and finite."""
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = grpo(tmp_path, 0.7, cb, reward=reward_varied, max_steps=2, logging_steps=2, logging_first_step=True)
    trainer.train()
    got = cb.latest
    p = "headwatch"
    H = got[f"{p}/logits/entropy"]
    shares = [got[f"{p}/rl/entropy_share/{b}"] for b in ("top1", "top10", "top50", "tail", "unseen")]
    assert sum(shares) == pytest.approx(H, rel=1e-9)
    assert any(math.isfinite(got[f"{p}/logits/{b}/entropy"]) for b in ("top1", "top10", "top50", "tail"))
    q = [got[f"{p}/logits/max_prob_p{k}"] for k in ("05", "50", "95")]
    assert 0 < q[0] <= q[1] <= q[2] <= 1
    assert math.isfinite(got[f"{p}/rl/sampled_nll"]) and 0 <= got[f"{p}/rl/sampled_top1_rate"] <= 1
    grads = {k: v for k, v in got.items() if k.startswith(f"{p}/grad/")}
    assert grads and all(math.isfinite(v) for v in grads.values()), grads
    assert any("tied" in k or "shared" in k for k in grads), sorted(grads)
    # the rare tokens' share of the entropy lost since the run's first RL logging step (step 1 here)
    history = trainer.state.log_history
    h, rare = by_step(history, f"{p}/logits/entropy"), by_step(history, f"{p}/rl/entropy_share/rare")
    share = by_step(history, f"{p}/rl/rare_share_of_entropy_drop")
    assert sorted(h) == [1, 2] and 1 not in share and 2 in share  # no reference before the first step
    want = (rare[1] - rare[2]) / (h[1] - h[2]) if h[1] - h[2] > DROP_FLOOR * h[1] else math.nan  # else within noise
    assert share[2] == pytest.approx(want, rel=1e-9, nan_ok=True)


def test_rloo_trainer_shares_the_path(tmp_path):
    """RLOOTrainer: same fused head, same temperature division, same completion mask: equal to its entropy."""
    from trl import RLOOConfig, RLOOTrainer

    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    args = RLOOConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, temperature=0.7, learning_rate=1e-2, report_to="none",
                      use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, use_vllm=False, seed=0,
                      beta=0.0)  # fmt: skip  (no reference model: it would be loaded from the Hub)
    trainer = RLOOTrainer(model=tiny_policy(), reward_funcs=reward_w7, args=args, train_dataset=prompts(),
                          processing_class=word_tokenizer(), callbacks=[cb])  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    ours, theirs = by_step(history, "headwatch/logits/entropy"), by_step(history, "entropy")
    assert sorted(ours) == sorted(theirs) == [1, 2]
    assert max(abs(ours[s] - theirs[s]) / theirs[s] for s in theirs) <= 1e-4
    assert cb.latest["headwatch/rl/temperature"] == 0.7


def test_a_logging_window_of_several_steps_is_said_once_where_trls_entropy_is_its_mean():
    """TRL logs ``entropy`` as the mean over the steps of each logging window, headwatch the logging step's own (and
    ``check/entropy_gap`` against TRL's value of that step): with ``logging_steps > 1`` the two curves differ while
    the gap reads 0, so one note says it, naming the window; nothing with ``logging_steps=1``, a logging strategy
    other than steps, no logit statistics, or a trainer outside TRL."""
    import warnings
    import weakref
    from types import SimpleNamespace

    from transformers import IntervalStrategy

    def said(name, module="trl.trainer.grpo_trainer", monitors=None, max_steps=0, **args):
        cb = HeadwatchCallback(monitors=monitors, figure_every_n_steps=0)
        trainer = type(name, (), {"__module__": module})()
        trainer.args = SimpleNamespace(**{"logging_strategy": IntervalStrategy.STEPS, "logging_steps": 5, **args})
        trainer.state = SimpleNamespace(max_steps=max_steps)  # 0 until train() starts
        trainer.temperature = 0.7
        cb._trainer = weakref.ref(trainer)  # as set_trainer holds it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cb.understand_trainer()
            cb.understand_trainer()  # on_train_begin of a second train(): still once
        return [str(w.message) for w in caught if "logging window" in str(w.message)]

    for name in ("GRPOTrainer", "SFTTrainer"):
        notes = said(name)
        assert len(notes) == 1 and f"{name} logs `entropy`" in notes[0]
        assert "logging_steps=5" in notes[0] and "check/entropy_gap" in notes[0] and "logging_steps=1" in notes[0]
    assert said("GRPOTrainer", logging_steps=1) == []
    assert said("GRPOTrainer", logging_strategy=IntervalStrategy.EPOCH) == []
    assert said("GRPOTrainer", monitors=["gradients"]) == []
    assert said("Trainer", module="transformers.trainer") == []
    assert said("GRPOTrainer", logging_strategy="no") == [] and said("GRPOTrainer", logging_strategy="epoch") == []
    assert said("GRPOTrainer", logging_steps=1.0) == []
    # a fraction of the run (0 < logging_steps < 1): ceil(max_steps * logging_steps) steps, known once training starts
    assert said("GRPOTrainer", logging_steps=0.1) == []  # the Trainer's construction: the run's length unknown
    assert said("GRPOTrainer", logging_steps=0.1, max_steps=10) == []  # a window of 1 step
    (note,) = said("GRPOTrainer", logging_steps=0.1, max_steps=25)
    assert "(logging_steps=0.1 of 25 steps: 3 steps:" in note
