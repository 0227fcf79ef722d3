"""The key-set rule on 2 processes: every rank publishes the same keys on the same steps, decided from the
configuration and from values already reduced over processes (docs/distributed.md, "The key-set rule").

Cases, each through the plain-loop door with all four monitors (2 gloo processes; each process trains its own
copy, the gradients are summed over processes by hand as DDP would):

- a matrix frozen at attach (the embedding): nothing is published for it, on any rank;
- a figure withheld for a step: the head's gradient vanishes on rank 1 only at one logging step (summed over
  processes it does not vanish: nothing is withheld) and on both at another (its row densities are withheld on
  every rank, the flag published);
- labels on one rank only: rank 1's batch has no labelled position at one logging step (the figures that need a
  label come from rank 0's positions), and no rank has one at another (the split's figures are NaN, "no data",
  on every rank);
- a rank whose forward raised: rank 1's forward fails at one logging step (the loop catches it and goes on,
  as an out-of-memory recovery does), so rank 1 captured nothing for that step; with the self-check on
  (``step_end(loss=)``), rank 1 raises after its forward (measured, its loss thrown away): the check's keys come
  from the reduced reference, and the position counts differ, so the check fails on every rank;
- a self-check that fails on one rank's data: rank 1 hands a wrong loss at one logging step (``step_end(loss=)``);
  the check compares with the loss reduced over processes, so every rank withholds that step's ``logits/*``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.forked import fork_gloo_workers

WORKER = r'''
import json, sys
from pathlib import Path

rank, port, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
sys.path.insert(0, root)
import torch
import torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
import headwatch
from tests.helpers import TinyCausalLM

STEPS, EVERY, V = 8, 2, 64
results = {}
for CASE in @CASES@:
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=16, tie_weights=False)
    if CASE == "frozen":
        model.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    hw = headwatch.Headwatch(model, log_every_n_steps=EVERY, figure_every_n_steps=0, summary=False)
    g = torch.Generator().manual_seed(100 + rank)
    keys = {}
    for step in range(STEPS):
        ids = torch.randint(0, V, (4, 12), generator=g)
        labels = ids.clone()
        if CASE == "unlabelled" and step == 3 and rank == 1:
            labels[:] = -100  # rank 1: no labelled position at this logging step
        if CASE == "unlabelled" and step == 5:
            labels[:] = -100  # no rank: no labelled position
        hw.step_start({"input_ids": ids, "labels": labels}, step)
        zero_head = CASE == "vanished" and ((step == 3 and rank == 1) or step == 5)
        handle = model.lm_head.weight.register_hook(lambda g: g * 0.0) if zero_head else None
        loss = None
        try:
            if CASE == "raised" and step == 3 and rank == 1:
                raise RuntimeError("out of memory (injected)")
            logits = model(ids)
            if CASE == "raised_checked" and step == 3 and rank == 1:
                raise RuntimeError("out of memory (injected)")  # after the forward: measured, its loss thrown away
            valid = labels[:, 1:] != -100
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
            (loss if valid.any() else logits.sum() * 0.0).backward()
        except RuntimeError:
            pass  # the step goes on without this rank's forward, as after an out-of-memory recovery
        if handle is not None:
            handle.remove()
        for p in model.parameters():  # the gradients summed over processes, as DDP would
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        hw.before_optimizer_step()
        optimizer.step()
        hw.after_optimizer_step()
        optimizer.zero_grad()
        wrong = 1.0 if CASE == "mismatch" and step == 5 and rank == 1 else 0.0  # rank 1's loss off by one nat
        if CASE == "raised_checked":  # the self-check on: each rank hands its loss, none where its forward raised
            values = hw.step_end(loss=None if loss is None else loss.detach())
        else:
            values = hw.step_end(loss=loss.detach() + wrong if CASE == "mismatch" else None)
        if values:
            keys[step] = values
    hw.close()
    results[CASE] = keys
(out / f"rank{rank}.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
'''


CASES = ("frozen", "vanished", "unlabelled", "raised", "mismatch", "raised_checked")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Every case in one launch of the 2 processes (each case its own model and ``Headwatch``): each rank's values."""
    out = tmp_path_factory.mktemp("key_set")
    r0, r1 = fork_gloo_workers(WORKER.replace("@CASES@", repr(CASES)), out, 31000)
    return {case: (r0[case], r1[case]) for case in CASES}


def run(runs: dict, case: str) -> dict:
    r0, r1 = runs[case]
    assert sorted(r0) == sorted(r1) == ["1", "3", "5", "7"]
    for step in r0:
        assert sorted(r0[step]) == sorted(r1[step]), step  # the same keys on every rank
    return r0


def test_a_matrix_frozen_at_attach_publishes_nothing_for_it_on_any_rank(runs):
    r0 = run(runs, "frozen")
    for values in r0.values():
        grad_or_update = [k for k in values if k.startswith(("headwatch/grad/", "headwatch/update/", "headwatch/freq/"))]
        assert "headwatch/update/head_row_density" in grad_or_update
        assert not [k for k in grad_or_update if "embedding" in k], grad_or_update


def test_a_figure_withheld_for_a_step_is_withheld_on_every_rank(runs):
    r0 = run(runs, "vanished")
    densities = [k for k in r0["1"] if k.startswith("headwatch/grad/") and k.endswith("head_row_density")]
    assert "headwatch/grad/head_row_density" in densities and len(densities) > 1
    assert r0["3"]["headwatch/check/vanished_gradient"] == 0.0  # rank 0's gradient stands: summed, nothing vanished
    assert set(densities) <= set(r0["3"]) and r0["3"]["headwatch/check/withheld"] == 0.0
    assert r0["5"]["headwatch/check/vanished_gradient"] == 1.0
    assert not set(densities) & set(r0["5"]) and r0["5"]["headwatch/check/withheld"] == len(densities)
    assert "headwatch/grad/embedding_row_density" in r0["5"]  # the embedding's gradient did not vanish


def test_labels_on_one_rank_give_the_same_keys_and_values_everywhere(runs):
    r0 = run(runs, "unlabelled")
    assert r0["3"]["headwatch/logits/target_nll"] > 0  # rank 0's positions are enough
    assert r0["3"]["headwatch/logits/positions"] == 4 * 11  # rank 0's rows only
    # no rank had one: no position predicts a label, every figure of the split is NaN ("no data") on every rank
    assert r0["5"]["headwatch/logits/positions"] == 0
    assert math.isnan(r0["5"]["headwatch/logits/target_nll"]) and math.isnan(r0["5"]["headwatch/logits/entropy"])


def test_a_rank_whose_forward_raised_publishes_the_same_keys(runs):
    r0 = run(runs, "raised")
    # rank 0's capture of step 3 stands for the run: the keys of step 5, where both ranks ran their forward (step 1,
    # the first logging step, is a collision probe step too)
    assert sorted(r0["3"]) == sorted(r0["5"])
    assert any(k.startswith("headwatch/collision/") for k in r0["1"]) and "headwatch/logits/entropy" in r0["3"]


def test_a_self_check_failing_on_one_ranks_data_withholds_the_logits_on_every_rank(runs):
    r0 = run(runs, "mismatch")
    logits = [k for k in r0["3"] if k.startswith("headwatch/logits/")]
    assert "headwatch/logits/entropy" in logits and len(logits) > 10
    assert r0["3"]["headwatch/check/mismatch"] == 0.0 and r0["3"]["headwatch/check/withheld"] == 0.0
    # step 5: the reduced reference is half a nat off (rank 1's weight is half): the check fails everywhere
    assert r0["5"]["headwatch/check/mismatch"] == 1.0
    assert 0.4 < -r0["5"]["headwatch/check/nll_gap"] < 0.6
    assert not [k for k in r0["5"] if k.startswith("headwatch/logits/")]
    assert r0["5"]["headwatch/check/withheld"] == len(logits)
    assert "headwatch/grad/head_row_density" in r0["5"]  # only the failing figures are withheld


def test_a_rank_whose_loss_was_thrown_away_fails_the_check_on_every_rank(runs):
    r0 = run(runs, "raised_checked")
    assert r0["5"]["headwatch/check/mismatch"] == 0.0 and "headwatch/logits/entropy" in r0["5"]
    # step 3: rank 1's forward was measured (4 rows x 11 labelled positions) but its loss was thrown away: the
    # reference holds rank 0's positions only, the capture both ranks'
    got = r0["3"]
    assert got["headwatch/debug/capture/labelled_positions"] == 2 * 4 * 11
    assert got["headwatch/debug/check/reference_positions"] == 4 * 11
    assert got["headwatch/check/mismatch"] == 1.0 and math.isfinite(got["headwatch/debug/check/reference_nll"])
    assert not [k for k in got if k.startswith("headwatch/logits/")] and got["headwatch/check/withheld"] > 10


CADENCE_WORKER = r"""
import json, os, sys
from pathlib import Path

rank, port, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
sys.path.insert(0, root)
import torch
import torch.distributed as dist
import torch.nn.functional as F

import headwatch
from headwatch.errors import HeadwatchError
from tests.helpers import TinyCausalLM

V = 64
torch.manual_seed(0)
said = {"late": {"published": []}}
model = TinyCausalLM(vocab_size=V, d_model=16, tie_weights=False)
# the user's mistake: each process logs at its own interval. Constructed before the process group exists, the check
# waits for the logging steps
late = headwatch.Headwatch(model, log_every_n_steps=1 + rank, figure_every_n_steps=0, summary=False)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
wrapped = TinyCausalLM(vocab_size=V, d_model=16, tie_weights=False)
ddp = torch.nn.parallel.DistributedDataParallel(wrapped)
try:  # in the group, DDP-wrapped: every process constructs it at the same point, the intervals are compared there
    headwatch.Headwatch(wrapped, log_every_n_steps=1 + rank, figure_every_n_steps=0, summary=False)
except HeadwatchError as err:
    said["ddp"] = str(err)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(100 + rank)
for step in range(4):
    ids = torch.randint(0, V, (4, 12), generator=g)
    late.step_start({"input_ids": ids, "labels": ids}, step)
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()  # no collective of its own
    late.before_optimizer_step()
    optimizer.step()
    late.after_optimizer_step()
    optimizer.zero_grad()
    try:
        if late.step_end(loss=None):
            said["late"]["published"].append(step)
    except HeadwatchError as err:
        said["late"].update(step=step, error=str(err))
        break
(out / f"rank{rank}.json").write_text(json.dumps(said))
os._exit(0)  # the processes are out of step: no collective of the run's end
"""


def test_processes_logging_at_different_intervals_raise_on_every_rank(tmp_path):
    """Rank 0 logs every step, rank 1 every 2. Constructed in the process group (every process at the same point),
    ``Headwatch`` gathers the intervals and both processes raise there, before any step: with the model DDP-wrapped, a
    first logging step on rank 0 alone would pair headwatch's reduction with rank 1's DDP gradient all-reduce (a hang).
    Constructed before the group exists, the check waits for the logging steps: the interval rides with the reduced
    sums (no collective of its own), their first logging steps' reductions pair step 0 with step 1, and each rank sees
    the sum is not twice its own and raises before publishing anything."""
    r0, r1 = fork_gloo_workers(CADENCE_WORKER, tmp_path, 43000, timeout=120.0)
    assert (r0["late"]["step"], r1["late"]["step"]) == (0, 1) and r0["late"]["published"] == r1["late"]["published"] == []
    for said, own in ((r0, 1), (r1, 2)):
        for error in (said["ddp"], said["late"]["error"]):
            assert "log_every_n_steps" in error and "logging_steps" in error
            assert f"this process (rank {own - 1}) logs every {own} step(s)" in error
        assert "by rank: 1, 2." in said["ddp"] and "the mean over the 2 processes is 1.5" in said["late"]["error"]


def _started(rank: int, reducer, intervals: tuple[int, ...]) -> str | None:
    """A plain-loop ``Headwatch`` constructed on ``rank`` with its own interval; the error it raised (None: none)."""
    from headwatch import Headwatch
    from headwatch.errors import HeadwatchError
    from tests.helpers import TinyCausalLM

    try:
        Headwatch(TinyCausalLM(vocab_size=32, d_model=8), log_every_n_steps=intervals[rank], reducer=reducer, summary=False)
    except HeadwatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("intervals", [(2, 2, 2), (1, 2, 3)])
def test_the_intervals_are_compared_at_construction_on_every_rank(intervals):
    """3 ranks (threads): one gather at construction, on no step. Every rank sees every interval, so every rank takes
    the same decision (a sum over processes would let rank 1 pass: 1 + 2 + 3 is 3 times its 2)."""
    results = run_ranks(3, lambda rank, reducer: (_started(rank, reducer, intervals), reducer))
    errors = [e for e, _ in results]
    assert results[0][1].world.calls == 1
    if len(set(intervals)) == 1:
        assert errors == [None, None, None]
    else:
        assert all(f"logs every {n} step(s), by rank: 1, 2, 3." in e for n, e in zip(intervals, errors, strict=True))


@pytest.mark.parametrize("budgets", [(0.01, 0.02, 0.03), (0.01, None, 0.01), (None, None, None)])
def test_the_budgets_are_compared_with_the_intervals_in_the_same_gather(budgets):
    """The one gather at construction carries ``overhead_budget`` too: a budget on some ranks and None on others raises
    on every rank, naming each rank's value; budgets that all differ but are all set are kept (their mean decides)."""
    from headwatch import Headwatch
    from headwatch.errors import HeadwatchError
    from tests.helpers import TinyCausalLM

    def started(rank, reducer):
        try:
            Headwatch(TinyCausalLM(vocab_size=32, d_model=8), reducer=reducer, summary=False, overhead_budget=budgets[rank])
        except HeadwatchError as err:
            return str(err), reducer
        return None, reducer

    results = run_ranks(3, started)
    errors = [e for e, _ in results]
    assert results[0][1].world.calls == 1
    if len({b is None for b in budgets}) == 1:
        assert errors == [None, None, None]
    else:
        assert all(f"by rank: 0.01, None, 0.01; this process, rank {r}: {budgets[r]!r})" in e for r, e in enumerate(errors))


class _OtherInterval:
    """The reducer of rank 0 of 2 processes whose other process logs at another interval (one more step): what every
    door's one gather before the first step sees. Its other collectives are those of equal processes."""

    world_size, rank = 2, 0

    def all_gather(self, tensor):
        return torch.stack([tensor, tensor + 1])

    def gather(self, tensor):
        return list(self.all_gather(tensor).unbind(0))

    def sum(self, tensor):
        return tensor * 2

    def mean(self, tensor):
        return tensor.clone()

    def all(self, flag):
        return bool(flag)


@pytest.mark.parametrize("door", ["loop", "hf_trainer", "lightning"])
def test_every_door_compares_the_intervals_before_the_first_step(tmp_path, monkeypatch, door):
    """The plain loop at construction, the Hugging Face callback at ``on_train_begin``, Lightning at
    ``on_train_start``: the error names the setting and each rank's interval, and no step was taken."""
    from headwatch import Headwatch, LogitStatsMonitor
    from headwatch.errors import HeadwatchError
    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers import TinyCausalLM, loader
    from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama
    from tests.helpers.lightning_runs import make_trainer

    with pytest.raises(HeadwatchError, match=r"logs every (\d+) step\(s\), by rank: \1, .*log_every_n_steps.*logging_steps") as raised:
        if door == "loop":
            Headwatch(TinyCausalLM(vocab_size=32, d_model=8), log_every_n_steps=3, reducer=_OtherInterval(), summary=False)
        elif door == "hf_trainer":
            from transformers import Trainer

            callback = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=None, reducer=_OtherInterval())
            trainer = Trainer(model=tiny_llama(tie=False), args=hf_args(tmp_path), train_dataset=Rows(one_batch()), callbacks=[callback])
            trainer.train()
        else:
            monkeypatch.setattr("headwatch.integrations.lightning.driver.LightningReducer", lambda strategy: _OtherInterval())
            trainer = make_trainer(tmp_path, [LogitStatsMonitor(figure_every_n_steps=None)], max_steps=1, limit_val_batches=0)
            trainer.fit(TinyCausalLM(), loader(n=8))
    if door != "loop":
        assert (trainer.global_step if door == "lightning" else trainer.state.global_step) == 0  # before the first step
    assert "by rank: 3, 4." in str(raised.value) if door == "loop" else "by rank:" in str(raised.value)
