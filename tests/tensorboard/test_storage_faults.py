"""Storage faults under a real training loop (docs/faults.md): a full disk, a read-only remount and a deleted
log directory, on a size-limited tmpfs mounted for the test.

Each test trains a tiny model through the plain-loop door (``headwatch.Headwatch``) writing to a
``SummaryWriter`` in the tmpfs, causes the fault in the middle of the run, clears it, and then reads every
event file back: every logging step's headwatch scalar must be there (nothing lost), training must have
run every step with the values returned to the caller, one warning must say that writing stopped, and
``headwatch/storage/delayed_events`` must count the events written late. The tmpfs needs ``mount``
(root or CAP_SYS_ADMIN): the tests skip, with that reason, where it is not allowed.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from headwatch import Headwatch
from headwatch.tensorboard import guard, storage_status
from headwatch.tensorboard.guard import STORAGE_TAGS
from tests.helpers import TinyCausalLM
from tests.helpers.storage import CLEAR_AT, FAULT_AT, STEPS, check_nothing_lost, fill, read_back, remount



def train(logdir: Path, fault, clear) -> tuple[list[dict[str, float]], list[str], SummaryWriter]:
    """``STEPS`` steps logging every step; ``fault()`` before step ``FAULT_AT``, ``clear()`` before ``CLEAR_AT``."""
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=64, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = guard(SummaryWriter(str(logdir)), retry_seconds=0.0)  # retry at every flush (default: every 30 s)
    hw = Headwatch(model, monitors=["logits"], writer=writer, log_every_n_steps=1, figure_every_n_steps=0)
    returned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if step == FAULT_AT:
                fault()
            if step == CLEAR_AT:
                clear()
            ids = torch.randint(0, 64, (4, 8))
            hw.step_start({"input_ids": ids, "labels": ids}, step)
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
            loss.backward()
            hw.before_optimizer_step()
            optimizer.step()
            hw.after_optimizer_step()
            optimizer.zero_grad()
            returned.append(hw.step_end())
    writer.close()
    return returned, [str(w.message) for w in caught if "headwatch" in str(w.message)], writer


def test_a_full_disk_mid_run_loses_nothing(tmpfs):
    logdir = tmpfs / "run"
    ballast: list[Path] = []
    returned, messages, writer = train(logdir, lambda: ballast.append(fill(tmpfs)), lambda: ballast[0].unlink())
    check_nothing_lost(logdir, returned, messages, writer)


def test_a_read_only_remount_mid_run_loses_nothing(tmpfs):
    logdir = tmpfs / "run"

    returned, messages, writer = train(logdir, lambda: remount(tmpfs, "ro"), lambda: remount(tmpfs, "rw"))
    check_nothing_lost(logdir, returned, messages, writer)


def test_a_deleted_log_directory_is_made_again_and_loses_nothing(tmp_path):
    logdir = tmp_path / "run"
    returned, messages, writer = train(logdir, lambda: shutil.rmtree(logdir), lambda: None)
    # the deletion is seen at the next flush, and the directory made again at once (nothing to clear); the
    # events written before the deletion went with the directory, every later one is written again
    check_nothing_lost(logdir, returned, messages, writer, first=FAULT_AT)


def test_events_beyond_the_memory_bound_are_counted_lost(tmpfs):
    logdir = tmpfs / "run"
    ballast: list[Path] = []
    torch.manual_seed(0)
    writer = guard(SummaryWriter(str(logdir)), retry_seconds=0.0, max_pending_bytes=2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            writer.add_scalar("x", float(step), step)
            writer.flush()
        ballast.append(fill(tmpfs))
        for step in range(4, 204):  # 200 events of ~40 bytes: ~8000 bytes, 4x the bound
            writer.add_scalar("x", float(step), step)
            writer.flush()
        status = storage_status(writer)
        lost = status["lost_events"]
        assert status["delayed_events"] == 0 and not status["writing"], status
        # appends that still fit in the event file's last tmpfs page were written: the rest is kept or lost
        assert lost > 0 and status["pending_events"] + lost <= 200, status
        ballast[0].unlink()
        writer.add_scalar("x", 204.0, 204)
        writer.flush()
    writer.close()
    lost = storage_status(writer)["lost_events"]  # event 204 pushed one more out of the full memory bound
    acc = read_back(logdir)
    written = {e.step for e in acc.Scalars("x")}
    assert len(written) == 205 - lost, f"every event not counted lost was written: missing {sorted(set(range(205)) - written)}"
    assert acc.Scalars(STORAGE_TAGS[1])[-1].value == lost


def test_guard_is_idempotent_and_leaves_other_writers_alone(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    guarded = guard(writer, retry_seconds=5.0)
    inner = writer.file_writer
    assert guard(guarded) is writer and writer.file_writer is inner and inner.retry_seconds == 5.0
    other = object()
    assert guard(other) is other
    writer.close()


def test_alert_records_survive_a_read_only_disk(tmpfs):
    """The JSON Lines record file: records that cannot be written are kept, the engine counts and warns once, and
    every record is in the file, in order, once the disk is writable again (at the next alert, or at flush)."""
    from headwatch.alerts.actions import JsonlLog
    from headwatch.alerts.engine import AlertEngine
    from headwatch.alerts.events import Alert
    from headwatch.alerts.rules import CollapseRules

    path = tmpfs / "alerts" / "headwatch_alerts.jsonl"
    log = JsonlLog(path)
    messages: list[str] = []
    engine = AlertEngine(CollapseRules(), [log], warn=messages.append)

    def fire(step: int) -> None:
        alert = Alert(time="t", step=step, epoch=0, rule="entropy_floor", metrics={}, message=f"step {step}")
        engine._run("JSON Lines log", lambda: log(alert))  # noqa: SLF001 - what the engine does for each action

    fire(0)
    remount(tmpfs, "ro")
    for step in (1, 2, 3):
        fire(step)
    assert engine.action_failures == 3 and len(messages) == 1 and "kept in memory" in messages[0]
    assert len(log.pending) == 3
    remount(tmpfs, "rw")
    engine.flush()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert log.delayed == 3 and log.lost == 0 and not log.pending
