"""The trainer-free pieces the front doors delegate to, tested without a trainer.

- :class:`headwatch.alerts.feed.LoggedFeed`: each published value evaluated once, the dataloader's value read;
- :mod:`headwatch.alerts.wiring`: rules made an engine, evaluations fed with the trainer's numbers, state;
- :class:`headwatch.model.hooks.InputsHook`: a positional ``input_ids``, one model at a time;
- :func:`headwatch.integrations.lightning.door.loader_rows_kept` against the sampler's own index list;
- :mod:`headwatch.integrations.hf_checkpoint`: the state file written, read back, missing, truncated.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from headwatch.alerts import AlertEngine, CollapseRules
from headwatch.alerts.feed import LoggedFeed
from headwatch.alerts.wiring import load_alert_state, observe, wire_alert, with_alert_state
from headwatch.integrations.hf_checkpoint import STATE_NAME, load_state_file, save_state_file
from headwatch.core.monitor import FailurePolicy
from headwatch.integrations.lightning.door import loader_rows_kept
from headwatch.model.hooks import InputsHook

E, K = "headwatch/logits/entropy", "headwatch/logits/kl_to_uniform"


class Recorder:
    """An engine stand-in that records what it is asked to observe."""

    def __init__(self, rules: CollapseRules) -> None:
        self.rules, self.train, self.val = rules, [], []

    def observe_train(self, step, metrics, epoch=0, published=()):
        self.train.append((step, dict(metrics)))
        return []

    def observe_val(self, step, metrics, dataloader_idx=0, epoch=0):
        self.val.append((step, dict(metrics), dataloader_idx))
        return []


def test_feed_evaluates_each_published_value_once_at_its_step():
    engine = Recorder(CollapseRules(entropy_floor=1.0))
    said = []
    feed = LoggedFeed(engine, lambda key, message: said.append(key))
    logged = {E: 2.0, K: 0.5}
    published = {E: 3}  # the entropy published at step 3 by a monitor; the KL logged by the user, no step
    feed.train(3, 1, logged.get, logged, published)
    feed.train(4, 1, logged.get, logged, published)  # the entropy of step 3 again: not evaluated twice
    published[E] = 5
    feed.train(5, 1, logged.get, logged, published)
    assert engine.train == [(3, {E: 2.0, K: 0.5}), (4, {K: 0.5}), (5, {E: 2.0, K: 0.5})]
    feed.reset()  # a new run: step 5 again is new
    feed.train(5, 1, logged.get, logged, published)
    assert engine.train[-1] == (5, {E: 2.0, K: 0.5}) and said == []


def test_feed_warns_once_when_nothing_watched_is_logged_after_twenty_intervals():
    engine = Recorder(CollapseRules(entropy_floor=1.0))
    said = []
    feed = LoggedFeed(engine, lambda key, message: said.append((key, message)))
    logged = {"headwatch/logits/entrpy": 1.0}
    feed.train(19 * 5, 5, logged.get, logged, {})
    assert said == []  # 19 intervals of 5 steps: not yet
    feed.train(20 * 5, 5, logged.get, logged, {})
    assert [k for k, _ in said] == ["missing"] and "'headwatch/logits/entrpy'" in said[0][1]
    assert engine.train == [(95, {}), (100, {})]  # every process still takes part in the decision


def test_feed_reads_the_watched_dataloader_of_a_validation():
    rules = CollapseRules(patience=2, val_dataloader_idx=1)
    engine, said = Recorder(rules), []
    feed = LoggedFeed(engine, lambda key, message: said.append(key))
    logged = {"val_loss/dataloader_idx_1": 0.7, "val_loss": 9.0, "headwatch/val/logits/entropy": 2.5}
    feed.val(8, logged.get, logged, loaders=2)
    assert engine.val == [(8, {"val_loss": 0.7, "headwatch/val/logits/entropy": 2.5}, 1)]
    feed.val(9, logged.get, logged, loaders=1)  # index 1 of one dataloader: not evaluated
    assert len(engine.val) == 1 and said == ["val_idx"]


def test_wiring_makes_rules_an_engine_and_feeds_evaluations_with_the_trainers_numbers():
    rules = CollapseRules(entropy_floor=1.0, entropy_drop=None)
    decided = []
    engine = wire_alert(rules, lambda fired: decided.append(fired) or fired, False, "door alert", jsonl_path=None)
    assert isinstance(engine, AlertEngine) and engine.name == "door alert" and not engine.main_process
    observe(engine, 0, {E: 0.5}, val=False)
    assert decided == [True] and [a.rule for a in engine.alerts] == ["entropy_floor"]
    seen = []
    engine.observe_val = lambda step, metrics: seen.append((step, metrics))  # the evaluation's values, with eval_loss
    observe(engine, 4, {"headwatch/val/logits/entropy": 2.0}, val=True, extra={"eval_loss": 1.5, "epoch_name": "x"})
    assert seen == [(4, {"eval_loss": 1.5, "headwatch/val/logits/entropy": 2.0})]
    observe(rules, 0, {E: 0.5}, val=False)  # rules not yet made an engine: nothing, no error
    state = with_alert_state({"monitors": []}, engine)
    fresh = wire_alert(CollapseRules(entropy_floor=1.0, entropy_drop=None), bool, True, "again", jsonl_path=None)
    load_alert_state(fresh, state)
    assert [a.rule for a in fresh.alerts] == ["entropy_floor"]
    assert "alert" not in with_alert_state({}, rules)


def test_inputs_hook_reads_a_positional_input_and_watches_one_model():
    seen = []
    hook = InputsHook(lambda module, batch, kwargs: seen.append((module, sorted(batch), sorted(kwargs))))
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    hook.watch(a)
    hook.watch(a)  # the same model: one hook, not two
    a(torch.zeros(1, 3))
    assert seen == [(a, ["input_ids"], [])]
    hook.watch(b)  # moves: `a` is no longer read
    a(torch.zeros(1, 3))
    b(input=torch.zeros(1, 3))
    assert seen[1:] == [(b, ["input"], ["input"])]
    hook.remove()
    b(torch.zeros(1, 3))
    assert len(seen) == 2 and hook.model is None


@pytest.mark.parametrize("total,world,batch", [(10, 3, 2), (7, 4, 3), (8, 2, 4), (5, 2, 4)])
def test_loader_rows_kept_matches_the_samplers_repeats(total, world, batch):
    """The reference: the sampler's own index list, padded with repeats; a position past the data set is a repeat."""
    data = list(range(total))
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=False)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
        positions = list(range(rank, len(sampler) * world, world))  # this rank's positions in the padded list
        for i in range(0, len(positions), batch):
            chunk = positions[i : i + batch]
            want = sum(1 for p in chunk if p < total)
            ids = {"input_ids": torch.zeros(len(chunk), 2)}
            assert loader_rows_kept(loader, ids, i // batch) == want, (rank, i)
    plain = DataLoader(data, batch_size=batch)
    assert loader_rows_kept(plain, {"input_ids": torch.zeros(batch, 2)}, 0) is None


class Policy(FailurePolicy):
    pass


def test_state_file_round_trip_missing_and_truncated(tmp_path):
    policy = Policy()
    folder = tmp_path / "checkpoint-3"
    save_state_file(policy, lambda: {"version": 2, "x": torch.arange(4)}, str(folder), write=False)
    assert not folder.exists()  # not the process that writes
    save_state_file(policy, lambda: {"version": 2, "x": torch.arange(4)}, str(folder), write=True)
    got = []
    load_state_file(policy, got.append, str(folder))
    assert torch.equal(got[0]["x"], torch.arange(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_state_file(policy, got.append, str(tmp_path / "checkpoint-9"))  # holds no state file: said once
        path = folder / STATE_NAME
        path.write_bytes(path.read_bytes()[:10])
        load_state_file(policy, got.append, str(folder))
    said = [str(w.message) for w in caught]
    assert len(got) == 1 and policy.failures == 1
    assert any("holds no headwatch_state.pt" in m for m in said) and any("restoring the monitors' state" in m for m in said)
    policy.strict = True
    with pytest.raises(Exception, match="restoring the monitors' state"):
        load_state_file(policy, got.append, str(folder))
