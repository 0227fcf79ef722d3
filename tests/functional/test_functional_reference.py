"""headwatch.functional's logit statistics, padded mass, sums and quantiles against float64 references and
the identities of the definitions (shift and permutation invariance, entropy bounds, perturbation bounds of
low-precision logits), on the paths the other functional tests leave out (copied blocks of non-viewable
logits, several CPU threads, transforms of float64 input, a low-precision head with a bias)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from headwatch import HeadwatchError
from headwatch.functional import (
    hidden_chunk_plan,
    logit_scale,
    logit_softcap,
    logit_statistics,
    logit_statistics_from_hidden,
    logit_stats_compute,
    logit_stats_update,
    nanquantiles,
    quantiles,
    sorted_quantiles,
)
from headwatch.functional.padding import padded_mass

NINF = float("-inf")


def ref64(logits: torch.Tensor, targets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-row statistics in float64 with plain torch ops (``log_softmax``), ``(..., V) -> (...)``; rows must be finite."""
    x = logits.detach().double()
    V = x.shape[-1]
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))  # 0 log 0 = 0
    H = -plogp.sum(-1)
    out = {
        "entropy": H,
        "kl_to_uniform": (p * (logp + math.log(V))).where(p > 0, torch.zeros_like(p)).sum(-1),
        "kl_from_uniform": -math.log(V) - logp.mean(-1),
        "max_prob": p.amax(-1),
    }
    if targets is not None:
        out["nll"] = -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return out


def _gen(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 2e-5, rtol: float = 2e-5) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=True)


# ---------------------------------------------------------------- identities of the definitions
rows_of_logits = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 5), st.integers(2, 48)), elements=st.floats(-30, 30, width=32)
)
# logits on a grid of 1/64 and shifts of whole multiples of 1/64 up to 2**10: x + c is exact in float32
grid_logits = hnp.arrays(np.int32, st.tuples(st.integers(1, 5), st.integers(2, 48)), elements=st.integers(-1920, 1920))


@settings(max_examples=30, deadline=None)
@given(grid_logits, st.integers(-(2**16), 2**16), st.integers(0, 2**31 - 1))
def test_statistics_are_invariant_to_a_constant_shift_and_a_permutation_of_the_vocabulary(units, shift, seed):
    """softmax(x + c) = softmax(x), and the statistics are symmetric functions of the probabilities."""
    logits = torch.from_numpy(units.astype(np.float32) / 64)
    shifted_logits = logits + shift / 64
    assert torch.equal(shifted_logits.double(), logits.double() + shift / 64)  # the shift itself is exact
    V = logits.shape[-1]
    targets = torch.randint(0, V, logits.shape[:-1], generator=torch.Generator().manual_seed(seed))
    base = logit_statistics(logits, targets=targets)
    shifted = logit_statistics(shifted_logits, targets=targets)
    want = ref64(logits, targets)
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(base, name), want[name], atol=3e-5, rtol=2e-5)
        _close(getattr(shifted, name), want[name], atol=3e-5, rtol=2e-5)
    assert torch.equal(shifted.target_is_argmax, base.target_is_argmax)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(V))
    permuted = logit_statistics(logits[..., perm], targets=inverse[targets])
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(permuted, name), want[name], atol=3e-5, rtol=2e-5)
    assert torch.equal(permuted.target_is_argmax, base.target_is_argmax)


@settings(max_examples=50, deadline=None)
@given(rows_of_logits, st.integers(0, 2**31 - 1))
def test_entropy_lies_between_the_min_entropy_and_log_of_the_support(x, seed):
    """-log max_v p_v <= H(p) <= log |{v : p_v > 0}| and nll >= -log max_v p_v, with equality for the argmax."""
    logits = torch.from_numpy(x.copy())
    V = logits.shape[-1]
    g = torch.Generator().manual_seed(seed)
    knocked = torch.rand(logits.shape, generator=g) < 0.3
    knocked[..., 0] = False  # at least one finite logit per row
    logits = logits.masked_fill(knocked, NINF)
    targets = torch.randint(0, V, logits.shape[:-1], generator=g)
    got = logit_statistics(logits, targets=targets)
    H = got.entropy.double()
    min_entropy = -got.max_prob.double().log()
    support = (~knocked).sum(-1).double()
    assert (H >= min_entropy - 1e-5).all()
    assert (H <= support.log() + 1e-5).all()
    nll = got.nll.double()
    assert (nll >= min_entropy - 1e-5).all()
    # nll - (-log max p) = log(max p / p_y) = max_v x_v - x_y, exactly for finite x_y
    gap = logits.double().amax(-1) - logits.double().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    finite = torch.isfinite(gap)
    _close((nll - min_entropy)[finite], gap[finite], atol=1e-4, rtol=1e-5)
    assert torch.equal(got.target_is_argmax, gap == 0)
    # a knocked-out target has probability 0: nll = +inf, and it is never the argmax
    hit = knocked.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(hit, ~finite)
    assert torch.isinf(nll[hit]).all() and not got.target_is_argmax[hit].any()
    # KL(U || p) is +inf exactly where some logit is -inf
    assert torch.equal(torch.isinf(got.kl_from_uniform), knocked.any(-1))


@pytest.mark.parametrize("V", [1, 2, 7])
def test_uniform_and_one_hot_rows_hit_the_ends_of_every_range(V):
    """Uniform logits: H = log V, KL(p||U) = KL(U||p) = 0, max_prob = 1/V. One finite logit: H = 0, KL(p||U) = log V."""
    uniform = torch.full((3, V), 4.25)
    got = logit_statistics(uniform, targets=torch.zeros(3, dtype=torch.long))
    _close(got.entropy, torch.full((3,), math.log(V)), atol=1e-6)
    _close(got.kl_to_uniform, torch.zeros(3), atol=1e-6)
    _close(got.kl_from_uniform, torch.zeros(3), atol=1e-6)
    _close(got.max_prob, torch.full((3,), 1.0 / V), atol=1e-7)
    _close(got.nll, torch.full((3,), math.log(V)), atol=1e-6)
    assert got.target_is_argmax.all()  # ties count as the argmax
    one_hot = torch.full((2, V), NINF)
    one_hot[:, V - 1] = -7.0
    got = logit_statistics(one_hot, targets=torch.full((2,), V - 1))
    assert torch.equal(got.entropy, torch.zeros(2))
    _close(got.kl_to_uniform, torch.full((2,), math.log(V)), atol=1e-6)
    assert torch.equal(got.max_prob, torch.ones(2))
    assert torch.equal(got.nll, torch.zeros(2))
    if V > 1:
        assert torch.isinf(got.kl_from_uniform).all()


# ---------------------------------------------------------------- precision of low-precision inputs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_stay_within_the_bound_of_their_rounding(dtype):
    """Rounding the logits to bf16/fp16 moves each by at most eps; the statistics move by no more than the
    perturbation bounds: |d nll| <= 2 eps, max_prob ratio in [e^-2eps, e^2eps],
    |d H| <= 2 eps + (e^(2 eps) - 1) (max x - min x) / 2; and they equal the float64 statistics of the rounded values."""
    x = _gen(6, 9, 301, seed=4)
    targets = torch.randint(0, 301, (6, 9), generator=torch.Generator().manual_seed(5))
    low = x.to(dtype)
    eps = (low.double() - x.double()).abs().amax(-1)  # per row
    got_low = logit_statistics(low, targets=targets)
    got_f32 = logit_statistics(x, targets=targets)
    ref_low = ref64(low, targets)
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(got_low, name), ref_low[name], atol=3e-5, rtol=3e-5)
    assert got_low.entropy.dtype == torch.float32  # the math is float32, not the input's dtype
    spread = (x.amax(-1) - x.amin(-1)).double()
    nll_diff = (got_low.nll.double() - got_f32.nll.double()).abs()
    assert (nll_diff <= 2 * eps + 1e-5).all()
    ratio = got_low.max_prob.double() / got_f32.max_prob.double()
    assert ((ratio >= torch.exp(-2 * eps) - 1e-6) & (ratio <= torch.exp(2 * eps) + 1e-6)).all()
    h_diff = (got_low.entropy.double() - got_f32.entropy.double()).abs()
    assert (h_diff <= 2 * eps + torch.expm1(2 * eps) * spread / 2 + 1e-5).all()
    assert (nll_diff > 0).any()  # the rounding did perturb: the bounds above were not vacuous


def test_float64_logits_are_measured_in_float64():
    """A row whose probabilities differ below float32 resolution: float64 input keeps them, float32 cannot."""
    V = 5
    x = torch.zeros(1, V, dtype=torch.float64)
    x[0, 0] = 1e-9  # p_0 - p_v ~ 2e-10: invisible in float32
    got = logit_statistics(x, targets=torch.zeros(1, dtype=torch.long))
    assert got.entropy.dtype == torch.float64
    want = ref64(x, torch.zeros(1, dtype=torch.long))
    torch.testing.assert_close(got.nll, want["nll"], atol=1e-15, rtol=0)
    assert got.nll.item() < math.log(V)  # the target is (barely) more likely than uniform
    assert bool(got.target_is_argmax.item())


# ---------------------------------------------------------------- execution paths that must not change values
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("max_chunk_bytes", [1, 5000, 2**26])
def test_values_do_not_depend_on_threads_or_chunks(threads, max_chunk_bytes):
    logits = _gen(4, 13, 97, seed=7)
    mask = torch.rand(4, 13, generator=torch.Generator().manual_seed(8)) > 0.2
    targets = torch.randint(0, 97, (4, 13), generator=torch.Generator().manual_seed(9))
    targets[0, :3] = -100
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = logit_statistics(logits, mask, targets, max_chunk_bytes=max_chunk_bytes)
    finally:
        torch.set_num_threads(previous)
    assert torch.get_num_threads() == previous
    want = ref64(logits, targets.clamp(min=0))
    valid = mask & (targets != -100)
    assert torch.equal(got.valid, valid)
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(got, name)[valid], want[name][valid])
        assert torch.isnan(getattr(got, name)[~valid]).all()


@pytest.mark.parametrize("max_chunk_bytes", [2**26, 1])
def test_non_viewable_logits_are_copied_a_block_of_items_at_a_time(max_chunk_bytes):
    """(T, B, V) transposed to (B, T, V) cannot be viewed as (B T, V): items are copied in blocks, same values."""
    base = _gen(6, 3, 2, 41, seed=10)  # (T, B, H, V)
    logits = base.permute(1, 0, 2, 3)  # (B, T, H, V), not viewable as 2-D
    with pytest.raises(RuntimeError):
        logits.view(-1, 41)
    targets = torch.randint(0, 41, logits.shape[:-1], generator=torch.Generator().manual_seed(11))
    got = logit_statistics(logits, targets=targets, max_chunk_bytes=max_chunk_bytes)
    want = ref64(logits, targets)
    assert got.entropy.shape == (3, 6, 2)
    for name in ("entropy", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(got, name), want[name])


def test_transform_of_float64_logits_runs_on_a_copy_and_in_float64():
    x = _gen(3, 50, seed=12).double()
    before = x.clone()
    got = logit_statistics(x, transform=logit_scale(0.25))
    assert torch.equal(x, before)  # the in-place scale worked on a copy
    assert got.entropy.dtype == torch.float64
    torch.testing.assert_close(got.entropy, ref64(x * 0.25)["entropy"], atol=1e-12, rtol=0)
    capped = logit_statistics(x, transform=logit_softcap(2.0))
    torch.testing.assert_close(capped.entropy, ref64(2.0 * torch.tanh(x / 2.0))["entropy"], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "transform, match",
    [
        (lambda x: x[:, :-1], r"return a tensor of shape \(3, 8\), got \(3, 7\)"),
        (lambda x: x.tolist(), "got list"),
        ("softcap", "`transform` to be None or a callable"),
    ],
)
def test_a_transform_that_breaks_the_contract_is_refused(transform, match):
    with pytest.raises(HeadwatchError, match=match):
        logit_statistics(torch.zeros(3, 8), transform=transform)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "30"])
def test_softcap_needs_a_positive_finite_cap(bad):
    with pytest.raises(HeadwatchError, match="positive finite number"):
        logit_softcap(bad)


@pytest.mark.parametrize("bad", [math.inf, math.nan, False, None])
def test_scale_needs_a_finite_factor(bad):
    with pytest.raises(HeadwatchError, match="finite number"):
        logit_scale(bad)


# ---------------------------------------------------------------- from hidden states
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [2**26, 6000])
def test_from_hidden_with_bias_mask_targets_and_transform_equals_float64_logits(weight_dtype, budget):
    g = torch.Generator().manual_seed(13)
    hidden = torch.randn(3, 7, 12, generator=g)
    weight = (torch.randn(90, 12, generator=g) / 2).to(weight_dtype)
    bias = torch.randn(90, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.3
    targets = torch.randint(0, 90, (3, 7), generator=g)
    got = logit_statistics_from_hidden(
        hidden, weight, bias, mask, targets, max_chunk_bytes=budget, transform=logit_softcap(5.0)
    )
    logits = 5.0 * torch.tanh((hidden.double() @ weight.double().T + bias.double()) / 5.0)  # (3, 7, 90)
    want = ref64(logits, targets)
    assert torch.equal(got.valid, mask)
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll"):
        _close(getattr(got, name)[mask], want[name][mask], atol=5e-5, rtol=5e-5)
    assert torch.equal(got.target_is_argmax[mask], (logits.argmax(-1) == targets)[mask])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, d, budget", [(1000, 64, 2**20), (32000, 256, 2**24), (7, 3, 10**6), (128256, 4096, 2**26)])
def test_hidden_chunk_plan_stays_within_the_budget(weight_dtype, V, d, budget):
    """Working set of a chunk: 12 V + 4 d bytes per row, plus a float32 slice of a low-precision head and its product."""
    rows, step = hidden_chunk_plan(V, d, weight_dtype, budget)
    assert rows >= 1 and 1 <= step <= V
    if weight_dtype == torch.float32:
        assert step == V
        used = rows * (12 * V + 4 * d)
    else:
        assert 4 * step * d <= max(budget // 4, 4 * d)  # the converted slice: at most a quarter of the budget
        used = 4 * step * d + rows * (12 * V + 4 * d + 4 * step)
    assert rows == 1 or used <= budget


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=[[0.0]], weight=torch.zeros(4, 1)), "`hidden` must be a torch.Tensor"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 5)), r"hidden \(2, 3\) and weight \(4, 5\)"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4)), "weight of shape"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 3), bias=torch.zeros(3)), r"bias of shape \(4,\), got \(3,\)"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 3), bias=[0.0] * 4), r"`bias` must be a torch.Tensor or None, got \[0.0"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 3), mask=torch.ones(3, dtype=torch.bool)), r"mask of shape \(2,\)"),
        (dict(hidden=torch.zeros(2, 3), weight=torch.zeros(4, 3), transform=3.0), "callable"),
    ],
)
def test_from_hidden_refuses_shapes_that_do_not_chain(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        logit_statistics_from_hidden(**kwargs)


# ---------------------------------------------------------------- padded mass
@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(2, 40)), elements=st.floats(-40, 40, width=32)),
    st.data(),
)
def test_padded_mass_is_the_softmax_mass_beyond_the_vocabulary(x, data):
    logits = torch.from_numpy(x.copy())
    V = logits.shape[-1]
    vocab_size = data.draw(st.integers(1, V))
    budget = data.draw(st.sampled_from([1, 300, 2**26]))
    got = padded_mass(logits, vocab_size, max_chunk_bytes=budget)
    p = torch.softmax(logits.double(), -1)
    want = p[:, vocab_size:].sum(-1)
    assert got.shape == logits.shape[:-1]
    assert ((got >= 0) & (got <= 1)).all()
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    # the complement is the mass on the tokenizer's columns
    torch.testing.assert_close(1 - got.double(), p[:, :vocab_size].sum(-1), atol=2e-6, rtol=2e-5)


def test_padded_mass_of_neg_inf_padding_nonfinite_rows_and_float64():
    x = _gen(5, 12, seed=14)
    x[0, 9:] = NINF  # padded logits all -inf: exactly 0
    x[1, 3] = math.nan
    x[2, 0] = math.inf
    x[3, :] = NINF  # no distribution
    got = padded_mass(x, 9)
    assert got[0].item() == 0.0
    assert torch.isnan(got[1:4]).all()
    torch.testing.assert_close(got[4].double(), torch.softmax(x[4].double(), -1)[9:].sum(), atol=1e-6, rtol=1e-6)
    exact = padded_mass(x[4:].double(), 9)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact[0], torch.softmax(x[4].double(), -1)[9:].sum(), atol=1e-14, rtol=0)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 5), 0), r"int in \[1, 5\]"),
        ((torch.zeros(2, 5), 6), r"int in \[1, 5\]"),
        ((torch.zeros(2, 5), True), r"int in \[1, 5\]"),
        ((torch.zeros(2, 5), 4.0), r"int in \[1, 5\]"),
        ((torch.zeros(2, 5), 3, 0), "max_chunk_bytes"),
        ((torch.zeros((), dtype=torch.float32), 1), "floating tensor"),
        (([0.0, 1.0], 1), "got list"),
    ],
)
def test_padded_mass_bad_arguments(args, match):
    with pytest.raises(HeadwatchError, match=match):
        padded_mass(*args)


# ---------------------------------------------------------------- sums: exact state for several batches and processes
def test_sums_of_two_batches_give_the_means_of_their_concatenation():
    """Means come from sums and counts: the state of two batches added equals the state of one batch of both."""
    g = torch.Generator().manual_seed(15)
    a, b = torch.randn(3, 5, 33, generator=g) * 2, torch.randn(2, 5, 33, generator=g) * 2
    ta, tb = torch.randint(0, 33, (3, 5), generator=g), torch.randint(0, 33, (2, 5), generator=g)
    ta[0, 0] = 40  # invalid target: counted, excluded
    b[1, 2, 4] = math.nan  # non-finite row: counted, excluded
    ma, mb = torch.rand(3, 5, generator=g) > 0.25, torch.ones(2, 5, dtype=torch.bool)
    ma[0, 0] = True
    sa = logit_stats_update(logit_statistics(a, ma, ta))
    sb = logit_stats_update(logit_statistics(b, mb, tb))
    added = type(sa)(*(x + y for x, y in zip(sa, sb)))
    whole = logit_stats_update(logit_statistics(torch.cat([a, b]), torch.cat([ma, mb]), torch.cat([ta, tb])))
    for name, x, y in zip(sa._fields, added, whole):
        torch.testing.assert_close(x, y, atol=1e-9, rtol=1e-12, msg=name)
    means = logit_stats_compute(added)
    assert means["invalid_target_positions"].item() == 1 and means["nonfinite_positions"].item() == 1
    logits, targets = torch.cat([a, b]), torch.cat([ta, tb])
    keep = torch.cat([ma, mb]) & (targets < 33) & torch.isfinite(logits).all(-1)
    want = ref64(logits, targets.clamp(max=32))
    assert means["positions"].item() == keep.sum().item()
    for name, key in (("entropy", "entropy"), ("kl_from_uniform", "kl_from_uniform"), ("max_prob", "max_prob"), ("nll", "target_nll")):
        assert means[key].item() == pytest.approx(want[name][keep].mean().item(), rel=1e-5, abs=1e-6)
    argmax = (logits.argmax(-1) == targets)[keep].double().mean().item()
    assert means["target_argmax_rate"].item() == pytest.approx(argmax)


def test_sums_without_targets_have_no_target_positions_and_nan_target_means():
    got = logit_stats_compute(logit_stats_update(logit_statistics(_gen(2, 4, 9, seed=16))))
    assert got["positions"].item() == 8
    assert math.isnan(got["target_nll"].item()) and math.isnan(got["target_argmax_rate"].item())
    assert got["entropy"].dtype == torch.float64


# ---------------------------------------------------------------- quantiles
@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 60), elements=st.floats(-1e6, 1e6)), st.lists(st.floats(0, 1), min_size=1, max_size=5))
def test_quantiles_match_numpy_linear_interpolation(values, qs):
    t = torch.from_numpy(values.copy())
    got = quantiles(t, tuple(qs))
    want = np.quantile(values, qs, method="linear")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-6)
    np.testing.assert_allclose(sorted_quantiles(t.sort().values, tuple(qs)).numpy(), want, rtol=1e-12, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float64, st.integers(0, 60), elements=st.one_of(st.floats(-1e6, 1e6), st.just(float("nan")))),
    st.lists(st.floats(0, 1), min_size=1, max_size=5),
)
def test_nanquantiles_match_numpy_on_the_values_that_are_not_nan(values, qs):
    """NumPy's quantiles of the non-NaN values (NaN when all are NaN), with the NaNs anywhere in the input."""
    kept = values[~np.isnan(values)]
    want = np.quantile(kept, qs, method="linear") if kept.size else np.full(len(qs), np.nan)
    got = nanquantiles(torch.from_numpy(values.copy()), tuple(qs))
    assert got.dtype == torch.float64 and got.shape == (len(qs),)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-6)


def test_quantiles_of_nothing_are_nan_and_of_any_shape_are_flattened():
    assert torch.isnan(quantiles(torch.zeros(0), (0.5, 0.9))).all()
    assert torch.isnan(sorted_quantiles(torch.zeros(0), (0.1,))).all()
    grid = torch.tensor([[4.0, 1.0], [3.0, 2.0]])
    assert quantiles(grid, (0.0, 0.5, 1.0)).tolist() == [1.0, 2.5, 4.0]
    assert quantiles(grid.to(torch.int64), (0.25,)).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_targets_are_compared_with_ignore_index_as_integers(dtype):
    # -100 cast to uint8 is 156: a uint8 target 156 must stay a measured prediction
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([156, 1, 199], dtype=dtype)
    stats = logit_statistics(logits, targets=targets)
    assert stats.valid.tolist() == [True, True, True]
    want = ref64(logits, targets.long())["nll"]
    torch.testing.assert_close(stats.nll.double(), want, rtol=1e-5, atol=1e-6)
