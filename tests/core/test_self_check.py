"""The self-check of every training logging step (``docs/self_check.md``).

On each door, headwatch publishes what it captured (``debug/capture/*``) and its gaps to an independent figure the
trainer already has (``check/*``): the model's own ``outputs.loss`` (Hugging Face Trainer, TRL's SFTTrainer, a
plain loop over a Hugging Face model), TRL's logged ``entropy`` and ``mean_token_accuracy``, a Lightning
user's logged loss (``compare_loss=``), a plain-loop user's ``step_end(loss=...)``. The references here are the
trainer's own records (``state.log_history``, Lightning's logged values) and float64 recomputations from the
model's logits, never headwatch's own numbers. A broken capture gives one warning and a non-zero gap; a head
whose gradient is zeroed by a hook is flagged as a vanished gradient.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from headwatch import GradientDensityMonitor, LogitStatsMonitor, names
from headwatch.core.capture_tally import CaptureTally
from headwatch.core.logits import LogitStats
from headwatch.core.self_check import TOLERANCES, SelfCheck
from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers import TinyCausalLM, loader
from tests.helpers.hf import (
    B,
    Rows,
    T,
    V,
    hf_args,
    one_batch,
    tiny_llama,
    uneven_batch,
    word_tokenizer,
)
from tests.helpers.lightning_runs import StepLogger, make_trainer

P = "headwatch"
CHECK_KEYS = ("debug/check/reference_nll", "check/nll_gap", "check/mismatch", "check/vanished_gradient")


def altered(labels: torch.Tensor) -> torch.Tensor:
    """Other labels at the same positions (each label id + 1)."""
    return torch.where(labels == -100, labels, (labels + 1) % V)


def peaked_llama():
    """An untied tiny Llama with a large head: peaked distributions, so other labels have another NLL."""
    model = tiny_llama(tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def float64_nll(model, batch: dict[str, torch.Tensor]) -> float:
    """Token-mean NLL of ``batch`` from the model's own logits, in float64 (an independent reference)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1), ignore_index=-100).item()


def no_self_check_warning(record) -> bool:
    said = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert not said, said
    return True


def test_every_published_self_check_name_is_declared():
    for key in (*CHECK_KEYS, "check/entropy_gap", "check/accuracy_gap", "debug/check/reference_positions",
                "debug/check/reference_forwards", "debug/capture/forwards", "debug/capture/positions", "debug/capture/labelled_positions"):  # fmt: skip
        assert names.declaration(f"{P}/{key}") is not None, key


# ---------------------------------------------------------------- agreement, every door
def test_plain_loop_agrees_with_the_models_own_loss_over_two_uneven_micro_batches():
    model = tiny_llama(tie=False)
    batch = uneven_batch()
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]  # 13 and 9 labels
    expected = float64_nll(model, batch)  # the step's token mean over both micro-batches, before the update
    hw = Headwatch(model, log_every_n_steps=1, figure_every_n_steps=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for half in halves:
            hw.step_start(half, 0)
            model(**half).loss.backward()
        hw.before_optimizer_step()
        opt.step()
        hw.after_optimizer_step()
        values = hw.step_end()
    assert no_self_check_warning(record)
    assert values[f"{P}/debug/capture/forwards"] == 2
    assert values[f"{P}/debug/capture/positions"] == values[f"{P}/debug/capture/labelled_positions"] == 22
    assert values[f"{P}/debug/check/reference_forwards"] == 2 and values[f"{P}/debug/check/reference_positions"] == 22
    # the two micro-batch means (13 and 9 labels) weighted by their labels: the step's token mean
    assert values[f"{P}/debug/check/reference_nll"] == pytest.approx(expected, abs=1e-6)
    assert abs(values[f"{P}/check/nll_gap"]) < 1e-5
    assert values[f"{P}/check/mismatch"] == 0 and values[f"{P}/check/vanished_gradient"] == 0


def test_plain_loop_step_end_loss_is_the_reference():
    model = tiny_llama(tie=True)
    batch = one_batch()
    expected = float64_nll(model, batch)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    hw.step_start(batch, 0)
    logits = model(input_ids=batch["input_ids"]).logits  # the user's own loss, no labels into the model
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1))
    values = hw.step_end(loss=loss)
    assert values[f"{P}/debug/check/reference_nll"] == pytest.approx(expected, abs=1e-6)
    assert abs(values[f"{P}/check/nll_gap"]) < 1e-5 and values[f"{P}/check/mismatch"] == 0
    assert math.isnan(values[f"{P}/debug/check/reference_forwards"])  # a step-level figure


def test_hf_trainer_agrees_with_its_logged_loss_under_gradient_accumulation(tmp_path):
    """The Trainer passes ``num_items_in_batch`` to the model: each micro-batch's ``outputs.loss`` is its NLL sum
    over the step's token count, so they add up to the step's token mean, which the Trainer logs as ``loss``."""
    model = tiny_llama(tie=False)
    batch = uneven_batch()
    expected = float64_nll(model, batch)
    cb = HeadwatchCallback(monitors=["logits", "gradients"], figure_every_n_steps=None)
    args = hf_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(batch), callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert no_self_check_warning(record)
    (logged,) = [r for r in trainer.state.log_history if f"{P}/check/nll_gap" in r]
    (trainer_loss,) = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert logged[f"{P}/debug/check/reference_nll"] == pytest.approx(trainer_loss, abs=1e-4)  # the Trainer's record (rounded)
    assert logged[f"{P}/debug/check/reference_nll"] == pytest.approx(expected, abs=1e-6)
    assert logged[f"{P}/debug/check/reference_forwards"] == 2 and logged[f"{P}/debug/check/reference_positions"] == 22
    assert logged[f"{P}/debug/capture/labelled_positions"] == 22
    assert abs(logged[f"{P}/check/nll_gap"]) < 1e-5
    assert logged[f"{P}/check/mismatch"] == 0 and logged[f"{P}/check/vanished_gradient"] == 0


def test_sft_trainer_agrees_with_trls_loss_entropy_and_token_accuracy(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": one_batch()["input_ids"].tolist()})
    cb = HeadwatchCallback(monitors=["logits", "gradients"], figure_every_n_steps=None)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, report_to="none", use_cpu=True, save_strategy="no",
                       disable_tqdm=True, max_length=T, padding_free=False)  # fmt: skip
    trainer = SFTTrainer(model=tiny_llama(tie=True), args=config, train_dataset=data, processing_class=word_tokenizer(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert no_self_check_warning(record)
    ours = {r["step"]: r for r in trainer.state.log_history if f"{P}/check/nll_gap" in r}
    trl = {r["step"]: r for r in trainer.state.log_history if "entropy" in r}  # TRL's own records
    assert sorted(ours) == sorted(trl) == [1, 2]
    for step, r in ours.items():
        assert r[f"{P}/debug/capture/forwards"] == 2 and r[f"{P}/debug/check/reference_forwards"] == 2
        assert r[f"{P}/debug/check/reference_nll"] == pytest.approx(trl[step]["loss"], abs=1e-4)  # TRL's logged loss
        assert abs(r[f"{P}/check/nll_gap"]) < TOLERANCES["nll"].atol
        # TRL's records average the step's two micro-batches (equal label counts here), as the check does
        assert r[f"{P}/logits/entropy"] - r[f"{P}/check/entropy_gap"] == pytest.approx(trl[step]["entropy"], abs=1e-6)
        assert abs(r[f"{P}/check/entropy_gap"]) < 1e-3
        assert r[f"{P}/logits/target_argmax_rate"] - r[f"{P}/check/accuracy_gap"] == pytest.approx(trl[step]["mean_token_accuracy"], abs=1e-6)
        assert abs(r[f"{P}/check/accuracy_gap"]) < 1e-6
        assert r[f"{P}/check/mismatch"] == 0 and r[f"{P}/check/vanished_gradient"] == 0


def test_lightning_compare_loss_agrees_under_gradient_accumulation(tmp_path):
    logger = StepLogger()
    monitors = [LogitStatsMonitor(compare_loss="train_loss", figure_every_n_steps=None), GradientDensityMonitor(figure_every_n_steps=None)]
    trainer = make_trainer(tmp_path, monitors, max_steps=2, log_every_n_steps=1, logger=logger, accumulate_grad_batches=2,
                           limit_val_batches=0)  # fmt: skip
    model = TinyCausalLM(lr=0.0)  # weights fixed: Lightning's logged losses are those of the measured forwards
    model.keep_logits = True
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=16, batch_size=4))  # padded rows: micro-batches with different label counts
    assert no_self_check_warning(record)
    values = logger.values
    assert len(values[f"{P}/check/nll_gap"]) == 2
    for i in range(2):  # float64 from the model's own logits of the step's two micro-batches
        recs = [r for r in model.records if r[0] == "train"][2 * i : 2 * i + 2]
        logits = torch.cat([r[2][:, :-1] for r in recs]).double()
        labels = torch.cat([r[3]["labels"][:, 1:] for r in recs])
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100).item()
        assert values[f"{P}/debug/check/reference_nll"][i] == pytest.approx(expected, abs=1e-6)
        assert values[f"{P}/debug/check/reference_positions"][i] == values[f"{P}/debug/capture/labelled_positions"][i] == (labels != -100).sum()
        assert abs(values[f"{P}/check/nll_gap"][i]) < 1e-5
        assert values[f"{P}/check/mismatch"][i] == 0 and values[f"{P}/check/vanished_gradient"][i] == 0


def logged_loss_checked(batches: list[tuple[list[int], float | None]], own: float) -> tuple[dict[str, float], list[str]]:
    """A Lightning logging step checked against its logged ``train_loss`` (``compare_loss=``), without a trainer: each
    micro-batch measures forwards of the given labelled positions, then hands its logged mean (None: not logged);
    headwatch's own pooled mean is ``own`` (float32 logits over 64 columns). The published floats, the warnings."""
    check, tally = SelfCheck(P), CaptureTally()
    check.begin(True)
    for forwards, logged in batches:
        for n in forwards:
            tally.add(torch.zeros(n, dtype=torch.long), -100, torch.float32, 64)
        metrics = {} if logged is None else {"train_loss": torch.tensor(logged)}
        check.add_logged_loss("train_loss", metrics, tally, "the LightningModule", "self.log")
    labelled = float(sum(sum(f) for f, _ in batches))
    scalars = {f"{P}/logits/target_nll": torch.tensor(own, dtype=torch.float64), f"{P}/logits/positions": torch.tensor(labelled)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        numbers = {k: float(v) for k, v in check.extend(scalars, [SimpleNamespace(capture_tally=tally)]).items()}
        check.published(numbers)
    return numbers, [str(w.message) for w in record]


@pytest.mark.parametrize(
    ("batches", "own", "mismatch"),
    [
        ([([8], 2.5)], 2.5, 0),  # logits_to_keep: the loss over the 8 kept positions (the batch holds 13 labels)
        ([([13, 13], 2.5)], 2.5, 0),  # R-Drop: one logged mean of two passes over the batch, both measured
        ([([13], 2.0), ([9], 3.0)], (13 * 2.0 + 9 * 3.0) / 22, 0),  # accumulation: each micro-batch by its positions
        ([([13], 2.5), ([9], None)], 2.5, 1),  # a measured micro-batch without a logged loss: 13 counted of 22
        ([([8], 2.5)], 2.6, 1),  # the same positions, another mean
    ],
    ids=["kept_positions", "r_drop", "accumulation", "unlogged_micro_batch", "other_values"],
)
def test_a_logged_loss_counts_the_positions_its_batch_measured(batches, own, mismatch):
    numbers, said = logged_loss_checked(batches, own)
    logged = [(sum(f), v) for f, v in batches if v is not None]
    positions = sum(n for n, _ in logged)
    reference = sum(n * v for n, v in logged) / positions  # float64, by hand
    assert numbers[f"{P}/debug/check/reference_nll"] == pytest.approx(reference, rel=1e-6)
    assert numbers[f"{P}/debug/check/reference_positions"] == positions
    assert numbers[f"{P}/check/mismatch"] == mismatch
    failed = [m for m in said if "self-check FAILED" in m]
    assert len(failed) == mismatch
    if batches[-1][1] is None:  # the count fails although the means agree, and the warning says why
        assert numbers[f"{P}/check/nll_gap"] == pytest.approx(0.0, abs=1e-7)
        assert "hold 22 labelled positions, the loss counts 13" in failed[0] and "`compare_loss=`" in failed[0]


# ---------------------------------------------------------------- broken captures
def test_labels_changed_after_headwatch_read_them_warn_once_with_a_gap():
    """The model's loss uses other labels than the batch headwatch measured, at the same positions (forced onto the
    hidden-state path, headwatch reads no loss call: it sees the batch's labels only)."""
    model = peaked_llama()
    batch = one_batch()
    hw = Headwatch(model, monitors=[LogitStats(path="hidden")], log_every_n_steps=1, figure_every_n_steps=None)
    for step in range(2):
        hw.step_start(batch, step)
        model(input_ids=batch["input_ids"], labels=altered(batch["labels"]))
        if step == 0:
            with pytest.warns(UserWarning, match=r"self-check FAILED.*target NLL .* vs the trainer's loss .*same positions, different values"):
                values = hw.step_end()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # said once
                values = hw.step_end()
        assert abs(values[f"{P}/check/nll_gap"]) > 0.05 and values[f"{P}/check/mismatch"] == 1
    assert hw.run.check.mismatched_steps == 2


def test_a_smoothed_loss_is_not_the_cross_entropy_measured():
    model = peaked_llama()
    batch = one_batch()
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    hw.step_start(batch, 0)
    logits = model(input_ids=batch["input_ids"]).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1), label_smoothing=0.3)
    with pytest.warns(UserWarning, match="label smoothing"):
        values = hw.step_end(loss=loss)
    assert abs(values[f"{P}/check/nll_gap"]) > 0.05 and values[f"{P}/check/mismatch"] == 1


class AlterLabels(TrainerCallback):
    """Registers, after headwatch's, a forward pre-hook that hands the model other labels than the batch's."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def hook(module, a, kw):
            return a, {**kw, "labels": altered(kw["labels"])}

        model.register_forward_pre_hook(hook, with_kwargs=True)


def test_hf_trainer_broken_capture_is_on_the_dashboard(tmp_path):
    """Forced onto the hidden-state path (no loss call read), headwatch measures the labels the forward's pre-hook saw."""
    cb = HeadwatchCallback(monitors=[LogitStats(path="hidden")], figure_every_n_steps=None)
    trainer = Trainer(model=peaked_llama(), args=hf_args(tmp_path), train_dataset=Rows(one_batch()), callbacks=[cb, AlterLabels()])
    with pytest.warns(UserWarning, match=r"self-check FAILED"):
        trainer.train()
    (logged,) = [r for r in trainer.state.log_history if f"{P}/check/nll_gap" in r]
    assert abs(logged[f"{P}/check/nll_gap"]) > 0.05 and logged[f"{P}/check/mismatch"] == 1


def test_no_labels_seen_names_the_cause():
    """headwatch reads the batch given to step_start; the model gets labels the batch does not hold (forced onto the
    hidden-state path: no loss call read)."""
    model = tiny_llama(tie=False)
    batch = one_batch()
    hw = Headwatch(model, monitors=[LogitStats(path="hidden")], log_every_n_steps=1, figure_every_n_steps=None)
    hw.step_start({"input_ids": batch["input_ids"]}, 0)
    model(**batch)
    with pytest.warns(UserWarning, match="headwatch saw no labels"):
        values = hw.step_end()
    assert values[f"{P}/debug/capture/labelled_positions"] == 0 and values[f"{P}/check/mismatch"] == 1
    assert math.isnan(values[f"{P}/check/nll_gap"])


def test_a_micro_batch_without_labelled_positions_adds_nothing_to_the_reference():
    # gradient accumulation over two micro-batches, the second with every label ignored: the model's loss of that
    # forward is NaN (0 / 0); the user skips its backward
    model = tiny_llama(tie=False)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    first = one_batch()
    second = {**first, "labels": torch.full_like(first["labels"], -100)}
    for batch in (first, second):
        hw.step_start(batch, 0)
        loss = model(**batch).loss
        if torch.isfinite(loss):
            (loss / 2).backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    model.zero_grad()
    values = hw.step_end()
    assert math.isnan(loss.item())  # the all-ignored forward's own loss
    reference = float64_nll(model, first)  # the float64 mean over the labelled positions (the first micro-batch's)
    assert values[f"{P}/debug/check/reference_nll"] == pytest.approx(reference, rel=1e-5)
    assert values[f"{P}/debug/check/reference_positions"] == (first["labels"][:, 1:] != -100).sum().item()
    assert values[f"{P}/check/mismatch"] == 0


# ---------------------------------------------------------------- vanished gradient
def _loop_step(model, hw, batch, step):
    hw.step_start(batch, step)
    model(**batch).loss.backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    model.zero_grad()
    return hw.step_end()


@pytest.mark.parametrize(("tie", "rows"), [(False, "all"), (True, "all")])
def test_a_zeroed_head_gradient_is_a_vanished_gradient(tie, rows):
    model = tiny_llama(tie=tie)
    hw = Headwatch(model, monitors=["logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=None)
    batch = one_batch()
    keep = torch.zeros(V, 1) if rows == "all" else (torch.arange(V) % 2).view(V, 1).float()
    model.lm_head.weight.register_hook(lambda g: g * keep)  # a backward that loses (some of) the head's gradient
    with pytest.warns(UserWarning, match="output head's gradient VANISHED"):
        values = _loop_step(model, hw, batch, 0)
    # the head's row densities would read as a measured 0 (or 0.5): withheld on that step, and counted
    flow = "shared" if tie else "head"
    assert not [k for k in values if k.startswith(f"{P}/grad/") and k.endswith(f"{flow}_row_density")]
    # the head flow overall and in its six buckets (top1, top10, top50, tail, unseen, rare); tied, also the shared
    # matrix overall, in top1 and rare
    assert values[f"{P}/check/withheld"] == 1 + 6 + (3 if tie else 0)
    if rows == "all":  # the norms stay: what the gradient holds
        assert values[f"{P}/grad/{flow}_row_norm_max"] == 0.0
    assert values[f"{P}/check/vanished_gradient"] == 1 and values[f"{P}/debug/check/reference_nll"] > 0
    assert hw.run.check.vanished_steps == 1


def test_a_masked_vocabulary_column_is_no_vanished_gradient():
    # an untied head whose model never predicts one token (its logit -inf): that row has no gradient, the others do
    model = tiny_llama(tie=False)
    pad = 0
    model.lm_head.register_forward_hook(lambda mod, args, out: out.masked_fill(torch.arange(V) == pad, float("-inf")))
    hw = Headwatch(model, monitors=["logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=None)
    batch = one_batch()
    batch = {**batch, "labels": torch.where(batch["labels"] == pad, 1, batch["labels"])}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hw.step_start(batch, 0)
        loss = model(**batch).loss
        loss.backward()
        true = (model.lm_head.weight.grad.abs().sum(1) > 0).double().mean().item()  # float64 reference
        hw.before_optimizer_step()
        hw.after_optimizer_step()
        model.zero_grad()
        values = hw.step_end()
    assert math.isfinite(loss.item()) and true == (V - 1) / V
    assert values[f"{P}/check/vanished_gradient"] == 0 and hw.run.check.vanished_steps == 0
    assert values[f"{P}/grad/head_row_density"] == pytest.approx(true, abs=1e-12)
    assert not [w for w in said if "VANISHED" in str(w.message)]


def test_a_normal_head_gradient_is_not_flagged_and_the_counts_round_trip():
    model = tiny_llama(tie=False)
    hw = Headwatch(model, monitors=["logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=None)
    values = _loop_step(model, hw, one_batch(), 0)
    assert values[f"{P}/grad/head_row_density"] == 1.0 and values[f"{P}/check/vanished_gradient"] == 0
    hw.run.check.mismatched_steps, hw.run.check.vanished_steps = 3, 2
    other = Headwatch(tiny_llama(tie=False), log_every_n_steps=1, figure_every_n_steps=None)
    other.load_state_dict(hw.state_dict())
    assert (other.run.check.mismatched_steps, other.run.check.vanished_steps) == (3, 2)


def test_an_auxiliary_loss_is_not_compared():
    """A MoE model's ``outputs.loss`` adds the router's load-balancing loss: no reference, said once."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=32,
                           output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    model = MixtralForCausalLM(config)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    batch = one_batch()
    hw.step_start(batch, 0)
    with pytest.warns(UserWarning, match="includes an auxiliary loss"):  # said at the forward that returns it
        out = model(**batch)
    assert out.aux_loss is not None
    values = hw.step_end()
    assert f"{P}/check/nll_gap" not in values and f"{P}/debug/check/reference_nll" not in values
    labelled = (batch["labels"][:, 1:] != -100).sum().item()
    assert values[f"{P}/debug/capture/labelled_positions"] == values[f"{P}/debug/capture/positions"] == labelled  # still published


TWO_PROCESS_WORKER = r'''
import datetime, json, os, sys, warnings
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from tests.helpers.hf import uneven_batch
from tests.helpers.hf import tiny_llama
from headwatch import Headwatch
from headwatch.core import TorchDistributedReducer
from headwatch.core.self_check import SelfCheck
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
warnings.simplefilter("ignore")
result = {}
# "ddp": the plain loop, the global token mean
model = tiny_llama(tie=False)
hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
part = {k: v[2 * rank : 2 * rank + 2] for k, v in uneven_batch().items()}  # rank 0: 13 labels, rank 1: 9
hw.step_start(part, 0)
model(**part).loss.backward()
result["ddp"] = hw.step_end()
# "trl": TRL's micro-batch entries weighed by their positions over every process
check = SelfCheck("hw", TorchDistributedReducer())
check.begin(True)
local = [10.0, 2.0] if rank == 0 else [2.0, 10.0]  # each micro-batch's labelled positions on this process
for n in local:
    check.add_nll_sum(torch.tensor(3.0 * n, dtype=torch.float64), torch.tensor(n))
check.trainer_metrics(entropy=[1.0, 2.0])  # TRL: each micro-batch's token mean over both processes
pooled = torch.tensor(1.5, dtype=torch.float64)  # headwatch: every token of the step, both processes (12 + 12)
out = check.extend({"hw/logits/entropy": pooled, "hw/logits/positions": torch.tensor(24.0),
                    "hw/logits/target_nll": torch.tensor(3.0, dtype=torch.float64)}, [])
result["trl"] = {k: float(v) for k, v in out.items() if k.startswith("hw/check/")}
json.dump(result, open(sys.argv[4] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, list[dict]]:
    """Both two-process cases in one launch of 2 gloo processes: each case's values, by rank."""
    from tests.helpers.forked import fork_gloo_workers

    ranks = fork_gloo_workers(TWO_PROCESS_WORKER, tmp_path_factory.mktemp("self_check_gloo"), 31500)
    return {case: [r[case] for r in ranks] for case in ("ddp", "trl")}


def test_two_processes_compare_the_global_token_mean(two_processes):
    """gloo, 2 processes with different label counts: every rank publishes the same check, against the token
    mean over both processes' labels (float64 from the model's logits of the whole batch)."""
    r0, r1 = two_processes["ddp"]
    expected = float64_nll(tiny_llama(tie=False), uneven_batch())
    for r in (r0, r1):
        assert r[f"{P}/debug/capture/labelled_positions"] == r[f"{P}/debug/check/reference_positions"] == 22  # 13 + 9
        assert r[f"{P}/debug/check/reference_nll"] == pytest.approx(expected, abs=1e-6)
        assert abs(r[f"{P}/check/nll_gap"]) < 1e-5 and r[f"{P}/check/mismatch"] == 0
    assert {k: v for k, v in r0.items() if "check" in k} == {k: v for k, v in r1.items() if "check" in k}


def test_step_end_loss_must_be_a_tensor_or_a_number():
    from headwatch import HeadwatchError

    model = tiny_llama(tie=True)
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None)
    hw.step_start(one_batch(), 0)
    with pytest.raises(HeadwatchError, match="`loss` must be a scalar tensor or a number, got '4.2'"):
        hw.step_end(loss="4.2")


def test_sft_label_smoothing_compares_trls_entropy_and_accuracy_not_the_smoothed_loss(tmp_path):
    """With label smoothing TRL's loss forward has no labels and its metrics come from a no-grad fused pass: no
    NLL reference (check/nll_gap left out: one warning), TRL's entropy and token accuracy still compared."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": one_batch()["input_ids"].tolist()})
    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=None)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, per_device_train_batch_size=B, report_to="none",
                       use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=T, padding_free=False,
                       label_smoothing_factor=0.1)  # fmt: skip
    trainer = SFTTrainer(model=tiny_llama(tie=True), args=config, train_dataset=data, processing_class=word_tokenizer(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    notes = [w for w in record if "no trainer loss to compare target_nll with" in str(w.message)]
    assert len(notes) == 1 and "check/nll_gap is not published" in str(notes[0].message)
    assert no_self_check_warning([w for w in record if w not in notes])
    (r,) = [r for r in trainer.state.log_history if f"{P}/check/entropy_gap" in r]
    (trl,) = [r for r in trainer.state.log_history if "entropy" in r]
    assert f"{P}/debug/check/reference_nll" not in r and f"{P}/check/nll_gap" not in r
    assert r[f"{P}/logits/entropy"] - r[f"{P}/check/entropy_gap"] == pytest.approx(trl["entropy"], abs=1e-6)
    assert abs(r[f"{P}/check/entropy_gap"]) < 1e-3 and abs(r[f"{P}/check/accuracy_gap"]) < 1e-6
    assert r[f"{P}/debug/capture/labelled_positions"] == B * (T - 1) and r[f"{P}/check/mismatch"] == 0


def test_trls_micro_batch_entries_are_weighted_by_their_positions_over_every_process(two_processes):
    """gloo, 2 processes, 2 micro-batches whose positions split 10/2 and 2/10 between the processes (12 and 12 in
    all): TRL's entries (1.0 and 2.0 nats) weighed by the global counts give 1.5, the pooled entropy, so the gap is
    0 on both ranks. Weighed by each rank's own counts (before) the ranks published +0.333 and -0.333 and a
    mismatch (seen under GRPO with gradient accumulation)."""
    ranks = two_processes["trl"]
    assert ranks[0] == ranks[1]
    assert abs(ranks[0]["hw/check/entropy_gap"]) < 1e-12 and ranks[0]["hw/check/mismatch"] == 0.0
    assert ranks[0]["hw/check/nll_gap"] == pytest.approx(0.0, abs=1e-12)


def test_the_tally_counts_narrow_integer_labels_against_ignore_index_as_integers():
    """uint8 labels: -100 would wrap to 156 in their own dtype, and a label 156 would be counted as ignored."""
    tally = CaptureTally()
    tally.add(torch.tensor([[156, 1, 2]], dtype=torch.uint8), -100)
    tally.add(torch.tensor([[5, -100]], dtype=torch.int16), -100)
    assert tally.take()[1].item() == 4
