"""Loss, accuracy and calibration by target frequency: float64 references, torchmetrics' ECE, DDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchmetrics.classification import MulticlassCalibrationError

from headwatch import HeadwatchError
from headwatch.functional.frequency import BUCKETS
from headwatch.functional.calibration import calibration_update
from headwatch.functional.logits import logit_statistics
from headwatch.core.metrics_evidence import FrequencyCalibrationMetric
from tests.helpers.calibration import V, batch, buckets_and_rare
from tests.helpers.paths import ROOT

def reference(batches, bucket, rare, n_bins=15):
    """float64 recomputation from the logits, independent of logit_statistics."""
    rows = []
    for logits, targets, mask in batches:
        lp = torch.log_softmax(logits.double(), -1).reshape(-1, V)
        t, m = targets.reshape(-1), mask.reshape(-1) & (targets.reshape(-1) != -100)
        for n in torch.nonzero(m).flatten().tolist():
            y = int(t[n])
            rows.append((y, -lp[n, y].item(), float(lp[n].argmax().item() == y), lp[n].exp().max().item()))
    y, nll, acc, conf = (np.array(c) for c in zip(*rows))
    groups = {name: bucket.numpy()[y] == i for i, name in enumerate(BUCKETS)}
    groups["rare"] = rare.numpy()[y]
    out = {}
    for name, sel in [*groups.items(), (None, np.ones_like(nll, dtype=bool))]:
        s = "" if name is None else f"_{name}"
        out[f"nll{s}"], out[f"accuracy{s}"] = nll[sel].mean(), acc[sel].mean()
        out[f"confidence{s}"], out[f"positions{s}"] = conf[sel].mean(), sel.sum()
    for s, sel in (("", np.ones_like(nll, dtype=bool)), ("_rare", groups["rare"])):
        idx = np.minimum((conf[sel] * n_bins).astype(int), n_bins - 1)  # the last bin is closed: c = 1 in it
        ece = sum(abs((conf[sel][idx == b] - acc[sel][idx == b]).sum()) for b in range(n_bins)) / sel.sum()
        out[f"ece{s}"], out[f"overconfidence{s}"] = ece, conf[sel].mean() - acc[sel].mean()
    return out


def test_metric_matches_float64_reference():
    bucket, rare = buckets_and_rare()
    batches = [batch(s) for s in range(3)]
    metric = FrequencyCalibrationMetric()
    for logits, targets, mask in batches:
        metric.update(logits, targets, bucket, rare, mask)
    got = metric.compute()
    ref = reference(batches, bucket, rare)
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert got[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0.3 < got["accuracy"].item() < 0.6 and got["positions"].item() == 3 * (120 - 3 - 4)


def test_ece_equals_torchmetrics():
    bucket, rare = buckets_and_rare()
    logits, targets, _ = batch(4, B=8, T=64, scale=2.0)
    targets = targets.clamp(min=0)
    metric = FrequencyCalibrationMetric()
    metric.update(logits, targets, bucket, rare)
    got = metric.compute()
    tm = MulticlassCalibrationError(num_classes=V, n_bins=15, norm="l1")
    tm.update(torch.softmax(logits.reshape(-1, V), -1), targets.reshape(-1))
    assert got["ece"].item() == pytest.approx(tm.compute().item(), abs=1e-6)
    sel = rare[targets.reshape(-1)]
    tm_rare = MulticlassCalibrationError(num_classes=V, n_bins=15, norm="l1")
    tm_rare.update(torch.softmax(logits.reshape(-1, V)[sel], -1), targets.reshape(-1)[sel])
    assert got["ece_rare"].item() == pytest.approx(tm_rare.compute().item(), abs=1e-6)


def test_update_from_statistics_reuses_one_pass():
    bucket, rare = buckets_and_rare()
    logits, targets, mask = batch(5)
    a, b = FrequencyCalibrationMetric(), FrequencyCalibrationMetric()
    a.update(logits, targets, bucket, rare, mask)
    b.update_from_statistics(logit_statistics(logits, mask=mask, targets=targets), targets, bucket, rare)
    assert all(torch.equal(x, y) for x, y in zip(a.compute().values(), b.compute().values()))
    b.update_from_statistics(logit_statistics(logits, mask=mask, targets=targets), targets, bucket, rare)
    assert b.compute()["positions"].item() == 2 * a.compute()["positions"].item()  # the compute cache was reset


def test_empty_groups_are_nan_and_no_rare_mask():
    bucket = torch.zeros(V, dtype=torch.long)  # every target in top1
    logits, targets, mask = batch(6)
    m = FrequencyCalibrationMetric()
    m.update(logits, targets, bucket, None, mask)
    out = m.compute()
    assert out["positions_top1"].item() == out["positions"].item() > 0
    assert np.isnan(out["nll_tail"].item()) and np.isnan(out["ece_rare"].item())


def test_bad_inputs():
    bucket, rare = buckets_and_rare()
    logits, targets, _ = batch(7)
    stats = logit_statistics(logits, targets=targets)
    with pytest.raises(HeadwatchError, match="with targets"):
        calibration_update(logit_statistics(logits), targets, bucket, 5)
    with pytest.raises(HeadwatchError, match="integer targets of shape \\(4, 30\\)"):
        calibration_update(stats, targets[:, :2], bucket, 5)
    with pytest.raises(HeadwatchError, match="`rare` of shape \\(50,\\)"):
        calibration_update(stats, targets, bucket, 5, rare[:3])
    with pytest.raises(HeadwatchError, match="`n_bins` must be an int >= 1, got 0"):
        FrequencyCalibrationMetric(n_bins=0)
    with pytest.raises(HeadwatchError, match="`bucket_names`"):
        FrequencyCalibrationMetric(bucket_names="top1")


DDP_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {helpers!r})  # tests/helpers itself: its package would import Lightning, for nothing here
from calibration import batch, buckets_and_rare
from headwatch.core.metrics_evidence import FrequencyCalibrationMetric
rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=world)
bucket, rare = buckets_and_rare()
m = FrequencyCalibrationMetric()
for s in range(4):
    if s % world == rank:
        logits, targets, mask = batch(s)
        m.update(logits, targets, bucket, rare, mask)
values = {{k: v.item() for k, v in m.compute().items()}}
json.dump(values, open(f"{{out}}/rank{{rank}}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_ddp_two_processes_equal_one_process(tmp_path):
    script = tmp_path / "ddp_calibration.py"
    script.write_text(DDP_SCRIPT.format(helpers=str(ROOT / "tests" / "helpers")))
    with socket.socket() as sock:  # a free port: other test runs may share the machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path)], env=env) for r in range(2)]
    bucket, rare = buckets_and_rare()  # the one-process reference, while the processes start
    single = FrequencyCalibrationMetric()
    for s in range(4):
        single.update(*batch(s)[:2], bucket, rare, batch(s)[2])
    expected = {k: v.item() for k, v in single.compute().items()}
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    for key, value in expected.items():
        assert ranks[0][key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
