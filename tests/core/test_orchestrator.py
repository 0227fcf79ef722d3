"""The one orchestrator behind every front door (headwatch.core.orchestrator), tested on its own and through the doors.

References: hand-built monitors whose values are known, the plain loop's own values for the same batches,
a counting sink, and a one-process run of the same model with the callbacks in another order.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

import headwatch
from headwatch import HeadwatchError
from headwatch.core import GradientDensity, LogitStats, SynonymCollision, TokenCounts
from headwatch.core.monitor import Media, Monitor
from headwatch.core.build import MONITOR_NAMES, build_monitors
from headwatch.core.driver import Driver
from headwatch.core.orchestrator import Orchestrator
from headwatch.core.publish import to_host
from tests.helpers import TinyCausalLM, loader


class Planted(Monitor):
    """A monitor that publishes planted values: a device tensor, a Python float, a histogram; can be made to fail."""

    name = "planted"

    def __init__(self, value: float = 2.5, fail_at: set[str] | None = None) -> None:
        super().__init__()
        self.value, self.fail_at, self.calls = value, fail_at or set(), []

    def _maybe_fail(self, where: str) -> None:
        self.calls.append(where)
        if where in self.fail_at:
            raise RuntimeError(f"planted failure in {where}")

    def step_start(self, batch: Any, step: int, logging: bool) -> None:
        self._maybe_fail("step_start")
        self.calls[-1] = ("step_start", step, logging)

    def gradients_ready(self, loss_scale: Any = None) -> None:
        self._maybe_fail("gradients_ready")

    def batch_end(self) -> None:
        self._maybe_fail("batch_end")

    def validation_batch_start(self, batch: Any, dataloader_idx: int = 0) -> None:
        self._maybe_fail("validation_batch_start")

    def compute(self) -> dict[str, Any]:
        self._maybe_fail("compute")
        self.media.histograms["headwatch/planted/hist"] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        return {"headwatch/planted/tensor": torch.tensor(self.value), "headwatch/planted/float": 0.25}

    def validation_epoch_end(self) -> dict[str, Any]:
        return {"headwatch/val/planted": torch.tensor(self.value + 1)}


class Recorder:
    """A sink that records what it is given."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def publish(self, numbers: dict[str, float], media: list[Media], step: int, val: bool) -> None:
        if self.fail:
            raise OSError("disk full")
        self.calls.append((dict(numbers), [dict(m.histograms) for m in media], step, val))


def run_of(*monitors: Monitor, every: int = 2, **kw: Any) -> Orchestrator:
    run = Orchestrator(list(monitors), **kw)
    run.configure(every)
    return run


# ---------------------------------------------------------------------------- to_host
def test_to_host_is_one_transfer_of_scalars_and_histograms():
    media = Media(histograms={"h": torch.arange(6.0).reshape(2, 3)})
    numbers = to_host({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor(-3.0, dtype=torch.bfloat16)}, [media])
    assert numbers == {"a": 1.5, "b": 2.0, "c": -3.0}
    assert list(numbers) == ["a", "b", "c"]  # the scalars' order
    assert media.histograms["h"].dtype == torch.float64 and media.histograms["h"].shape == (2, 3)
    assert media.histograms["h"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert to_host({}) == {}
    assert to_host({"x": 7}) == {"x": 7.0}  # Python numbers never go through a tensor


def test_to_host_moves_to_the_host_once(monkeypatch):
    """Only one tensor is brought to the host, however many scalars and histograms."""
    moved = []
    original = torch.Tensor.cpu

    def counting_cpu(self, *a, **kw):
        moved.append(tuple(self.shape))
        return original(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    media = [Media(histograms={"h1": torch.ones(4)}), Media(histograms={"h2": torch.ones(2, 2)})]
    to_host({f"s{i}": torch.tensor(float(i)) for i in range(10)}, media)
    assert moved == [(18,)]  # 10 scalars + 4 + 4 histogram values


# ---------------------------------------------------------------------------- building and checks
def test_build_monitors_shares_one_token_count():
    built = build_monitors(None, None, "headwatch")
    assert [type(m) for m in built] == [TokenCounts, LogitStats, GradientDensity, SynonymCollision]
    counts = built[0]
    assert all(m.frequency is counts for m in built[1:])
    only = build_monitors(["logits"], None, "hw")
    assert [type(m) for m in only] == [LogitStats] and only[0].prefix == "hw"
    assert sorted(MONITOR_NAMES) == ["collision", "gradients", "logits", "tokens"]


@pytest.mark.parametrize("bad", [42, ["logits", "nope"], [object()], "nope"])
def test_bad_monitors_are_refused_by_name(bad):
    with pytest.raises(HeadwatchError, match="`monitors` must be"):
        Orchestrator(bad)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(prefix="a/"), "`prefix`"),
    (dict(strict=1), "`strict` must be a bool"),
    (dict(reducer="gloo"), "`reducer` must be None or a headwatch.core.Reducer"),
    (dict(batch_format={}), "`batch_format`"),
    (dict(sinks=[object()]), "`sinks` must be a sequence of objects with a publish"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        Orchestrator(["logits"], **kwargs)


def test_configure_sets_each_monitors_schedule():
    counts, planted = TokenCounts(), Planted()
    run = run_of(counts, planted, every=3)
    assert counts.schedule.every == 3 and planted.schedule.every == 3
    run.configure(0)
    assert planted.schedule.every == 0 and run.due(5) == []
    with pytest.raises(HeadwatchError, match="`every` must be an int >= 0"):
        run.configure(-1)


# ---------------------------------------------------------------------------- schedule and capture decisions
def test_due_follows_the_engines_rule_and_the_first_step():
    run = run_of(Planted(), every=4)
    assert [s for s in range(12) if run.due(s)] == [3, 7, 11]  # (s + 1) % 4 == 0
    assert run.due(0, first=True) and not run.due(1, first=True)  # logging_first_step


def test_forward_starts_a_micro_batch_at_its_first_loss_forward_only():
    """The capture contract (headwatch.core.forwards): no-grad passes of a training step and generate()'s
    forwards start nothing; an evaluation batch starts at its first loss forward, once."""
    planted = Planted()
    run = run_of(planted, every=2)
    run.begin_step(1)
    with torch.no_grad():
        run.forward({"input_ids": torch.ones(1, 2, dtype=torch.long)}, training=True)  # a reference pass: nothing
    assert planted.calls == []
    run.forward({"input_ids": torch.ones(1, 3, dtype=torch.long)}, training=True)
    run.forward({"input_ids": torch.ones(1, 3, dtype=torch.long)}, training=True)  # a second loss forward: pooled
    assert planted.calls == [("step_start", 1, True)]
    run.batch_end()
    run.forward({}, training=True)  # the next micro-batch starts again
    assert planted.calls[-1] == ("step_start", 1, True)
    run.end_step()
    n = len(planted.calls)

    class Model(torch.nn.Module):
        def generate(self):
            run.forward({}, training=False)  # generate()'s forwards: not the loss's

    with torch.no_grad():
        Model().generate()
        assert len(planted.calls) == n
        run.forward({}, training=False)  # outside a training step: an evaluation batch
        run.forward({}, training=False)  # a second pass of the same batch: nothing new
    assert planted.calls[n:] == ["validation_batch_start"]
    run.validation_batch_end()
    run.forward({}, training=False)
    assert planted.calls[-1] == "validation_batch_start"


def test_loss_inputs_complete_a_forward_without_labels():
    """A trainer that pops ``labels`` before the forward (label smoothing): the forward's batch gets them back."""
    planted = Planted()
    run = run_of(planted, every=1)
    ids, labels = torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": labels}
    seen = []
    planted.step_start = lambda batch, step, logging: seen.append(batch)
    run.begin_step(0)
    with run.loss_inputs(inputs):
        inputs.pop("labels")  # as Trainer.compute_loss does
        run.forward({"input_ids": ids}, training=True)
    assert seen[0]["labels"] is labels and seen[0]["input_ids"] is ids
    assert run.with_loss_inputs({"input_ids": ids}) == {"input_ids": ids}  # closed: nothing added
    with run.loss_inputs({"input_ids": ids, "labels": labels}):  # another batch's forward keeps its own fields
        assert "labels" not in run.with_loss_inputs({"input_ids": torch.ones(1, 5, dtype=torch.long)})


def test_end_step_publishes_due_monitors_once_through_every_sink():
    planted, sink, other = Planted(), Recorder(), Recorder()
    run = run_of(planted, every=2, sinks=[sink, other])
    for step in range(4):
        run.begin_step(step)
        run.step_start({})
        run.batch_end()
        numbers = run.end_step()
        assert bool(numbers) == (step % 2 == 1)
    assert [c[2] for c in sink.calls] == [1, 3] and sink.calls == other.calls
    numbers, hists, step, val = sink.calls[0]
    assert numbers == {"headwatch/planted/tensor": 2.5, "headwatch/planted/float": 0.25} and not val
    assert hists[0]["headwatch/planted/hist"].dtype == torch.float64  # on the host before any sink
    assert run.latest == numbers


def test_epoch_end_publishes_at_the_doors_x_axis():
    class AtEpochEnd(Planted):
        def train_epoch_end(self, step: int) -> bool:
            return True

    sink = Recorder()
    run = run_of(AtEpochEnd(), every=10, sinks=[sink])
    assert run.epoch_end(-1) == {}
    run.epoch_end(4, at=5)
    assert sink.calls[0][2] == 5


def test_validation_end_publishes_validation_values():
    sink = Recorder()
    run = run_of(Planted(value=1.0), sinks=[sink])
    assert run.validation_end(7) == {"headwatch/val/planted": 2.0}
    assert sink.calls == [({"headwatch/val/planted": 2.0}, [], 7, True)]  # its training media are not published again


# ---------------------------------------------------------------------------- failure policy
def test_a_failing_monitor_is_skipped_and_said_once_and_the_others_publish():
    bad, good, sink = Planted(fail_at={"compute", "gradients_ready"}), Planted(value=9.0), Recorder()
    good.prefix = "other"
    run = run_of(bad, good, every=1, sinks=[sink])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            run.begin_step(step)
            run.gradients_ready()
            run.end_step()
    messages = [str(w.message) for w in said if "Planted failed" in str(w.message)]
    assert len(messages) == 2  # one per cause (gradients, compute), not one per step
    assert bad.failures == 6 and good.failures == 0
    assert len(sink.calls) == 3 and all(c[0]["headwatch/planted/tensor"] == 9.0 for c in sink.calls)


def test_strict_raises_with_the_monitor_and_the_phase():
    run = run_of(Planted(fail_at={"step_start"}), strict=True)
    run.begin_step(0)
    with pytest.raises(HeadwatchError, match="Planted failed while starting a batch: RuntimeError: planted failure"):
        run.step_start({})


def test_a_failing_sink_warns_once_and_the_values_are_kept():
    good, broken = Recorder(), Recorder(fail=True)
    run = run_of(Planted(), every=1, sinks=[broken, good])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            run.begin_step(step)
            assert run.end_step()["headwatch/planted/tensor"] == 2.5
    messages = [str(w.message) for w in said if "could not publish through Recorder" in str(w.message)]
    assert len(messages) == 1 and "disk full" in messages[0] and "kept in `.latest`" in messages[0]
    assert len(good.calls) == 3  # the other sink still gets every step
    strict = run_of(Planted(), every=1, sinks=[broken], strict=True)
    strict.begin_step(0)
    with pytest.raises(HeadwatchError, match="could not publish through Recorder: OSError: disk full"):
        strict.end_step()


def test_state_round_trips_through_a_file(tmp_path):
    counts = TokenCounts()
    run = Orchestrator([counts, "logits"])
    run.configure(1)
    model = TinyCausalLM()
    run.attach(model)
    batch = next(iter(loader(n=8, batch_size=4)))
    run.begin_step(0)
    run.step_start(batch)
    model(batch["input_ids"])
    run.batch_end()
    run.end_step()
    saved = run.state_dict()
    torch.save(saved, tmp_path / "state.pt")
    again = Orchestrator([TokenCounts(), "logits"])
    again.configure(1)
    again.attach(TinyCausalLM())
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    counted = again.state_dict()["monitors"][0]["counts"]
    expected = torch.bincount(batch["input_ids"][batch["attention_mask"] != 0], minlength=64)  # padding is not counted
    assert torch.equal(counted, saved["monitors"][0]["counts"]) and torch.equal(counted, expected)


def test_a_door_reads_its_orchestrators_attributes():
    class Door(Driver):
        def __init__(self) -> None:
            self.run = Orchestrator(["logits"])

    door = Door()
    assert door.monitors is door.run.monitors and door.reducer is door.run.reducer and door.latest is door.run.latest
    assert isinstance(Door.monitors, object)  # the descriptor on the class


# ---------------------------------------------------------------------------- through the doors
def test_plain_loop_refuses_a_new_step_before_step_end(tmp_path):
    model = TinyCausalLM()
    hw = headwatch.Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    batch = next(iter(loader(n=4, batch_size=4)))
    hw.step_start(batch, 8)
    hw.step_start(batch, 8)  # a second micro-batch of the same step is fine
    with pytest.raises(HeadwatchError, match=r"step_start\(step=9\) while step 8 has not ended: call step_end\(\)"):
        hw.step_start(batch, 9)


def test_plain_loop_survives_a_writer_that_cannot_write_the_layout(tmp_path, monkeypatch):
    def unwritable(*args: Any, **kwargs: Any) -> Any:
        raise OSError("read-only file system")

    monkeypatch.setattr("headwatch.tensorboard.layout.layout_summary", unwritable)
    writer = SummaryWriter(str(tmp_path))
    hw = headwatch.Headwatch(TinyCausalLM(), monitors=["logits"], writer=writer, log_every_n_steps=1, figure_every_n_steps=None)
    batch = next(iter(loader(n=4, batch_size=4)))
    with pytest.warns(UserWarning, match="LayoutWriter.before_flush failed.*read-only file system.*the events are written"):
        with hw.step(batch, 0):
            hw.run.monitors[0].model(batch["input_ids"])
    assert math.isfinite(hw.latest["headwatch/logits/entropy"])
    writer.close()


def test_lightning_gives_the_same_values_whatever_the_callbacks_order(tmp_path):
    """The shared TokenFrequency is read by the others: the orchestrator puts it first, wherever it is listed."""
    import lightning.pytorch as pl

    def fit(order: str) -> dict[str, float]:
        torch.manual_seed(0)
        logits = headwatch.LogitStatsMonitor(validation=False, figure_every_n_steps=None, log_histogram=False)
        tokens = headwatch.TokenFrequency()
        callbacks = [tokens, logits] if order == "tokens first" else [logits, tokens]
        trainer = pl.Trainer(
            default_root_dir=tmp_path / order.replace(" ", "_"), max_steps=4, log_every_n_steps=2, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
            callbacks=callbacks,
        )
        trainer.fit(TinyCausalLM(), loader(n=32, batch_size=8))
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/logits/")}

    first, last = fit("tokens first"), fit("tokens last")
    assert any("/rare/" in k for k in first) and set(first) == set(last)
    for key in first:
        a, b = first[key], last[key]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9), key
