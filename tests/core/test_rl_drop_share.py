"""``rl/rare_share_of_entropy_drop``: the rare tokens' part of the entropy lost since the run's first RL logging step,
against hand-computed values; its reference survives a checkpoint and restarts with a new run."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from headwatch.core.orchestrator import Orchestrator
from headwatch.core.rl import DROP_FLOOR, drop_reference, rl_scalars

P = "headwatch"


def scalars(entropy: float, rare_entropy: float, rare_n: int, n: int) -> dict:
    t = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731
    return {f"{P}/logits/entropy": t(entropy), f"{P}/logits/positions": t(n),
            f"{P}/logits/rare/entropy": t(rare_entropy), f"{P}/logits/rare/positions": t(rare_n)}  # fmt: skip


def test_the_share_is_the_rare_part_of_the_drop():
    start = drop_reference({f"{P}/logits/entropy": 3.0, f"{P}/rl/entropy_share/rare": 0.9}, P)
    out = rl_scalars(scalars(2.0, 1.0, 10, 40), P, 1.0, start)  # rare share now 10/40 * 1.0 = 0.25
    assert float(out[f"{P}/rl/entropy_share/rare"]) == pytest.approx(0.25)
    assert float(out[f"{P}/rl/rare_share_of_entropy_drop"]) == pytest.approx((0.9 - 0.25) / (3.0 - 2.0))
    risen = rl_scalars(scalars(3.5, 1.0, 10, 40), P, 1.0, start)  # no drop: undefined
    assert math.isnan(float(risen[f"{P}/rl/rare_share_of_entropy_drop"]))
    assert f"{P}/rl/rare_share_of_entropy_drop" not in rl_scalars(scalars(2.0, 1.0, 10, 40), P, 1.0, None)
    assert drop_reference({f"{P}/logits/entropy": math.nan, f"{P}/rl/entropy_share/rare": 0.1}, P) is None


def test_the_reference_is_in_the_state_and_a_new_run_restarts_it():
    run = Orchestrator(["logits"])
    run.rl_start = {"entropy": 3.0, "rare": 0.9}
    state = run.state_dict()
    resumed = Orchestrator(["logits"])
    resumed.load_state_dict(state)
    assert resumed.rl_start == {"entropy": 3.0, "rare": 0.9}
    resumed.start_run(resumed=False)
    assert resumed.rl_start is None
    state["rl_start"] = {"entropy": math.inf, "rare": 0.9}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = Orchestrator(["logits"])
        bad.load_state_dict(state)
    assert bad.rl_start is None and any("rl_start" in str(w.message) for w in caught)


def test_a_drop_within_noise_is_nan_and_one_above_the_floor_matches_float64():
    start_h, start_rare = 6.9126, 0.31
    start = drop_reference({f"{P}/logits/entropy": start_h, f"{P}/rl/entropy_share/rare": start_rare}, P)
    noise = rl_scalars(scalars(6.9110, 2.0, 10, 40), P, 1.0, start)  # fell 0.0016 nats: 0.02% of H(start)
    assert math.isnan(float(noise[f"{P}/rl/rare_share_of_entropy_drop"]))
    edge = rl_scalars(scalars(start_h * (1 - DROP_FLOOR), 2.0, 10, 40), P, 1.0, start)  # exactly at the floor
    assert math.isnan(float(edge[f"{P}/rl/rare_share_of_entropy_drop"]))
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        h = start_h * (1 - DROP_FLOOR) - 3 * float(torch.rand((), generator=rng))  # beyond the floor
        rare_h, rare_n = 8 * float(torch.rand((), generator=rng)), int(torch.randint(1, 40, (), generator=rng))
        got = float(rl_scalars(scalars(h, rare_h, rare_n, 40), P, 1.0, start)[f"{P}/rl/rare_share_of_entropy_drop"])
        want = (start_rare - (rare_n / 40) * rare_h) / (start_h - h)  # float64 by hand
        assert got == pytest.approx(want, rel=1e-12)
