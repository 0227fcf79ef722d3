"""The collision probe's panel: fixed seeded rare rows (a prefix of one permutation), its Wilson interval, its growth,
the same on 2 processes; ``every_n_steps``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from headwatch import Headwatch, HeadwatchError
from headwatch.core import SynonymCollision
from headwatch.core.collision import PANEL_HALF_WIDTH, PANEL_START
from headwatch.core.orchestrator import Orchestrator
from headwatch.core.schedule import Schedule
from headwatch.functional import Z95
from headwatch.functional.collision import panel_mask, panel_order
from headwatch.names import declaration
from tests.helpers.collision import collision_monitor, snapshot
from tests.helpers.forked import fork_gloo_workers
from tests.helpers.references import wilson_roots

V, D, TAU = 3000, 8, 0.97  # at tau 0.97 these Gaussian rows collide at about 11%: a 1024-row panel is too wide
C = "headwatch/collision"


def frequent_and_rare() -> tuple[torch.Tensor, object]:
    """Rows 0..1499 seen 4 times, 1500..2999 twice: the rare set is exactly rows 1500..2999."""
    counts = torch.full((V,), 2, dtype=torch.long)
    counts[:1500] = 4
    return torch.randn(V, D, generator=torch.Generator().manual_seed(0)), snapshot(
        counts, torch.ones(V, dtype=torch.bool)
    )


def host(scalars: dict) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items()}


def test_the_panel_is_a_prefix_of_one_seeded_permutation():
    mask = torch.rand(500, generator=torch.Generator().manual_seed(1)) < 0.4
    keys = panel_order(500, seed=7)
    order = [r for r in torch.randperm(500, generator=torch.Generator().manual_seed(7)).tolist() if mask[r]]
    panels = {}
    for k in (10, 20, 40, 500):
        ids, taken = panel_mask(mask, keys, k)
        panels[k] = ids[taken].tolist()
        assert panels[k] == sorted(order[:k])  # the first k rows of the permutation in the mask
        assert not taken[len(panels[k]) :].any() and ids[~taken].eq(0).all()
    assert set(panels[10]) < set(panels[20]) < set(panels[40]) < set(panels[500]) and len(panels[500]) == int(
        mask.sum()
    )
    other = panel_mask(mask, panel_order(500, seed=8), 20)
    assert other[0][other[1]].tolist() != panels[20]


def test_the_panel_is_the_same_rows_at_every_probe_and_its_interval_is_wilson():
    w, snap = frequent_and_rare()
    monitor = collision_monitor(w, tau=TAU)
    assert monitor.max_rare is None and monitor.panel == PANEL_START
    first, _ = monitor.measure(snap, step=3)
    rows = monitor.last_result["rare_sample"].clone()
    monitor.measure(snap, step=40)  # another step: the same rows (before, a new sample every probe)
    assert torch.equal(monitor.last_result["rare_sample"], rows) and rows.numel() == PANEL_START
    assert snap.rare[rows].all()
    cos = monitor.last_result["head"]["cosine"].double()
    k, n = int((cos >= TAU).sum()), cos.numel()
    want_low, want_high = wilson_roots(k, n, Z95)
    assert first[f"{C}/rare_measured_head"].item() == n == PANEL_START
    assert first[f"{C}/rare_rate_head"].item() == pytest.approx(k / n, abs=1e-15)
    assert first[f"{C}/rare_rate_head_low"].item() == pytest.approx(want_low, abs=1e-12)
    assert first[f"{C}/rare_rate_head_high"].item() == pytest.approx(want_high, abs=1e-12)
    assert 0.05 < k / n < 0.2  # the setting this file relies on: wider than 0.01 at 1024 rows


def test_the_panel_doubles_after_a_wide_interval_keeps_its_rows_and_stops_at_the_whole_rare_set():
    w, snap = frequent_and_rare()
    monitor = collision_monitor(w, tau=TAU)
    numbers = host(monitor.measure(snap, step=0)[0])
    before = set(monitor.last_result["rare_sample"].tolist())
    half = (numbers[f"{C}/rare_rate_head_high"] - numbers[f"{C}/rare_rate_head_low"]) / 2
    assert half > PANEL_HALF_WIDTH
    assert monitor.grow_panel(numbers) and monitor.panel == 2 * PANEL_START
    numbers = host(monitor.measure(snap, step=1)[0])
    after = set(monitor.last_result["rare_sample"].tolist())
    assert before < after and len(after) == 1500 == numbers[f"{C}/rare_count"] == numbers[f"{C}/rare_sample_size"]
    assert numbers[f"{C}/rare_measured_head"] == 1500
    assert (numbers[f"{C}/rare_rate_head_high"] - numbers[f"{C}/rare_rate_head_low"]) / 2 > PANEL_HALF_WIDTH
    assert not monitor.grow_panel(numbers) and monitor.panel == 2 * PANEL_START  # every rare row is in it


def panel_numbers(low: float, high: float, m: str = "head", sample: float = 1024.0, rare: float = 5000.0):
    return {f"{C}/rare_rate_{m}_low": low, f"{C}/rare_rate_{m}_high": high, f"{C}/rare_sample_size": sample,
            f"{C}/rare_count": rare}  # fmt: skip


@pytest.mark.parametrize(("numbers", "grows"), [
    (panel_numbers(0.0, 0.02), False),  # half-width exactly 0.01
    (panel_numbers(0.0, 0.02 + 1e-12), True),
    (panel_numbers(0.3, 0.3 + 2 * PANEL_HALF_WIDTH - 1e-9), False),
    (panel_numbers(0.3, 0.35, m="embedding"), True),  # either matrix
    (panel_numbers(math.nan, math.nan), False),  # nothing measured
    (panel_numbers(0.3, 0.35, sample=5000.0), False),  # the panel holds every rare row
    ({}, False),  # the values were dropped
])  # fmt: skip
def test_growth_happens_exactly_when_the_half_width_exceeds_the_bound(numbers, grows):
    monitor = SynonymCollision(tau=TAU)
    assert monitor.grow_panel(numbers) is grows
    assert monitor.panel == (2 * PANEL_START if grows else PANEL_START)


def test_an_explicit_max_rare_fixes_the_panel():
    w, snap = frequent_and_rare()
    monitor = collision_monitor(w, tau=TAU, max_rare=100)
    numbers = host(monitor.measure(snap, step=0)[0])
    assert numbers[f"{C}/rare_sample_size"] == 100 == numbers[f"{C}/rare_measured_head"]
    assert (numbers[f"{C}/rare_rate_head_high"] - numbers[f"{C}/rare_rate_head_low"]) / 2 > PANEL_HALF_WIDTH
    assert not monitor.grow_panel(numbers) and monitor.panel == 100
    assert set(monitor.last_result["rare_sample"].tolist()) <= set(
        panel_mask(snap.rare, panel_order(V, 0), 1024)[0].tolist()
    )


def test_the_panel_size_goes_through_a_checkpoint(tmp_path):
    monitor = SynonymCollision()
    assert monitor.grow_panel(panel_numbers(0.3, 0.35))
    torch.save(monitor.state_dict(), tmp_path / "collision.pt")
    state = torch.load(tmp_path / "collision.pt")
    resumed = SynonymCollision()
    resumed.load_state_dict(state)
    assert resumed.panel == 2 * PANEL_START
    fixed = SynonymCollision(max_rare=64)
    fixed.load_state_dict(state)
    assert fixed.panel == 64  # an explicit max_rare wins
    old = SynonymCollision()
    old.load_state_dict({"version": 1, "measurements": 2, "last_step": 9, "failures": 0})
    assert old.panel == PANEL_START
    resumed.reset()
    assert resumed.panel == PANEL_START


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "10"])
def test_every_n_steps_is_checked(value):
    with pytest.raises(HeadwatchError, match="every_n_steps"):
        SynonymCollision(every_n_steps=value)
    with pytest.raises(HeadwatchError, match="max_rare"):
        SynonymCollision(max_rare=value if value != "10" else 0)


def test_every_n_steps_replaces_the_default_cadence():
    default, own = SynonymCollision(), SynonymCollision(every_n_steps=3)
    run = Orchestrator([default, own])
    run.configure(5)
    assert (default.schedule.every, own.schedule.every) == (SynonymCollision.every_factor * 5, 3)
    own.configure(Schedule(50))
    assert own.schedule.every == 3
    assert [s for s in range(10) if own in run.due(s)] == [2, 5, 8]


class Wide(nn.Module):
    """An untied embedding and head of V rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.lm_head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed_tokens(ids))  # (B, T, V)


def test_the_interval_and_the_panel_size_are_published_and_declared():
    torch.manual_seed(0)
    model = Wide()
    hw = Headwatch(model, monitors=[SynonymCollision(tau=TAU, every_n_steps=1)], log_every_n_steps=1)
    ids = torch.cat([torch.arange(1500)] * 2 + [torch.arange(1500, V)]).reshape(6, 750)
    hw.step_start({"input_ids": ids, "labels": ids}, 0)
    model(ids).logsumexp(-1).mean().backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    values = hw.step_end()
    for m in ("head", "embedding"):
        keys = [f"{C}/rare_rate_{m}_low", f"{C}/rare_rate_{m}_high", f"{C}/rare_measured_{m}"]
        assert all(k in values and declaration(k) is not None for k in keys), sorted(values)
        assert values[keys[0]] <= values[f"{C}/rare_rate_{m}"] <= values[keys[1]]
        assert values[keys[2]] == PANEL_START


WORKER = r"""
import datetime, json, os, sys, warnings
import torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, sys.argv[3])
from headwatch import Headwatch
from headwatch.core import SynonymCollision
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
warnings.simplefilter("ignore")
V, D = 3000, 8
class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens, self.lm_head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    def forward(self, ids):
        return self.lm_head(self.embed_tokens(ids))
torch.manual_seed(0)  # the same weights on both processes; no optimizer step: they stay
model = Wide()
collision = SynonymCollision(tau=0.97, every_n_steps=1)
hw = Headwatch(model, monitors=[collision], log_every_n_steps=1)
# rank 0 never sees a rare token: rows 0..1499 four times a step over both processes, 1500..2999 twice
parts = [torch.arange(1500)] * 3 if rank == 0 else [torch.arange(1500)] + [torch.arange(1500, V)] * 2
ids = torch.cat(parts).reshape(6, 750)
out = []
for step in range(3):
    hw.step_start({"input_ids": ids, "labels": ids}, step)
    model(ids).logsumexp(-1).mean().backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    model.zero_grad()
    values = hw.step_end()
    out.append({"panel": collision.panel, "rows": collision.last_result["rare_sample"].tolist(),
                "values": {k: v for k, v in values.items() if k.startswith("headwatch/collision/rare_")}})
json.dump(out, open(sys.argv[4] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_two_processes_measure_the_same_panel_and_grow_it_together(tmp_path):
    r0, r1 = fork_gloo_workers(WORKER, tmp_path, 37500, timeout=240)
    assert r0 == r1  # the same rows, values and panel sizes on both processes, every probe
    assert [p["panel"] for p in r0] == [2 * PANEL_START] * 3  # grown once, after the first probe
    first, second, third = (set(p["rows"]) for p in r0)
    assert len(first) == PANEL_START and first < second == third == set(range(1500, V))
    assert r0[0]["values"][f"{C}/rare_count"] == 1500.0
    assert (
        r0[0]["values"][f"{C}/rare_rate_head_high"] - r0[0]["values"][f"{C}/rare_rate_head_low"]
    ) / 2 > PANEL_HALF_WIDTH
