"""The trainer matrix's shared parts (docs/supported.md): the three tiny families, the rows they train on, the
recorders of what the loss used, and the float64 references each published figure is compared with."""

from __future__ import annotations

import math
from itertools import accumulate

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from headwatch import GradientDensityMonitor, LogitStatsMonitor, TokenFrequency
from headwatch.core import LogitStats, TokenCounts
from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.lightning_runs import StepLogger
from tests.helpers.matrices import D, V, tiny
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


class Rows(torch.utils.data.Dataset):
    """``n`` rows of ``T`` tokens below ``vocab``; row ``i`` masks its first ``i % 3 + 1`` labels (rows of different
    label counts)."""

    def __init__(self, n: int, seed: int, vocab: int = V):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, T), generator=g)
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


def packed(batch: dict) -> bool:
    """A padding-free batch of :class:`Rows`: one row of ``B`` sequences, ``position_ids`` restarting at each, no
    attention mask, ``B`` labelled spans (each sequence's labels after its masked prefix, as a multi-turn mask)."""
    kept = (batch["labels"][0] != -100).long()
    spans = int(kept[0]) + int((kept[1:] - kept[:-1] == 1).sum())
    restart = int(batch["position_ids"][0, T]) == 0
    return (
        batch["input_ids"].shape == (1, B * T)
        and "attention_mask" not in batch
        and restart
        and spans == B
    )


class LogitsRecorder:
    """The model's own ``outputs.logits`` of every training forward with gradient (the forwards a loss uses)."""

    def __init__(self, model: torch.nn.Module):
        self.logits: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if (
            module.training and torch.is_grad_enabled() and output.logits is not None
        ):  # a fused loss returns none
            self.logits.append(output.logits.detach().clone())

    def remove(self) -> None:
        self.handle.remove()


def logits_reference(
    logits: list[torch.Tensor], batches: list[dict]
) -> dict[str, float]:
    """float64 statistics pooled over the forwards of one step: logits ``(B, L, V)`` of the last ``L`` positions
    scored against ``labels[t + 1]`` (the causal loss's positions: ``-100`` and each row's last position out)."""
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("entropy", "kl_to_uniform", "max_prob", "nll", "argmax")
    }
    for x, batch in zip(logits, batches, strict=True):
        labels = batch["labels"]
        targets = torch.cat(
            [labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1
        )[:, -x.shape[1] :]
        ref = float64_stats(x, None, targets)
        valid = ref["valid"]
        for k in ("entropy", "kl_to_uniform", "max_prob", "nll"):
            cols[k].append(ref[k][valid])
        cols["argmax"].append(ref["target_is_argmax"][valid])
    out = {k: float(np.concatenate(v).astype(float).mean()) for k, v in cols.items()}
    out["positions"] = sum(len(v) for v in cols["nll"])
    return out


def assert_logits(values: dict[str, float], want: dict[str, float], group: str = f"{H}/logits", suffix: str = "") -> None:
    assert values[f"{group}/positions{suffix}"] == want["positions"]
    pairs = {"entropy": "entropy", "kl_to_uniform": "kl_to_uniform", "max_prob": "max_prob", "target_nll": "nll",
             "target_argmax_rate": "argmax"}  # fmt: skip
    for key, col in pairs.items():
        assert values[f"{group}/{key}{suffix}"] == pytest.approx(want[col], abs=ATOL), key
    assert math.isfinite(values[f"{group}/ece{suffix}"])


def assert_unlabelled(got: dict[str, float], logits: torch.Tensor) -> None:
    """No labels in the batch: the target statistics refused (NaN); entropy and max-probability over every attended
    position equal float64 statistics of the forward's ``logits`` (B, T, V)."""
    ref = float64_stats(logits, None, None)
    assert got[f"{H}/logits/positions"] == B * T and got[f"{H}/debug/capture/labelled_positions"] == 0
    assert got[f"{H}/logits/entropy"] == pytest.approx(ref["entropy"].mean(), abs=ATOL)
    assert got[f"{H}/logits/max_prob"] == pytest.approx(ref["max_prob"].mean(), abs=ATOL)
    assert math.isnan(got[f"{H}/logits/target_nll"]) and math.isnan(got[f"{H}/logits/ece"])


def grad_reference(
    flows: dict[str, torch.Tensor], padding_idx: int | None, real: int = V
) -> dict[str, float]:
    """float64 row statistics of each ``(V, d_model)`` gradient over the rows that can train (the first ``real``,
    the tokenizer's, all but the embedding's ``padding_idx``, which never gets a gradient): density (rows with a
    non-zero gradient / rows), mean and max row norm."""
    out = {}
    rows = torch.arange(V) < real
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
        want = grad_reference(
            {"embedding": real["embedding"], "head": real["head"]}, pad
        )
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
        torch.testing.assert_close(
            twin["embedding"] + twin["head"], real["embedding"], rtol=1e-4, atol=1e-6
        )  # the twin is the model
    for key, value in want.items():
        assert values[f"{H}/grad/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), (
            key
        )
    assert values[f"{H}/check/vanished_gradient"] == 0.0


NO_REFERENCE = "no trainer loss to compare target_nll with"  # check/nll_gap left out where no loss is read: said once
OVER_BUDGET = "its logging statistics alone take"  # tiny models logged every step exceed overhead_budget: said once


def headwatch_warnings(caught) -> list[str]:
    said = [
        str(w.message) for w in caught if "/headwatch/" in w.filename.replace("\\", "/")
    ]
    return [m for m in said if NO_REFERENCE not in m and OVER_BUDGET not in m]


# ====================================================================================== HF Trainer
def hf_args(out, cls: type = TrainingArguments, **kw) -> TrainingArguments:
    """The matrix's arguments (``cls``: ``TrainingArguments`` or a subclass, TRL's ``SFTConfig``)."""
    opts = {
        "output_dir": str(out), "max_steps": STEPS, "logging_steps": 1, "per_device_train_batch_size": B, "per_device_eval_batch_size": 8,
        "learning_rate": 0.0, "max_grad_norm": 0.0, "report_to": "none", "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "seed": 7,
    }  # fmt: skip
    opts.update(kw)
    return cls(**opts)


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


class KeepLastLogitsLoss:
    """A Trainer mixin: a loss on the logits of the last ``K`` positions only (``logits_to_keep=K``): the forward
    gets no labels."""

    K = 5

    def compute_loss(
        self, model, inputs, return_outputs=False, num_items_in_batch=None
    ):
        out = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            logits_to_keep=self.K,
        )
        labels = inputs["labels"][:, -self.K + 1 :]
        loss = F.cross_entropy(
            out.logits[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100
        )
        return (loss, out) if return_outputs else loss


class KeepLastLogits(KeepLastLogitsLoss, Trainer):
    pass


def check_hf_door(
    trainer, latest, seen, grads, logits, metrics, twin_grads, model, per_step: int = 1, self_check: bool = True, smoothed: bool = False,
    split_refused_first: bool = False, forwards: int | None = None, scored: list[dict] | None = None,
) -> None:  # fmt: skip
    """Every logging step of a Hugging Face door's run against its references: ``logits`` the ``(B, L, V)`` logits
    of each forward the loss used, ``seen`` the collated batches, ``grads`` / ``twin_grads`` the real and the untied
    twin's ``.grad`` at each optimizer step (``per_step`` forwards each, or a list: each step's micro-batches); ``self_check``: whether a forward returns
    the loss (``check/*``); ``smoothed``: the logged loss is not the cross-entropy; ``split_refused_first``: the
    tied split refused on the first logging step (a model compiled from outside); ``forwards``: the forwards
    with gradient per step (default ``per_step``), ``scored`` the batch each scored (default ``seen``);
    ``metrics``: what ``evaluate()`` returned, each evaluation set against a fresh float64 forward, and ``latest``
    the callback's ``latest`` just after that ``evaluate()``."""
    from tests.helpers.capture import reference as eval_reference

    # micro-batches of each step
    micro = per_step if isinstance(per_step, list) else [per_step] * STEPS
    fwd = [forwards] * STEPS if forwards else micro
    ends, micro_ends = list(accumulate(fwd)), list(accumulate(micro))
    scored = seen if scored is None else scored
    # the dataloader may fetch one batch ahead
    assert len(logits) == ends[-1] and len(scored) >= len(logits)
    logged = [r for r in trainer.state.log_history if f"{H}/logits/entropy" in r]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for step, values in enumerate(logged):
        lo, hi = ends[step] - fwd[step], ends[step]
        want = logits_reference(logits[lo:hi], scored[lo:hi])
        assert_logits(values, want)
        assert values[f"{H}/debug/capture/forwards"] == fwd[step]
        assert values[f"{H}/debug/capture/positions"] == want["positions"]
        # the run's total so far (a padding-free batch has no attention mask)
        counted = seen[: micro_ends[step]]
        assert values[f"{H}/tokens/total"] == sum(
            b["attention_mask"].sum().item()
            if "attention_mask" in b
            else b["input_ids"].numel()
            for b in counted
        )
        if (
            not smoothed
        ):  # the Trainer's loss is then the smoothed one, not the cross-entropy
            assert values[f"{H}/logits/target_nll"] == pytest.approx(
                losses[step], abs=1e-6
            )
        if (
            not self_check
        ):  # no eager forward returns the loss: no self-check of the NLL (said at INFO)
            assert f"{H}/check/nll_gap" not in values
        else:  # the self-check against the model's own outputs.loss
            if not smoothed:
                assert values[f"{H}/debug/check/reference_nll"] == pytest.approx(
                    losses[step], abs=1e-6
                )
            assert (
                values[f"{H}/debug/check/reference_positions"]
                == values[f"{H}/debug/capture/labelled_positions"]
                == want["positions"]
            )
            assert (
                abs(values[f"{H}/check/nll_gap"]) < 1e-5
                and values[f"{H}/check/mismatch"] == 0
            )
        if (
            split_refused_first and twin_grads is not None and step == 0
        ):  # refused: the split; shared exact
            assert not any(
                k.startswith((f"{H}/grad/embedding_row", f"{H}/grad/head_row"))
                for k in values
            )
            want_shared = grad_reference(
                {"shared": grads[step]["embedding"]},
                model.get_input_embeddings().padding_idx,
            )
            for key, value in want_shared.items():
                assert values[f"{H}/grad/{key}"] == pytest.approx(
                    value, rel=1e-5, abs=1e-7
                ), key
            continue
        assert_grads(
            values,
            grads[step],
            twin_grads[step] if twin_grads else None,
            model.get_input_embeddings().padding_idx,
        )
    if (
        model.config.model_type == "gemma2"
    ):  # the capped distribution is what is measured
        assert max(x.abs().max().item() for x in logits) < SOFTCAP
    if (
        metrics is not None
    ):  # every evaluation under the Trainer's own name, against a fresh float64 forward
        sets = (
            trainer.eval_dataset
            if isinstance(trainer.eval_dataset, dict)
            else {"": trainer.eval_dataset}
        )
        for set_name, rows in sets.items():
            want = eval_reference(
                model, rows.batch() if isinstance(rows, Rows) else rows_batch(rows)
            )
            prefix = f"eval_{set_name}_" if set_name else "eval_"
            got = {
                k.removeprefix(prefix): v
                for k, v in metrics.items()
                if k.startswith(prefix)
            }
            assert got[f"{H}/val/logits/positions"] == want["positions"]
            for key in (
                "entropy",
                "max_prob",
                "kl_to_uniform",
                "target_nll",
                "target_argmax_rate",
            ):
                assert got[f"{H}/val/logits/{key}"] == pytest.approx(
                    want[key], abs=ATOL
                ), (set_name, key)
            if set_name:  # published under its own name too: none overwrites another
                assert latest[
                    f"{H}/val/logits/entropy/eval_{set_name}"
                ] == pytest.approx(want["entropy"], abs=ATOL)


def rows_batch(rows) -> dict[str, torch.Tensor]:
    """A prepared ``datasets.Dataset`` of equal-length rows (``input_ids``, ``labels``) as one batch."""
    ids = torch.tensor(rows["input_ids"])
    return {
        "input_ids": ids,
        "labels": torch.tensor(rows["labels"]),
        "attention_mask": torch.ones_like(ids),
    }


class HiddenRecorder:
    """The hidden states each training forward with gradient feeds the first decoder layer (once per forward:
    gradient checkpointing's recomputation in the backward is not a forward of its own)."""

    def __init__(self, model):
        self.hidden: list[torch.Tensor] = []
        self.armed = False
        self.handles = [
            model.register_forward_pre_hook(self._arm),
            model.model.layers[0].register_forward_pre_hook(
                self._record, with_kwargs=True
            ),
        ]

    def _arm(self, module, args):
        self.armed = module.training and torch.is_grad_enabled()

    def _record(self, module, args, kwargs):
        if self.armed:
            self.hidden.append(
                (args[0] if args else kwargs["hidden_states"]).detach().clone()
            )
            self.armed = False

    def logits(self, model, keep: int = 0) -> list[torch.Tensor]:
        """The ``(B, L, V)`` logits of each recorded forward, recomputed from its hidden states."""
        for h in self.handles:
            h.remove()
        model.eval()
        with torch.no_grad():
            return [
                model(inputs_embeds=h, logits_to_keep=keep).logits for h in self.hidden
            ]


def sft_rows(n: int, seed: int, vocab: int = V):
    """:class:`Rows` as TRL takes them: token ids and a ``completion_mask`` (TRL builds the ``-100`` labels)."""
    import datasets

    rows = Rows(n, seed, vocab)
    keep = (rows.labels != -100).long()
    return datasets.Dataset.from_dict(
        {"input_ids": rows.ids.tolist(), "completion_mask": keep.tolist()}
    )


def word_ids_tokenizer(words: int = V):
    """A tokenizer of ``words`` words for rows that come tokenized: TRL reads only its pad and end ids (and its
    length, the run's vocabulary, headwatch)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
        pad_token="w0",
        eos_token="w1",
    )


class SeenCollator:
    def __init__(self, collate):
        self.collate, self.seen = collate, []

    def __call__(self, rows):
        self.seen.append(self.collate(rows))
        return self.seen[-1]


class LitLoss(pl.LightningModule):
    """``model(**batch).loss``, logged as ``train_loss``; the optimizer over the Parameters that train."""

    def __init__(self, model, loss=None):
        super().__init__()
        self.model, self.loss = model, loss or model_loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(self.model, batch)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(
            [p for p in self.parameters() if p.requires_grad], lr=0.0
        )


def model_loss(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def door_run(
    door: str, model, out, loss=None, rows=None, vocab: int | None = None
) -> tuple[list[dict], list[dict], list[torch.Tensor]]:
    """One run of ``door`` (``hf_trainer``, ``sft_trainer``, ``lightning``, ``loop``) of ``model`` on :class:`Rows`
    (lr 0, ``STEPS`` steps, every one a logging step), each step's loss ``loss(model, batch)`` (default
    ``model(**batch).loss``; the Trainers through their ``compute_loss``): (published values per step, batches
    trained on, logits per forward). ``rows``: the training rows (a Dataset of dicts; not for ``sft_trainer``);
    ``vocab``: the tokenizer's size, the model's rows padded beyond it (the rows drawn below it; ``vocab_size=`` of
    the loop's and Lightning's monitors, TRL's ``processing_class``; not for ``hf_trainer``)."""
    if vocab is not None and rows is None and door != "sft_trainer":
        rows = Rows(B * STEPS, seed=3, vocab=vocab)
    if door == "loop":
        data = list(
            torch.utils.data.DataLoader(rows or Rows(B * STEPS, seed=3), batch_size=B)
        )
        recorder, values = LogitsRecorder(model), []
        names = ["tokens", "logits", "gradients"]
        if vocab is not None:
            names[:2] = [TokenCounts(vocab_size=vocab), LogitStats(vocab_size=vocab)]
        with Headwatch(
            model,
            monitors=names,
            log_every_n_steps=1,
            figure_every_n_steps=0,
        ) as hw:
            for step, batch in enumerate(data):
                hw.step_start(batch, step)
                (loss or model_loss)(model, batch).backward()
                hw.before_optimizer_step()
                hw.after_optimizer_step()
                model.zero_grad()
                values.append(hw.step_end())
        recorder.remove()
        return values, data, recorder.logits
    if door == "lightning":
        logger = StepLogger()
        callbacks = [TokenFrequency(vocab_size=vocab), LogitStatsMonitor(log_every_n_steps=1, figure_every_n_steps=0, compare_loss="train_loss",
                     vocab_size=vocab), GradientDensityMonitor(log_every_n_steps=1)]  # fmt: skip
        trainer = pl.Trainer(default_root_dir=out, max_steps=STEPS, log_every_n_steps=1, logger=logger, callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, limit_val_batches=0)  # fmt: skip
        data = torch.utils.data.DataLoader(
            rows or Rows(B * STEPS, seed=3), batch_size=B
        )
        recorder = LogitsRecorder(model)
        trainer.fit(LitLoss(model, loss), data)
        recorder.remove()
        values = [
            {k: v[i] for k, v in logger.values.items() if k.startswith(f"{H}/")}
            for i in range(STEPS)
        ]
        return values, list(data), recorder.logits
    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    if door == "hf_trainer":
        trainer = transformers_trainer(model, hf_args(out), cb, loss, rows)
        recorder = LogitsRecorder(model)
    else:
        import trl

        config = hf_args(out, trl.SFTConfig, completion_only_loss=True, bf16=False)
        cls = (
            type(
                "CustomLossSFT",
                (CustomLoss, trl.SFTTrainer),
                {"loss_fn": staticmethod(loss)},
            )
            if loss is not None
            else trl.SFTTrainer
        )
        trainer = cls(model=model, args=config, train_dataset=sft_rows(B * STEPS, seed=3, vocab=vocab or V),
                      processing_class=word_ids_tokenizer(vocab or V), callbacks=[cb])  # fmt: skip
        recorder = HiddenRecorder(base(model))
    seen = SeenCollator(trainer.data_collator)
    trainer.data_collator = seen
    trainer.train()
    logged = [r for r in trainer.state.log_history if f"{H}/logits/entropy" in r]
    if door == "hf_trainer":
        recorder.remove()
        return logged, seen.seen, recorder.logits
    return logged, seen.seen, recorder.logits(base(model))


class CustomLoss:
    """A Trainer mixin: each step's loss is ``self.loss_fn(model, inputs)``."""

    loss_fn = staticmethod(model_loss)

    def compute_loss(
        self, model, inputs, return_outputs=False, num_items_in_batch=None
    ):
        return self.loss_fn(model, inputs)


def transformers_trainer(model, args, cb, loss=None, rows=None):
    extra = {"loss_fn": staticmethod(loss)}
    cls = type("CustomLossTrainer", (CustomLoss, Trainer), extra) if loss else Trainer
    return cls(
        model=model,
        args=args,
        train_dataset=rows or Rows(B * STEPS, seed=3),
        callbacks=[cb],
    )


def base(model):
    """The causal LM itself (a PEFT model's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
