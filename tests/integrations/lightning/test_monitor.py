"""LogitStatsMonitor in real Trainer runs: logged values equal a direct computation."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from headwatch import HeadwatchError, LogitStatsMonitor
from headwatch.integrations.lightning.driver import drivers
from headwatch.core.metrics import LogitStatsMetric
from tests.helpers import TinyCausalLM, loader
from tests.helpers.events import read_events
from tests.helpers.lightning_runs import make_trainer
from tests.helpers.references import reference


def expected(records, stage: str, step: int | None = None) -> dict[str, float]:
    """Means over the valid positions of the recorded forwards, by the float64 reference."""
    refs = []
    for rec_stage, rec_step, logits, batch in records:
        if rec_stage != stage or (step is not None and rec_step != step):
            continue
        labels = batch["labels"]
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        refs.append(reference(logits, batch["attention_mask"].bool(), targets))
    cat = {k: np.concatenate([r[k].reshape(-1) for r in refs]) for k in refs[0]}
    valid = cat["valid"]
    ent = cat["entropy"][valid]
    return {
        "entropy": ent.mean(),
        "kl_to_uniform": cat["kl_to_uniform"][valid].mean(),
        "kl_from_uniform": cat["kl_from_uniform"][valid].mean(),
        "max_prob": cat["max_prob"][valid].mean(),
        "target_nll": cat["nll"][valid].mean(),
        "target_argmax_rate": cat["target_is_argmax"].sum() / valid.sum(),
        "entropy_p05": np.percentile(ent, 5),
        "entropy_p50": np.percentile(ent, 50),
        "entropy_p95": np.percentile(ent, 95),
        "positions": float(valid.sum()),
        "nonfinite_positions": float(cat["nonfinite"].sum()),
    }


def test_tensorboard_values_equal_direct_computation(tmp_path):
    model = TinyCausalLM()
    model.keep_logits = True
    trainer = make_trainer(tmp_path, [LogitStatsMonitor()], val_check_interval=4)
    trainer.fit(model, loader(), loader(n=16, seed=1))
    acc = read_events(trainer.logger.log_dir)
    tags = set(acc.Tags()["scalars"])
    for key in ("entropy", "kl_to_uniform", "kl_from_uniform", "entropy_p50", "max_prob", "target_nll"):
        assert f"headwatch/logits/{key}" in tags
        assert f"headwatch/val/logits/{key}" in tags
    assert "headwatch/logits/entropy_histogram" in acc.Tags()["histograms"]
    # Lightning logs train steps 1 and 3 with log_every_n_steps=2; so does headwatch.
    steps = [e.step for e in acc.Scalars("headwatch/logits/entropy")]
    assert steps == [e.step for e in acc.Scalars("train_loss")] == [1, 3]
    for step in steps:
        want = expected(model.records, "train", step)
        for key, value in want.items():
            got = [e.value for e in acc.Scalars(f"headwatch/logits/{key}") if e.step == step][0]
            assert got == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # the logged NLL is the model's own loss on that step
    for event in acc.Scalars("train_loss"):
        nll = [e.value for e in acc.Scalars("headwatch/logits/target_nll") if e.step == event.step][0]
        assert nll == pytest.approx(event.value, rel=1e-5)
    want = expected(model.records, "val")
    (val_entropy,) = acc.Scalars("headwatch/val/logits/entropy")
    assert val_entropy.value == pytest.approx(want["entropy"], rel=1e-5)
    (val_kl,) = acc.Scalars("headwatch/val/logits/kl_to_uniform")
    assert val_kl.value == pytest.approx(want["kl_to_uniform"], rel=1e-5)
    (val_n,) = acc.Scalars("headwatch/val/logits/positions")
    assert val_n.value == want["positions"]
    hist = acc.Histograms("headwatch/val/logits/entropy_histogram")[0].histogram_value
    assert hist.num == want["positions"]
    assert hist.sum == pytest.approx(want["entropy"] * want["positions"], rel=1e-5)
    # available to other callbacks (EarlyStopping, ModelCheckpoint, alerts)
    assert "headwatch/logits/entropy" in trainer.callback_metrics
    assert "headwatch/val/logits/entropy" in trainer.callback_metrics
    # headwatch's scalars of a logging step reach the TensorBoardLogger as one event (headwatch.tensorboard.batched_scalars)
    from tensorboard.backend.event_processing import event_file_loader

    events = [e for path in sorted(Path(trainer.logger.log_dir).glob("events.out.tfevents.*"))
              for e in event_file_loader.LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]  # fmt: skip
    ours = [e for e in events if any(v.tag.startswith("headwatch/logits/") and v.HasField("simple_value") for v in e.summary.value)]
    assert [e.step for e in ours] == [1, 3] and all(len(e.summary.value) > 10 for e in ours)


def test_hook_does_no_work_off_logging_steps(tmp_path, monkeypatch):
    calls = []
    original = LogitStatsMetric.update_from_statistics

    def counting(self, *args, **kw):
        calls.append(self)
        return original(self, *args, **kw)

    monkeypatch.setattr(LogitStatsMetric, "update_from_statistics", counting)
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(log_every_n_steps=3, validation=False)], max_steps=7)
    trainer.fit(TinyCausalLM(), loader(n=64))
    assert len(calls) == 2  # steps 2 and 5 only, of 7 training forwards


def test_gradient_accumulation_measures_every_micro_batch(tmp_path):
    model = TinyCausalLM()
    model.keep_logits = True
    trainer = make_trainer(
        tmp_path, [LogitStatsMonitor(validation=False)], accumulate_grad_batches=2, log_every_n_steps=1, max_steps=2
    )
    trainer.fit(model, loader(n=32))
    acc = read_events(trainer.logger.log_dir)
    events = acc.Scalars("headwatch/logits/positions")
    assert [e.step for e in events] == [0, 1]
    # step 0 is made of the first two micro-batches
    want = expected(model.records[:2], "train")
    assert events[0].value == want["positions"]
    assert acc.Scalars("headwatch/logits/entropy")[0].value == pytest.approx(want["entropy"], rel=1e-5)


def test_every_logger_receives_scalars(tmp_path):
    csv = CSVLogger(tmp_path, name="csv")
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False)], logger=[csv])
    trainer.fit(TinyCausalLM(), loader())
    text = Path(csv.log_dir, "metrics.csv").read_text()
    assert "headwatch/logits/entropy" in text and "headwatch/logits/kl_to_uniform" in text


def test_checkpoint_round_trip(tmp_path):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    monitor = LogitStatsMonitor(validation=False, log_every_n_steps=1)
    trainer = first_trainer = make_trainer(tmp_path, [monitor, ckpt_cb], enable_checkpointing=True, max_steps=3)
    trainer.fit(TinyCausalLM(), loader())
    saved = monitor.state_dict()
    assert saved["logged_steps"] == 3 and saved["total_positions"] > 0
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["callbacks"][monitor.state_key] == saved
    resumed = LogitStatsMonitor(validation=False, log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [resumed], max_steps=5)
    trainer.fit(TinyCausalLM(), loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.state_dict()["logged_steps"] == 5
    assert resumed.state_dict()["total_positions"] > saved["total_positions"]
    # the end-of-training summary covers the whole run: its first entropy is the first fit's first logged value
    first_fit, resumed_fit = (drivers(t.callbacks)[0].summary for t in (first_trainer, trainer))
    assert resumed_fit.first["headwatch/logits/entropy"] == first_fit.first["headwatch/logits/entropy"]
    assert resumed_fit.first["headwatch/logits/entropy"][0] == 0 and "since step 0" in resumed_fit.text
    # two monitors with different prefixes coexist in one checkpoint
    assert LogitStatsMonitor(prefix="a").state_key != LogitStatsMonitor(prefix="b").state_key
    # an old or partial state loads with defaults
    fresh = LogitStatsMonitor()
    fresh.load_state_dict({"version": 1})
    assert fresh.state_dict()["logged_steps"] == 0


def _inject_nan(module, args, output):
    output = output.clone()
    output[0, 0, 3] = float("nan")
    output[1, 2, 0] = float("inf")
    return output


def test_nonfinite_logits_are_counted_and_training_goes_on(tmp_path):
    model = TinyCausalLM()
    model.sanitize_logits = True
    model.lm_head.register_forward_hook(_inject_nan)  # runs before headwatch's hook sees the output
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False, log_every_n_steps=1)], max_steps=2)
    with pytest.warns(UserWarning, match="NaN or \\+inf logits"):
        trainer.fit(model, loader(pad=False))
    acc = read_events(trainer.logger.log_dir)
    assert [e.value for e in acc.Scalars("headwatch/logits/nonfinite_positions")] == [2.0, 2.0]
    assert all(math.isfinite(e.value) for e in acc.Scalars("headwatch/logits/entropy"))
    assert [e.value for e in acc.Scalars("headwatch/logits/positions")] == [8 * 11 - 2] * 2


def test_all_masked_batch_logs_nan_and_zero_positions(tmp_path):
    data = loader(n=8, pad=False)
    data.dataset.labels[:] = -100
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False, log_every_n_steps=1)], max_steps=1)
    with pytest.warns(UserWarning, match="no valid position"):
        trainer.fit(TinyCausalLM(), data)
    assert trainer.callback_metrics["headwatch/logits/positions"].item() == 0
    assert math.isnan(trainer.callback_metrics["headwatch/logits/entropy"].item())


def test_vocabulary_mismatch_targets_are_excluded_and_reported(tmp_path):
    model = TinyCausalLM(vocab_size=64)
    model.clamp_labels = True
    data = loader(n=8, pad=False)
    data.dataset.labels[:, 5] = 70  # a tokenizer larger than the head
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False, log_every_n_steps=1)], max_steps=1)
    with pytest.warns(UserWarning, match="outside \\[0, vocab_size\\)"):
        trainer.fit(model, data)
    # position 4 predicts label 5 in every sequence of the batch of 8
    assert trainer.callback_metrics["headwatch/logits/invalid_target_positions"].item() == 8
    assert trainer.callback_metrics["headwatch/logits/positions"].item() == 8 * 11 - 8  # 11 targets per sequence of 12


def test_missing_head_fails_in_setup(tmp_path):
    class NoHead(TinyCausalLM):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Identity()
            self.mix = torch.nn.Linear(16, 16)

    trainer = make_trainer(tmp_path, [LogitStatsMonitor(strict=True)])
    with pytest.raises(HeadwatchError, match="could not find the output head.*head="):
        trainer.fit(NoHead(), loader())
    # without strict: refused with one warning naming the cause, training goes on (docs/evaluation.md)
    model = NoHead()
    model.clamp_labels = True  # its 16 "logits" train against clamped labels
    trainer = make_trainer(tmp_path, [LogitStatsMonitor()], max_steps=2)
    with pytest.warns(UserWarning, match="could not find the output head.*head=.*Still measured: nothing"):
        trainer.fit(model, loader())
    assert trainer.global_step == 2 and not any(k.startswith("headwatch/") for k in trainer.callback_metrics)


def test_ambiguous_head_fails_in_setup(tmp_path):
    class TwoHeads(TinyCausalLM):
        def __init__(self):
            super().__init__()
            self.aux = torch.nn.Module()
            self.aux.lm_head = torch.nn.Linear(16, 64)

    trainer = make_trainer(tmp_path, [LogitStatsMonitor(strict=True)])
    with pytest.raises(HeadwatchError, match="ambiguous.*lm_head.*aux.lm_head"):
        trainer.fit(TwoHeads(), loader())
    trainer = make_trainer(tmp_path, [LogitStatsMonitor()], max_steps=1)  # without strict: one warning, training goes on
    with pytest.warns(UserWarning, match="ambiguous.*lm_head.*aux.lm_head"):
        trainer.fit(TwoHeads(), loader())
    # naming it resolves the ambiguity
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(head="lm_head", validation=False)], max_steps=2)
    trainer.fit(TwoHeads(), loader())
    assert "headwatch/logits/entropy" in trainer.callback_metrics


def test_monitoring_failure_does_not_stop_training_unless_strict(tmp_path):
    def broken_mask(batch):
        raise RuntimeError("user mask function is broken")

    trainer = make_trainer(tmp_path, [LogitStatsMonitor(mask_fn=broken_mask, validation=False)])
    with pytest.warns(UserWarning, match="training goes on"):
        trainer.fit(TinyCausalLM(), loader())
    assert trainer.global_step == 4
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(mask_fn=broken_mask, strict=True)])
    with pytest.raises(HeadwatchError, match="user mask function is broken"):
        trainer.fit(TinyCausalLM(), loader())


def test_mask_fn_and_targets_fn_override_the_batch(tmp_path):
    model = TinyCausalLM()
    model.keep_logits = True
    only_first = lambda batch: torch.zeros_like(batch["input_ids"], dtype=torch.bool).index_fill(1, torch.tensor([0]), True)  # noqa: E731
    same_as_input = lambda batch: batch["input_ids"]  # noqa: E731
    monitor = LogitStatsMonitor(mask_fn=only_first, targets_fn=same_as_input, validation=False, log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [monitor], max_steps=1)
    trainer.fit(model, loader())
    _, _, logits, batch = model.records[0]
    ref = reference(logits[:, :1], targets=batch["input_ids"][:, :1])
    assert trainer.callback_metrics["headwatch/logits/positions"].item() == 8
    assert trainer.callback_metrics["headwatch/logits/target_nll"].item() == pytest.approx(np.nanmean(ref["nll"]), rel=1e-5)


def test_shape_mismatch_is_skipped_with_a_warning(tmp_path):
    wrong = lambda batch: torch.ones(3, 3, dtype=torch.bool)  # noqa: E731
    monitor = LogitStatsMonitor(mask_fn=wrong, validation=False, log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [monitor], max_steps=2)
    with pytest.warns(UserWarning, match="mask has shape \\(3, 3\\)"):
        trainer.fit(TinyCausalLM(), loader())
    assert monitor.state_dict()["skipped_forwards"] == 2


def test_tuple_batches_and_tied_weights(tmp_path):
    class TupleLM(TinyCausalLM):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self(x).logsumexp(-1).mean()

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 5))), batch_size=4
    )
    model = TupleLM(tie_weights=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False, log_every_n_steps=1)], max_steps=2)
    with pytest.warns(UserWarning, match="found no `labels` in a (training )?list batch.*targets_fn=lambda batch: batch\\[1\\]"):
        trainer.fit(model, data)
    assert trainer.callback_metrics["headwatch/logits/positions"].item() == 20  # every position measured
    assert math.isnan(trainer.callback_metrics["headwatch/logits/target_nll"].item())  # no targets in a tuple


def test_compiled_model_keeps_the_hook(tmp_path):
    model = TinyCausalLM()
    model.keep_logits = True
    # the forward (embedding -> lm_head, hooks included) runs under TorchDynamo
    model.forward = torch.compile(model.forward, backend="eager")
    trainer = make_trainer(tmp_path, [LogitStatsMonitor(validation=False, log_every_n_steps=2)], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader())
    acc = read_events(trainer.logger.log_dir)
    events = acc.Scalars("headwatch/logits/entropy")
    assert [e.step for e in events] == [1, 3]
    assert events[0].value == pytest.approx(expected(model.records, "train", 1)["entropy"], rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(log_every_n_steps=0), "log_every_n_steps"),
        (dict(log_every_n_steps=True), "log_every_n_steps"),
        (dict(head=3), "head"),
        (dict(shift_labels="yes"), "shift_labels"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(mask_fn="labels"), "mask_fn"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes"),
        (dict(prefix="a/"), "prefix"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(HeadwatchError, match=match):
        LogitStatsMonitor(**kwargs)
