"""Synonym collision: nearest neighbours against float64 brute force, planted duplicates, monitor runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from headwatch import HeadwatchError, SynonymCollisionMonitor, TokenFrequency
from headwatch.integrations.lightning.collision import decode_token
from headwatch.functional.neighbors import nearest_neighbours, pair_cosine, synonym_confusion, synonym_table
from tests.helpers import TinyCausalLM, ids_loader
from tests.helpers.collision import FixedCounts, brute_force, collision_monitor, confusion_reference, corrected_reference, planted, snapshot
from tests.helpers.lightning_runs import make_trainer


@pytest.mark.parametrize("budget", [2_000, 50_000, 64 * 2**20])
def test_nearest_neighbours_match_brute_force(budget):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 24, generator=g)
    w[17] = 0.0  # a zero row: cosine 0 with everything
    valid = torch.rand(300, generator=g) > 0.2
    queries = torch.tensor([0, 5, 17, 299, 150, 151, 3])
    got = nearest_neighbours(w, queries, valid, max_chunk_bytes=budget)
    cos, idx = brute_force(w, queries, valid)
    np.testing.assert_allclose(got.cosine.double().numpy(), cos, atol=1e-6)
    finite = [i for i, q in enumerate(queries.tolist()) if q != 17]  # the zero row ties everywhere at 0
    assert got.index[finite].tolist() == idx[finite].tolist()


def test_nearest_neighbours_in_low_precision_and_edge_cases():
    w = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    got = nearest_neighbours(w.to(torch.bfloat16), torch.arange(50))
    cos, _ = brute_force(w.to(torch.bfloat16).float(), torch.arange(50), torch.ones(50, dtype=torch.bool))
    np.testing.assert_allclose(got.cosine.double().numpy(), cos, atol=1e-6)
    only_self = torch.zeros(50, dtype=torch.bool)
    only_self[4] = True
    lonely = nearest_neighbours(w, torch.tensor([4]), only_self)
    assert lonely.cosine.item() == -math.inf and lonely.index.item() == -1
    assert nearest_neighbours(w, torch.tensor([], dtype=torch.long)).cosine.numel() == 0
    with pytest.raises(HeadwatchError, match=r"query row ids must be in \[0, 50\)"):
        nearest_neighbours(w, torch.tensor([50]))
    with pytest.raises(HeadwatchError, match="vocab_size, d_model"):
        nearest_neighbours(torch.zeros(3), torch.tensor([0]))


def test_planted_duplicates_are_found_exactly_at_the_threshold_edges():
    w, plants = planted()
    queries = torch.tensor(sorted(plants))
    got = nearest_neighbours(w, queries)
    for q, cos, idx in zip(queries.tolist(), got.cosine.tolist(), got.index.tolist()):
        partner, target = plants[q]
        assert idx == partner
        assert cos == pytest.approx(target, abs=1e-5)
        assert (cos >= 0.9) == (target > 0.9)


def test_random_gaussian_rows_do_not_collide_at_default_tau():
    w = torch.randn(8192, 256, generator=torch.Generator().manual_seed(2))
    got = nearest_neighbours(w, torch.arange(8192))
    assert got.cosine.max().item() < 0.4  # far below the default tau = 0.9
    assert (got.cosine >= 0.9).sum().item() == 0


def test_monitor_measure_planted_rates_and_padded_rows():
    w, plants = planted(V=2048, d=64)
    counts = torch.zeros(2048, dtype=torch.long)
    counts[:1000] = 1000  # frequent
    counts[1000:1100] = 1  # rare: the planted rows and 95 others
    valid = torch.ones(2048, dtype=torch.bool)
    valid[2000:] = False  # padded vocabulary
    w[2001] = w[1010]  # an exact duplicate in the padding must not count
    w[1200] = w[1011]  # nor one among the never-seen rows
    monitor = collision_monitor(w, tau=0.9)
    scalars, tables = monitor.measure(snapshot(counts, valid, max_count=1))
    # raw cosine (now the drift statistic): rows 1000 (tau + eps), 1002 (tau + eps), 1003 (0.99) of 100
    assert scalars["headwatch/collision/drift/raw_rate_head"].item() == pytest.approx(3 / 100)
    # headline: drift removed (mean and k = 1 direction of the 1100 seen rows), against float64
    rare = torch.arange(1000, 1100)
    ref_cos, ref_idx = corrected_reference(w, rare, (counts > 0) & valid)
    assert scalars["headwatch/collision/rare_rate_head"].item() == (ref_cos >= 0.9).mean()
    np.testing.assert_allclose(monitor.last_result["head"]["cosine"].double().numpy(), ref_cos, atol=1e-5)
    assert monitor.last_result["head"]["neighbour"].tolist() == ref_idx.tolist()
    assert scalars["headwatch/collision/rare_count"] == 100
    assert scalars["headwatch/collision/rare_sample_size"] == 100
    assert scalars["headwatch/collision/invalid_count"] == 48
    assert scalars["headwatch/collision/unseen_count"] == 900
    assert scalars["headwatch/collision/untrained_count_head"].item() == 0
    pairs = monitor.last_result["head"]["pairs"]
    assert pairs[0][:2] == (1003, 3)  # most similar first
    assert [p[0] for p in pairs] == [1000 + i for i in np.argsort(-ref_cos, kind="stable") if ref_cos[i] >= 0.9]
    table = tables["headwatch/collision/top_pairs_head"]
    assert f"| 1003 `'1003'` | 1 | 3 `'3'` | 1000 | {ref_cos[3]:.4f} | 0.9900 |" in table
    assert "not paired: 900 never-seen, 48 padded or invalid, 0 zero, 0 non-finite rows" in table
    assert "headwatch/collision/rare/head_nn_cosine_mean" in scalars
    assert math.isnan(scalars["headwatch/collision/unseen/head_nn_cosine_mean"])  # never-seen rows are not paired
    assert "headwatch/collision/rare_rate_embedding" not in scalars  # tied: measured once


def test_monitor_headline_is_the_planted_fraction_under_drift():
    """Drift planted: frequent rows random, rare rows one common direction (raw cosine 0.97)."""
    from tests.helpers.collision import drifted_head

    w, rare, a, b = drifted_head()  # 2000 frequent rows, 1000 rare ones, 100 planted pairs among them
    counts = torch.full((3000,), 1000, dtype=torch.long)
    counts[rare] = 1
    counts[5] = 0  # a never-seen row
    w[7] = 0.0  # a zero row
    monitor = collision_monitor(w)
    scalars, tables = monitor.measure(snapshot(counts, torch.ones(3000, dtype=torch.bool), max_count=1))
    assert scalars["headwatch/collision/rare_rate_head"].item() == 200 / 1000  # exactly the planted fraction
    assert scalars["headwatch/collision/drift/raw_rate_head"].item() >= 0.99
    assert scalars["headwatch/collision/drift/mean_cos_head"].item() > 0.95
    assert scalars["headwatch/collision/drift/removed_variance_head"].item() > 0.5
    assert scalars["headwatch/collision/untrained_count_head"].item() == 1
    partner = {**dict(zip(a.tolist(), b.tolist())), **dict(zip(b.tolist(), a.tolist()))}
    assert all(partner[r] == j for r, j, _ in monitor.last_result["head"]["pairs"])
    assert "not paired: 1 never-seen, 0 padded or invalid, 1 zero, 0 non-finite rows" in tables["headwatch/collision/top_pairs_head"]


def test_rare_sample_is_seeded_and_sized():
    w = torch.randn(600, 16, generator=torch.Generator().manual_seed(3))
    counts = torch.ones(600, dtype=torch.long)
    counts[:100] = 50
    snap = snapshot(counts, torch.ones(600, dtype=torch.bool))
    monitor = SynonymCollisionMonitor(max_rare=64)
    monitor.tied = True
    monitor._head = monitor._emb = torch.nn.Linear(16, 600, bias=False)
    monitor._head.weight.data = w
    scalars, _ = monitor.measure(snap, step=7)
    first = monitor.last_result["rare_sample"].clone()
    assert scalars["headwatch/collision/rare_count"] == snap.rare.sum().item() > 64
    assert scalars["headwatch/collision/rare_sample_size"] == 64
    monitor.measure(snap, step=7)
    assert torch.equal(monitor.last_result["rare_sample"], first)  # same seed and step, same sample
    assert snap.rare[first].all()


def test_supervised_pairs_and_table():
    w, _ = planted(V=2048, d=64)
    counts = torch.zeros(2048, dtype=torch.long)
    counts[:1000] = 1000
    counts[1000:1100] = 1
    snap = snapshot(counts, torch.ones(2048, dtype=torch.bool), max_count=1)
    # (1000, 0) collide (tau + eps); (1001, 1) do not (tau - eps); 1500 is unseen, so its pair is not rare
    monitor = SynonymCollisionMonitor(synonym_groups=[[1000, 0], [1001, 1], [1500, 7]])
    monitor.tied = True
    monitor._head = monitor._emb = torch.nn.Linear(64, 2048, bias=False)
    monitor._head.weight.data = w
    monitor._group_ids = [[1000, 0], [1001, 1], [1500, 7]]
    scalars, _ = monitor.measure(snap)
    # ordered pairs of seen rows: (1000, 0), (0, 1000), (1001, 1), (1, 1001); 1500 was never seen
    assert scalars["headwatch/collision/synonym_pairs"].item() == 4
    assert scalars["headwatch/collision/synonym_skipped_pairs"].item() == 2
    # float64 reference on the corrected rows (mean and top direction of the 1100 seen rows removed)
    seen = counts > 0
    x = w.double().numpy()
    mu = x[seen.numpy()].mean(0)
    u = np.linalg.eigh((x[seen.numpy()] - mu).T @ (x[seen.numpy()] - mu))[1][:, -1:]
    y = (x - mu) - (x - mu) @ u @ u.T
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    cos, ranks = [], []
    for a, b in [(1000, 0), (0, 1000), (1001, 1), (1, 1001)]:
        sims = y[seen.numpy()] @ y[a]
        others = np.delete(sims, [int(seen[:a].sum()), int(seen[:b].sum())])  # all seen rows but a and b
        cos.append(y[a] @ y[b])
        ranks.append(1 + int((others > y[a] @ y[b]).sum()))
    assert scalars["headwatch/collision/synonym_pair_rate_head"].item() == np.mean(np.array(cos) >= 0.9)
    assert scalars["headwatch/collision/synonym_partner_rank_head"].item() == sorted(ranks)[1]  # lower median
    assert sorted(ranks)[1] == 1  # planted at raw cosine 0.9: still each other's nearest row
    table = synonym_table([[1, 2, 3], [3, 4]], 6)
    assert table.tolist() == [[-1, -1, -1], [2, 3, -1], [1, 3, -1], [1, 2, 4], [3, -1, -1], [-1, -1, -1]]
    with pytest.raises(HeadwatchError, match="outside"):
        synonym_table([[1, 9]], 6)
    assert pair_cosine(w, torch.tensor([1000]), torch.tensor([0])).item() == pytest.approx(0.901, abs=1e-5)


def test_prediction_confusion_on_hand_built_logits():
    V = 6
    table = synonym_table([[1, 2], [3, 4]], V)
    eligible = torch.tensor([False, True, False, True, False, False])  # rare and grouped: 1 and 3
    logits = torch.tensor(
        [
            [0.0, 5.0, 4.0, 0.0, 0.0, 0.0],  # target 1, synonym 2 lower: not confused
            [0.0, 4.0, 4.0, 0.0, 0.0, 0.0],  # target 1, synonym 2 equal: confused
            [0.0, 0.0, 0.0, 1.0, 2.0, 0.0],  # target 3, synonym 4 higher: confused
            [0.0, 0.0, 9.0, 0.0, 0.0, 0.0],  # target 2: not eligible (not rare)
            [0.0, 0.0, 9.0, 0.0, 0.0, 0.0],  # ignore_index
        ]
    )
    targets = torch.tensor([1, 1, 3, 2, -100])
    n, confused = synonym_confusion(logits, targets, table, eligible)
    assert (n.item(), confused.item()) == (3, 2)


def test_decoding():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "cat": 1, "kitten": 2, "dog": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    assert decode_token(tok, 2) == "kitten"
    assert decode_token(lambda i: f"<{i}>", 3) == "<3>"
    assert decode_token(None, 3) == "3"
    from headwatch.core.tokens import encode_group

    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert encode_group(tok, ["cat", "kitten", 3]) == [1, 2, 3]
    with pytest.raises(HeadwatchError, match="pass tokenizer="):
        encode_group(None, ["cat"])


def _collision_run(tmp_path, tie: bool, groups=None, tokenizer=None):
    V = 64
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, tie_weights=tie, lr=0.0)
    with torch.no_grad():
        w = model.lm_head.weight
        w[40] = w[2]  # rare token 40 duplicates frequent token 2 in the head (any correction keeps cos 1)
        if not tie:
            model.embed_tokens.weight[41] = -model.embed_tokens.weight[5]  # opposite: no collision
    frequent = torch.tensor([2, 3, 5, 7, 11, 13] * 4)
    rare = torch.tensor([40, 41, 40, 41, 42, 43, 40, 41])  # counts 3, 3, 1, 1: all rare (<= 3)
    ids = torch.stack([torch.cat([frequent[i : i + 8], rare[i : i + 1]]) for i in range(8)])
    monitor = SynonymCollisionMonitor(every_n_steps=2, synonym_groups=groups, tokenizer=tokenizer)
    trainer = make_trainer(tmp_path, [TokenFrequency(rare_max_count=3), monitor], max_steps=4, log_every_n_steps=1)
    trainer.fit(model, ids_loader(ids, 2))
    return trainer, monitor


@pytest.mark.parametrize("tie", [False, True])
def test_monitor_in_a_training_run(tmp_path, tie):
    trainer, monitor = _collision_run(tmp_path, tie, groups=[[40, 2], [41, 5]])
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["headwatch/collision/rare_count"] == 4
    assert m["headwatch/collision/rare_rate_head"] == pytest.approx(1 / 4)  # token 40
    assert ("headwatch/collision/rare_rate_embedding" in m) == (not tie)
    if not tie:
        assert m["headwatch/collision/rare_rate_embedding"] == 0.0
    assert m["headwatch/collision/synonym_pair_rate_head"] == pytest.approx(0.5)
    assert 0 <= m["headwatch/collision/synonym_confusion_rate"] <= 1
    assert m["headwatch/collision/synonym_confusion_positions"] > 0
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("headwatch/collision/rare_rate_head")] == [1, 3]  # the epoch ends at step 3
    assert "headwatch/collision/top_pairs_head/text_summary" in acc.Tags()["tensors"]
    assert monitor.state_dict()["measurements"] == 2


def test_bad_arguments():
    with pytest.raises(HeadwatchError, match="tau"):
        SynonymCollisionMonitor(tau=1.5)
    with pytest.raises(HeadwatchError, match="max_rare"):
        SynonymCollisionMonitor(max_rare=0)
    with pytest.raises(HeadwatchError, match="synonym_groups"):
        SynonymCollisionMonitor(synonym_groups="cat dog")


def test_llama3_sized_vocabulary_in_bounded_memory():
    """V = 128256, d_model = 4096 (Llama 3): exact neighbours with a working set within the budget."""
    code = """
import torch

from headwatch.functional.neighbors import nearest_neighbours
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1])
w = torch.empty(128256, 4096, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
w[77] = w[5] * 3  # a planted duplicate
before = hwm()
got = nearest_neighbours(w, torch.tensor([5, 77, 128255]), max_chunk_bytes=64 * 2**20)
import json
print(json.dumps([(hwm() - before) / 1024, got.index.tolist(), got.cosine.tolist()]))
"""
    import subprocess

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read the peak resident memory")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    grown_mib, index, cosine = json.loads(out)
    assert grown_mib < 96  # the 64 MiB budget plus allocator slack; the matrix itself is 1 GiB
    assert index[:2] == [77, 5] and cosine[0] == pytest.approx(1.0, abs=1e-5)  # 3 * w rounds in bf16


def test_a_nan_row_is_nobodys_neighbour():
    w = torch.randn(200, 16, generator=torch.Generator().manual_seed(4))
    w[7, 3] = float("nan")
    queries = torch.tensor([0, 7, 50])
    got = nearest_neighbours(w, queries, max_chunk_bytes=4000)
    finite = torch.ones(200, dtype=torch.bool)
    finite[7] = False
    cos, idx = brute_force(w, torch.tensor([0, 50]), finite)
    assert got.index.tolist() == [idx[0], -1, idx[1]]
    assert math.isnan(got.cosine[1].item())
    np.testing.assert_allclose(got.cosine[[0, 2]].double().numpy(), cos, atol=1e-6)


def test_synonym_group_entries_are_checked():
    from headwatch.core.tokens import encode_group

    assert encode_group(None, [np.int64(3), 4]) == [3, 4]
    with pytest.raises(HeadwatchError, match="is a bool"):
        encode_group(None, [True, 2])
    with pytest.raises(HeadwatchError, match="token ids or strings only"):
        encode_group(None, [1.7])
    groups = (g for g in [[1, 2], [3, 4]])  # a generator is read once, and kept
    assert SynonymCollisionMonitor(synonym_groups=groups).synonym_groups == [[1, 2], [3, 4]]

    class BosTokenizer:  # Hugging Face style: adds a BOS id unless add_special_tokens=False
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [{"cat": 5, "kitten": 6}[text]]

    assert encode_group(BosTokenizer(), ["cat", "kitten"]) == [5, 6]


def test_confusion_counts_every_training_batch_since_the_last_measurement_and_validation():
    """Was: only the logging step's batch counted (1 or 0 positions in a planted run)."""
    from headwatch.core.collision import SynonymCollision

    V = 64
    counts = torch.full((V,), 100, dtype=torch.long)
    counts[[1, 2, 3, 4]] = 1  # rare and grouped
    snap = snapshot(counts, torch.ones(V, dtype=torch.bool), max_count=1)
    syn = {1: [2], 2: [1], 3: [4], 4: [3]}
    monitor = SynonymCollision(frequency=FixedCounts(snap), synonym_groups=[[1, 2], [3, 4]])
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=V, tie_weights=True)
    monitor.attach(model)
    g = torch.Generator().manual_seed(5)
    expected = {"train": [0, 0], "val": [0, 0]}
    for step in range(3):  # steps 0 and 1 do not log, step 2 does: all three count
        ids = torch.randint(0, 6, (4, 10), generator=g)
        monitor.step_start({"input_ids": ids, "labels": ids}, step, logging=step == 2)
        logits = model(ids)
        monitor.batch_end()
        n, c = confusion_reference(logits.detach(), ids, snap.rare, syn)
        expected["train"] = [expected["train"][0] + n, expected["train"][1] + c]
    for _ in range(2):
        ids = torch.randint(0, 6, (3, 8), generator=g)
        monitor.validation_batch_start({"input_ids": ids, "labels": ids})
        logits = model(ids)
        monitor.validation_batch_end()
        n, c = confusion_reference(logits.detach(), ids, snap.rare, syn)
        expected["val"] = [expected["val"][0] + n, expected["val"][1] + c]
    model(ids)  # a forward outside any batch is not counted
    val = monitor.validation_epoch_end()
    scalars = monitor.compute()
    n, c = expected["train"]
    assert scalars["headwatch/collision/synonym_confusion_positions"].item() == n > 10
    assert scalars["headwatch/collision/synonym_confusion_rate"].item() == pytest.approx(c / n)
    n, c = expected["val"]
    assert val["headwatch/collision/val/synonym_confusion_positions"].item() == n > 5
    assert val["headwatch/collision/val/synonym_confusion_rate"].item() == pytest.approx(c / n)
    again = monitor.compute()  # reset at each measurement
    assert again["headwatch/collision/synonym_confusion_positions"].item() == 0
    assert math.isnan(again["headwatch/collision/synonym_confusion_rate"].item())
