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
gives no headwatch warning at all. docs/supported.md holds the table these tests back; the Lightning column is in
``test_trainer_matrix_lightning.py``, TRL's in ``test_trainer_matrix_trl.py``.
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening, Trainer

from headwatch.integrations.loop import Headwatch
from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.capture import causal_ce
from tests.helpers.matrices import D, V, untied_twin
from tests.helpers.trainer_matrix import (
    ATOL,
    FAMILIES,
    SOFTCAP,
    STEPS,
    B,
    GradRecorder,
    H,
    KeepLastLogits,
    LogitsRecorder,
    Rows,
    T,
    assert_grads,
    assert_logits,
    assert_unlabelled,
    check_hf_door,
    family,
    headwatch_warnings,
    hf_args,
    is_tied,
    logits_reference,
    packed,
)  # fmt: skip

transformers = pytest.importorskip("transformers")


def test_the_families_are_what_the_matrix_claims():
    """The matrix's premise: one tied family, embeddings scaled by ``sqrt(d_model)`` in their own forward, and
    softcapping that bends the logits (capped below ``SOFTCAP``, not a scaled copy of the uncapped ones)."""
    ids = torch.arange(1, 6)[None]
    for name, tied, scale in (
        ("llama_tied", True, 1.0),
        ("gemma_scaled", True, D**0.5),
        ("gemma2_softcap", False, D**0.5),
    ):
        model = family(name)
        emb = model.get_input_embeddings()
        assert is_tied(model) == tied, name
        torch.testing.assert_close(
            emb(ids), scale * emb.weight[ids].detach(), rtol=1e-3, atol=0
        )
    model = family("gemma2_softcap")
    capped = model(input_ids=ids).logits
    model.config.final_logit_softcapping = None
    raw = model(input_ids=ids).logits
    torch.testing.assert_close(capped, SOFTCAP * torch.tanh(raw / SOFTCAP))
    assert (raw - capped).abs().max() > 1e-3  # tanh bends this model's logits


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
    "padding_free",
    "gradient_checkpointing",
    "short_last_window",
]
# the door's own mechanics (a collator, checkpointing, an accumulation window): on the tied and the untied family,
# not the third (its scaled embedding is covered by the other features), to keep the suite's time
DOOR_ONLY = ("padding_free", "gradient_checkpointing", "short_last_window")
HF_CASES = [
    (n, f)
    for f in HF_FEATURES
    for n in FAMILIES
    if not (n == "gemma_scaled" and f in DOOR_ONLY)
]
# micro-batches per optimizer step: 6 rows in batches of 2, two per window, so the last window holds one
WINDOWS = {"gradient_accumulation": [2] * STEPS, "short_last_window": [2, 1]}


def hf_run(model, out, feature: str, headwatch: bool):
    """One HF Trainer run of ``feature``; returns (trainer, callback, batches seen, grads, logits recorder, warnings)."""
    kw = {
        "label_smoothing": {"label_smoothing_factor": 0.1},
        "gradient_accumulation": {"gradient_accumulation_steps": 2},
        "short_last_window": {"gradient_accumulation_steps": 2},
        # transformers 5's name of gradient_checkpointing
        "gradient_checkpointing": {"activation_checkpointing": True},
        "neftune": {"neftune_noise_alpha": 5.0},
        "torch_compile": {
            "torch_compile": True,
            "torch_compile_backend": "aot_eager",
        },  # the Trainer wraps the model
    }.get(feature, {})
    if not headwatch:  # the twin's reference gradients: eager autograd is the reference (and compiling costs seconds)
        kw.pop("torch_compile", None), kw.pop("torch_compile_backend", None)
    extra = {"compute_loss_func": causal_ce} if feature == "compute_loss_func" else {}
    if feature == "two_eval_sets":
        extra["eval_dataset"] = {"wiki": Rows(5, seed=11), "code": Rows(6, seed=12)}
    if feature == "evaluate_before_train":
        extra["eval_dataset"] = Rows(5, seed=11)
    # each batch one row of B sequences, position_ids restarting at each
    if feature == "padding_free":
        extra["data_collator"] = DataCollatorWithFlattening()
    cls = KeepLastLogits if feature == "logits_to_keep" else Trainer
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
        trainer = cls(
            model=model,
            args=hf_args(out, **kw),
            train_dataset=Rows(6 if feature == "short_last_window" else 8, seed=3),
            callbacks=[c for c in (cb, grads) if c],
            **extra,
        )
        seen: list[dict] = []
        collate = trainer.data_collator
        trainer.data_collator = lambda rows: seen.append(collate(rows)) or seen[-1]
        logits = LogitsRecorder(model)
        metrics = (
            trainer.evaluate() if feature == "evaluate_before_train" else None
        )  # hooks attached at construction
        seen.clear()  # the evaluation's batches went through the collator too
        trainer.train()
        if (
            feature == "second_train"
        ):  # the same Trainer and callback, a new run (a search trial): starts empty
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


@pytest.mark.parametrize(
    "name, feature", HF_CASES, ids=[f"{n}-{f}" for n, f in HF_CASES]
)
def test_hf_trainer(tmp_path, name, feature):
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    # the first layer's attention calls: its recomputation in the backward too, under checkpointing
    layer_calls = []
    counter = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *a: layer_calls.append(1)
    )
    trainer, cb, seen, grads, logits, said, metrics = hf_run(
        model, tmp_path / "run", feature, headwatch=True
    )
    twin_grads = (
        hf_run(twin, tmp_path / "twin", feature, headwatch=False)[3]
        if twin is not None
        else None
    )
    if feature == "logits_to_keep":
        assert (
            len(said) == 1
            and f"last {KeepLastLogits.K} positions of each row" in said[0]
        ), said
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
    self_check = feature not in (
        "label_smoothing",
        "compute_loss_func",
        "logits_to_keep",
        "torch_compile",
    )  # no eager forward returns the loss
    counter.remove()
    # the premise: the layer ran again in the backward, the head once
    if feature == "gradient_checkpointing":
        assert len(layer_calls) == 2 * STEPS and len(logits) == STEPS
    per_step = WINDOWS.get(feature, [1] * STEPS)
    # the premise: the two micro-batches of a window hold different label counts
    if feature in WINDOWS:
        counts = [
            int((b["labels"][:, 1:] != -100).sum()) for b in seen[: sum(per_step)]
        ]
        assert any(
            counts[i] != counts[i + 1] for i in range(0, 2 * per_step.count(2), 2)
        ), counts
    # one row of B sequences, the second's first label the separator
    if feature == "padding_free":
        assert all(packed(b) for b in seen)
    check_hf_door(trainer, cb.latest, seen, grads, logits, metrics, twin_grads, model, per_step, self_check,
                  smoothed=feature == "label_smoothing", split_refused_first=feature == "torch_compile")  # fmt: skip


# ====================================================================================== plain loop
LOOP_FEATURES = [
    "plain",
    "gradient_accumulation",
    "no_labels",
    "logits_to_keep",
    "compile",
    "padding_free",
    "gradient_checkpointing",
    "short_last_window",
]
LOOP_CASES = [
    (n, f)
    for f in LOOP_FEATURES
    for n in FAMILIES
    if not (n == "gemma_scaled" and f in DOOR_ONLY)
]
KEEP = 5


def loop_loss(model, batch: dict, feature: str) -> torch.Tensor:
    """The step's loss as a plain-loop user writes it for ``feature``."""
    if (
        feature == "no_labels"
    ):  # the model gets no labels; the loss is computed outside from the logits
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, V),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
        )
    if (
        feature == "logits_to_keep"
    ):  # a loss on the logits of the last KEEP positions only
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            logits_to_keep=KEEP,
        ).logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, V),
            batch["labels"][:, -KEEP + 1 :].reshape(-1),
            ignore_index=-100,
        )
    return model(**batch).loss


def loop_twin_grads(
    twin, micro: list[list[dict]], feature: str
) -> list[dict[str, torch.Tensor]]:
    """Autograd on the untied twin, the same loss, accumulated over each step's micro-batches."""
    out = []
    for group in micro:
        for batch in group:
            (loop_loss(twin, batch, feature) / len(group)).backward()
        out.append(
            {
                "embedding": twin.get_input_embeddings().weight.grad.clone(),
                "head": twin.lm_head.weight.grad.clone(),
            }
        )
        twin.zero_grad()
    return out


@pytest.mark.parametrize(
    "name, feature", LOOP_CASES, ids=[f"{n}-{f}" for n, f in LOOP_CASES]
)
def test_plain_loop(name, feature):
    """``plain``: ``model(**batch).loss``; ``gradient_accumulation``: two micro-batches per optimizer step;
    ``no_labels``: the model gets no labels (the loss is computed outside from the logits): target statistics
    NaN, entropy over every attended position, said once, nothing else; ``logits_to_keep``: the loss uses the
    last ``KEEP`` positions, those only are measured, said once; ``compile``: ``model.compile()`` (aot_eager)
    before headwatch attaches; ``padding_free``: each batch one row of ``B`` sequences with ``position_ids``
    (``DataCollatorWithFlattening``); ``gradient_checkpointing``: ``model.activation_checkpointing_enable()``
    (transformers 5's name of ``gradient_checkpointing_enable``); ``short_last_window``: three micro-batches, two
    in the first optimizer step, one in the last, each loss over its window's micro-batches."""
    model = family(name)
    twin = untied_twin(model) if is_tied(model) else None
    windows = WINDOWS.get(feature, [1] * STEPS)  # micro-batches per optimizer step
    collate = DataCollatorWithFlattening() if feature == "padding_free" else None
    rows = Rows(B * sum(windows), seed=3)
    data = list(torch.utils.data.DataLoader(rows, batch_size=B, collate_fn=collate))
    ends = list(accumulate(windows))
    micro = [data[end - n : end] for n, end in zip(windows, ends, strict=True)]
    assert feature != "padding_free" or all(packed(b) for b in data)
    twin_grads = loop_twin_grads(twin, micro, feature) if twin is not None else None
    if feature == "compile":
        model.compile(backend="aot_eager")
    if feature == "gradient_checkpointing":
        model.activation_checkpointing_enable()
    # the first layer's attention calls: its recomputation in the backward too, under checkpointing
    layer_calls = []
    counter = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *a: layer_calls.append(1)
    )
    recorder = LogitsRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    values, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hw = Headwatch(
            model,
            monitors=["tokens", "logits", "gradients"],
            log_every_n_steps=1,
            figure_every_n_steps=0,
        )
        for step, group in enumerate(micro):
            for batch in group:
                hw.step_start(
                    {k: v for k, v in batch.items() if k != "labels"}
                    if feature == "no_labels"
                    else batch,
                    step,
                )
                (loop_loss(model, batch, feature) / len(group)).backward()
            hw.before_optimizer_step()
            grads.append(
                {
                    "embedding": model.get_input_embeddings().weight.grad.clone(),
                    "head": model.lm_head.weight.grad.clone(),
                }
            )
            opt.step()
            hw.after_optimizer_step()
            opt.zero_grad()
            values.append(hw.step_end())
        hw.close()
    recorder.remove(), counter.remove()
    said = headwatch_warnings(caught)
    pad = model.get_input_embeddings().padding_idx
    checkpointed = 2 if feature == "gradient_checkpointing" else 1
    assert len(layer_calls) == checkpointed * len(data) == checkpointed * ends[-1]
    for step, group in enumerate(micro):
        got, logits = (
            values[step],
            recorder.logits[ends[step] - len(group) : ends[step]],
        )
        assert got[f"{H}/debug/capture/forwards"] == len(group)
        assert got[f"{H}/tokens/total"] == B * T * ends[step]
        assert_grads(got, grads[step], twin_grads[step] if twin_grads else None, pad)
        if feature == "no_labels":
            assert_unlabelled(got, logits[0])  # every attended position: no labels select them
            assert (
                f"{H}/check/nll_gap" not in got
            )  # no reference loss from the model: nothing compared
            continue
        want = logits_reference(logits, group)
        assert_logits(got, want)
        assert (
            got[f"{H}/debug/capture/positions"]
            == got[f"{H}/debug/capture/labelled_positions"]
            == want["positions"]
        )
        if feature in (
            "logits_to_keep",
            "compile",
        ):  # no loss from an eager forward: nothing compared (said once)
            assert f"{H}/check/nll_gap" not in got
        else:
            assert (
                abs(got[f"{H}/check/nll_gap"]) < 1e-5
                and got[f"{H}/check/mismatch"] == 0
            )
            assert got[f"{H}/debug/check/reference_nll"] == pytest.approx(
                want["nll"], abs=ATOL
            )
    if feature == "no_labels":
        assert (
            len(said) == 1
            and "no `labels` in a training dict batch" in said[0]
            and "every attended position" in said[0]
        ), said
    elif feature == "logits_to_keep":
        assert len(said) == 1 and f"last {KEEP} positions of each row" in said[0], said
    else:
        assert said == [], said
