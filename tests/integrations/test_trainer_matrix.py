"""The trainer matrix (docs/supported.md): one parametrised test per front door runs each trainer feature on
tiny models of three families, and compares every published figure with an independent reference.

Families (``V = 128``, ``d_model = 32``, one layer; :func:`tests.helpers.matrices.tiny`):

- ``llama_tied``: Llama, tied embedding and head;
- ``gemma_scaled``: Gemma (``GemmaConfig``), tied, the embedding scales its rows by ``sqrt(d_model)``
  (``GemmaTextScaledWordEmbedding``);
- ``gemma2_softcap``: Gemma 2, untied, scaled embedding, ``final_logit_softcapping=2`` (low enough that
  ``tanh`` bends the tiny model's logits: the distribution measured must be the capped one).

References, each independent of headwatch:

- logits: float64 SciPy statistics (:func:`tests.helpers.references.reference`) of the model's own
  ``outputs.logits`` of every forward that fed the loss (recorded by a forward hook: the noisy forward under
  NEFTune, the ``k`` kept positions under ``logits_to_keep``), scored against the step's real labels (the
  collated batch, shifted as the causal loss does); evaluations: float64 statistics of a fresh forward of the
  evaluation rows (:func:`tests.helpers.capture.reference`);
- gradients: float64 row norms and densities of the real ``.grad`` (untied family), or of the two ``.grad``
  of an untied twin (:func:`tests.helpers.matrices.untied_twin`) trained by the same door on the same
  batches (tied families: the lookup and scoring flows), and the real tied ``.grad`` for ``shared``;
- the trainer's own figures: the HF Trainer's logged ``loss`` (where it is the token-mean cross-entropy),
  Lightning's ``self.log("train_loss")`` through ``compare_loss=``, the plain loop's ``step_end(loss=)``.

A feature headwatch refuses is asserted to give its documented warning and nothing else; every other case
gives no headwatch warning at all. docs/supported.md holds the table these tests back.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.capture import causal_ce
from tests.helpers.capture import reference as eval_reference
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.matrices import D, V, tiny, untied_twin
from tests.helpers.matrices import twin_grads as twin_grads_of
from tests.helpers.references import reference as float64_stats

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama_tied", "gemma_scaled", "gemma2_softcap"]
B, T, STEPS = 2, 8, 2
SOFTCAP = 2.0
H = "headwatch"
ATOL = 2e-5  # float32 model against float64 statistics of its own logits (measured: below 1e-6)


def family(name: str) -> torch.nn.Module:
    """A tiny model of the family ``name`` (seeded: the same weights every call)."""
    if name == "llama_tied":
        return tiny("llama", tied=True)
    if name == "gemma2_softcap":
        model = tiny("gemma2", tied=False)
        model.config.final_logit_softcapping = SOFTCAP
        return model
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    return transformers.GemmaForCausalLM(config)


def is_tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.get_input_embeddings().weight


def test_the_families_are_what_the_matrix_claims():
    """The matrix's premise: one tied family, embeddings scaled by ``sqrt(d_model)`` in their own forward, and
    softcapping that bends the logits (capped below ``SOFTCAP``, not a scaled copy of the uncapped ones)."""
    ids = torch.arange(1, 6)[None]
    for name, tied, scale in (("llama_tied", True, 1.0), ("gemma_scaled", True, D**0.5), ("gemma2_softcap", False, D**0.5)):
        model = family(name)
        emb = model.get_input_embeddings()
        assert is_tied(model) == tied, name
        torch.testing.assert_close(emb(ids), scale * emb.weight[ids].detach(), rtol=1e-3, atol=0)
    model = family("gemma2_softcap")
    capped = model(input_ids=ids).logits
    model.config.final_logit_softcapping = None
    raw = model(input_ids=ids).logits
    torch.testing.assert_close(capped, SOFTCAP * torch.tanh(raw / SOFTCAP))
    assert (raw - capped).abs().max() > 1e-3  # tanh bends this model's logits


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``T`` tokens; row ``i`` masks its first ``i % 3 + 1`` labels (rows of different label counts)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, : i % 3 + 1] = -100

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "labels": self.labels[i],
            "attention_mask": torch.ones(T, dtype=torch.long),
        }

    def batch(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids,
            "labels": self.labels,
            "attention_mask": torch.ones_like(self.ids),
        }


class LogitsRecorder:
    """The model's own ``outputs.logits`` of every training forward with gradient (the forwards a loss uses)."""

    def __init__(self, model: torch.nn.Module):
        self.logits: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.logits.append(output.logits.detach().clone())

    def remove(self) -> None:
        self.handle.remove()


def logits_reference(logits: list[torch.Tensor], batches: list[dict]) -> dict[str, float]:
    """float64 statistics pooled over the forwards of one step: logits ``(B, L, V)`` of the last ``L`` positions
    scored against ``labels[t + 1]`` (the causal loss's positions: ``-100`` and each row's last position out)."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("entropy", "kl_to_uniform", "max_prob", "nll", "argmax")}
    for x, batch in zip(logits, batches, strict=True):
        labels = batch["labels"]
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)[:, -x.shape[1] :]
        ref = float64_stats(x, None, targets)
        valid = ref["valid"]
        for k in ("entropy", "kl_to_uniform", "max_prob", "nll"):
            cols[k].append(ref[k][valid])
        cols["argmax"].append(ref["target_is_argmax"][valid])
    out = {k: float(np.concatenate(v).astype(float).mean()) for k, v in cols.items()}
    out["positions"] = sum(len(v) for v in cols["nll"])
    return out


def assert_logits(
    values: dict[str, float],
    want: dict[str, float],
    group: str = f"{H}/logits",
    suffix: str = "",
) -> None:
    assert values[f"{group}/positions{suffix}"] == want["positions"]
    pairs = {"entropy": "entropy", "kl_to_uniform": "kl_to_uniform", "max_prob": "max_prob", "target_nll": "nll",
             "target_argmax_rate": "argmax"}  # fmt: skip
    for key, col in pairs.items():
        assert values[f"{group}/{key}{suffix}"] == pytest.approx(want[col], abs=ATOL), key
    assert math.isfinite(values[f"{group}/ece{suffix}"])


def grad_reference(flows: dict[str, torch.Tensor], padding_idx: int | None) -> dict[str, float]:
    """float64 row statistics of each ``(V, d_model)`` gradient over the rows that can train (all but the
    embedding's ``padding_idx``, which never gets a gradient): density (rows with a non-zero gradient / rows),
    mean and max row norm."""
    out = {}
    rows = torch.ones(V, dtype=torch.bool)
    if padding_idx is not None:
        rows[padding_idx] = False
    for name, grad in flows.items():
        norms = grad.double().norm(dim=1)[rows]
        out.update({f"{name}_row_density": float((norms > 0).double().mean()), f"{name}_row_norm_mean": float(norms.mean()),
                    f"{name}_row_norm_max": float(norms.max())})  # fmt: skip
    return out


def assert_grads(
    values: dict[str, float],
    real: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor] | None,
    pad: int | None,
) -> None:
    """``real``: the model's ``.grad`` at the optimizer step; ``twin``: the untied twin's (tied models);
    ``pad``: the embedding's ``padding_idx``."""
    if twin is None:  # untied: the two matrices' own gradients
        want = grad_reference({"embedding": real["embedding"], "head": real["head"]}, pad)
        assert values[f"{H}/grad/tied"] == 0.0
    else:
        want = grad_reference(
            {
                "embedding": twin["embedding"],
                "head": twin["head"],
                "shared": real["embedding"],
            },
            pad,
        )
        assert values[f"{H}/grad/tied"] == 1.0
        torch.testing.assert_close(twin["embedding"] + twin["head"], real["embedding"], rtol=1e-4, atol=1e-6)  # the twin is the model
    for key, value in want.items():
        assert values[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert values[f"{H}/check/vanished_gradient"] == 0.0


NO_REFERENCE = "no trainer loss to compare target_nll with"  # check/nll_gap left out where no loss is read: said once


def headwatch_warnings(caught) -> list[str]:
    said = [str(w.message) for w in caught if "/headwatch/" in w.filename.replace("\\", "/")]
    return [m for m in said if NO_REFERENCE not in m]


# ====================================================================================== HF Trainer
def hf_args(out, **kw) -> TrainingArguments:
    opts = {
        "output_dir": str(out), "max_steps": STEPS, "logging_steps": 1, "per_device_train_batch_size": B, "per_device_eval_batch_size": 8,
        "learning_rate": 0.0, "max_grad_norm": 0.0, "report_to": "none", "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "seed": 7,
    }  # fmt: skip
    opts.update(kw)
    return TrainingArguments(**opts)


class GradRecorder(TrainerCallback):
    """The real ``.grad`` of the embedding and the head at each optimizer step (accumulated over micro-batches)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            {
                "embedding": model.get_input_embeddings().weight.grad.clone(),
                "head": model.lm_head.weight.grad.clone(),
            }
        )


class KeepLastLogits(Trainer):
    """A loss on the logits of the last ``K`` positions only (``logits_to_keep=K``): the forward gets no labels."""

    K = 5

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            logits_to_keep=self.K,
        )
        labels = inputs["labels"][:, -self.K + 1 :]
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        return (loss, out) if return_outputs else loss


HF_FEATURES = [
    "plain",
    "label_smoothing",
    "compute_loss_func",
    "gradient_accumulation",
    "two_eval_sets",
    "logits_to_keep",
    "neftune",
    "evaluate_before_train",
    "second_train",
    "torch_compile",
]


def hf_run(model, out, feature: str, headwatch: bool):
    """One HF Trainer run of ``feature``; returns (trainer, callback, batches seen, grads, logits recorder, warnings)."""
    kw = {
        "label_smoothing": {"label_smoothing_factor": 0.1},
        "gradient_accumulation": {"gradient_accumulation_steps": 2},
        "neftune": {"neftune_noise_alpha": 5.0},
        "torch_compile": {"torch_compile": True, "torch_compile_backend": "aot_eager"},  # the Trainer wraps the model
    }.get(feature, {})
    if not headwatch:  # the twin's reference gradients: eager autograd is the reference (and compiling costs seconds)
        kw.pop("torch_compile", None), kw.pop("torch_compile_backend", None)
    extra = {"compute_loss_func": causal_ce} if feature == "compute_loss_func" else {}
    if feature == "two_eval_sets":
        extra["eval_dataset"] = {"wiki": Rows(5, seed=11), "code": Rows(6, seed=12)}
    if feature == "evaluate_before_train":
        extra["eval_dataset"] = Rows(5, seed=11)
    cls = KeepLastLogits if feature == "logits_to_keep" else Trainer
    grads = GradRecorder()
    cb = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0) if headwatch else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cls(
            model=model,
            args=hf_args(out, **kw),
            train_dataset=Rows(8, seed=3),
            callbacks=[c for c in (cb, grads) if c],
            **extra,
        )
        seen: list[dict] = []
        collate = trainer.data_collator
        trainer.data_collator = lambda rows: seen.append(collate(rows)) or seen[-1]
        logits = LogitsRecorder(model)
        metrics = trainer.evaluate() if feature == "evaluate_before_train" else None  # hooks attached at construction
        seen.clear()  # the evaluation's batches went through the collator too
        trainer.train()
        if feature == "second_train":  # the same Trainer and callback, a new run (a search trial): starts empty
            seen.clear(), logits.logits.clear(), grads.grads.clear()
            trainer.train()
        logits.remove()
        if feature == "two_eval_sets":
            metrics = trainer.evaluate()
    return (
        trainer,
        cb,
        seen,
        grads.grads,
        logits.logits,
        headwatch_warnings(caught),
        metrics,
    )


@pytest.mark.parametrize("feature", HF_FEATURES)
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_trainer(tmp_path, name, feature):
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    trainer, cb, seen, grads, logits, said, metrics = hf_run(model, tmp_path / "run", feature, headwatch=True)
    twin_grads = hf_run(twin, tmp_path / "twin", feature, headwatch=False)[3] if twin is not None else None
    if feature == "logits_to_keep":
        assert len(said) == 1 and f"last {KeepLastLogits.K} positions of each row" in said[0], said
    elif feature == "torch_compile" and twin is not None:  # learned inside the first compiled forward: refused once
        assert len(said) == 1 and "torch.compile" in said[0] and "from the next logging step on" in said[0], said
    else:
        assert said == [], said
    per_step = 2 if feature == "gradient_accumulation" else 1
    assert len(logits) == STEPS * per_step and len(seen) >= len(logits)  # the dataloader may fetch one batch ahead
    logged = [r for r in trainer.state.log_history if f"{H}/logits/entropy" in r]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for step, values in enumerate(logged):
        batches = seen[step * per_step : (step + 1) * per_step]
        want = logits_reference(logits[step * per_step : (step + 1) * per_step], batches)
        assert_logits(values, want)
        assert values[f"{H}/debug/capture/forwards"] == per_step
        assert values[f"{H}/debug/capture/positions"] == want["positions"]
        counted = seen[: (step + 1) * per_step]  # the run's total so far
        assert values[f"{H}/tokens/total"] == sum(b["attention_mask"].sum().item() for b in counted)
        if feature != "label_smoothing":  # the Trainer's loss is then the smoothed one, not the cross-entropy
            assert values[f"{H}/logits/target_nll"] == pytest.approx(losses[step], abs=1e-6)
        if feature in (
            "label_smoothing",
            "compute_loss_func",
            "logits_to_keep",
            "torch_compile",
        ):  # no eager forward returns the loss:
            assert f"{H}/check/nll_gap" not in values  # no self-check of the NLL (said once in a warning, docs/self_check.md)
        else:  # the self-check against the model's own outputs.loss
            assert values[f"{H}/debug/check/reference_nll"] == pytest.approx(losses[step], abs=1e-6)
            assert values[f"{H}/debug/check/reference_positions"] == values[f"{H}/debug/capture/labelled_positions"] == want["positions"]
            assert abs(values[f"{H}/check/nll_gap"]) < 1e-5 and values[f"{H}/check/mismatch"] == 0
        if feature == "torch_compile" and twin is not None and step == 0:  # refused: the split; shared still exact
            assert not any(k.startswith((f"{H}/grad/embedding_row", f"{H}/grad/head_row")) for k in values)
            want_shared = grad_reference({"shared": grads[step]["embedding"]}, model.get_input_embeddings().padding_idx)
            for key, value in want_shared.items():
                assert values[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            continue
        assert_grads(values, grads[step], twin_grads[step] if twin_grads else None, model.get_input_embeddings().padding_idx)
    if name == "gemma2_softcap":  # the capped distribution is what is measured
        assert max(x.abs().max().item() for x in logits) < SOFTCAP
    if metrics is not None:  # every evaluation under the Trainer's own name, against a fresh float64 forward
        sets = trainer.eval_dataset if isinstance(trainer.eval_dataset, dict) else {"": trainer.eval_dataset}
        for set_name, rows in sets.items():
            want = eval_reference(model, rows.batch())
            prefix = f"eval_{set_name}_" if set_name else "eval_"
            got = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
            assert got[f"{H}/val/logits/positions"] == want["positions"]
            for key in ("entropy", "max_prob", "kl_to_uniform", "target_nll", "target_argmax_rate"):
                assert got[f"{H}/val/logits/{key}"] == pytest.approx(want[key], abs=ATOL), (set_name, key)
            if set_name:  # published under its own name too: none overwrites another
                assert cb.latest[f"{H}/val/logits/entropy/eval_{set_name}"] == pytest.approx(want["entropy"], abs=ATOL)


# ====================================================================================== Lightning
class LitModel(pl.LightningModule):
    """A Hugging Face model trained by Lightning: ``model(**batch).loss``, logged as ``train_loss`` (the
    self-check's ``compare_loss``); manual optimization: zero_grad, manual_backward, step."""

    def __init__(self, model, manual: bool = False):
        super().__init__()
        self.model = model
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class LitGradRecorder(pl.Callback):
    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        m = pl_module.model
        self.grads.append(
            {
                "embedding": m.get_input_embeddings().weight.grad.clone(),
                "head": m.lm_head.weight.grad.clone(),
            }
        )


LIGHTNING_FEATURES = ["automatic", "manual", "two_val_dataloaders", "second_fit"]


def batches_of(rows: Rows, size: int = B) -> list[dict[str, torch.Tensor]]:
    return list(torch.utils.data.DataLoader(rows, batch_size=size, shuffle=False))


def summed(grads: list[dict[str, torch.Tensor]], n: int) -> dict[str, torch.Tensor]:
    """The gradient of the mean of ``n`` micro-batch losses: the sum of their gradients over ``n``."""
    return {k: sum(g[k] for g in grads) / n for k in grads[0]}


@pytest.mark.parametrize("feature", LIGHTNING_FEATURES)
@pytest.mark.parametrize("name", FAMILIES)
def test_lightning(tmp_path, name, feature):
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    train_rows = Rows(B * STEPS, seed=3)
    val_sets = [Rows(5, seed=11), Rows(6, seed=12)] if feature == "two_val_dataloaders" else [Rows(5, seed=11)]
    data = batches_of(train_rows)
    twin_grads = twin_grads_of(twin, data) if twin is not None else None
    logger, grads = StepLogger(), LitGradRecorder()
    callbacks = [TokenFrequency(), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0, compare_loss="train_loss"),
                 GradientDensityMonitor(log_every_n_steps=1), grads]  # fmt: skip
    def fit(logger):
        trainer = pl.Trainer(
            default_root_dir=tmp_path, max_steps=STEPS, log_every_n_steps=1, logger=logger, callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(LitModel(model, manual=feature == "manual"), torch.utils.data.DataLoader(train_rows, batch_size=B),
                    [torch.utils.data.DataLoader(r, batch_size=8) for r in val_sets])  # fmt: skip
        return trainer

    recorder = LogitsRecorder(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if feature == "second_fit":  # the same callbacks in a new Trainer: the second run starts from empty state
            fit(StepLogger())
            recorder.logits.clear(), grads.grads.clear()
        trainer = fit(logger)
    recorder.remove()
    assert headwatch_warnings(caught) == []
    assert len(recorder.logits) == len(grads.grads) == STEPS
    values = [{k: v[i] for k, v in logger.values.items() if k.startswith(f"{H}/") and "/val/" not in k} for i in range(STEPS)]
    for step in range(STEPS):
        want = logits_reference([recorder.logits[step]], [data[step]])
        got = values[step]
        assert_logits(got, want)
        assert got[f"{H}/debug/capture/forwards"] == 1 and got[f"{H}/debug/capture/positions"] == want["positions"]
        assert got[f"{H}/tokens/total"] == B * T * (step + 1)
        # the self-check against Lightning's own logged loss (compare_loss="train_loss")
        assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(logger.values["train_loss"][step], abs=1e-6)
        assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(want["nll"], abs=ATOL)
        assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
        assert_grads(
            got,
            grads.grads[step],
            twin_grads[step] if twin_grads else None,
            model.get_input_embeddings().padding_idx,
        )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{H}/val/")}
    for i, rows in enumerate(val_sets):
        want = eval_reference(model, rows.batch())
        suffix = f"/dataloader_idx_{i}" if len(val_sets) > 1 else ""
        assert metrics[f"{H}/val/logits/positions{suffix}"] == want["positions"]
        for key in (
            "entropy",
            "max_prob",
            "kl_to_uniform",
            "target_nll",
            "target_argmax_rate",
        ):
            assert metrics[f"{H}/val/logits/{key}{suffix}"] == pytest.approx(want[key], abs=ATOL), (i, key)


# ====================================================================================== plain loop
LOOP_FEATURES = ["plain", "gradient_accumulation", "no_labels", "logits_to_keep", "compile"]
KEEP = 5


def loop_loss(model, batch: dict, feature: str) -> torch.Tensor:
    """The step's loss as a plain-loop user writes it for ``feature``."""
    if feature == "no_labels":  # the model gets no labels; the loss is computed outside from the logits
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    if feature == "logits_to_keep":  # a loss on the logits of the last KEEP positions only
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=KEEP).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, -KEEP + 1 :].reshape(-1), ignore_index=-100)
    return model(**batch).loss


def loop_twin_grads(twin, micro: list[list[dict]], feature: str) -> list[dict[str, torch.Tensor]]:
    """Autograd on the untied twin, the same loss, accumulated over each step's micro-batches."""
    out = []
    for group in micro:
        for batch in group:
            (loop_loss(twin, batch, feature) / len(group)).backward()
        out.append({"embedding": twin.get_input_embeddings().weight.grad.clone(), "head": twin.lm_head.weight.grad.clone()})
        twin.zero_grad()
    return out


@pytest.mark.parametrize("feature", LOOP_FEATURES)
@pytest.mark.parametrize("name", FAMILIES)
def test_plain_loop(name, feature):
    """``plain``: ``model(**batch).loss``; ``gradient_accumulation``: two micro-batches per optimizer step;
    ``no_labels``: the model gets no labels (the loss is computed outside from the logits): target statistics
    NaN, entropy over every attended position, said once, nothing else; ``logits_to_keep``: the loss uses the
    last ``KEEP`` positions, those only are measured, said once; ``compile``: ``model.compile()`` (aot_eager)
    before headwatch attaches."""
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    per_step = 2 if feature == "gradient_accumulation" else 1
    data = batches_of(Rows(B * STEPS * per_step, seed=3))
    micro = [data[s * per_step : (s + 1) * per_step] for s in range(STEPS)]
    twin_grads = loop_twin_grads(twin, micro, feature) if twin is not None else None
    if feature == "compile":
        model.compile(backend="aot_eager")
    recorder = LogitsRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    values, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = Headwatch(model, monitors=["tokens", "logits", "gradients"], log_every_n_steps=1, figure_every_n_steps=0)
        for step, group in enumerate(micro):
            for batch in group:
                hw.step_start({k: v for k, v in batch.items() if k != "labels"} if feature == "no_labels" else batch, step)
                (loop_loss(model, batch, feature) / per_step).backward()
            hw.before_optimizer_step()
            grads.append({"embedding": model.get_input_embeddings().weight.grad.clone(), "head": model.lm_head.weight.grad.clone()})
            opt.step()
            hw.after_optimizer_step()
            opt.zero_grad()
            values.append(hw.step_end())
        hw.close()
    recorder.remove()
    said = headwatch_warnings(caught)
    pad = model.get_input_embeddings().padding_idx
    for step, group in enumerate(micro):
        got, logits = values[step], recorder.logits[step * per_step : (step + 1) * per_step]
        assert got[f"{H}/debug/capture/forwards"] == per_step
        assert got[f"{H}/tokens/total"] == B * T * per_step * (step + 1)
        assert_grads(got, grads[step], twin_grads[step] if twin_grads else None, pad)
        if feature == "no_labels":
            ref = float64_stats(logits[0], None, None)  # every attended position: no labels to select them
            assert got[f"{H}/logits/positions"] == B * T and got[f"{H}/debug/capture/labelled_positions"] == 0
            assert got[f"{H}/logits/entropy"] == pytest.approx(ref["entropy"].mean(), abs=ATOL)
            assert got[f"{H}/logits/max_prob"] == pytest.approx(ref["max_prob"].mean(), abs=ATOL)
            assert math.isnan(got[f"{H}/logits/target_nll"]) and math.isnan(got[f"{H}/logits/ece"])
            assert f"{H}/check/nll_gap" not in got  # no reference loss from the model: nothing compared
            continue
        want = logits_reference(logits, group)
        assert_logits(got, want)
        assert got[f"{H}/debug/capture/positions"] == got[f"{H}/debug/capture/labelled_positions"] == want["positions"]
        if feature in ("logits_to_keep", "compile"):  # no loss from an eager forward: nothing compared (said once)
            assert f"{H}/check/nll_gap" not in got
        else:
            assert abs(got[f"{H}/check/nll_gap"]) < 1e-5 and got[f"{H}/check/mismatch"] == 0
            assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(want["nll"], abs=ATOL)
    if feature == "no_labels":
        assert len(said) == 1 and "no `labels` in a training dict batch" in said[0] and "every attended position" in said[0], said
    elif feature == "logits_to_keep":
        assert len(said) == 1 and f"last {KEEP} positions of each row" in said[0], said
    else:
        assert said == [], said
