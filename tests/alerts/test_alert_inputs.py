"""What the alert engine takes (NaN: skipped; a non-number: HeadwatchError) and how often its checkpoint action
writes (once per firing episode, the latest few kept)."""

from __future__ import annotations

import math
import random

import pytest

from headwatch.alerts import AlertEngine, CollapseRules, standard_actions
from headwatch.alerts.actions import KEEP_CHECKPOINTS, CheckpointOnCritical
from headwatch.errors import HeadwatchError

E = "headwatch/logits/entropy"
KL = "headwatch/logits/kl_to_uniform"


def test_nan_is_taken_and_never_fires():
    engine = AlertEngine(CollapseRules(entropy_floor=1.0, kl_ceiling=2.0), [], warn=lambda m: None)
    for step in range(5):
        assert engine.observe_train(step, {E: math.nan, KL: math.nan}) == []
        assert engine.observe_val(step, {"val_loss": math.nan}) == []
    assert engine.alerts == [] and engine.rules.smoothed is None
    assert [a.rule for a in engine.observe_train(5, {E: 0.5})] == ["entropy_floor"]  # NaN did not stop it


@pytest.mark.parametrize("value", ["0.5", b"0.5", True, [0.5], {"v": 0.5}, object(), 1 + 2j])
def test_a_non_number_raises_a_headwatch_error_naming_the_metric(value):
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [], warn=lambda m: None)
    with pytest.raises(HeadwatchError, match=r"'headwatch/logits/entropy' must be a real number or None"):
        engine.observe_train(0, {E: value})
    with pytest.raises(HeadwatchError, match=r"'val_loss' must be a real number or None"):
        engine.observe_val(0, {"val_loss": value})
    with pytest.raises(HeadwatchError, match=r"CollapseRules.observe_train"):
        CollapseRules(entropy_floor=1.0).observe_train(0, {E: value})
    with pytest.raises(HeadwatchError, match="`metrics` must be a dict"):
        engine.observe_train(0, [(E, 0.5)])  # type: ignore[arg-type]


def reference_episodes(values: list[float], floor: float, margin: float) -> list[int]:
    """The steps at which an ``entropy_floor`` episode opens: below the floor while closed; closed again at
    ``>= floor + margin * |floor|``."""
    fired, open_ = [], False
    for step, v in enumerate(values):
        if open_ and v >= floor + margin * abs(floor):
            open_ = False
        elif not open_ and v < floor:
            open_ = True
            fired.append(step)
    return fired


@pytest.mark.parametrize("keep", [KEEP_CHECKPOINTS, 1, 5])
def test_a_value_hovering_at_the_floor_writes_one_checkpoint_per_episode_and_keeps_the_last_few(tmp_path, keep):
    rng = random.Random(0)
    values = [1.0 + rng.uniform(-0.08, 0.08) for _ in range(60)]
    written = []

    def save(alert):
        path = tmp_path / f"headwatch_alert_step{alert.step}.ckpt"
        path.write_bytes(b"weights")
        written.append(alert.step)
        return path

    actions = standard_actions(warn=lambda m: None, save_checkpoint=save, keep_checkpoints=keep)
    engine = AlertEngine(CollapseRules(entropy_floor=1.0, margin=0.05), actions, warn=lambda m: None)
    for step, v in enumerate(values):
        engine.observe_train(step, {E: v})
    episodes = reference_episodes(values, 1.0, 0.05)
    assert len(episodes) > keep  # hovering: several episodes
    assert written == episodes == [a.step for a in engine.alerts]
    assert engine.rules.episode("entropy_floor").fired == len(episodes)
    on_disk = sorted(int(p.stem.removeprefix("headwatch_alert_step")) for p in tmp_path.glob("*.ckpt"))
    assert on_disk == episodes[-keep:]


def test_rules_firing_at_one_step_share_one_checkpoint(tmp_path):
    saved = []
    action = CheckpointOnCritical(lambda a: saved.append((a.step, a.rule)))
    engine = AlertEngine(CollapseRules(entropy_floor=1.0, kl_ceiling=2.0, entropy_drop=None), [action], warn=lambda m: None)
    engine.observe_train(0, {E: 0.5, KL: 3.0})
    assert sorted(a.rule for a in engine.alerts) == ["entropy_floor", "kl_ceiling"]
    assert saved == [(0, "entropy_floor")] and action.saved == 1


def test_a_save_without_a_path_is_never_rotated(tmp_path):
    calls = []
    action = CheckpointOnCritical(lambda a: calls.append(a.step), keep=1)
    engine = AlertEngine(CollapseRules(entropy_floor=1.0), [action], warn=lambda m: None)
    for step, v in enumerate([0.5, 1.5, 0.5, 1.5, 0.5]):
        engine.observe_train(step, {E: v})
    assert calls == [0, 2, 4] and action.written == []


@pytest.mark.parametrize("keep", [0, -1, 2.5, "3", None, True])
def test_keep_checkpoints_must_be_a_positive_int(keep):
    with pytest.raises(HeadwatchError, match="`keep_checkpoints` must be an int"):
        standard_actions(save_checkpoint=print, keep_checkpoints=keep)
