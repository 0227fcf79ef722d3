"""The trainer matrix's PEFT rows (docs/supported.md): a tied Llama adapted by PEFT, trained by each trainer door
(the Hugging Face ``Trainer``, TRL's ``SFTTrainer``, Lightning, the plain loop), every published figure against an independent
reference.

Cases: ``lora_both``: LoRA on the embedding and the head (no ``ensure_weight_tying``: two effective matrices
``W + s B A``, untied); ``lora_embedding``: LoRA on the embedding only, the head frozen (TRL refuses LoRA on the
head); ``modules_to_save``: LoRA on ``q_proj``, the head a trained copy, the embedding frozen. A frozen matrix is
said once, nothing published for it. ``trainable_tokens``: 3 rows of the embedding train as a delta of their own:
the gradient statistics refused once with the cause, the logits still exact (under TRL on the untied family).
``lora_both_compiled``: ``lora_both`` compiled in place (``model.compile``, aot_eager) before the door: compiled code
hides the LoRA head's output gradient, so its gradient statistics are refused once, as the plain loop's; the
embedding's stay exact. Other PEFT methods (IA3, DoRA, OFT; VeRA and BOFT in the plain loop): refused at attach, the
method named, the logits exact.

References: float64 statistics of the logits of each loss forward (the adapted model's ``outputs.logits``; under
TRL's fused head, a fresh forward from the hidden states the loss's forward fed its first layer); gradients: an
untied plain twin whose two matrices are the adapted modules' rows as their own forwards compute them
(``emb(arange(V))``, ``head(I).T``), by autograd on the batches the door trained on: its ``.grad`` are the
effective matrices' gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.matrices import D, V, twin_grads, untied_twin
from tests.helpers.trainer_matrix import (
    STEPS,
    H,
    assert_logits,
    door_run,
    family,
    grad_reference,
    headwatch_warnings,
    logits_reference,
)  # fmt: skip

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

CASES = {
    "lora_both": {"target_modules": ["embed_tokens", "lm_head"]},
    "lora_both_compiled": {
        "target_modules": ["embed_tokens", "lm_head"]
    },  # model.compile() before the door
    "modules_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "lora_embedding": {"target_modules": ["embed_tokens"]},
    "trainable_tokens": {
        "target_modules": ["embed_tokens"],
        "token_indices": [1, 2, 3],
    },
}
# PEFT methods other than LoRA, on the head or the embedding: their matrix is not the base (IA3 scales, OFT rotates,
# DoRA rescales columns) and headwatch does not compute it: refused at attach, the method named in one warning
OTHER = {
    "ia3_head": (
        lambda: peft.IA3Config(target_modules=["lm_head"], feedforward_modules=[]),
        "PEFT ia3",
    ),
    "dora_both": (
        lambda: peft.LoraConfig(
            r=4, use_dora=True, target_modules=["embed_tokens", "lm_head"]
        ),
        "DoRA",
    ),
    "oft_embedding": (
        lambda: peft.OFTConfig(target_modules=["embed_tokens"]),
        "PEFT oft",
    ),
    "vera_head": (
        lambda: peft.VeraConfig(r=4, target_modules=["lm_head"]),
        "PEFT vera",
    ),
    "boft_head": (
        lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["lm_head"]),
        "PEFT boft",
    ),
}
# TRL refuses an adapter on the head itself (its fused head reads ``lm_head.weight``; trainable tokens on a tied
# model adapt the head too): the embedding's LoRA there
RUNS = [
    (door, case)
    for door in ("hf_trainer", "lightning")
    for case in ("lora_both", "modules_to_save")
]
RUNS += [
    ("sft_trainer", "lora_embedding"),
    ("sft_trainer", "modules_to_save"),
    ("loop", "modules_to_save"),
]
RUNS += [
    ("lightning", "trainable_tokens"),
    (
        "sft_trainer",
        "trainable_tokens",
    ),  # on the untied family: TRL refuses it on a tied head
]  # refused: the gradient statistics
RUNS += [
    ("hf_trainer", "lora_both_compiled"),
    ("lightning", "lora_both_compiled"),
]  # refused: the LoRA head's gradient statistics (as the plain loop's)
RUNS += [
    ("hf_trainer", "ia3_head"),
    ("lightning", "dora_both"),
    ("sft_trainer", "oft_embedding"),  # TRL refuses an adapter on the head
]  # refused at attach: the gradient statistics


UNTIED = "gemma2_softcap"


def adapted(case: str, door: str = ""):
    """The tied Llama of the matrix, adapted (LoRA weights not zero: the adapters change the matrices), and the
    untied plain twin of its effective matrices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warnings about tied layers
        model = peft.get_peft_model(
            family(
                UNTIED
                if door == "sft_trainer" and case == "trainable_tokens"
                else "llama_tied"
            ),
            OTHER[case][0]()
            if case in OTHER
            else peft.TrainableTokensConfig(**CASES[case])
            if case == "trainable_tokens"
            else peft.LoraConfig(
                r=4, lora_alpha=8, init_lora_weights=False, **CASES[case]
            ),
        )
    if case in OTHER:
        return model, None
    if case == "modules_to_save":
        with torch.no_grad():  # the trained copy differs from the frozen embedding
            model.get_output_embeddings().modules_to_save["default"].weight.mul_(1.5)
    twin = untied_twin(
        family("llama_tied")
    )  # the same seeded weights as the adapted model's frozen base
    with torch.no_grad():
        twin.get_input_embeddings().weight.copy_(
            model.get_input_embeddings()(torch.arange(V))
        )
        twin.lm_head.weight.copy_(model.get_output_embeddings()(torch.eye(D)).T)
        twin.model.layers[0].self_attn.q_proj.weight.copy_(
            model.get_base_model().model.layers[0].self_attn.q_proj(torch.eye(D)).T
        )
    if case.endswith(
        "_compiled"
    ):  # AOTAutograd as inductor does, without its C++ build
        model.compile(backend="aot_eager")
    return model, twin


@pytest.mark.parametrize("door, case", RUNS)
def test_peft_on_a_tied_model_through_each_door(tmp_path, door, case):
    model, twin = adapted(case, door)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values, seen, logits = door_run(door, model, tmp_path)
    finally:
        torch._dynamo.reset()
    said = headwatch_warnings(caught)
    if (
        case in OTHER
    ):  # refused at attach, the method named; the logits still exact, no gradient figure
        assert (
            len(said) == 1 and OTHER[case][1] in said[0] and "cannot measure" in said[0]
        ), said
        assert len(values) == STEPS and len(logits) == STEPS
        for step in range(STEPS):
            assert_logits(values[step], logits_reference([logits[step]], [seen[step]]))
            assert not any(
                k.startswith((f"{H}/grad/", f"{H}/update/")) for k in values[step]
            ), values[step]
        return
    expected = twin_grads(twin, seen[:STEPS])
    trains = {"embedding": case != "modules_to_save", "head": case != "lora_embedding"}
    if (
        case == "trainable_tokens"
    ):  # only 3 rows train, as a delta of their own: refused once, with the cause
        assert len(said) == 1 and "trainable tokens" in said[0], said
        trains = {}
    elif (
        case == "lora_both_compiled"
    ):  # compiled code hides the LoRA head's output gradient: refused, said once
        assert len(said) == 1 and "torch.compile" in said[0], said
        assert "head's gradient statistics are not reported" in said[0], said
        trains = {"embedding": True, "head": False}
    elif case != "lora_both":  # the frozen matrix said once
        assert len(said) == 1 and "FROZEN" in said[0], said
    else:
        assert said == [], said
    assert len(values) == STEPS and len(logits) == STEPS
    pad = None  # the tiny Llama has no padding_idx
    for step in range(STEPS):
        got = values[step]
        assert_logits(got, logits_reference([logits[step]], [seen[step]]))
        if door == "hf_trainer" and case.endswith(
            "_compiled"
        ):  # no eager forward returns the loss: no self-check
            assert f"{H}/check/nll_gap" not in got
        else:
            assert (
                abs(got[f"{H}/check/nll_gap"]) < 1e-5
                and got[f"{H}/check/mismatch"] == 0
            )
        if not trains:
            assert not any(
                k.startswith((f"{H}/grad/shared_row", f"{H}/grad/embedding_row"))
                for k in got
            )
            continue
        assert got[f"{H}/grad/tied"] == 0.0  # two effective matrices
        for role, trained in trains.items():
            if not trained:
                assert not any(k.startswith(f"{H}/grad/{role}_row") for k in got), role
                continue
            for key, want in grad_reference({role: expected[step][role]}, pad).items():
                assert got[f"{H}/grad/{key}"] == pytest.approx(
                    want, rel=1e-4, abs=1e-7
                ), (role, key)


@pytest.mark.parametrize("case", ["vera_head", "boft_head"])
def test_the_plain_loop_refuses_other_adapters_at_construction_naming_the_method(case):
    """``Headwatch(model)`` is not a trainer hook: it raises, the method named, rather than measure the base."""
    from headwatch import Headwatch
    from headwatch.errors import HeadwatchError

    model, _ = adapted(case)
    with pytest.raises(HeadwatchError, match=OTHER[case][1]):
        Headwatch(model, monitors=["tokens", "logits", "gradients"])


@pytest.mark.parametrize("name", ["llama_tied", UNTIED])
def test_sft_trainer_refuses_lora_on_both_compiled_at_construction(tmp_path, name):
    """LoRA on the embedding and the head under TRL's ``SFTTrainer`` with ``torch_compile=True``: TRL itself raises
    at construction, on the tied and the untied family (its fused head multiplies by ``lm_head.weight``, so the
    head's adapter would never train); nothing for headwatch to measure."""
    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers.trainer_matrix import hf_args, sft_rows, word_ids_tokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warnings about tied layers
        model = peft.get_peft_model(
            family(name), peft.LoraConfig(r=4, **CASES["lora_both"])
        )
    config = hf_args(tmp_path, trl.SFTConfig, completion_only_loss=True, bf16=False, torch_compile=True,
                     torch_compile_backend="aot_eager")  # fmt: skip
    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    with pytest.raises(
        ValueError, match="Applying a PEFT adapter to `lm_head` is not supported"
    ):
        trl.SFTTrainer(model=model, args=config, train_dataset=sft_rows(STEPS * 2, seed=3),
                       processing_class=word_ids_tokenizer(), callbacks=[cb])  # fmt: skip
