"""The RL alert preset (docs/rl.md): the fraction of the run's starting entropy lost
and an entropy floor, held ``for_steps``; it fires on an induced GRPO collapse before the reward reaches its
plateau, and not on a healthy run."""

from __future__ import annotations

import json

import pytest

from headwatch.alerts import RL_DEFAULTS, CollapseRules, rl_collapse_rules
from headwatch.alerts.events import CRITICAL, FIRED, RESOLVED, WARNING
from headwatch.errors import HeadwatchError

H = "headwatch/logits/entropy"


def test_the_fall_is_measured_from_the_runs_start_with_a_hold():
    """alpha = 1/2 on values that are multiples of 1/4: every smoothed value is exact. Reference by hand:
    S = 2, 2, 1.5, 1.25, 0.875, 0.6875; lost fraction 0, 0, 0.25, 0.375, 0.5625, 0.65625."""
    rules = rl_collapse_rules(fall=(0.3, 0.5), for_steps=2, smoothing=0.5, floor=None)
    fired = []
    for step, h in enumerate([2.0, 2.0, 1.0, 1.0, 0.5, 0.5]):
        fired += [(e.step, e.rule, e.severity, e.kind) for e in rules.observe_train(step, {H: h})]
    # warning: 0.375 (step 3), 0.5625 (4) -> fires at 4; critical: 0.5625 (4), 0.65625 (5) -> fires at 5
    assert fired == [(4, "entropy_drop", WARNING, FIRED), (5, "entropy_drop", CRITICAL, FIRED)]
    assert "starting entropy" in rules.describe("entropy_drop", WARNING)
    # recovery: back above the start's 1 - 0.3 (1 - margin) share re-arms the warning
    events = [e for step, h in enumerate([4.0, 4.0, 4.0], start=6) for e in rules.observe_train(step, {H: h})]
    assert (RESOLVED, WARNING) in {(e.kind, e.severity) for e in events}


def test_the_start_survives_a_checkpoint():
    rules = rl_collapse_rules(floor=None)
    rules.observe_train(0, {H: 2.0})
    rules.observe_train(1, {H: 1.0})
    again = rl_collapse_rules(floor=None)
    again.load_state_dict(json.loads(json.dumps(rules.state_dict())))
    assert list(again.history) == [2.0] and again.smoothed == rules.smoothed


def test_the_floor_is_absolute_and_held():
    rules = rl_collapse_rules(fall=None, floor=0.05, for_steps=2)
    events = [e for step, h in enumerate([1.0, 0.04, 0.2, 0.04, 0.03]) for e in rules.observe_train(step, {H: h})]
    assert [(e.step, e.rule, e.severity) for e in events] == [(4, "entropy_floor", CRITICAL)]


def test_defaults_and_bad_arguments():
    rules = rl_collapse_rules()
    assert rules.drop_from == "start" and rules.for_steps == RL_DEFAULTS["for_steps"] == 2
    assert rules.thresholds["entropy_drop"] == {WARNING: 0.3, CRITICAL: 0.5}
    assert rules.thresholds["entropy_floor"] == {CRITICAL: 0.05}
    assert rl_collapse_rules(window=5).drop_from == "window"
    with pytest.raises(HeadwatchError, match="`fall`"):
        rl_collapse_rules(fall=1.5)
    with pytest.raises(HeadwatchError, match="drop_from"):
        CollapseRules(entropy_drop=0.5, drop_from="begin")


# ---------------------------------------------------------------------------------------- a GRPO run
def run_grpo(tmp_path, lr: float, steps: int = 12):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.rl import by_step, reward_w7, tiny_policy, word_tokenizer

    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0, alert=rl_collapse_rules())
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=steps, logging_steps=1, per_device_train_batch_size=8,
                      num_generations=8, max_completion_length=8, temperature=0.7, learning_rate=lr, report_to="none",
                      use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, use_vllm=False, seed=0)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["w1 w2 w3"] * 8 * steps})  # one prompt: the reward drives the policy onto w7
    trainer = GRPOTrainer(model=tiny_policy(), reward_funcs=reward_w7, args=args, train_dataset=data,
                          processing_class=word_tokenizer(), callbacks=[cb])  # fmt: skip
    trainer.train()
    path = tmp_path / "headwatch_alerts.jsonl"
    alerts = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    history = trainer.state.log_history
    return alerts, by_step(history, "headwatch/logits/entropy"), by_step(history, "reward")


def test_the_alert_fires_on_an_induced_collapse_before_the_reward_plateaus(tmp_path):
    """The example itself (examples/grpo_collapse.py, its defaults: 40 steps, learning rate 5e-3): the warning
    fires at least 3 steps before the reward first reaches 90% of the run's best (measured: 8 steps, at step 8
    against 16), and the collapse is real (the entropy ends under a tenth of where it started)."""
    pytest.importorskip("trl")
    from examples.grpo_collapse import main

    run = main(["--out", str(tmp_path)])
    entropy, alerts = run["entropy"], run["alerts"]
    assert entropy[max(entropy)] < 0.1 * entropy[1], entropy
    assert alerts and (alerts[0]["rule"], alerts[0]["severity"]) == ("entropy_drop", WARNING), alerts
    assert run["plateau"] - alerts[0]["step"] >= 3, (alerts, run["reward"])
    assert {(a["rule"], a["severity"]) for a in alerts} >= {("entropy_drop", CRITICAL)}


def test_the_alert_stays_quiet_on_a_healthy_run(tmp_path):
    alerts, entropy, _ = run_grpo(tmp_path, lr=0.0)
    assert alerts == [], alerts
    assert min(entropy.values()) > 0.7 * entropy[1]


AGREE_WORKER = r'''
import datetime, json, os, sys, types
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from headwatch.alerts import rl_collapse_rules
from headwatch.core import TorchDistributedReducer
from headwatch.integrations import hf_support
rank, out = int(sys.argv[1]), sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
stops = []
cb = types.SimpleNamespace(alert=rl_collapse_rules(), reducer=TorchDistributedReducer(), prefix="headwatch",
                           checkpoint_on_critical=False, stop_on_critical=True, stop_training=lambda alert=None: stops.append(1),
                           writers=lambda: [])
hf_support.wire_alert(cb, types.SimpleNamespace(output_dir=f"{out}/rank{rank}"))
# rank 0 collapses (the hand reference of test_the_fall_is_measured_from_the_runs_start_with_a_hold), rank 1 does not
values = [2.0, 2.0, 1.0, 1.0, 0.5, 0.5] if rank == 0 else [2.0] * 6
fired = [(e.step, e.rule, e.severity) for s, h in enumerate(values)
         for e in cb.alert.observe_train(s, {"headwatch/logits/entropy": h})]
json.dump({"fired": fired, "stops": len(stops), "jsonl": os.path.exists(f"{out}/rank{rank}/headwatch_alerts.jsonl")},
          open(f"{out}/rank{rank}.json", "w"))
dist.destroy_process_group()
'''


def test_the_rl_preset_agrees_on_every_rank(tmp_path):
    """gloo, 2 processes, the Hugging Face door's wiring (hf_support.wire_alert): rank 0's entropy collapses,
    rank 1's does not; both ranks fire the same alerts on the same steps and both stop (any rank firing fires
    everywhere); only rank 0 writes the alert file."""
    from tests.helpers.forked import fork_gloo_workers

    ranks = fork_gloo_workers(AGREE_WORKER, tmp_path, 33500)
    expected = [[4, "entropy_drop", WARNING], [5, "entropy_drop", CRITICAL]]
    assert ranks[0]["fired"] == ranks[1]["fired"] == expected
    assert ranks[0]["stops"] == ranks[1]["stops"] == 1
    assert [r["jsonl"] for r in ranks] == [True, False]


def test_a_misspelt_metric_is_warned_about_once_with_the_closest_names():
    """A misspelt ``entropy_metric`` could never fire (and was never warned about on any door, as the
    KL metric was published). The engine warns once after 20 logging steps with values but without it."""
    import warnings

    from headwatch.alerts import AlertEngine

    def run(rules):
        engine = AlertEngine(rules)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(45):
                engine.observe_train(step, {H: 1.0, "headwatch/logits/kl_to_uniform": 3.0, "headwatch/grad/x": 0.1})
        return [str(w.message) for w in caught if "has not been published" in str(w.message)]

    (said,) = run(rl_collapse_rules(entropy_metric="headwatch/logits/entropyy"))
    assert "'headwatch/logits/entropyy'" in said and "entropy_floor and entropy_drop read" in said
    assert "'headwatch/logits/entropy'" in said.split("closest")[1]
    assert run(rl_collapse_rules()) == []
    assert run(rl_collapse_rules(floor=None, entropy_metric="nope")) != []  # the fall rule alone still needs it
    assert run(CollapseRules(entropy_floor=None, entropy_drop=None, kl_ceiling=None, entropy_metric="nope")) == []


@pytest.mark.parametrize(
    "kwargs, named",
    [({"fall": (0.5, 0.3)}, "`fall`"), ({"fall": -1}, "`fall`"), ({"floor": "x"}, "`floor`"), ({"floor": 0}, "`floor`"),
     ({"floor": -1.0}, "`floor`"), ({"floor": (0.2, -1)}, "`floor`"), ({"smoothing": 2}, "`smoothing`"),
     ({"for_steps": 0}, "`for_steps`"), ({"window": 0}, "`window`")],
)  # fmt: skip
def test_the_presets_errors_name_the_argument_typed(kwargs, named):
    """The preset's names (``fall``, ``floor``, ``smoothing``), not CollapseRules' (``entropy_drop``, ...); a floor
    at or below 0 nats could never fire and is refused."""
    with pytest.raises(HeadwatchError) as err:
        rl_collapse_rules(**kwargs)
    assert named in str(err.value) and "entropy_drop" not in str(err.value) and "alpha" not in str(err.value)
