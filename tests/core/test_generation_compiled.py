"""Forwards of ``generate()`` are never pooled, in eager and compiled models (docs/capture.md).

Under ``torch.compile`` the hooks only stash the forwards and they are replayed after the forward has returned,
where the call stack no longer shows ``generate()``: headwatch wraps the model's ``generate`` methods at attach
time and records inside each forward whether one is running (:mod:`headwatch.model.generation`). Every published
figure is compared with a float64 recomputation from the loss forward's logits only; the forwards refused as
``generate()``'s are counted against the forwards the test saw inside its ``generate()`` call.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from headwatch.core import LogitStats
from headwatch.core.collision import SynonymCollision
from headwatch.core import logits as core_logits
from headwatch.integrations.transformers import HeadwatchCallback
from headwatch.model import generation
from tests.helpers.capture import KEYS, GenerateThenLoss, assert_published, reference
from tests.helpers.collision import FixedCounts, confusion_reference, snapshot
from tests.helpers.hf import B, Rows, hf_args, one_batch, tiny_llama

MODES = ["eager", "compiled", "fullgraph"]
NEW = 3  # max_new_tokens


def compile_model(model, mode: str) -> None:
    """In place (hooks registered before stay traced): dynamo's ``eager`` backend, fast on a CPU."""
    torch._dynamo.reset()
    if mode != "eager":
        model.compile(backend="eager", fullgraph=mode == "fullgraph")


def generate(model, batch: dict) -> None:
    model.generate(input_ids=batch["input_ids"][:, :6], attention_mask=batch["attention_mask"][:, :6],
                   max_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip


@pytest.fixture
def decisions(monkeypatch):
    """The reasons the capture contract gave, one per forward LogitStats was asked about (None: measured)."""
    said: list[str | None] = []
    real = core_logits.not_loss_forward

    def spy(*args, **kwargs):
        why = real(*args, **kwargs)
        said.append(why)
        return why

    monkeypatch.setattr(core_logits, "not_loss_forward", spy)
    return said


@pytest.mark.parametrize(
    ("mode", "order"),
    [(mode, order) for mode in MODES for order in ("loss_then_generate", "generate_then_loss")
     # compiled with graph breaks and fullgraph each once per order, not twice (test time)
     if not (mode, order) in {("compiled", "generate_then_loss"), ("fullgraph", "loss_then_generate")}],
)
def test_validation_with_generate_measures_the_loss_forward_only(mode, order, decisions):
    """A validation step (what Lightning's door calls around ``validation_step``) with the loss forward and a
    ``generate()`` call: the logit statistics and the synonym confusion count the loss forward only."""
    model, batch = tiny_llama(tie=False), one_batch()
    want = reference(model, batch)
    model.eval()
    counts = torch.full((model.config.vocab_size,), 100)
    counts[[3, 5, 7]] = 1  # rare; token 3 is every other target of the batch
    snap = snapshot(counts, torch.ones_like(counts, dtype=torch.bool), max_count=1)
    with torch.no_grad():
        n, confused = confusion_reference(model(**batch).logits, batch["labels"], snap.rare, {3: [5], 5: [3], 7: [9]})
    traced: list[bool] = []
    model.register_forward_hook(lambda m, a, o: traced.append(torch.compiler.is_compiling()))
    monitor = LogitStats(log_histogram=False)
    collision = SynonymCollision(frequency=FixedCounts(snap), synonym_groups=[[3, 5], [7, 9]])
    monitor.attach(model)
    collision.attach(model)
    compile_model(model, mode)
    generated = 0
    with torch.no_grad():
        for _ in range(2):  # two validation batches: the guard on the recorded flag holds on the second
            monitor.validation_batch_start(batch)
            collision.validation_batch_start(batch)
            if order == "loss_then_generate":
                model(**batch)
            before = len(traced)
            generate(model, batch)
            generated += len(traced) - before
            if order == "generate_then_loss":
                model(**batch)
            monitor.validation_batch_end()
            collision.validation_batch_end()
    values = {k: v.item() for k, v in monitor.validation_epoch_end().items()}
    confusion = {k: v.item() for k, v in collision.validation_epoch_end().items()}
    assert all(traced) == (mode != "eager") and any(traced) == (mode != "eager")  # the hooks ran compiled
    assert generated == 2 * NEW  # the prompt pass and two decoding steps, per batch
    assert decisions.count("generation") == generated and decisions.count(None) == 2, decisions
    assert values["headwatch/val/logits/positions"] == 2 * want["positions"]
    for key in KEYS:
        assert values[f"headwatch/val/logits/{key}"] == pytest.approx(want[key], abs=2e-5), key
    assert confusion["headwatch/collision/val/synonym_confusion_positions"] == 2 * n > 10
    assert confusion["headwatch/collision/val/synonym_confusion_rate"] == pytest.approx(confused / n)
    monitor.detach()
    assert "generate" in model.__dict__  # the collision monitor still watches
    collision.detach()
    assert "generate" not in model.__dict__ and not generation.active  # restored


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_hf_trainer_evaluate_and_train_with_generate(tmp_path, mode, decisions):
    """``evaluate()`` with a ``prediction_step`` that generates after the loss forward and makes a metric's pass;
    a training step whose ``compute_loss`` samples with ``generate()`` first (an RL trainer): the published
    ``debug/capture/generation_forwards`` is the number of ``generate()``'s forwards."""
    model, batch = tiny_llama(tie=False), one_batch()
    want = reference(model, batch)
    seen: list[str] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append("g" if generating[0] else "m"), with_kwargs=True)
    generating = [False]
    traced: list[bool] = []
    model.register_forward_hook(lambda m, a, o: traced.append(torch.compiler.is_compiling()))

    class Sampling(type("T", (GenerateThenLoss,), {"after": True})):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            generating[0] = True
            model.generate(input_ids=inputs["input_ids"][:, :6], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            generating[0] = False
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    compile_model(model, mode)  # in place: evaluate() and generate() run it compiled too (the Trainer's
    # torch_compile=True wraps only the training forward: generate() and evaluate() use the inner model)
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    trainer = Sampling(model=model, args=hf_args(tmp_path, per_device_eval_batch_size=B),
                       train_dataset=Rows(batch), eval_dataset=Rows(batch), callbacks=[cb])  # fmt: skip
    trainer.train()
    assert seen.count("g") == NEW and seen[NEW:].count("m") == 1  # generate's forwards, then the loss forward
    assert cb.latest["headwatch/debug/capture/generation_forwards"] == NEW
    assert cb.latest["headwatch/debug/capture/no_grad_forwards"] == 0
    assert_published(cb.latest, "headwatch/logits", want)
    decisions.clear()
    metrics = trainer.evaluate()
    assert decisions.count(None) == 1 and decisions.count("generation") == NEW, decisions
    assert_published({k.removeprefix("eval_"): v for k, v in metrics.items()}, "headwatch/val/logits", want)
    assert all(traced) == (mode == "compiled") and any(traced) == (mode == "compiled")  # the model ran compiled


def test_watch_generate_is_found_from_every_handle_and_restored():
    """The wrapper is reached through the inner model, a ``torch.compile`` wrapper and a PEFT model; counted when
    two watchers share it; a deep copy or a pickle of the model carries the plain method, bound to the copy."""
    peft = pytest.importorskip("peft")
    model, batch = tiny_llama(tie=False), one_batch()
    active: list[bool] = []
    model.register_forward_pre_hook(lambda m, a: active.append(generation.active))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    release = generation.watch_generate(lora)
    again = generation.watch_generate(model)  # a second watcher (the collision monitor's)
    assert isinstance(model.__dict__["generate"], generation._WatchedGenerate)
    assert isinstance(lora.__dict__["generate"], generation._WatchedGenerate)
    for handle in (model, torch.compile(model, backend="eager"), lora):
        active.clear()
        with torch.no_grad():
            model(input_ids=batch["input_ids"])  # not inside generate()
            generate(handle, batch)
        assert active == [False] + [True] * NEW, (type(handle).__name__, active)
        assert not generation.active
    twin = copy.deepcopy(model)
    assert twin.generate.__self__ is twin
    plain = tiny_llama(tie=False)  # no test hooks (lambdas do not pickle)
    undo = generation.watch_generate(plain)
    assert pickle.loads(pickle.dumps(plain)).generate.__func__ is type(plain).generate
    undo()
    release()
    assert isinstance(model.__dict__["generate"], generation._WatchedGenerate) and "generate" not in lora.__dict__
    again()
    assert "generate" not in model.__dict__


def test_lightning_compiled_validation_with_generate(tmp_path):
    """Lightning's door, the model compiled in place before ``fit``: each validation step generates first, then
    the loss forward, then a metric's pass (``LitLlama``); the validation figures are the loss forward's."""
    import lightning.pytorch as pl

    from headwatch import LogitStatsMonitor
    from tests.helpers.capture import LitLlama
    from tests.helpers.lightning_runs import StepLogger

    model, batch = tiny_llama(tie=False), one_batch()
    want = reference(model, batch)
    traced: list[bool] = []
    model.register_forward_hook(lambda m, a, o: traced.append(torch.compiler.is_compiling()))
    compile_model(model, "compiled")
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=1, log_every_n_steps=1, logger=StepLogger(), enable_progress_bar=False,
        callbacks=[LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0)], enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Rows(batch), batch_size=B)
    trainer.fit(LitLlama(model), data, data)
    assert traced and all(traced)  # every forward ran compiled
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("headwatch/val/")}
    assert_published(val, "headwatch/val/logits", want)
