"""Evaluations, runs and failures (docs/evaluation.md): every evaluation is measured under the trainer's own name for it, every run
starts fresh, no monitoring limitation aborts training.

Evaluation figures are compared with float64 statistics of the model's own ``outputs.logits`` and labels
over the real rows. ``python -m torch.distributed.run --nproc_per_node 2 tests/core/test_runs_and_evals.py OUT``
runs the distributed evaluation (gloo, CPU) that :func:`test_hf_two_process_evaluation_counts_real_rows_once` and
:func:`test_sft_two_process_evaluation_counts_real_rows_once` compare with one process (the Trainer, then TRL's
``SFTTrainer``, in one launch).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from headwatch.integrations.transformers import HeadwatchCallback

V, T = 64, 8
VAL = "headwatch/val/logits"


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``T`` tokens; row ``i`` masks its first ``i % 3`` labels (rows of different lengths)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, : i % 3 + 1] = -100

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "attention_mask": torch.ones(T, dtype=torch.long)}


def reference(model: nn.Module, rows: Rows) -> dict[str, float]:
    """float64 entropy, target NLL and position count over the predicting positions of every row, from the
    model's own logits (logits at t predict labels[t + 1])."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows.ids, attention_mask=torch.ones_like(rows.ids)).logits.double()[:, :-1]
    targets = rows.labels[:, 1:]
    valid = targets != -100
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"entropy": entropy[valid].mean().item(), "target_nll": nll[valid].mean().item(), "positions": float(valid.sum())}


def args(out: Path | str, cls: type = TrainingArguments, **kw) -> TrainingArguments:
    opts = dict(
        output_dir=str(out), max_steps=2, logging_steps=1, per_device_train_batch_size=4, per_device_eval_batch_size=2,
        learning_rate=0.0, max_grad_norm=0.0, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    opts.update(kw)
    return cls(**opts)


def assert_matches(values: dict[str, float], ref: dict[str, float], suffix: str = "", key: str = VAL) -> None:
    assert values[f"{key}/positions{suffix}"] == ref["positions"]
    for k in ("entropy", "target_nll"):
        assert math.isclose(values[f"{key}/{k}{suffix}"], ref[k], rel_tol=2e-6, abs_tol=1e-6), (k, suffix)


# ------------------------------------------------------------------------------------------------ point 3, HF
def test_hf_eval_dataset_dict_evaluation_only_each_under_its_name(tmp_path):
    """An evaluation-only script (no train) with a dict of two eval sets: each published as
    ``.../val/logits/<k>/eval_<name>`` and returned as ``eval_<name>_headwatch/val/logits/<k>``."""
    model, sets = tiny_llama(), {"wiki": Rows(5, seed=1), "code": Rows(6, seed=2)}
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = Trainer(model=model, args=args(tmp_path), eval_dataset=sets, callbacks=[cb])
    metrics = trainer.evaluate()
    for name, rows in sets.items():
        ref = reference(model, rows)
        assert_matches(cb.latest, ref, f"/eval_{name}")
        assert_matches(metrics, ref, key=f"eval_{name}_{VAL}")
    logged = [r for r in trainer.state.log_history if any(k.startswith(VAL) for k in r)]
    mine = (f"{VAL}/entropy/eval_wiki", f"{VAL}/entropy/eval_code")  # not the buckets' `<bucket>/entropy/...`
    assert [sorted(k for k in r if k in mine) for r in logged] == [
        [f"{VAL}/entropy/eval_wiki"], [f"{VAL}/entropy/eval_code"]
    ]
    assert not any(f"{VAL}/entropy" in r for r in logged), "no evaluation under the default name: none overwrites another"
    assert reference(model, sets["wiki"])["entropy"] != reference(model, sets["code"])["entropy"]


def test_hf_evaluate_before_during_and_after_train(tmp_path):
    """``evaluate()`` before ``train()`` (hooks attached when the Trainer is built), the evaluations
    during training and after it: each published at its step, each equal to the float64 reference."""
    model, rows = tiny_llama(), Rows(5, seed=3)
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = Trainer(model=model, args=args(tmp_path, eval_strategy="steps", eval_steps=1), train_dataset=Rows(8, seed=4),
                      eval_dataset=rows, callbacks=[cb])  # fmt: skip
    before = trainer.evaluate()
    ref = reference(model, rows)  # learning rate 0: the model never changes
    assert_matches(before, ref, key=f"eval_{VAL}")
    logged = [r for r in trainer.state.log_history if f"{VAL}/entropy" in r]  # train() starts a new log history
    trainer.train()
    after = trainer.evaluate()
    assert_matches(after, ref, key=f"eval_{VAL}")
    logged += [r for r in trainer.state.log_history if f"{VAL}/entropy" in r]
    assert [r["step"] for r in logged] == [0, 1, 2, 2]  # before, at steps 1 and 2, after
    for r in logged:
        assert_matches(r, ref)


def test_hf_layout_whatever_the_callbacks_order(tmp_path):
    """HeadwatchCallback placed before the TensorBoardCallback (whose writer does not exist yet at its
    ``on_train_begin``): the Custom Scalars layout is still written, with the charts of the first log."""
    from tests.helpers.events import layouts

    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path, report_to="tensorboard"),
                      train_dataset=Rows(8, seed=4))  # fmt: skip
    trainer.callback_handler.callbacks.insert(0, cb)
    cb.set_trainer(trainer)
    trainer.train()
    (event_dir,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    layout = layouts(event_dir)[-1]  # TensorBoard reads the last one
    assert [c.title for c in layout.category][0] == "headwatch: vital signs"
    assert "entropy, train: mean and p05-p95 band (nats)" in [c.title for c in layout.category[0].chart]


# ------------------------------------------------------------------------------------------------ distributed
KINDS = ("hf", "sft")  # the Hugging Face Trainer; TRL's SFTTrainer (its fused head, completion-only labels)


def sft_trainer(model: nn.Module, rows: Rows, out: str, world: int, cb: HeadwatchCallback) -> Trainer:
    """TRL's ``SFTTrainer`` evaluating ``rows`` as TRL takes them (token ids and a ``completion_mask``: TRL builds
    the same ``-100`` labels); float32 (TRL's default ``bf16=True`` would score bf16 logits)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": rows.ids.tolist(), "completion_mask": (rows.labels != -100).long().tolist()})
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))  # the rows come tokenized
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1")
    config = args(out, cls=SFTConfig, ddp_backend="gloo" if world > 1 else None, bf16=False, completion_only_loss=True)
    return SFTTrainer(model=model, args=config, train_dataset=data, eval_dataset=data, processing_class=tokenizer,
                      callbacks=[cb])  # fmt: skip


def main(out: str) -> None:
    """One evaluation of 5 rows, 2 per process and batch, by each trainer of :data:`KINDS` (TRL's when installed):
    under 2 processes the sampler repeats 3 rows. Writes ``<kind>-rank<r>.json``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for kind in KINDS:
        if kind == "sft" and importlib.util.find_spec("trl") is None:
            continue
        model, rows = tiny_llama(), Rows(5, seed=5)
        cb = HeadwatchCallback(figure_every_n_steps=0)
        if kind == "sft":
            trainer = sft_trainer(model, rows, out, world, cb)
        else:
            trainer = Trainer(model=model, args=args(out, ddp_backend="gloo" if world > 1 else None), eval_dataset=rows,
                              callbacks=[cb])  # fmt: skip
        metrics = trainer.evaluate()
        Path(out).mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in metrics.items() if VAL in k}
        result = {"metrics": keep, "ref": reference(model, rows)}
        (Path(out) / f"{kind}-rank{trainer.args.process_index}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_evaluations(tmp_path_factory) -> Path:
    """Started together: one torchrun of :func:`main` (2 CPU processes, gloo; both trainers in one launch) and
    Lightning's validation under DDP (:func:`lightning_main`, 2 processes); meanwhile each in this one process."""
    tmp_path = tmp_path_factory.mktemp("evaluations")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    commands = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", __file__,
                     str(tmp_path / "ddp")],
        "lightning": [sys.executable, __file__, "lightning", str(tmp_path / "lightning" / "ddp"), "2"],
    }  # fmt: skip
    procs = {}
    for name, cmd in commands.items():
        with (tmp_path / f"{name}.log").open("w") as sink:
            procs[name] = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        main(str(tmp_path / "single"))
        lightning_main(str(tmp_path / "lightning" / "single"), 1)
        for proc in procs.values():
            proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    for name, proc in procs.items():
        assert proc.returncode == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    return tmp_path


def assert_real_rows_once(out: Path, kind: str) -> None:
    single = json.loads((out / "single" / f"{kind}-rank0.json").read_text())
    ranks = [json.loads((out / "ddp" / f"{kind}-rank{r}.json").read_text()) for r in range(2)]
    ref = single["ref"]
    assert ref["positions"] == sum(8 - 1 - (i % 3) for i in range(5))  # the 5 real rows' predicting positions
    for got in [single] + ranks:
        assert_matches(got["metrics"], ref, key=f"eval_{VAL}")
    for got in ranks:  # 1 process = 2 processes, every mean published (none withheld as NaN)
        for key in ("kl_to_uniform", "kl_from_uniform", "max_prob", "renyi2_entropy", "target_argmax_rate", "ece"):
            one, two = single["metrics"][f"eval_{VAL}/{key}"], got["metrics"][f"eval_{VAL}/{key}"]
            assert math.isfinite(one) and math.isclose(two, one, rel_tol=1e-5, abs_tol=1e-6), (kind, key, one, two)


def test_hf_two_process_evaluation_counts_real_rows_once(two_process_evaluations):
    """torchrun, 2 CPU processes (gloo): the figures of one process over the 5 real rows, not over the 8 the
    sampler hands out (the Trainer's ``gather_for_metrics`` drops the same 3)."""
    assert_real_rows_once(two_process_evaluations, "hf")


def test_sft_two_process_evaluation_counts_real_rows_once(two_process_evaluations):
    """The same under TRL's ``SFTTrainer``: its fused head scores the hidden states, never builds the logits;
    the figures of each process are those of one process over the 5 real rows."""
    pytest.importorskip("trl")
    assert_real_rows_once(two_process_evaluations, "sft")


# ------------------------------------------------------------------------------------------------ point 4
def test_hf_second_train_starts_fresh_resume_continues(tmp_path):
    """A second ``train()`` of the same Trainer (as each hyperparameter-search trial) starts from empty token
    counts and alert smoothing; a resume from a checkpoint continues them."""
    from headwatch.alerts import CollapseRules

    cb = HeadwatchCallback(figure_every_n_steps=0, alert=CollapseRules())
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path, save_strategy="steps", save_steps=2), train_dataset=Rows(8, seed=4),
                      callbacks=[cb])  # fmt: skip
    trainer.train()
    first = dict(cb.latest)
    history = list(cb.alert.rules.history)
    assert first["headwatch/tokens/total"] == 2 * 4 * T and len(history) == 2
    trainer.train()
    assert cb.latest["headwatch/tokens/total"] == first["headwatch/tokens/total"]
    assert list(cb.alert.rules.history) == history  # not 4 values: the smoothing restarted
    trainer.args.max_steps = 4
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert cb.latest["headwatch/tokens/total"] == 4 * 4 * T  # the checkpoint's 2 steps and 2 more


def loop_run(hw, model: nn.Module, rows: Rows, steps: int = 2) -> dict[str, float]:
    values = {}
    batch = {"input_ids": rows.ids, "labels": rows.labels, "attention_mask": torch.ones_like(rows.ids)}
    for step in range(steps):
        hw.step_start(batch, step)
        model(**batch).loss.backward()
        hw.before_optimizer_step()
        hw.after_optimizer_step()
        values = hw.step_end()
    return values


def test_loop_reused_headwatch_starts_fresh():
    """A plain-loop ``Headwatch`` whose steps start at 0 again counts the new run only (said once);
    ``load_state_dict`` continues a run."""
    from headwatch.integrations.loop import Headwatch

    model, rows = tiny_llama(), Rows(4, seed=6)
    hw = Headwatch(model, log_every_n_steps=1, figure_every_n_steps=0)
    first = loop_run(hw, model, rows)
    assert first["headwatch/tokens/total"] == 2 * 4 * T
    state = hw.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = loop_run(hw, model, rows)
    assert again["headwatch/tokens/total"] == first["headwatch/tokens/total"]
    assert [str(w.message) for w in caught if "a new run starts" in str(w.message)], "said once"
    hw.load_state_dict(state)
    hw.step_index = 2
    hw.step_start({"input_ids": rows.ids, "labels": rows.labels}, 2)
    model(input_ids=rows.ids, labels=rows.labels).loss.backward()
    assert hw.step_end()["headwatch/tokens/total"] == 3 * 4 * T  # continued


# ------------------------------------------------------------------------------------------------ point 6
class NoHead(nn.Module):
    """An embedding and a scoring matrix used as ``h @ W.T`` (no module headwatch can call the head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(V, 8)
        self.score = nn.Parameter(torch.randn(V, 8) * 0.1)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.embed_tokens(input_ids) @ self.score.T
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def test_hf_model_without_head_trains_with_one_warning_strict_raises(tmp_path):
    """A model where no head is found: one warning naming the cause and what is still measured (token
    counts), training goes on; with ``strict=True`` ``train()`` raises."""
    cb = HeadwatchCallback(figure_every_n_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model=NoHead(), args=args(tmp_path), train_dataset=Rows(8, seed=4), callbacks=[cb])
        trainer.train()
    said = [str(w.message) for w in caught if "headwatch cannot measure" in str(w.message)]
    assert len(said) == 1, said
    assert "logits" in said[0] and "Still measured: tokens" in said[0] and "could not find the output head" in said[0]
    assert trainer.state.global_step == 2
    assert cb.latest["headwatch/tokens/total"] == 2 * 4 * T  # what can be measured still is
    assert not any(k.startswith("headwatch/logits/") for k in cb.latest)
    from headwatch import HeadwatchError

    strict = HeadwatchCallback(figure_every_n_steps=0, strict=True)
    trainer = Trainer(model=NoHead(), args=args(tmp_path), train_dataset=Rows(8, seed=4))
    strict.set_trainer(trainer)
    trainer.add_callback(strict)  # added after construction: the first attach is train()'s
    with pytest.raises(HeadwatchError, match="could not find the output head"):
        trainer.train()


def test_hf_unexpected_error_in_a_hook_warns_once_strict_raises(tmp_path, monkeypatch):
    """Any error inside a trainer hook (here reading the AMP scale) is a monitoring failure: one warning naming
    where, training and the other measurements go on; ``strict=True`` raises it."""
    import headwatch.integrations.transformers as door
    from headwatch import HeadwatchError

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(door, "gradient_scale", boom)
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows(8, seed=4), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "boom" in str(w.message)]
    assert said == ["headwatch failed while reading the gradients (RuntimeError: boom); training goes on, what this "
                    "skipped is not measured. Pass strict=True to raise instead. (warned once)"]  # fmt: skip
    assert trainer.state.global_step == 2 and "headwatch/logits/entropy" in cb.latest
    strict = HeadwatchCallback(figure_every_n_steps=0, strict=True)
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows(8, seed=4), callbacks=[strict])
    with pytest.raises(HeadwatchError, match="failed while reading the gradients: RuntimeError: boom"):
        trainer.train()


# ------------------------------------------------------------------------------------------------ Lightning
class LitLM(pl.LightningModule):
    """A Hugging Face causal LM (or :class:`NoHead`) under Lightning, validation on any number of dataloaders."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.model(**batch)["loss"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def lightning_trainer(tmp_path: Path, callbacks: list, **kw) -> pl.Trainer:
    opts = dict(default_root_dir=tmp_path, max_steps=2, log_every_n_steps=1, callbacks=callbacks, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, logger=False,
                num_sanity_val_steps=0)  # fmt: skip
    opts.update(kw)
    return pl.Trainer(**opts)


def loader(rows: Rows, batch_size: int = 2) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(rows, batch_size=batch_size)


def test_lightning_several_val_dataloaders_validate_before_and_during_fit(tmp_path):
    """``trainer.validate()`` before ``fit`` and the validation of ``fit``, on two dataloaders: each under
    Lightning's ``/dataloader_idx_<k>``, each equal to the float64 reference of its rows."""
    from headwatch import LogitStatsMonitor

    model, sets = tiny_llama(), [Rows(5, seed=7), Rows(3, seed=8)]
    refs = [reference(model, rows) for rows in sets]
    trainer = lightning_trainer(tmp_path, [LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0)], val_check_interval=2)
    lit = LitLM(model)
    trainer.validate(lit, dataloaders=[loader(rows) for rows in sets], verbose=False)
    before = {k: float(v) for k, v in trainer.callback_metrics.items()}
    trainer.fit(lit, loader(Rows(8, seed=4), 4), val_dataloaders=[loader(rows) for rows in sets])
    during = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for values in (before, during):
        for k, ref in enumerate(refs):
            assert_matches(values, ref, f"/dataloader_idx_{k}")


def test_lightning_second_fit_starts_fresh(tmp_path):
    """The same callbacks in a second ``fit`` (a new Trainer, as a search trial): token counts and the
    alert's smoothing start empty."""
    from headwatch import LogitStatsMonitor, SharpnessCollapseAlert, TokenFrequency

    tokens, alert = TokenFrequency(), SharpnessCollapseAlert(log_every_n_steps=1)
    callbacks = [tokens, LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0), alert]
    totals, histories = [], []
    for run in range(2):
        trainer = lightning_trainer(tmp_path / str(run), callbacks)
        trainer.fit(LitLM(tiny_llama()), loader(Rows(8, seed=4), 4))
        totals.append(float(trainer.callback_metrics["headwatch/tokens/total"]))
        histories.append(list(alert.engine.rules.history))
    assert totals == [2 * 4 * T] * 2
    assert len(histories[0]) == 2 and histories[1] == histories[0]


def test_lightning_model_without_head_fits_with_one_warning_strict_raises(tmp_path):
    from headwatch import GradientDensityMonitor, HeadwatchError, LogitStatsMonitor, TokenFrequency

    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0), GradientDensityMonitor(log_every_n_steps=1)]
    trainer = lightning_trainer(tmp_path, callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LitLM(NoHead()), loader(Rows(8, seed=4), 4))
    said = [str(w.message) for w in caught if "headwatch cannot measure" in str(w.message)]
    assert len(said) == 1, said
    assert "logits, grad: HeadwatchError: could not find the output head" in said[0] and "Still measured: tokens." in said[0]
    assert trainer.global_step == 2 and float(trainer.callback_metrics["headwatch/tokens/total"]) == 2 * 4 * T
    assert not any(k.startswith(("headwatch/logits/", "headwatch/grad/")) for k in trainer.callback_metrics)
    strict = lightning_trainer(tmp_path, [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, strict=True)])
    with pytest.raises(HeadwatchError, match="could not find the output head"):
        strict.fit(LitLM(NoHead()), loader(Rows(8, seed=4), 4))


# ------------------------------------------------------------------------------------------------ the row rules
@pytest.mark.parametrize("world", [2, 3])
def test_row_rules_keep_every_real_row_exactly_once(world):
    """Against the samplers themselves: the rows kept on every process by ``eval_rows_kept`` (accelerate's
    ``BatchSamplerShard`` with ``even_batches``, the HF Trainer's) and by ``sampler_rows_kept`` (torch's
    ``DistributedSampler``, Lightning's) are each data-set row exactly once, for every size and batch size."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

    from headwatch.integrations.hf_support import eval_rows_kept
    from headwatch.integrations.lightning.door import sampler_rows_kept

    for n in range(1, 14):
        for bs in (1, 2, 3):
            kept = []
            for rank in range(world):
                batches = list(BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), bs, False), world, rank, even_batches=True))
                for i, b in enumerate(batches):
                    keep = eval_rows_kept(len(b), rank, n % (bs * world)) if i == len(batches) - 1 else len(b)
                    kept += b[:keep]
            assert sorted(kept) == list(range(n)), ("accelerate", n, bs)
            kept = []
            for rank in range(world):
                local = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))
                for start in range(0, len(local), bs):
                    b = local[start : start + bs]
                    kept += b[: sampler_rows_kept(start, len(b), rank, world, n)]
            assert sorted(kept) == list(range(n)), ("torch", n, bs)


def lightning_main(out: str, devices: int) -> None:
    """Lightning validation of 5 rows, 2 per process and batch; under DDP its ``DistributedSampler`` pads
    rank 1 with a repeat of row 0 (rank 0: rows 0, 2, 4; rank 1: rows 1, 3 and 0 again)."""
    from headwatch import LogitStatsMonitor

    model, rows = tiny_llama(), Rows(5, seed=5)
    trainer = lightning_trainer(Path(out), [LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0)], devices=devices,
                                strategy="ddp" if devices > 1 else "auto")  # fmt: skip
    trainer.validate(LitLM(model), dataloaders=loader(rows), verbose=False)
    values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(VAL)}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{trainer.global_rank}.json").write_text(json.dumps({"values": values, "ref": reference(model, rows)}))


def test_lightning_two_process_validation_counts_real_rows_once(two_process_evaluations):
    """Lightning under DDP (2 CPU processes, gloo): the validation figures of one process over the 5 real
    rows, the row its sampler repeats left out."""
    tmp_path = two_process_evaluations / "lightning"
    results = [json.loads((tmp_path / run / "rank0.json").read_text()) for run in ("single", "ddp")]
    results.append(json.loads((tmp_path / "ddp" / "rank1.json").read_text()))
    ref = results[0]["ref"]
    for got in results:
        assert_matches(got["values"], ref)


if __name__ == "__main__":
    if sys.argv[1] == "lightning":
        lightning_main(sys.argv[2], int(sys.argv[3]))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    else:
        main(sys.argv[1])
