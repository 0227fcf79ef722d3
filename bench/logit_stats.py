"""Benchmark: headwatch's logit statistics against the usual ways of computing them.

What is measured, on one float32 ``(rows, vocab)`` logits tensor on the CPU
(default ``(2048, 32000)``, i.e. 250 MiB), in one run:

- wall time of each method, after warm-up calls, over ``--repeats`` calls run
  round-robin (method A, B, C, ..., A, B, C, ...) so that clock or thermal drift
  hits every method alike; the table reports the median and the minimum;
- the ratio of each median to the median of one ``torch.logsumexp(logits, -1)``,
  the cheapest full pass any of these statistics needs (target: headwatch <= 1.1x);
- the peak extra memory of one call: memory allocated beyond the input tensor,
  outputs included. The CPU allocator keeps no statistics, so one call of each
  method is run under ``torch.profiler`` with ``profile_memory=True``; every
  allocation and free of torch's CPU allocator is then an event with a signed
  byte count, and the peak is the maximum of their running sum in time order.
  The input is allocated before profiling starts, so it is not counted.

Before timing, the methods' results are compared (max abs differences, nats). While
timing, the share of the machine's CPU used by other processes is measured from
``/proc/stat`` and printed: the timings only mean something when it is near 0.

Methods: ``torch.logsumexp`` (reference); headwatch ``logit_statistics`` without and
with targets (entropy, KL(p||U), KL(U||p), max prob, and the target NLL);
the naive recipe (``log_softmax`` + ``kl_div`` against a full ``(rows, vocab)``
uniform tensor + a separate entropy); TRL's ``entropy_from_logits`` (entropy only,
chunks of 128 rows). Two more rows help reading the others: logsumexp's arithmetic
with its ``(rows, vocab)`` temporary allocated once outside the timed call (so without
the cost of fresh memory), and ``logits.amax(-1)``, a single read of the input with no
``(rows, vocab)`` output: the memory-bandwidth floor.

``--contended``: the same timings twice in one process, first as they are, then while
``--spinners`` (default 1) other Python processes spin on the CPU (started and stopped
by the script), printed side by side with each method's ratio to ``torch.logsumexp``
under the same conditions (the target: 1.5x in both). An extra row,
``headwatch, chunks in one thread``, runs the same row math with every op of every chunk
multi-threaded (the behaviour before the chunks were split across threads).

Run: ``python bench/logit_stats.py [--rows 2048] [--vocab 32000] [--repeats 10] [--contended]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from headwatch.functional import DEFAULT_MAX_CHUNK_BYTES, LogitStatistics, logit_statistics, rows_per_chunk

TRL_MISSING = "not installed (pip install -e .[bench])"


@dataclass
class Method:
    name: str
    fn: Callable[[], object] | None
    """None when the method is unavailable (TRL not installed)."""
    note: str = ""


@dataclass
class Result:
    name: str
    median_ms: float
    min_ms: float
    peak_mib: float


def naive_recipe(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The common recipe: full log-softmax, KL(U || p) against a full uniform tensor, separate entropy."""
    logp = F.log_softmax(logits, dim=-1)
    uniform = torch.full_like(logp, 1.0 / logits.shape[-1])
    kl = F.kl_div(logp, uniform, reduction="batchmean")
    ent = -(logp.exp() * logp).sum(-1)
    return kl, ent


def logsumexp_preallocated(logits: Tensor, buf: Tensor) -> Tensor:
    """logsumexp's own arithmetic with its ``(rows, vocab)`` temporary already allocated.

    ``torch.logsumexp`` allocates ``x - max`` afresh at every call; the difference between
    the two rows is the cost of getting 250 MiB of new memory (page faults, zeroing).
    """
    m = logits.amax(dim=-1, keepdim=True)
    torch.sub(logits, m, out=buf).exp_()
    return buf.sum(dim=-1).log_().add_(m.squeeze(-1))


def load_trl_entropy() -> tuple[Callable[[Tensor], Tensor] | None, str]:
    """TRL's ``entropy_from_logits`` and its version, or ``(None, reason)``."""
    try:
        import trl
        from trl.trainer.utils import entropy_from_logits
    except Exception as exc:  # ImportError, or a broken transformers/accelerate underneath
        return None, f"trl {TRL_MISSING}: {type(exc).__name__}: {exc}"
    return entropy_from_logits, f"trl {trl.__version__}"


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak of the running sum of torch CPU allocations/frees during one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def time_round_robin(methods: list[Method], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each available method, calls interleaved across methods."""
    runnable = [m for m in methods if m.fn is not None]
    for _ in range(warmup):
        for m in runnable:
            assert m.fn is not None
            m.fn()
    times: dict[str, list[float]] = {m.name: [] for m in runnable}
    for _ in range(repeats):
        for m in runnable:
            assert m.fn is not None
            t0 = time.perf_counter()
            out = m.fn()
            times[m.name].append(time.perf_counter() - t0)
            del out
    return times


def _system_busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy (Linux ``/proc/stat``), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def other_cpu_share(busy0: float | None, own0: float, wall0: float) -> str:
    """Share of the machine's CPUs used by other processes since the given marks."""
    busy1 = _system_busy_seconds()
    if busy0 is None or busy1 is None:
        return "unknown (no /proc/stat)"
    own = sum(os.times()[:2]) - own0
    wall = time.perf_counter() - wall0
    share = max(0.0, (busy1 - busy0 - own) / (wall * (os.cpu_count() or 1)))
    verdict = "quiet" if share < 0.05 else "BUSY: timings are not representative, rerun on a quiet machine"
    return f"{100 * share:.0f}% ({verdict})"


def chunks_in_one_thread(logits: Tensor) -> LogitStatistics:
    """headwatch's row math with each chunk's ops multi-threaded in turn (no split across threads).

    The scheme before the chunks were split across threads, rebuilt from public API: the rows
    are cut into the cache-sized chunks ``logit_statistics`` uses (``rows_per_chunk`` with the
    default budget), and ``logit_statistics`` is called on one chunk at a time with a budget
    that holds the whole chunk, so each call is a single task run in the calling thread with
    torch's intra-op threads; the per-row results are concatenated.
    """
    rows = rows_per_chunk(logits.shape[-1], logits.dtype, logits.device, DEFAULT_MAX_CHUNK_BYTES)
    budget = DEFAULT_MAX_CHUNK_BYTES * torch.get_num_threads()  # one chunk = one task in every call
    parts = [logit_statistics(chunk, max_chunk_bytes=budget) for chunk in logits.split(rows)]
    return LogitStatistics(*(None if field[0] is None else torch.cat(field) for field in zip(*parts)))


def contended_comparison(methods: list[Method], warmup: int, repeats: int, spinners: int) -> None:
    """Median times idle and with ``spinners`` busy processes, side by side, each as a ratio to the first method."""
    idle = time_round_robin(methods, warmup, repeats)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        time.sleep(0.5)  # let the spinners get scheduled
        busy = time_round_robin(methods, warmup, repeats)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    ref = methods[0].name
    name_w = max(len(m.name) for m in methods)
    header = f"{'method':<{name_w}}  {'idle ms':>8}  {'x lse':>6}  {'contended ms':>12}  {'x lse':>6}"
    print(header)
    print("-" * len(header))
    for m in methods:
        if m.name not in idle:
            print(f"{m.name:<{name_w}}  {m.note}")
            continue
        i, b = statistics.median(idle[m.name]), statistics.median(busy[m.name])
        print(f"{m.name:<{name_w}}  {1e3 * i:>8.1f}  {i / statistics.median(idle[ref]):>5.2f}x  "
              f"{1e3 * b:>12.1f}  {b / statistics.median(busy[ref]):>5.2f}x")
    print()
    print(f"contended: {spinners} other process(es) running `while True: pass` during the second timing; "
          "x lse: median / median of torch.logsumexp under the same conditions (target <= 1.5x).")


def check_agreement(logits: Tensor, targets: Tensor, trl_entropy: Callable[[Tensor], Tensor] | None) -> str:
    """Max absolute differences between headwatch and the reference computations (nats)."""
    stats = logit_statistics(logits, targets=targets)
    kl, ent = naive_recipe(logits)
    assert stats.nll is not None
    diffs = {
        "entropy vs naive": (stats.entropy - ent).abs().max().item(),
        "mean KL(U||p) vs kl_div": abs(stats.kl_from_uniform.mean().item() - kl.item()),
        "nll vs cross_entropy": (stats.nll - F.cross_entropy(logits, targets, reduction="none")).abs().max().item(),
    }
    if trl_entropy is not None:
        diffs["entropy vs trl"] = (stats.entropy - trl_entropy(logits)).abs().max().item()
    return ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="positions (batch x sequence), default 2048")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size, default 32000")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per method, default 10")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method first, default 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contended", action="store_true",
                        help="time idle and with --spinners busy processes, side by side")
    parser.add_argument("--spinners", type=int, default=1, help="busy processes for --contended, default 1")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    # Scale 3: a realistic spread (entropies well below log V), no effect on speed.
    logits = torch.randn(args.rows, args.vocab, dtype=torch.float32).mul_(3.0)
    targets = torch.randint(0, args.vocab, (args.rows,))
    lse_buf = torch.empty_like(logits)
    trl_entropy, trl_info = load_trl_entropy()

    methods = [
        Method("torch.logsumexp (reference)", lambda: torch.logsumexp(logits, -1)),
        Method("logsumexp math, temporary preallocated", lambda: logsumexp_preallocated(logits, lse_buf)),
        Method("logits.amax(-1) (one read pass, floor)", lambda: logits.amax(-1)),
        Method("headwatch logit_statistics", lambda: logit_statistics(logits)),
        Method("headwatch logit_statistics + targets", lambda: logit_statistics(logits, targets=targets)),
        Method("headwatch, chunks in one thread", lambda: chunks_in_one_thread(logits)),
        Method("naive log_softmax + kl_div + entropy", lambda: naive_recipe(logits)),
        Method(
            "trl entropy_from_logits",
            (lambda: trl_entropy(logits)) if trl_entropy is not None else None,
            note="" if trl_entropy is not None else TRL_MISSING,
        ),
    ]

    input_mib = logits.numel() * logits.element_size() / 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (os.cpu_count: {os.cpu_count()}), "
          f"{platform.machine()} {platform.processor() or ''}".rstrip())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"python {platform.python_version()}, {trl_info}; load average before: {load}")
    print(f"logits float32 ({args.rows}, {args.vocab}) = {input_mib:.1f} MiB on cpu; "
          f"warm-up {args.warmup}, repeats {args.repeats} (round-robin)")
    print(f"agreement: {check_agreement(logits, targets, trl_entropy)}")
    print()
    if args.contended:
        contended_comparison(methods, args.warmup, args.repeats, args.spinners)
        return

    busy0, own0, wall0 = _system_busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    times = time_round_robin(methods, args.warmup, args.repeats)
    contention = other_cpu_share(busy0, own0, wall0)
    results: dict[str, Result] = {}
    for m in methods:
        if m.fn is None:
            continue
        t = times[m.name]
        results[m.name] = Result(
            m.name, 1e3 * statistics.median(t), 1e3 * min(t), peak_extra_bytes(m.fn) / 2**20
        )

    ref = results[methods[0].name].median_ms
    name_w = max(len(m.name) for m in methods)
    header = f"{'method':<{name_w}}  {'median ms':>9}  {'min ms':>8}  {'x logsumexp':>11}  {'peak extra MiB':>14}"
    print(header)
    print("-" * len(header))
    for m in methods:
        r = results.get(m.name)
        if r is None:
            print(f"{m.name:<{name_w}}  {m.note}")
            continue
        print(f"{r.name:<{name_w}}  {r.median_ms:>9.1f}  {r.min_ms:>8.1f}  {r.median_ms / ref:>10.2f}x  "
              f"{r.peak_mib:>14.1f}")
    print()
    print(f"CPU used by other processes while timing: {contention}")
    print("x logsumexp: median time / median time of torch.logsumexp(logits, -1).")
    print("peak extra MiB: torch.profiler(profile_memory=True), max running sum of CPU allocator "
          "events during one call; input not counted, outputs counted.")


if __name__ == "__main__":
    main()
