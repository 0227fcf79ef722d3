"""The Hugging Face Trainer front door: one batch against float64 references and the other front
doors, the logging-steps grid in TensorBoard event files, TRL's SFTTrainer, bad arguments."""

from __future__ import annotations

import copy
import math
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import LlamaForCausalLM, Trainer

from headwatch import GradientDensityMonitor, HeadwatchError, LogitStatsMonitor, SynonymCollisionMonitor, TokenFrequency
from headwatch.core import Schedule
from headwatch.integrations.transformers import HeadwatchCallback, attach
from headwatch.integrations.loop import Headwatch
from tests.helpers.hf import B, RARE, T, TWIN_OF, V, Rows, hf_args, one_batch, tiny_llama, word_tokenizer
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.references import reference

TAU = 0.9


def hf_values(model, tmp_path: Path) -> tuple[dict[str, float], HeadwatchCallback]:
    cb = HeadwatchCallback()
    Trainer(model=model, args=hf_args(tmp_path), train_dataset=Rows(one_batch()), callbacks=[cb]).train()
    return dict(cb.latest), cb


def loop_values(model) -> dict[str, float]:
    hw = Headwatch(model, log_every_n_steps=1)
    for m in hw.monitors:
        m.configure(Schedule(1))  # collision too, on this one step
    batch = one_batch()
    hw.step_start(batch, 0)
    model(**batch).loss.backward()
    hw.before_optimizer_step()
    hw.after_optimizer_step()
    return hw.step_end()


class LitLlama(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def lightning_values(model, tmp_path: Path) -> dict[str, float]:
    logger = StepLogger()
    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0),
                 GradientDensityMonitor(log_every_n_steps=1), SynonymCollisionMonitor(every_n_steps=1)]  # fmt: skip
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=1, log_every_n_steps=1, logger=logger, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Rows(one_batch()), batch_size=B)
    trainer.fit(LitLlama(model), data)
    return {k: v[0] for k, v in logger.values.items() if k.startswith("headwatch/")}


def untied_float64_twin(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same function with separate embedding and head matrices, in float64."""
    twin = tiny_llama(tie=False)
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, strict=False)
    with torch.no_grad():
        twin.lm_head.weight.copy_(model.lm_head.weight)
    return twin.double()


def assert_same(got: dict[str, float], want: dict[str, float], what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        if "/overhead/" not in k:  # headwatch's own timings: the same keys, measured values of each run
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=f"{what}: {k}")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_one_batch_equals_float64_and_the_other_front_doors(tmp_path, tie):
    model = tiny_llama(tie)
    batch = one_batch()
    twin = untied_float64_twin(model)
    out = twin(**{k: v for k, v in batch.items()})
    out.loss.backward()
    got, cb = hf_values(copy.deepcopy(model), tmp_path / "hf")
    h = "headwatch"

    # logit statistics: SciPy float64, position by position, on the model's own logits
    targets = torch.cat([batch["labels"][:, 1:], torch.full((B, 1), -100)], dim=1)
    ref = reference(out.logits.detach(), None, targets)
    valid = ref["valid"]
    assert got[f"{h}/logits/positions"] == valid.sum() == B * (T - 1)
    for key, col in (("entropy", "entropy"), ("kl_to_uniform", "kl_to_uniform"), ("kl_from_uniform", "kl_from_uniform"),
                     ("max_prob", "max_prob"), ("target_nll", "nll")):  # fmt: skip
        assert got[f"{h}/logits/{key}"] == pytest.approx(ref[col][valid].mean(), abs=1e-6), key
    assert got[f"{h}/logits/target_nll"] == pytest.approx(out.loss.item(), abs=1e-6)  # the model's own loss

    # row densities: the lookup flow touches exactly the distinct input ids that reach the loss (the
    # last position's id only feeds the last logits, whose target is ignored)
    distinct = batch["input_ids"][:, :-1].unique().numel()
    assert distinct < batch["input_ids"].unique().numel()
    assert got[f"{h}/grad/embedding_row_density"] == distinct / V
    assert (twin.model.embed_tokens.weight.grad.norm(dim=1) > 0).sum() == distinct
    assert got[f"{h}/grad/tied"] == float(tie)

    # the flows (tied: the split of the shared gradient) against autograd on the float64 untied twin
    flows = {"embedding": twin.model.embed_tokens.weight.grad, "head": twin.lm_head.weight.grad}
    norms = {k: g.norm(dim=1) for k, g in flows.items()}
    for flow in flows:
        assert got[f"{h}/grad/{flow}_row_norm_mean"] == pytest.approx(norms[flow].mean().item(), abs=1e-6), flow
        assert got[f"{h}/grad/{flow}_row_norm_max"] == pytest.approx(norms[flow].max().item(), abs=1e-6), flow
    if tie:
        both = (norms["embedding"] > 0) & (norms["head"] > 0)
        cosine = torch.nn.functional.cosine_similarity(flows["embedding"], flows["head"], dim=1)[both]
        assert got[f"{h}/grad/tied_flow_rows"] == both.sum().item() == distinct
        assert got[f"{h}/grad/tied_flow_cosine_mean"] == pytest.approx(cosine.mean().item(), abs=1e-6)
        assert got[f"{h}/grad/tied_flow_conflict_fraction"] == pytest.approx((cosine < 0).double().mean().item(), abs=1e-6)

    # collision: float64 brute-force nearest neighbours of the rare rows (lr 0: the weights did not move)
    snap = cb.monitors[0].snapshot()
    rare, pairable = snap.rare, snap.valid & (snap.counts > 0)  # never-seen rows are nobody's neighbour
    assert rare[RARE]
    for name, weight in {"head": model.lm_head.weight, **({} if tie else {"embedding": model.model.embed_tokens.weight})}.items():
        w = torch.nn.functional.normalize(weight.detach().double(), dim=1)
        cos = w[rare] @ w.T
        cos[torch.arange(cos.shape[0]), rare.nonzero().flatten()] = -math.inf  # not its own neighbour
        cos[:, ~pairable] = -math.inf
        rate = (cos.max(dim=1).values >= TAU).double().mean().item()
        # raw cosine: the drift statistic (the headline removes the mean and the top direction first)
        assert got[f"{h}/collision/drift/raw_rate_{name}"] == pytest.approx(rate, abs=1e-6), name
    assert got[f"{h}/collision/drift/raw_rate_head"] > 0  # the planted pair is found

    # the other front doors on the same batch give the same values
    assert_same(loop_values(copy.deepcopy(model)), got, "plain loop")
    assert_same(lightning_values(copy.deepcopy(model), tmp_path / "pl"), got, "Lightning")


def _again(tag: str) -> bool:
    """A cost key the end of training publishes again at the last logging step (every one but the window's)."""
    return "/overhead/" in tag and not tag.endswith("/overhead/fraction")


def test_trainer_run_writes_the_tags_on_the_logging_steps_grid(tmp_path):
    args = hf_args(tmp_path, max_steps=6, logging_steps=2, logging_first_step=False, learning_rate=1e-2,
                   report_to="tensorboard", per_device_train_batch_size=2)  # fmt: skip
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), repeat=3))
    cb = attach(trainer)
    trainer.train()
    (logdir,) = {p.parent for p in Path(tmp_path).rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = acc.Tags()["scalars"]

    def steps(tag):
        return [e.step for e in acc.Scalars(tag)]

    for name in ("logits/entropy", "grad/embedding_row_density", "grad/tied_flow_cosine_mean", "tokens/total"):
        assert steps(f"train/headwatch/{name}") == [2, 4, 6], name
    assert steps("train/loss") == [2, 4, 6]  # the Trainer's own logging is untouched
    # the probes: the first logging step and the end of training (the epoch end too: 12 rows, batch 2)
    assert steps("train/headwatch/collision/rare_rate_head") == [2, 6]
    headwatch_tags = [t for t in tags if t.startswith("train/headwatch/")]
    assert len(headwatch_tags) > 100
    # the run's cost again with the end-of-training probe's (not `overhead/fraction`: the end closes no window of steps)
    odd = {t: steps(t) for t in headwatch_tags
           if steps(t) not in ([2, 4, 6], [2, 6], [2, 4, 6, 6] if _again(t) else [])}  # fmt: skip
    assert not odd, odd
    np.testing.assert_allclose([e.value for e in acc.Scalars("train/headwatch/logits/entropy")],
                               [r["headwatch/logits/entropy"] for r in trainer.state.log_history if "headwatch/logits/entropy" in r],
                               rtol=1e-6)  # fmt: skip
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    assert "train/headwatch/logits/entropy_histogram" in acc.Tags()["histograms"]
    assert cb.trainer is trainer
    # each Trainer.log call's scalars are one event (headwatch.tensorboard.batched_scalars), every value that of
    # the log history (float32, as TensorBoard stores scalars)
    from tensorboard.backend.event_processing import event_file_loader

    events = [e for path in sorted(logdir.glob("events.out.tfevents.*"))
              for e in event_file_loader.LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]  # fmt: skip
    scalar_events = [e for e in events if e.summary.value[0].HasField("simple_value")]
    per_step = {s: sum(e.step == s for e in scalar_events) for s in (2, 4, 6)}
    records = {s: [r for r in trainer.state.log_history if r.get("step") == s] for s in (2, 4, 6)}
    # one event per Trainer.log call; the end-of-training probe's call (at on_train_end, after the TensorBoardCallback
    # closed its writer, which its on_log opens again) writes one event per scalar
    end = [k for k, v in records[6][-1].items() if isinstance(v, float) and k != "step"]
    assert "headwatch/collision/rare_rate_head" in end
    assert per_step == {2: len(records[2]), 4: len(records[4]), 6: len(records[6]) - 1 + len(end)}
    for s, recs in records.items():
        for record in recs:
            for key, value in record.items():
                if key.startswith("headwatch/") and isinstance(value, float):
                    got = [e.value for e in acc.Scalars("train/" + key) if e.step == s]  # the run's cost: twice at 6
                    assert len(got) == (2 if s == 6 and _again(key) else 1), key
                    assert any(g == pytest.approx(np.float32(value), nan_ok=True, rel=1e-7) for g in got), key


def test_first_step_and_evaluation(tmp_path):
    args = hf_args(tmp_path, max_steps=3, logging_steps=2, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=B)
    cb = HeadwatchCallback(monitors=["logits"])
    trainer = Trainer(model=tiny_llama(tie=False), args=args, train_dataset=Rows(one_batch(), 3),
                      eval_dataset=Rows(one_batch()), callbacks=[cb])  # fmt: skip
    trainer.train()
    logged = [r["step"] for r in trainer.state.log_history if "headwatch/logits/entropy" in r]
    assert logged == [1, 2]  # logging_first_step, then the grid
    assert cb.trainer is trainer  # found without attach()
    metrics = trainer.evaluate()
    assert metrics["eval_headwatch/val/logits/positions"] == B * (T - 1)
    assert metrics["eval_headwatch/val/logits/target_nll"] == pytest.approx(metrics["eval_loss"], abs=1e-5)


class TwoForwards(Trainer):
    """A loss from one forward and metrics from a second (as TRL does with ``compute_loss_func``)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model(**inputs).loss
        with torch.no_grad():
            model(**inputs)
        return loss


def test_second_forward_of_a_batch_is_not_counted_twice(tmp_path):
    cb = HeadwatchCallback(monitors=["tokens", "logits"])
    args = hf_args(tmp_path, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    TwoForwards(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), 2), callbacks=[cb]).train()
    assert cb.latest["headwatch/tokens/total"] == 2 * B * T  # 2 steps of 2 micro-batches of 2 rows
    assert cb.latest["headwatch/logits/positions"] == B * (T - 1)  # both micro-batches, once each


def test_sft_trainer(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    batch = one_batch()
    data = Dataset.from_dict({"input_ids": batch["input_ids"].tolist()})
    cb = HeadwatchCallback(monitors=["logits", "gradients"])
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=B, report_to="none",
                       use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=T, padding_free=False)  # fmt: skip
    tokenizer = word_tokenizer()
    model = tiny_llama(tie=True)
    head_calls = []  # no (B, T, V) logits: neither TRL nor headwatch calls the head
    model.lm_head.register_forward_hook(lambda mod, a, out: head_calls.append(tuple(out.shape)))
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in record if "never ran" in str(w.message)]  # measured at the loss, not the hidden-state path
    assert head_calls == []
    logged = [r for r in trainer.state.log_history if "headwatch/logits/entropy" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert logged[0]["headwatch/grad/embedding_row_density"] == batch["input_ids"][:, :-1].unique().numel() / V
    trl = {r["step"]: r for r in trainer.state.log_history if "entropy" in r}  # TRL's own metrics, its own records
    assert sorted(trl) == [1, 2] and not any("entropy" in r for r in logged)
    for r in logged:  # TRL's fused head never calls lm_head: its own per-token values are measured
        assert r["headwatch/logits/positions"] == B * (T - 1)
        assert r["headwatch/logits/entropy"] == pytest.approx(trl[r["step"]]["entropy"], rel=1e-6)  # its own values
        assert r["headwatch/logits/target_argmax_rate"] == pytest.approx(trl[r["step"]]["mean_token_accuracy"], abs=1e-6)


def test_collapse_alert_actions(tmp_path):
    """An entropy floor above log V fires at the first logging step: marker, JSON Lines, stop and checkpoint."""
    import json

    from headwatch.alerts import CollapseRules

    cb = HeadwatchCallback(monitors=["logits"], alert=CollapseRules(entropy_floor=5.0), stop_on_critical=True,
                           checkpoint_on_critical=True)  # fmt: skip
    args = hf_args(tmp_path, max_steps=6, logging_steps=2, logging_first_step=False, report_to="tensorboard", save_strategy="steps",
                   save_steps=100, per_device_train_batch_size=2)  # fmt: skip
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), 3), callbacks=[cb])
    trainer.train()
    assert trainer.state.global_step == 2  # stopped at the first logging step (of 6 steps)
    assert (tmp_path / "checkpoint-2").is_dir()
    (record,) = [json.loads(line) for line in (tmp_path / "headwatch_alerts.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and record["rule"] == "entropy_floor"
    (logdir,) = {p.parent for p in Path(tmp_path).rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir)).Reload()
    assert [e.step for e in acc.Scalars("train/headwatch/alerts/entropy_floor")] == [2]


def test_bad_arguments(tmp_path):
    with pytest.raises(HeadwatchError, match=r"`monitors` must be a sequence of core monitors or names among .*got \['logit'\]"):
        HeadwatchCallback(monitors=["logit"])
    with pytest.raises(HeadwatchError, match="`alert` must be a headwatch.alerts.CollapseRules or have observe_train and observe_val methods \\(an AlertEngine\\), got <object object"):
        HeadwatchCallback(alert=object())
    with pytest.raises(HeadwatchError, match="`stop_on_critical` must be a bool, got 1"):
        HeadwatchCallback(stop_on_critical=1)
    with pytest.raises(HeadwatchError, match="`trainer` must be a transformers.Trainer, got str"):
        attach("trainer")
    with pytest.warns(UserWarning, match="no `model`.*training goes on"):  # never out of a trainer hook ...
        HeadwatchCallback().on_train_begin(hf_args(tmp_path), None, None)
    with pytest.raises(HeadwatchError, match="no `model`"):  # ... unless strict
        HeadwatchCallback(strict=True).on_train_begin(hf_args(tmp_path), None, None)



def test_sft_trainer_warns_synonym_confusion_uncounted(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from headwatch.core import SynonymCollision, TokenCounts

    counts = TokenCounts()
    cb = HeadwatchCallback(monitors=[counts, SynonymCollision(frequency=counts, synonym_groups=[[RARE, TWIN_OF]])])
    data = Dataset.from_dict({"input_ids": one_batch()["input_ids"].tolist()})
    config = SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, per_device_train_batch_size=B, report_to="none",
                       use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=T, padding_free=False)  # fmt: skip
    trainer = SFTTrainer(model=tiny_llama(tie=True), args=config, train_dataset=data, processing_class=word_tokenizer(), callbacks=[cb])
    with pytest.warns(UserWarning, match=r"fused LM head never calls the head, so collision/synonym_confusion_rate is not counted"):
        trainer.train()


def test_trainer_run_draws_figures_every_10_logging_steps_and_names_the_layout_headwatch(tmp_path):
    pytest.importorskip("matplotlib")
    from tensorboard.plugins.custom_scalar import layout_pb2

    args = hf_args(tmp_path, max_steps=10, logging_steps=1, logging_first_step=False, report_to="tensorboard",
                   per_device_train_batch_size=2)  # fmt: skip
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(one_batch(), repeat=5))
    # default figure_every_n_steps="auto": 10 x logging_steps without a budget (with one: the probe steps)
    cb = attach(trainer, monitors=["logits", "gradients"], overhead_budget=None)
    trainer.train()
    assert [m.figure_every for m in cb.monitors if hasattr(m, "figure_every")] == [10, 10]
    (logdir,) = {p.parent for p in Path(tmp_path).rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "tensors": 0}).Reload()
    for tag in ("train/headwatch/logits/entropy_over_run", "train/headwatch/grad/row_norm_vs_frequency"):
        assert [e.step for e in acc.Images(tag)] == [10], tag  # the Trainer's 10th logging step, once
    # the Custom Scalars pages are named "headwatch: ..."; their charts read the Trainer's train/headwatch/ tags
    proto = acc.Tensors("custom_scalars__config__")[-1].tensor_proto  # TensorBoard reads the last one
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    assert [c.title for c in layout.category][:2] == ["headwatch: vital signs", "headwatch: entropy and sharpness"]
    tags = [t for cat in layout.category for chart in cat.chart for t in chart.multiline.tag]
    external = ("^(train_loss|train/loss)$", "^(val_loss|eval/loss)$")  # the loss as Lightning and the Trainer log it
    assert tags and all(t.startswith("train/headwatch/") or t in external for t in tags), tags[:5]
    # the "trainer's loss" chart finds the Trainer's own loss tag
    written = acc.Tags()["scalars"]
    assert "train/loss" in written and [t for t in written if re.search(external[0], t)] == ["train/loss"]
    with pytest.raises(HeadwatchError, match="`figure_every_n_steps` must be 'auto', None, or an int >= 0, got 'x'"):
        HeadwatchCallback(figure_every_n_steps="x")
