"""The trainer matrix's TRL column (docs/supported.md): TRL's ``SFTTrainer`` (the Hugging Face door, TRL's own
loss through its fused head, TRL's defaults: gradient checkpointing on) on the three tiny families of
``tests/integrations/test_trainer_matrix.py``, every published figure against an independent reference.

TRL's fused head builds no ``outputs.logits``: the logits reference is a fresh float64 forward from the hidden
states the loss's forward fed its first layer (recorded by a pre-hook: the noisy rows under NEFTune), scored
against the collated batch's labels; gradients against the real ``.grad`` and an untied twin trained by the same
``SFTTrainer`` on the same batches; the Trainer's logged loss (TRL's token mean) equals ``logits/target_nll``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.capture import causal_ce
from tests.helpers.matrices import V, untied_twin
from tests.helpers.trainer_matrix import (
    FAMILIES,
    STEPS,
    B,
    GradRecorder,
    H,
    HiddenRecorder,
    KeepLastLogitsLoss,
    Rows,
    T,
    check_hf_door,
    family,
    headwatch_warnings,
    hf_args,
    is_tied,
    sft_rows,
    word_ids_tokenizer,
)  # fmt: skip

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# ``evaluate``: a dict of two evaluation sets evaluated before any training (an evaluation-only script up to
# there), then two micro-batches per step, then ``train()`` again on the same Trainer and callback (a new run)
# ``r_drop``: TRL's loss twice over the batch, averaged; ``own_labels``: TRL's loss plus TRL's loss of a second
# batch with labels of its own (a pretraining mix); ``torch_compile``: ``SFTConfig(torch_compile=True)`` (the
# Trainer wraps the model; aot_eager); ``compute_loss_func`` evaluates with ``prediction_loss_only=False`` too (TRL's loss
# forward, its no-grad fused metrics pass and the logits' recomputation for ``compute_metrics``); every evaluation
# step generates before and after its loss forward
# ``assistant_only``: ``assistant_only_loss=True`` on two-turn conversations through a chat template with
# ``{% generation %}`` markers (two masked spans per row)
SFT_FEATURES = [
    "evaluate",
    "neftune",
    "compute_loss_func",
    "logits_to_keep",
    "r_drop",
    "own_labels",
    "assistant_only",
    "torch_compile",
    "short_last_window",
]
NEW = 3  # max_new_tokens of each generate() of an evaluation step
MIX = Rows(B, seed=21).batch()
# the user's turn opens with w2, the assistant's with w3; the assistant's words and its end of turn are trained
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w2 {{ m['content'] }} {% else %}w3 "
    "{% generation %}{{ m['content'] }} <eos>{% endgeneration %} {% endif %}{% endfor %}"
)


def chat_tokenizer():
    """A word-level tokenizer of ``V`` ids (``<pad>`` 0, ``<eos>`` 1, words ``w2``...) with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def chat_rows(n: int, seed: int):
    """``n`` conversations of two user and two assistant turns (random words ``w4``...)."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(
            f"w{i}" for i in torch.randint(4, V, (k,), generator=g).tolist()
        )

    turns = [("user", 3), ("assistant", 2), ("user", 2), ("assistant", 3)]
    messages = [[{"role": r, "content": words(k)} for r, k in turns] for _ in range(n)]
    return datasets.Dataset.from_dict({"messages": messages})


class KeepLastSFT(KeepLastLogitsLoss, trl.SFTTrainer):
    pass


class TwoLossesSFT(trl.SFTTrainer):
    """Two forwards with gradient in one step, each through TRL's own loss (its fused head)."""

    mix = False

    def compute_loss(
        self, model, inputs, return_outputs=False, num_items_in_batch=None
    ):
        first = super().compute_loss(
            model, dict(inputs), num_items_in_batch=num_items_in_batch
        )
        if self.mix:
            return first + super().compute_loss(model, dict(MIX))
        return (
            first
            + super().compute_loss(
                model, dict(inputs), num_items_in_batch=num_items_in_batch
            )
        ) / 2


class MixSFT(TwoLossesSFT):
    mix = True


class GenerateSFT(trl.SFTTrainer):
    """An evaluation step that samples with ``generate()`` (prompt pass and decoding steps) before its loss forward
    and again after it (``predict_with_generate``-style)."""

    generated = 0

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.sample(model, inputs)
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        self.sample(model, inputs)
        return out

    def sample(self, model, inputs) -> None:
        prompt = {k: inputs[k][:, :6] for k in ("input_ids", "attention_mask")}
        model.generate(**prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        self.generated += 1


def sft_run(model, out, feature: str, headwatch: bool):
    kw = {
        "neftune": {"neftune_noise_alpha": 5.0},
        "evaluate": {"gradient_accumulation_steps": 2},
        "short_last_window": {"gradient_accumulation_steps": 2},
        "compute_loss_func": {"prediction_loss_only": False},
        "torch_compile": {"torch_compile": True, "torch_compile_backend": "aot_eager"},
    }.get(feature, {})
    if not headwatch:  # the twin's reference gradients: eager autograd is the reference
        kw.pop("torch_compile", None), kw.pop("torch_compile_backend", None)
    chat = feature == "assistant_only"
    mask = {"assistant_only_loss": True} if chat else {"completion_only_loss": True}
    config = hf_args(out, trl.SFTConfig, bf16=False, **mask, **kw)
    # short_last_window: 6 rows in batches of 2, two per window: the last window holds one
    n = 6 if feature == "short_last_window" else B * STEPS * 2
    rows = chat_rows(B * STEPS, seed=3) if chat else sft_rows(n, seed=3)
    tokenizer = chat_tokenizer() if chat else word_ids_tokenizer()
    extra = {"compute_loss_func": causal_ce} if feature == "compute_loss_func" else {}
    if (
        feature == "evaluate" and headwatch
    ):  # the twin's gradients: its first run is the second run's
        extra["eval_dataset"] = {
            "wiki": sft_rows(5, seed=11),
            "code": sft_rows(6, seed=12),
        }
    elif feature == "compute_loss_func" and headwatch:
        extra["eval_dataset"] = sft_rows(5, seed=11)
    cls = {
        "logits_to_keep": KeepLastSFT,
        "r_drop": TwoLossesSFT,
        "own_labels": MixSFT,
    }.get(feature, GenerateSFT)
    grads = GradRecorder()
    cb = (
        HeadwatchCallback(
            monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
        )
        if headwatch
        else None
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cls(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                      callbacks=[c for c in (cb, grads) if c], **extra)  # fmt: skip
        seen: list[dict] = []
        collate = trainer.data_collator
        trainer.data_collator = lambda rows: seen.append(collate(rows)) or seen[-1]
        metrics = trainer.evaluate() if "eval_dataset" in extra else None
        trainer.evaluated = list(
            trainer.state.log_history
        )  # train() starts a new history
        latest = dict(cb.latest) if cb is not None else None
        seen.clear()  # the evaluation's batches went through the collator too
        hidden = HiddenRecorder(model)
        trainer.train()
        if (
            feature == "evaluate" and headwatch
        ):  # the same Trainer and callback, a new run: starts empty
            seen.clear(), hidden.hidden.clear(), grads.grads.clear()
            trainer.train()
    return (
        trainer,
        latest,
        seen,
        grads.grads,
        hidden,
        headwatch_warnings(caught),
        metrics,
    )


# the door's own mechanics (a custom loss, two forwards): on the tied and the untied family, not the third (its
# scaled embedding is covered by the other features), to keep the suite's time
DOOR_ONLY = (
    "compute_loss_func",
    "logits_to_keep",
    "r_drop",
    "own_labels",
    "assistant_only",
    "torch_compile",
)
CASES = [
    (n, f)
    for f in SFT_FEATURES
    for n in FAMILIES
    if not (n == "gemma_scaled" and f in DOOR_ONLY)
    # a shorter last window: the untied family only (the other windows run on all three under ``evaluate``)
    and not (n != "gemma2_softcap" and f == "short_last_window")
]


@pytest.mark.parametrize("name, feature", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_sft_trainer(tmp_path, name, feature):
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    # the first layer's attention calls: TRL's default gradient checkpointing runs it again in the backward
    layer_calls = []
    counter = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: layer_calls.append(module.training)
    )
    trainer, latest, seen, grads, hidden, said, metrics = sft_run(
        model, tmp_path / "run", feature, headwatch=True
    )
    twin_grads = (
        sft_run(twin, tmp_path / "twin", feature, headwatch=False)[3]
        if twin is not None
        else None
    )
    counter.remove()
    # each forward with gradient ran the layer twice (``evaluate``: two runs; ``compute_loss_func``: TRL's no-grad
    # metrics pass once a step); the loss's forward was measured once (``debug/capture/forwards``, check_hf_door)
    runs = 2 if feature == "evaluate" else 1
    no_grad = STEPS if feature == "compute_loss_func" else 0
    assert sum(layer_calls) == 2 * runs * len(hidden.hidden) + no_grad, layer_calls
    if feature == "logits_to_keep":
        assert (
            len(said) == 1 and f"last {KeepLastSFT.K} positions of each row" in said[0]
        ), said
    elif feature in (
        "r_drop",
        "own_labels",
    ):  # each forward against its own labels, pooled: said once
        assert len(said) == 1 and "more than once with gradient" in said[0], said
    elif (
        feature == "torch_compile" and twin is not None
    ):  # learned inside the first compiled forward: refused once
        assert (
            len(said) == 1
            and "torch.compile" in said[0]
            and "from the next logging step on" in said[0]
        ), said
    else:
        assert said == [], said
    # uneven accumulation: a window's two micro-batches hold different label counts
    if feature in ("evaluate", "short_last_window"):
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in seen[:4]]
        assert counts[0] != counts[1] or counts[2] != counts[3], counts
    # the premise: each row's labels are two spans, the assistant's turns
    if feature == "assistant_only":
        assert all(starts(b["labels"][i]) == 2 for b in seen for i in range(B)), seen
    else:
        assert all(b["input_ids"].shape == (B, T) for b in seen)
    logits = hidden.logits(
        model, keep=KeepLastSFT.K if feature == "logits_to_keep" else 0
    )
    per_step = {"evaluate": 2, "short_last_window": [2, 1]}.get(feature, 1)
    check_hf_door(
        trainer,
        latest,
        seen,
        grads,
        logits,
        metrics,
        twin_grads,
        model,
        per_step=per_step,
        self_check=feature
        in (
            "evaluate",
            "neftune",
            "r_drop",
            "own_labels",
            "assistant_only",
            "short_last_window",
        ),
        split_refused_first=feature == "torch_compile",
        smoothed=feature == "own_labels",  # the logged loss is the sum of the two
        forwards=2 if feature in ("r_drop", "own_labels") else None,
        scored=[
            x for b in seen[:STEPS] for x in (b, MIX if feature == "own_labels" else b)
        ]
        if feature in ("r_drop", "own_labels")
        else None,
    )
    if metrics is not None:
        trls_own_evaluation_metrics(trainer, metrics, feature)


def trls_own_evaluation_metrics(trainer, metrics: dict, feature: str) -> None:
    """TRL's ``eval_entropy`` and ``eval_mean_token_accuracy`` of each set (one batch per set: a token mean over its
    rows) equal headwatch's; under ``compute_loss_func`` its ``eval_loss`` (the causal cross-entropy) equals the
    target NLL. Each set's one batch generated twice (before and after its loss forward)."""
    # TRL logs its own metrics as eval_entropy whatever the set's name: each set's record says which set (its loss)
    records = [r for r in trainer.evaluated if "eval_entropy" in r]
    prefixes = [
        next(k for k in r if k.endswith("loss")).removesuffix("loss") for r in records
    ]
    assert sorted(prefixes) == sorted({k.split(H)[0] for k in metrics if H in k}), (
        prefixes
    )
    assert trainer.generated == 2 * len(prefixes)
    for prefix, trls in zip(prefixes, records, strict=True):
        got = {
            k.removeprefix(prefix + H): v
            for k, v in metrics.items()
            if k.startswith(prefix + H)
        }
        assert got["/val/logits/entropy"] == pytest.approx(
            trls["eval_entropy"], rel=1e-5
        ), prefix
        assert got["/val/logits/target_argmax_rate"] == pytest.approx(
            trls["eval_mean_token_accuracy"], abs=1e-6
        )
        if feature == "compute_loss_func":
            assert got["/val/logits/target_nll"] == pytest.approx(
                trls[f"{prefix}loss"], abs=1e-6
            )


def test_sft_trainer_model_without_a_head_headwatch_finds_trains_with_one_warning_strict_raises(
    tmp_path,
):
    """A model whose head is held outside its module tree: its forward and ``get_output_embeddings()`` (which TRL's
    fused head reads) reach it, ``named_modules()`` does not list it. The logit and gradient statistics are refused
    with one warning naming the cause; TRL trains on, the token counts are measured; ``strict=True`` raises."""
    from headwatch import HeadwatchError

    def headless():
        model = family("gemma2_softcap")
        model.__dict__["lm_head"] = model._modules.pop(
            "lm_head"
        )  # reached, not registered
        return model

    config = hf_args(tmp_path, trl.SFTConfig, completion_only_loss=True, bf16=False)
    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trl.SFTTrainer(model=headless(), args=config, train_dataset=sft_rows(B * STEPS, seed=3),
                                 processing_class=word_ids_tokenizer(), callbacks=[cb])  # fmt: skip
        trainer.train()
    said = [m for m in headwatch_warnings(caught) if "headwatch cannot measure" in m]
    assert (
        len(said) == 1
        and "could not find the output head" in said[0]
        and "Still measured: tokens" in said[0]
    ), said
    trls = [r["entropy"] for r in trainer.state.log_history if "entropy" in r]
    assert (
        trainer.state.global_step == STEPS and len(trls) == STEPS
    )  # TRL trained, through the head
    assert cb.latest[f"{H}/tokens/total"] == STEPS * B * T
    assert not any(k.startswith((f"{H}/logits/", f"{H}/grad/")) for k in cb.latest)
    strict = HeadwatchCallback(
        monitors=["tokens", "logits"], figure_every_n_steps=0, strict=True
    )
    with pytest.raises(HeadwatchError, match="could not find the output head"):
        trl.SFTTrainer(model=headless(), args=config, train_dataset=sft_rows(B * STEPS, seed=3),
                       processing_class=word_ids_tokenizer(), callbacks=[strict]).train()  # fmt: skip


def starts(labels) -> int:
    """The number of labelled spans in one row's labels (``-100`` outside them)."""
    kept = (labels != -100).long()
    return int(kept[0]) + int((kept[1:] - kept[:-1] == 1).sum())


def test_sft_trainer_evaluation_of_a_compiled_model_that_generates(tmp_path):
    """The model compiled in place before the ``SFTTrainer`` (``evaluate()`` and ``generate()`` run it compiled):
    each evaluation step generates before and after its loss forward; the figures are the loss forward's, against a
    fresh float64 forward and TRL's own evaluation metrics."""
    from tests.helpers.capture import reference as eval_reference
    from tests.helpers.trainer_matrix import ATOL, rows_batch

    model = family("llama_tied")
    traced: list[bool] = []
    model.register_forward_hook(
        lambda m, a, o: traced.append(torch.compiler.is_compiling())
    )
    torch._dynamo.reset()
    model.compile(backend="eager")
    config = hf_args(tmp_path, trl.SFTConfig, completion_only_loss=True, bf16=False)
    cb = HeadwatchCallback(monitors=["tokens", "logits"], figure_every_n_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GenerateSFT(model=model, args=config, train_dataset=sft_rows(B, seed=3), eval_dataset=sft_rows(5, seed=11),
                              processing_class=word_ids_tokenizer(), callbacks=[cb])  # fmt: skip
        metrics = trainer.evaluate()
    assert headwatch_warnings(caught) == []
    assert traced and all(traced)  # every forward ran compiled, generate()'s too
    trainer.evaluated = list(trainer.state.log_history)
    want = eval_reference(model, rows_batch(trainer.eval_dataset))
    assert metrics[f"eval_{H}/val/logits/positions"] == want["positions"]
    for key in (
        "entropy",
        "max_prob",
        "kl_to_uniform",
        "target_nll",
        "target_argmax_rate",
    ):
        assert metrics[f"eval_{H}/val/logits/{key}"] == pytest.approx(
            want[key], abs=ATOL
        ), key
    trls_own_evaluation_metrics(trainer, metrics, "compiled")
