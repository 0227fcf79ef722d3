"""A NaN gradient row and the frequency-gravity Spearman through the plain-loop door, on 1 and 2 gloo processes
(each process trains its own copy, the gradients summed over processes by hand as DDP would).

- ``freq/<matrix>_norm_spearman`` equals SciPy's ``spearmanr`` of ``log(count)`` (the counts summed over processes,
  those before a resume from the run's state included) and the weight rows' L2 norms (before the optimizer step)
  over the seen rows;
- a NaN written into one row of the head's gradient on rank 1 only (summed: NaN on every rank) makes every field of
  each row-norm summary whose group holds that row NaN (as numpy's mean, max and percentile), the other groups'
  finite, with the same keys on every rank at every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headwatch.functional.frequency import BUCKETS, frequency_buckets
from tests.helpers.forked import fork_gloo_workers

TRAIN = r'''
import json, math
import torch
import torch.distributed as dist
import torch.nn.functional as F

import headwatch
from tests.helpers import TinyCausalLM

STEPS, EVERY, V, NAN_ROW, NAN_STEP = 4, 2, 64, 7, 3


def train(rank, world):
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, d_model=16, tie_weights=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    hw = headwatch.Headwatch(model, log_every_n_steps=EVERY, figure_every_n_steps=0, summary=False)
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.zeros(V, dtype=torch.long)
    steps = {}
    for step in range(STEPS):
        ids = torch.randint(0, V // 2, (4, 12), generator=g) ** 2 % V  # a skewed, tied count distribution
        seen = torch.bincount(ids.reshape(-1), minlength=V)
        if world > 1:
            dist.all_reduce(seen)
        counts += seen
        hw.step_start({"input_ids": ids, "labels": ids}, step)
        poison = step == NAN_STEP and rank == world - 1
        handle = model.lm_head.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([NAN_ROW]), math.nan)) if poison else None
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
        if handle is not None:
            handle.remove()
        for p in model.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
        weights = {"embedding": model.embed_tokens.weight.detach().double().tolist(), "head": model.lm_head.weight.detach().double().tolist()}
        hw.before_optimizer_step()
        optimizer.step()
        hw.after_optimizer_step()
        optimizer.zero_grad()
        values = hw.step_end()
        if values:
            steps[step] = {"values": values, "counts": counts.tolist(), "weights": weights}
        if step == 1:  # resumed from a checkpoint: the counts so far restored, summed with those counted after
            state = hw.state_dict()
            hw.close()
            hw = headwatch.Headwatch(model, log_every_n_steps=EVERY, figure_every_n_steps=0, summary=False)
            hw.load_state_dict(state)
    hw.close()
    return steps
'''

WORKER = TRAIN + r'''
import sys
from pathlib import Path

rank, port, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
sys.path.insert(0, root)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
(out / f"rank{rank}.json").write_text(json.dumps(train(rank, 2)))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module", params=[1, 2], ids=["1process", "2processes"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Each rank's logging steps (``{step: {values, counts, weights}}``, steps as strings)."""
    if request.param == 1:
        import json

        scope: dict = {}
        exec(compile(TRAIN, "train", "exec"), scope)  # noqa: S102 - the workers' own loop, in this process
        return [json.loads(json.dumps(scope["train"](0, 1)))]
    return fork_gloo_workers(WORKER, tmp_path_factory.mktemp("nan_rows"), 45000)


def test_every_rank_publishes_the_same_keys_on_the_same_steps(ranks):
    steps = sorted(ranks[0])
    assert steps == ["1", "3"]
    for other in ranks[1:]:
        assert sorted(other) == steps
        for step in steps:
            assert sorted(other[step]["values"]) == sorted(ranks[0][step]["values"]), step


@pytest.mark.parametrize("step", ["1", "3"])
@pytest.mark.parametrize("matrix", ["embedding", "head"])
def test_the_gravity_spearman_equals_scipys_of_log_count_and_row_norm(ranks, step, matrix):
    from scipy.stats import spearmanr

    logged = ranks[0][step]
    counts = np.array(logged["counts"], dtype=np.float64)
    seen = counts > 0
    assert 2 < seen.sum() < counts.size and len(set(counts[seen])) < seen.sum()  # unseen rows and ties
    norms = np.linalg.norm(np.array(logged["weights"][matrix]), axis=1)
    want = spearmanr(np.log(counts[seen]), norms[seen]).statistic
    for rank in ranks:
        assert rank[step]["values"]["headwatch/tokens/total"] == counts.sum()  # the restored counts too
        assert rank[step]["values"][f"headwatch/freq/{matrix}_norm_spearman"] == pytest.approx(want, abs=1e-12)


def test_a_nan_gradient_row_makes_its_groups_summaries_nan(ranks):
    values = ranks[0]["3"]["values"]
    counts = torch.tensor(ranks[0]["3"]["counts"])
    bucket = BUCKETS[int(frequency_buckets(counts, torch.ones_like(counts, dtype=torch.bool))[7])]
    fields = ("mean", "max", "p50", "p95")
    holding = [f"headwatch/grad/head_row_norm_{f}" for f in fields]
    holding += [f"headwatch/grad/{bucket}/head_row_norm_{f}" for f in fields]
    for key in holding:
        for rank in ranks:
            assert math.isnan(rank["3"]["values"][key]), key
    others = [b for b in BUCKETS if b != bucket and f"headwatch/grad/{b}/head_row_norm_mean" in values]
    assert others
    for b in others:
        for f in fields:
            assert math.isfinite(values[f"headwatch/grad/{b}/head_row_norm_{f}"]), (b, f)
    # the step before: every summary finite
    assert all(math.isfinite(ranks[0]["1"]["values"][k.replace("/" + bucket, "")]) for k in holding)
    assert math.isfinite(ranks[0]["3"]["values"]["headwatch/grad/embedding_row_norm_max"])
