"""headwatch.functional checked against an independent float64 NumPy/SciPy reference."""

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
    entropy,
    kl_from_uniform,
    kl_to_uniform,
    logit_statistics,
    logit_statistics_from_hidden,
)
from headwatch.functional.logits import rows_per_chunk
from headwatch.functional.sums import logit_stats_compute, logit_stats_update
from tests.helpers.references import reference

NINF = float("-inf")


def assert_matches(got, ref, rtol=2e-5, atol=2e-5):
    np.testing.assert_array_equal(got.valid.numpy(), ref["valid"])
    np.testing.assert_array_equal(got.nonfinite.numpy(), ref["nonfinite"])
    np.testing.assert_array_equal(got.invalid_target.numpy(), ref["invalid_target"])
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob"):
        np.testing.assert_allclose(getattr(got, name).double().numpy(), ref[name], rtol=rtol, atol=atol, err_msg=name)
    if got.nll is not None:
        np.testing.assert_allclose(got.nll.double().numpy(), ref["nll"], rtol=rtol, atol=atol, err_msg="nll")
        np.testing.assert_array_equal(got.target_is_argmax.numpy(), ref["target_is_argmax"])


def _gen(*shape, scale=3.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


CASES = {
    "2d": lambda: (_gen(16, 100), None, None),
    "3d": lambda: (_gen(3, 5, 37), None, None),
    "one_position": lambda: (_gen(1, 50), None, None),
    "v2": lambda: (_gen(7, 2), None, None),
    "v1": lambda: (_gen(3, 1), None, None),
    "peaked": lambda: (_gen(4, 64, scale=40.0), None, None),
    "uniform": lambda: (torch.zeros(3, 10), None, None),
    "mask": lambda: (_gen(2, 6, 30), torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool), None),
    "targets_ignore_index": lambda: (
        _gen(2, 4, 20),
        None,
        torch.tensor([[3, -100, 19, 0], [-100, -100, 7, 7]]),
    ),
    "targets_and_mask": lambda: (
        _gen(2, 4, 20),
        torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]], dtype=torch.bool),
        torch.tensor([[3, 5, 19, 0], [-100, 2, 7, 7]]),
    ),
    "large_offset": lambda: (_gen(5, 300) + 1e4, None, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case):
    logits, mask, targets = CASES[case]()
    got = logit_statistics(logits, mask=mask, targets=targets)
    assert_matches(got, reference(logits, mask, targets))


def test_neg_inf_logits_are_exact():
    # all but k logits at -inf: entropy <= log k, never NaN; KL(U || p) is +inf.
    V, k = 50, 4
    logits = torch.full((3, V), NINF)
    logits[0, :k] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    logits[1, :k] = 0.0  # uniform over k: entropy exactly log k
    logits[2, 10] = 5.0  # one finite logit: entropy 0, max_prob 1
    got = logit_statistics(logits, targets=torch.tensor([3, 0, 10]))
    assert torch.isfinite(got.entropy).all()
    assert (got.entropy <= math.log(k) + 1e-6).all()
    assert got.entropy[1].item() == pytest.approx(math.log(k), abs=1e-6)
    assert got.entropy[2].item() == 0.0
    assert got.max_prob[2].item() == 1.0
    assert got.nll[2].item() == 0.0
    assert torch.isinf(got.kl_from_uniform).all()
    assert got.kl_to_uniform[1].item() == pytest.approx(math.log(V) - math.log(k), abs=1e-6)
    assert_matches(got, reference(logits, targets=torch.tensor([3, 0, 10])))


def test_nan_and_posinf_rows_are_counted_and_excluded():
    logits = _gen(6, 40)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[4, :] = NINF  # no distribution at all
    got = logit_statistics(logits)
    assert got.nonfinite.tolist() == [False, True, True, False, True, False]
    assert got.valid.tolist() == [True, False, False, True, False, True]
    sums = logit_stats_update(got)
    means = logit_stats_compute(sums)
    assert sums.nonfinite_positions.item() == 3
    assert sums.positions.item() == 3
    ref = reference(logits)
    assert means["entropy"].item() == pytest.approx(np.nanmean(ref["entropy"]), rel=1e-6)
    assert math.isfinite(means["kl_to_uniform"].item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_inputs(dtype):
    logits = _gen(4, 7, 120).to(dtype)
    targets = torch.randint(0, 120, (4, 7), generator=torch.Generator().manual_seed(1))
    got = logit_statistics(logits, targets=targets)
    assert got.entropy.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the reference sees exactly the same (rounded) input values, in float64
    assert_matches(got, reference(logits, targets=targets))


def test_out_of_range_targets_are_excluded_not_gathered():
    logits = _gen(4, 10)
    targets = torch.tensor([2, 10, -5, -100])  # 10 and -5 are outside [0, V)
    got = logit_statistics(logits, targets=targets)
    assert got.invalid_target.tolist() == [False, True, True, False]
    assert got.valid.tolist() == [True, False, False, False]
    assert_matches(got, reference(logits, targets=targets))


def test_custom_ignore_index():
    logits = _gen(3, 9)
    targets = torch.tensor([0, 4, 4])
    got = logit_statistics(logits, targets=targets, ignore_index=4)
    assert got.valid.tolist() == [True, False, False]


@pytest.mark.parametrize("max_chunk_bytes", [1, 1000, 10_000, 2**30])
def test_chunking_does_not_change_values(max_chunk_bytes):
    logits = _gen(3, 11, 257)
    targets = torch.randint(0, 257, (3, 11), generator=torch.Generator().manual_seed(2))
    got = logit_statistics(logits, targets=targets, max_chunk_bytes=max_chunk_bytes)
    assert_matches(got, reference(logits, targets=targets))


def test_non_contiguous_logits():
    base = _gen(5, 8, 64)
    logits = base.transpose(0, 1)  # (8, 5, 64), not viewable as (40, 64)
    got = logit_statistics(logits, max_chunk_bytes=3 * 64 * 4 * 2)
    assert_matches(got, reference(logits))
    sliced = _gen(4, 6, 80)[:, ::2, :50]  # strided in two dimensions
    assert_matches(logit_statistics(sliced, max_chunk_bytes=1), reference(sliced))


def test_rows_per_chunk_respects_budget():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    V = 32000
    for budget in (1 << 20, 64 << 20):
        rows = rows_per_chunk(V, torch.float32, meta, budget)
        assert rows * V * 4 * 2 <= budget
        rows = rows_per_chunk(V, torch.bfloat16, meta, budget)
        assert rows * V * 4 * 3 <= budget
    assert rows_per_chunk(V, torch.float32, cpu, 64 << 20) * V * 8 <= 4 << 20  # cache-sized on the CPU
    assert rows_per_chunk(10**9, torch.float32, meta, 1) == 1


def test_peak_extra_memory_is_bounded():
    """The largest allocation is one chunk buffer, not a (B, T, V) tensor."""
    from torch.profiler import ProfilerActivity, profile

    logits = _gen(8, 256, 1000)  # 8 MB of logits
    budget = 256 * 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logit_statistics(logits, targets=torch.zeros(8, 256, dtype=torch.long), max_chunk_bytes=budget)
    largest = max(evt.cpu_memory_usage for evt in prof.events())
    assert largest <= budget // 2 + 4096  # one of the two float32 working buffers
    assert largest < logits.numel() * 4 // 8


def test_convenience_functions():
    logits = _gen(2, 3, 17)
    ref = reference(logits)
    np.testing.assert_allclose(entropy(logits).double().numpy(), ref["entropy"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl_to_uniform(logits).double().numpy(), ref["kl_to_uniform"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl_from_uniform(logits).double().numpy(), ref["kl_from_uniform"], rtol=1e-5, atol=1e-6)


def test_sums_and_means():
    logits = _gen(3, 4, 25)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    targets = torch.randint(0, 25, (3, 4), generator=torch.Generator().manual_seed(5))
    means = logit_stats_compute(logit_stats_update(logit_statistics(logits, mask, targets)))
    ref = reference(logits, mask, targets)
    assert means["positions"].item() == 7
    for name in ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob"):
        assert means[name].item() == pytest.approx(np.nanmean(ref[name]), rel=1e-5)
    assert means["target_nll"].item() == pytest.approx(np.nanmean(ref["nll"]), rel=1e-5)
    assert means["target_argmax_rate"].item() == pytest.approx(ref["target_is_argmax"].sum() / 7)


def test_all_masked_gives_nan_means_and_zero_count():
    logits = _gen(2, 3, 10)
    means = logit_stats_compute(logit_stats_update(logit_statistics(logits, torch.zeros(2, 3, dtype=torch.bool))))
    assert means["positions"].item() == 0
    assert math.isnan(means["entropy"].item())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logits=torch.zeros(2, 3, dtype=torch.long)), "floating-point"),
        (dict(logits=torch.zeros(2, 0)), r"\[..., vocab_size\]"),
        (dict(logits=torch.zeros(2, 3, 5), mask=torch.ones(3, 2, dtype=torch.bool)), r"mask of shape \(2, 3\)"),
        (dict(logits=torch.zeros(2, 3, 5), mask=torch.ones(2, 3)), "boolean mask"),
        (dict(logits=torch.zeros(2, 3, 5), targets=torch.zeros(2, 4, dtype=torch.long)), r"targets of shape \(2, 3\)"),
        (dict(logits=torch.zeros(2, 3, 5), targets=torch.zeros(2, 3)), "`targets` must be an integer tensor of token ids"),
        (dict(logits=[[0.0, 1.0]]), "torch.Tensor"),
        (dict(logits=torch.zeros(2, 5), max_chunk_bytes=0), "max_chunk_bytes"),
    ],
)
def test_bad_input_raises(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        logit_statistics(**kwargs)


# ---------------------------------------------------------------- properties
finite_logits = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(2, 40)),
    elements=st.floats(-60, 60, width=32),
)


@settings(max_examples=150, deadline=None)
@given(finite_logits, st.floats(0.0, 1.0))
def test_entropy_bounds_and_identity(x, neg_inf_fraction):
    logits = torch.from_numpy(x.copy())
    V = logits.shape[-1]
    # knock out a fraction of logits to -inf, keeping at least one finite per row
    k = int(neg_inf_fraction * (V - 1))
    if k:
        logits[:, :k] = NINF
    got = logit_statistics(logits)
    log_v = math.log(V)
    assert got.valid.all()
    H = got.entropy.double()
    assert (H >= 0).all() and (H <= log_v + 1e-6).all()
    assert (H <= math.log(V - k) + 1e-5).all()
    assert (got.kl_to_uniform >= 0).all() and (got.kl_from_uniform >= 0).all()
    torch.testing.assert_close(H + got.kl_to_uniform.double(), torch.full_like(H, log_v), rtol=0, atol=1e-5)
    assert ((got.max_prob > 0) & (got.max_prob <= 1)).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_from_hidden_states_equals_from_logits(with_bias):
    """The fused-cross-entropy path: statistics of hidden @ W.T + b, never holding the logits."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=g).to(torch.bfloat16)
    weight = torch.randn(300, 16, generator=g)
    bias = torch.randn(300, generator=g) if with_bias else None
    targets = torch.randint(0, 300, (2, 9), generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.2
    logits = hidden.double() @ weight.double().T + (bias.double() if with_bias else 0)
    got = logit_statistics_from_hidden(hidden, weight, bias, mask, targets, max_chunk_bytes=4 * 300 * 4 * 3)
    assert_matches(got, reference(logits, mask, targets), rtol=1e-4, atol=1e-4)


def test_from_hidden_shape_errors():
    with pytest.raises(HeadwatchError, match=r"hidden of shape \[..., d_model\]"):
        logit_statistics_from_hidden(torch.zeros(2, 5), torch.zeros(10, 4))
    with pytest.raises(HeadwatchError, match=r"bias of shape \(10,\)"):
        logit_statistics_from_hidden(torch.zeros(2, 4), torch.zeros(10, 4), torch.zeros(9))


def test_float64_logits_keep_float64_precision_and_neg_inf_target_nll():
    logits = torch.tensor([[1e10, 1e10 + 1.0, 1e10 - 1.0]], dtype=torch.float64)  # float32 would round them equal
    got = logit_statistics(logits, targets=torch.tensor([2]))
    # float32 would give log 3 = 1.0986; the float64 reference itself carries ~1e-8 error at this offset
    assert_matches(got, reference(logits, targets=torch.tensor([2])), rtol=1e-6, atol=1e-6)
    inf_target = torch.tensor([[0.0, float("-inf"), 1.0]])
    assert logit_statistics(inf_target, targets=torch.tensor([1])).nll.item() == float("inf")


def test_from_hidden_with_a_low_precision_head_is_chunked_over_the_vocabulary():
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, 5, 32, generator=g)
    weight = torch.randn(1000, 32, generator=g).to(torch.bfloat16)
    bias = torch.randn(1000, generator=g)
    logits = hidden.double() @ weight.double().T + bias.double()
    got = logit_statistics_from_hidden(hidden, weight, bias, max_chunk_bytes=32 * 1024)  # 64 vocabulary rows a slice
    assert_matches(got, reference(logits), rtol=1e-4, atol=1e-4)
