"""Storage faults at start (docs/faults.md): a log directory that cannot be written when the writer is made
(a read-only or a full file system, a real size-limited tmpfs), on the plain-loop, Hugging Face and Lightning doors.

torch's ``SummaryWriter(...)`` raises there (it opens its event file in its constructor);
``headwatch.tensorboard.SummaryWriter`` starts without a file instead, and the Hugging Face door gives the
Trainer's ``TensorBoardCallback`` that class. Each test checks that training runs every step, that the values
reach the caller (the Trainer's log history), that one warning says writing stopped, and that after the fault
clears every event is in the files, read back with TensorBoard's ``EventAccumulator``, with
``headwatch/storage/delayed_events`` published. Lightning's own ``TensorBoardLogger`` raises in ``Trainer.fit``
before any callback runs (``test_lightning_stops_before_any_callback_runs_headwatch_or_not``);
``headwatch.TensorBoardLogger`` does not (``test_lightning_with_headwatchs_logger_...``, ``docs/faults.md``).
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter as TorchSummaryWriter

from headwatch import Headwatch
from headwatch.tensorboard import SummaryWriter, storage_status
from headwatch.tensorboard.guard import STORAGE_TAGS
from tests.helpers import TinyCausalLM, watched_step
from tests.helpers.storage import ENTROPY, STEPS, check_nothing_lost, fill, read_back, remount

CLEAR_AT = 5


def faults(mount: Path):
    """``{name: (make the fault, clear it)}`` on the tmpfs at ``mount``."""
    ballast: list[Path] = []
    return {
        "read_only": (lambda: remount(mount, "ro"), lambda: remount(mount, "rw")),
        "full": (lambda: ballast.append(fill(mount)), lambda: ballast[0].unlink()),
    }


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # torch's writer thread dies
@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_torchs_writer_raises_at_start_where_headwatchs_does_not(tmpfs, fault):
    make, clear = faults(tmpfs)[fault]
    make()
    with pytest.raises(OSError):  # the reason for this class: torch's own stops the run here
        TorchSummaryWriter(str(tmpfs / "torch"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = SummaryWriter(str(tmpfs / "run"), retry_seconds=0.0, purge_step=0, filename_suffix=".hw")
        for step in range(3):
            writer.add_scalar("x", float(step), step)
            writer.flush()
        assert storage_status(writer)["pending_events"] == 5  # the purge marks (2) and 3 scalars, kept
        assert not storage_status(writer)["writing"]
        clear()
        writer.add_scalar("x", 3.0, 3)
        writer.close()
    messages = [str(w.message) for w in caught if "headwatch" in str(w.message)]
    assert len([m for m in messages if "cannot be written" in m]) == 1, messages
    assert isinstance(writer, TorchSummaryWriter)
    assert [p.name.endswith(".hw") for p in (tmpfs / "run").iterdir()] == [True]  # torch's arguments kept
    acc = read_back(tmpfs / "run")
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(s, float(s)) for s in range(4)]
    status = storage_status(writer)
    assert status["delayed_events"] == 6 and status["lost_events"] == 0, status  # 2 purge marks + 4 scalars
    assert acc.Scalars(STORAGE_TAGS[0])[-1].value == 6


@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_plain_loop_starts_on_an_unwritable_log_directory_and_loses_nothing(tmpfs, fault):
    make, clear = faults(tmpfs)[fault]
    make()
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=64, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    returned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = SummaryWriter(str(tmpfs / "run"), retry_seconds=0.0)  # torch's would raise here
        hw = Headwatch(model, monitors=["logits"], writer=writer, log_every_n_steps=1, figure_every_n_steps=0)
        for step in range(STEPS):
            if step == CLEAR_AT:
                clear()
            ids = torch.randint(0, 64, (4, 8))
            returned.append(watched_step(hw, model, optimizer, ids, step))
            if step == CLEAR_AT - 1:
                assert not list(tmpfs.rglob("events.out.tfevents.*"))  # nothing could be written yet
        writer.close()
    assert len(returned) == STEPS
    check_nothing_lost(tmpfs / "run", returned, [str(w.message) for w in caught if "headwatch" in str(w.message)], writer)
    # the steps before the fault cleared (and the layout) were written late: at least one event per step
    assert storage_status(writer)["delayed_events"] >= CLEAR_AT + 1


@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_hf_trainer_starts_on_an_unwritable_log_directory_and_loses_nothing(tmpfs, fault, monkeypatch):
    from transformers import Trainer, TrainerCallback

    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.hf import Rows, hf_args, one_batch, tiny_llama

    monkeypatch.setattr("headwatch.tensorboard.summary_writer.DEFAULT_RETRY_SECONDS", 0.0)  # retry at every flush
    out = tmpfs / "out"
    out.mkdir()  # the Trainer makes output_dir in its constructor (an unwritable one stops it there, headwatch or not)
    make, clear = faults(tmpfs)[fault]
    make()
    steps = 6

    class Clear(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                clear()

    args = hf_args(out, max_steps=steps, logging_steps=1, logging_first_step=False, learning_rate=1e-2,
                   report_to="tensorboard", per_device_train_batch_size=2)  # fmt: skip
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), repeat=3),
                      callbacks=[HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0), Clear()])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()  # without headwatch: OSError from SummaryWriter(...) in TensorBoardCallback.on_train_begin
    assert trainer.state.global_step == steps
    logged = {r["step"]: r for r in trainer.state.log_history if ENTROPY in r}
    assert sorted(logged) == list(range(1, steps + 1)), "every logging step's values reach the Trainer's log"
    messages = [str(w.message) for w in caught if "headwatch" in str(w.message)]
    assert len([m for m in messages if "cannot be written" in m]) == 1, messages
    assert len([m for m in messages if "again" in m]) == 1, messages
    (logdir,) = {p.parent for p in out.rglob("events.out.tfevents.*")}
    acc = read_back(logdir)
    written = {e.step: e.value for e in acc.Scalars("train/" + ENTROPY)}
    assert written == pytest.approx({s: r[ENTROPY] for s, r in logged.items()}, rel=1e-6)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, steps + 1))  # the Trainer's own, too
    assert "args" in " ".join(acc.Tags()["tensors"])  # its text at on_train_begin, written late
    delayed = acc.Scalars(STORAGE_TAGS[0])
    assert delayed and delayed[-1].value >= 3 * 2  # steps 1-3 (loss and entropy each) at least
    assert acc.Scalars(STORAGE_TAGS[1])[-1].value == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # torch's writer thread dies
@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_lightning_stops_before_any_callback_runs_headwatch_or_not(tmpfs, fault, tmp_path):
    """Lightning's own logger (``headwatch.TensorBoardLogger`` is the fix, tested below): Lightning makes its
    ``TensorBoardLogger.experiment`` (``makedirs`` of ``save_dir``, then torch's ``SummaryWriter(...)``) in
    ``Trainer.fit`` before the first callback hook, and writes ``hparams.yaml`` there after each ``log_metrics``;
    the same Trainer without headwatch stops the same way."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from headwatch import LogitStatsMonitor
    from tests.helpers import loader

    called: list[str] = []

    class Hooks(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            called.append("setup")

    make, _ = faults(tmpfs)[fault]
    make()
    for callbacks in ([Hooks()], [Hooks(), LogitStatsMonitor(log_every_n_steps=1)]):
        logger = TensorBoardLogger(str(tmpfs / "logs"))
        trainer = pl.Trainer(max_steps=2, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path))  # fmt: skip
        with pytest.raises(OSError) as raised:
            trainer.fit(TinyCausalLM(), loader())
        assert raised.value.errno == (30 if fault == "read_only" else 28)
        assert any(f.name == "experiment" for f in traceback.extract_tb(raised.tb)), "in logger.experiment"
        assert called == [] and trainer.global_step == 0  # before any callback hook and any step


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # torch's writer thread dies
@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_lightning_with_headwatchs_logger_starts_on_an_unwritable_save_dir_and_loses_nothing(tmpfs, fault, tmp_path):
    """``headwatch.TensorBoardLogger`` (Lightning's, with a guarded writer and ``hparams.yaml``): where Lightning's
    own logger stops ``Trainer.fit`` with ``OSError`` in ``logger.experiment``, the run trains every step, the
    values reach the other logger (a ``CSVLogger`` on writable storage), one warning, and after the fault clears
    (before the end) every event and ``hparams.yaml`` are on disk, with ``headwatch/storage/delayed_events``."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

    import headwatch
    from headwatch import LogitStatsMonitor, TensorBoardLogger
    from tests.helpers import loader

    assert headwatch.integrations.lightning.TensorBoardLogger is TensorBoardLogger
    steps, clear_after = 6, 3
    make, clear = faults(tmpfs)[fault]

    class Clear(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == clear_after:
                clear()

    def fit(logger):
        torch.manual_seed(0)
        csv_logger = CSVLogger(str(tmp_path / "csv"), name="", version=str(type(logger).__module__))
        trainer = pl.Trainer(max_steps=steps, log_every_n_steps=1, logger=[logger, csv_logger],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[LogitStatsMonitor(log_every_n_steps=1), Clear()],
                             default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(TinyCausalLM(), loader(n=steps * 8))
        return trainer, csv_logger

    make()
    with pytest.raises(OSError) as raised:  # Lightning's own logger, the same set-up: stops before step 1
        fit(LightningTensorBoardLogger(str(tmpfs / "lightning")))
    assert raised.value.errno == (30 if fault == "read_only" else 28)
    logger = TensorBoardLogger(save_dir=str(tmpfs / "logs"), retry_seconds=0.0)
    assert isinstance(logger, LightningTensorBoardLogger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, csv_logger = fit(logger)
    assert trainer.global_step == steps
    assert ENTROPY in trainer.callback_metrics
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(ENTROPY)]
    in_csv = {int(r["step"]): float(r[ENTROPY]) for r in rows}
    assert len(in_csv) == steps, in_csv  # every step's values reached the other logger
    messages = [str(w.message) for w in caught if str(w.message).startswith("headwatch: TensorBoard events")]
    assert len(messages) == 2, "\n".join(m[:200] for m in messages)  # the fault, then writing resumed
    assert "cannot be written" in messages[0] and "again" in messages[1], messages
    log_dir = Path(logger.log_dir)
    assert log_dir.parent.parent == tmpfs / "logs"
    acc = read_back(log_dir)
    written = {e.step: e.value for e in acc.Scalars(ENTROPY)}
    assert written == pytest.approx(in_csv, rel=1e-6)  # every step, the values the other logger got
    assert sorted({e.step for e in acc.Scalars("train_loss")}) == sorted(in_csv)  # Lightning's own metric, too
    hparams = (log_dir / "hparams.yaml").read_text()
    assert "vocab_size: 64" in hparams and "lr: 0.01" in hparams  # written once the fault cleared
    status = storage_status(logger.experiment)
    print(f"{fault}: {status}")
    assert status["writing"] and status["lost_events"] == 0 and status["delayed_events"] >= clear_after * 2, status
    assert acc.Scalars(STORAGE_TAGS[0])[-1].value == status["delayed_events"]
    assert acc.Scalars(STORAGE_TAGS[1])[-1].value == 0


def test_lightning_with_headwatchs_logger_on_writable_storage_writes_what_lightnings_writes(tmp_path):
    """Without a fault, ``headwatch.TensorBoardLogger`` writes what Lightning's own writes (the same scalar tags,
    steps and values, the same ``hparams.yaml``) and warns nothing."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

    from headwatch import LogitStatsMonitor, TensorBoardLogger
    from tests.helpers import loader

    out = {}
    for cls in (LightningTensorBoardLogger, TensorBoardLogger):
        torch.manual_seed(0)
        logger = cls(save_dir=str(tmp_path / cls.__module__))
        trainer = pl.Trainer(max_steps=3, log_every_n_steps=1, logger=logger, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[LogitStatsMonitor(log_every_n_steps=1)], default_root_dir=str(tmp_path))  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyCausalLM(), loader(n=24))
        assert not [w for w in caught if "headwatch" in str(w.message) and "cannot" in str(w.message)]
        acc = read_back(Path(logger.log_dir))
        out[cls] = ({t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]},
                    (Path(logger.log_dir) / "hparams.yaml").read_text())  # fmt: skip
    ours, theirs = out[TensorBoardLogger], out[LightningTensorBoardLogger]
    assert ENTROPY in ours[0] and len(ours[0][ENTROPY]) == 3
    assert not any(t.startswith("headwatch/storage") for t in ours[0])  # no fault: no storage counts
    assert sorted(ours[0]) == sorted(theirs[0])
    for tag, points in theirs[0].items():
        assert [s for s, _ in ours[0][tag]] == [s for s, _ in points], tag
        if "/overhead/" in tag:  # headwatch's own timings: each run its own
            continue
        assert [v for _, v in ours[0][tag]] == pytest.approx([v for _, v in points], rel=1e-5, nan_ok=True), tag
    assert ours[1] == theirs[1] and "vocab_size: 64" in ours[1]
