"""The sampling temperature in the core (docs/rl.md): ``LogitStats(temperature=T)`` measures
softmax(logits / T) on both capture paths, equal to a float64 recomputation from the model's own logits; a sampled
token in no frequency bucket (the padding row) leaves its part of the entropy out of the buckets' shares."""

from __future__ import annotations

import pytest
import torch

from headwatch.core.logits import LogitStats
from headwatch.errors import HeadwatchError
from headwatch.integrations.loop import Headwatch
from headwatch.model.capture import Captured
from headwatch.model.captured import captured_statistics


def reference(logits: torch.Tensor, labels: torch.Tensor, T: float) -> dict[str, float]:
    """float64, from the logits: entropy and the target NLL of softmax(logits / T) over labelled positions."""
    x = logits[:, :-1].double() / T
    t = labels[:, 1:]
    keep = t != -100
    logp = torch.log_softmax(x, -1)
    H = -(logp.exp() * logp).sum(-1)
    nll = -logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"entropy": float(H[keep].mean()), "target_nll": float(nll[keep].mean()), "positions": float(keep.sum())}


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("T", [1.0, 0.5, 1.7])
def test_statistics_are_those_of_the_tempered_softmax(path, T):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=g), 2 * torch.randn(40, 8, generator=g)
    logits = hidden @ weight.T
    targets = torch.randint(0, 40, (2, 6), generator=g)
    targets[0, :2] = -100
    captured = Captured("logits", logits=logits) if path == "logits" else Captured("hidden", hidden=hidden, weight=weight)
    stats = captured_statistics(captured, targets=targets, temperature=T).statistics
    keep = targets != -100
    logp = torch.log_softmax(logits.double() / T, -1)
    H = -(logp.exp() * logp).sum(-1)
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert stats.entropy[keep].double() == pytest.approx(H[keep], abs=2e-5)
    assert stats.nll[keep].double() == pytest.approx(nll[keep], abs=2e-5)
    if T != 1.0:  # the figure really moves with T
        untempered = -(torch.log_softmax(logits.double(), -1).exp() * torch.log_softmax(logits.double(), -1)).sum(-1)
        assert (untempered[keep] - H[keep]).abs().max() > 1e-2
    assert torch.equal(logits, hidden @ weight.T)  # the model's logits are not modified in place


def test_plain_loop_with_a_sampling_temperature():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5))  # fmt: skip
    ids = torch.randint(0, 64, (2, 7))
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt
    hw = Headwatch(model, monitors=[LogitStats(temperature=0.6)], log_every_n_steps=1)
    hw.step_start({"input_ids": ids, "labels": labels}, step=0)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    values = hw.step_end()
    want = reference(out.logits.detach(), labels, 0.6)
    assert values["headwatch/logits/entropy"] == pytest.approx(want["entropy"], abs=2e-5)
    assert values["headwatch/logits/target_nll"] == pytest.approx(want["target_nll"], abs=2e-5)
    assert values["headwatch/logits/positions"] == want["positions"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "0.7"])
def test_a_bad_temperature_is_refused(bad):
    with pytest.raises(HeadwatchError, match="`temperature` must be"):
        LogitStats(temperature=bad)


@pytest.mark.parametrize("offset", [20.0, 60.0])
def test_near_collapse_headwatch_keeps_float64_precision_where_trls_fused_entropy_loses_it(offset):
    """A near-deterministic policy (about 2e-3 nats per token), logits around ``offset`` as real heads give.
    TRL's fused head (``trl.kernels.ChunkedLogProbFunction``, its CPU path) computes ``H = log Z - E[z]`` from
    the raw logits: two numbers near ``max z`` whose float32 difference loses about ``eps * max|z|`` nats.
    headwatch's hidden-state path stays within 1e-5 relative of float64 there; TRL's figure stays within its
    own rounding bound of it (``8 eps max|z|`` per token), which is the tolerance docs/rl.md gives for the
    equality with TRL's ``entropy`` below a few hundredths of a nat."""
    kernels = pytest.importorskip("trl.kernels")
    g = torch.Generator().manual_seed(0)
    V, N, T = 151, 256, 0.7
    hidden = torch.randn(N, V, generator=g) + offset
    hidden[:, 3] += 15.0 * T  # one dominant token
    weight = torch.eye(V)  # logits = hidden: the case isolates the entropy's arithmetic
    z64 = hidden.double() / T
    logp = torch.log_softmax(z64, -1)
    H64 = float(-(logp.exp() * logp).sum(-1).mean())
    assert 1e-3 < H64 < 1e-2
    ours = captured_statistics(Captured("hidden", hidden=hidden.unsqueeze(0), weight=weight), temperature=T).statistics
    ours = float(ours.entropy.double().mean())
    _, theirs, *_ = kernels.ChunkedLogProbFunction.apply(hidden, weight, None, torch.full((N,), 3), T, 64, None, 1.0,
                                                        ("log_probs", "entropy"))  # fmt: skip
    theirs = float(theirs.double().mean())
    assert abs(ours - H64) <= 1e-5 * H64
    bound = 8 * torch.finfo(torch.float32).eps * float(z64.abs().max())
    assert abs(theirs - H64) <= bound and abs(ours - theirs) <= bound


def test_a_sampled_padding_token_is_in_no_bucket_and_its_part_of_the_entropy_is_in_no_share():
    """A policy can sample the token of its embedding's ``padding_idx`` (a column of the head like any other): that
    row is no valid row, so the position is in no frequency bucket; the buckets' positions add up to
    ``logits/positions`` less those positions and the shares to ``logits/entropy`` less their part (docs/rl.md),
    against a float64 entropy of softmax(logits / T) per position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headwatch.functional.frequency import BUCKETS

    V, PAD, T = 32, 30, 0.7
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=PAD))  # fmt: skip
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[0, 3], ids[1, 5] = PAD, PAD  # sampled, inside the completion: labelled
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    hw = Headwatch(model, monitors=["tokens", "logits"], log_every_n_steps=1, figure_every_n_steps=None,
                   overhead_budget=None, summary=False)  # fmt: skip
    hw.run.sample_at(T, "the test")
    hw.step_start(batch, 0)
    out = model(**batch)
    out.loss.backward()
    values = hw.step_end()
    hw.close()
    logp = torch.log_softmax(out.logits.detach()[:, :-1].double() / T, -1)
    H, pad = -(logp.exp() * logp).sum(-1), ids[:, 1:] == PAD
    n = H.numel()
    p = "headwatch"
    assert values[f"{p}/logits/positions"] == n and int(pad.sum()) == 2
    assert sum(values[f"{p}/logits/{b}/positions"] for b in BUCKETS) == n - 2
    assert values[f"{p}/logits/entropy"] == pytest.approx(float(H.mean()), abs=2e-5)
    shares = sum(values[f"{p}/rl/entropy_share/{b}"] for b in BUCKETS)
    assert shares == pytest.approx(float(H[~pad].sum()) / n, abs=2e-5)
    assert values[f"{p}/logits/entropy"] - shares == pytest.approx(float(H[pad].sum()) / n, abs=2e-5)
