"""Precision of the functional statistics: autocast, overflow, logit transforms, CPU threading.

Every value is checked against a float64 recomputation that does not use headwatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from headwatch import HeadwatchError
from headwatch.functional import (
    finite_histogram_values,
    logit_scale,
    logit_softcap,
    logit_statistics,
    logit_statistics_from_hidden,
)
from headwatch.functional.neighbors import nearest_neighbours, pair_cosine
from headwatch.functional.precision import SMALL_DENSE, single_threaded
from headwatch.functional.rows import row_cosine, row_norms, summarize
from tests.helpers.references import reference

FIELDS = ("entropy", "kl_to_uniform", "kl_from_uniform", "max_prob", "nll")


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def assert_matches(got, want: dict[str, np.ndarray], atol: float) -> None:
    for name in FIELDS:
        g = getattr(got, name)
        if g is None:
            continue
        np.testing.assert_allclose(g.double().numpy(), want[name], atol=atol, rtol=0, err_msg=name)


@pytest.mark.parametrize("inside", [False, True], ids=["plain", "autocast"])
def test_logit_statistics_keeps_float32_precision_under_autocast(inside):
    """Under autocast: bf16 logits, (256, 32000), within 1e-5 nats per position of float64 (1.5e-2 before)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 32000, generator=g) * 3).bfloat16()
    t = torch.randint(0, 32000, (256,), generator=g)
    with autocast(inside):
        got = logit_statistics(x, targets=t)
    assert_matches(got, reference(x, targets=t), atol=1e-5)


@pytest.mark.parametrize("inside", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_from_hidden_projects_in_float32_under_autocast(inside, with_bias):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 40, 64, generator=g).bfloat16()
    weight = (torch.randn(3000, 64, generator=g) * 0.4).bfloat16()
    bias = torch.randn(3000, generator=g).bfloat16() if with_bias else None
    t = torch.randint(0, 3000, (2, 40), generator=g)
    logits64 = hidden.double() @ weight.double().T + (bias.double() if with_bias else 0)  # independent float64
    with autocast(inside):
        got = logit_statistics_from_hidden(hidden, weight, bias, targets=t, max_chunk_bytes=1 << 20)
    assert_matches(got, reference(logits64, targets=t), atol=1e-5)


@pytest.mark.parametrize("inside", [False, True], ids=["plain", "autocast"])
def test_row_functions_and_neighbours_keep_precision_under_autocast(inside):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(700, 96, generator=g)
    w[5] = w[9] * 0.5 + 1e-3 * torch.randn(96, generator=g)  # a near-duplicate: bf16 products would blur it
    b = torch.randn(700, 96, generator=g)
    w64, b64 = w.double().numpy(), b.double().numpy()
    unit = w64 / np.linalg.norm(w64, axis=1, keepdims=True)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    queries = torch.tensor([5, 9, 100, 699])
    with autocast(inside):
        norms = row_norms(w)
        cos, _ = row_cosine(w, b)
        nn = nearest_neighbours(w, queries, max_chunk_bytes=1 << 20)
        pairs = pair_cosine(w, queries, queries.flip(0))
    np.testing.assert_allclose(norms.numpy(), np.linalg.norm(w64, axis=1), rtol=1e-6)
    want_cos = (w64 * b64).sum(1) / np.linalg.norm(w64, axis=1) / np.linalg.norm(b64, axis=1)
    np.testing.assert_allclose(cos.numpy(), want_cos, atol=1e-6)
    np.testing.assert_allclose(nn.cosine.numpy(), sims[queries.numpy()].max(1), atol=1e-6)
    assert nn.index.tolist() == sims[queries.numpy()].argmax(1).tolist()
    np.testing.assert_allclose(pairs.numpy(), (unit[queries.numpy()] * unit[queries.flip(0).numpy()]).sum(1), atol=1e-6)


def test_row_norms_do_not_overflow_or_underflow():
    """Extreme gradients: loss x 1e22 made head row norms inf (true 2.198e21); tiny rows underflowed."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 64, generator=g) * 3e20  # squares (~1e41) overflow float32
    tiny = torch.randn(300, 64, generator=g) * 1e-21  # squares (~1e-42) are float32 subnormals: precision lost
    for m in (big, tiny):
        want = np.linalg.norm(m.double().numpy(), axis=1)
        np.testing.assert_allclose(row_norms(m).double().numpy(), want, rtol=1e-6)
        s = summarize(row_norms(m))
        assert s.max.item() == pytest.approx(want.max(), rel=1e-6)
        assert s.p50.item() == pytest.approx(np.quantile(want, 0.5), rel=1e-6)
    edge = torch.full((2, 16), 1e38)  # norm 4e38: above float32's largest value
    assert torch.isinf(row_norms(edge)).all()
    assert row_norms(edge, dtype=torch.float64).tolist() == pytest.approx([4e38, 4e38], rel=1e-6)


def test_cosines_and_neighbours_of_huge_and_tiny_rows():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 32, generator=g)
    w[:100] *= 1e21
    w[100:] *= 1e-21
    w[7] = (w[150].double() * 1e42).float()  # the direction of a tiny row, at 1e42 times its scale
    w64 = w.double().numpy()
    unit = w64 / np.linalg.norm(w64, axis=1, keepdims=True)
    cos, both = row_cosine(w, w.roll(1, 0))
    assert both.all()
    np.testing.assert_allclose(cos.numpy(), (unit * np.roll(unit, 1, 0)).sum(1), atol=1e-6)
    nn = nearest_neighbours(w, torch.tensor([7, 150, 3]))
    assert nn.index[:2].tolist() == [150, 7]
    assert nn.cosine[:2].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert torch.isfinite(nn.cosine).all()
    assert pair_cosine(w, torch.tensor([7]), torch.tensor([150])).item() == pytest.approx(1.0, abs=1e-6)


def test_finite_histogram_values():
    v = torch.tensor([1.0, float("nan"), 3e38, float("inf"), -float("inf"), -2.0])
    kept, skipped = finite_histogram_values(v.reshape(2, 3))
    assert kept.tolist() == pytest.approx([1.0, 3e38, -2.0], rel=1e-7) and skipped == 3


def test_logit_transforms_match_the_transformed_logits():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 500, generator=g) * 40
    t = torch.randint(0, 500, (3, 7), generator=g)
    before = x.clone()
    got = logit_statistics(x, targets=t, transform=logit_softcap(30.0), max_chunk_bytes=20_000)
    assert torch.equal(x, before)  # the in-place transform works on a copy
    assert_matches(got, reference(30.0 * torch.tanh(x.double() / 30.0), targets=t), atol=1e-5)
    got = logit_statistics(x.bfloat16(), targets=t, transform=logit_scale(0.25))
    assert_matches(got, reference(x.bfloat16().double() * 0.25, targets=t), atol=1e-5)
    got = logit_statistics(x, transform=lambda c: c.abs().sqrt())  # any callable, out of place
    assert_matches(got, reference(x.double().abs().sqrt()), atol=1e-5)


def test_from_hidden_with_softcap_equals_softcapped_logits():
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(9, 32, generator=g), torch.randn(1000, 32, generator=g) * 3
    logits64 = hidden.double() @ weight.double().T
    got = logit_statistics_from_hidden(hidden, weight.bfloat16(), transform=logit_softcap(30.0))
    want = reference(30.0 * torch.tanh((hidden.double() @ weight.bfloat16().double().T) / 30.0))
    assert_matches(got, want, atol=1e-5)
    assert not np.allclose(want["entropy"], reference(logits64)["entropy"], atol=1e-3)  # the cap matters here


def test_bad_transforms_raise():
    x = torch.randn(4, 10)
    with pytest.raises(HeadwatchError, match="`transform` to be None or a callable.*got int"):
        logit_statistics(x, transform=3)
    with pytest.raises(HeadwatchError, match=r"`transform` to return a tensor of shape \(4, 10\), got \(4, 9\)"):
        logit_statistics(x, transform=lambda c: c[:, :9])
    with pytest.raises(HeadwatchError, match="`cap` to be a positive finite number, got 0"):
        logit_softcap(0)
    with pytest.raises(HeadwatchError, match="`factor` to be a finite number, got nan"):
        logit_scale(float("nan"))


def test_cpu_threads_split_chunks_and_restore_the_thread_count():
    """Chunks are shared among single-threaded workers: same values as 1 thread, thread count restored."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 5000, generator=g) * 3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        many = logit_statistics(x, max_chunk_bytes=600_000)  # 200 kB a thread, 5 rows a chunk: 60 chunks
        with_grad = logit_statistics(x.clone().requires_grad_(), max_chunk_bytes=600_000)  # no graph in workers
        assert torch.equal(with_grad.entropy, many.entropy)
        with torch.inference_mode():  # Lightning validates under inference mode: the workers must be in it too
            inference = logit_statistics(x, max_chunk_bytes=200_000)
        assert torch.equal(inference.entropy, many.entropy)
        assert torch.get_num_threads() == 3
        with pytest.raises(HeadwatchError, match="to return a tensor of shape"):  # a worker's error reaches us
            logit_statistics(x, max_chunk_bytes=600_000, transform=lambda c: c[:, :1])
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert_matches(many, reference(x), atol=1e-5)


def test_from_hidden_at_llama3_scale_stays_in_budget():
    """V = 128256, d_model = 4096, 4096 positions, bf16 head: extra resident memory within the 64 MiB budget.

    Each chunk of 32 positions costs 1-5 s on a 2-core CPU (a float32 copy of the 1 GiB head, a slice at a
    time, and the products), so the call is stopped in its second chunk (by a transform that raises): the working set of a chunk is the same for
    every chunk, and every per-position output for the 4096 positions is allocated before the first.
    """
    code = """
import json, torch

from headwatch.functional import logit_statistics_from_hidden
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1])
torch.manual_seed(0)
w = torch.full((128256, 4096), 0.01, dtype=torch.bfloat16)  # 1 GiB, resident (values do not matter here)
h = torch.randn(4096, 4096, dtype=torch.bfloat16)
seen = []
class Stop(Exception):
    pass
def count(x):
    seen.append(tuple(x.shape))
    if len(seen) == 2:
        raise Stop
    return x
# warm-up on a small input: one-time costs (lazy imports, thread pools, library buffers) are not the call's working set
logit_statistics_from_hidden(h[:64], w[:512], max_chunk_bytes=64 * 2**20, transform=lambda x: x)
before = hwm()
try:
    logit_statistics_from_hidden(h, w, max_chunk_bytes=64 * 2**20, transform=count)
except Stop:
    pass
print(json.dumps([(hwm() - before) / 1024, seen]))
import sys; print((hwm() - before) / 1024, file=sys.stderr)
"""
    import subprocess

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read the peak resident memory")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    grown_mib, seen = json.loads(out)
    assert seen == [[32, 128256]] * 2
    assert grown_mib < 96  # the 64 MiB budget plus allocator slack; the head itself is 1 GiB


def test_cpu_threads_share_the_memory_budget():
    """With 4 threads, the chunk buffers of all threads together stay within max_chunk_bytes."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2048, 1000, generator=torch.Generator().manual_seed(8))  # 8 MB
    budget = 1 << 20
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = logit_statistics(x, max_chunk_bytes=budget)
    finally:
        torch.set_num_threads(threads)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:  # the running sum of allocations and frees, in time order
        running += e.nbytes()
        peak = max(peak, running)
    outputs = 2048 * 4 * 16  # the (N,) per-position tensors, with room for their temporaries
    assert peak <= budget + outputs
    assert_matches(out, reference(x), atol=1e-5)


def test_a_small_dense_factorisation_runs_on_one_cpu_thread_and_the_count_comes_back():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded(torch.device("cpu"), SMALL_DENSE):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with single_threaded(torch.device("cpu"), SMALL_DENSE + 1):  # a large one keeps every thread
            assert torch.get_num_threads() == 2
        with single_threaded(torch.device("meta"), 4):  # not the CPU: nothing changes
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), single_threaded(torch.device("cpu"), 4):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
