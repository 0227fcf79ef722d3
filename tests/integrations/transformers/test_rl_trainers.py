"""TRL trainers the Hugging Face door does not understand (docs/rl.md): ``DPOTrainer`` and ``KTOTrainer`` are
refused by the logit statistics with ONE message naming them; the other monitors go on (the gradients against
float64 row statistics of the real ``.grad``); no logits/ figure, in training as in evaluation."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")

from headwatch.integrations.transformers import HeadwatchCallback
from tests.helpers.rl import V, tiny_policy, word_tokenizer


def untied_policy():
    """The example's policy with a head of its own (the gradient statistics of two matrices, each its real ``.grad``)."""
    model = tiny_policy()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def preference_trainer(kind: str, tmp_path, model, callbacks):
    """TRL's ``DPOTrainer`` (prompt, chosen, rejected) or ``KTOTrainer`` (prompt, completion, a desirable label) on 4
    rows, 2 steps, every one a logging step, with a reference model and an evaluation set."""
    import trl
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(
            f"w{i}" for i in torch.randint(0, V - 2, (n,), generator=g).tolist()
        )

    prompts = [words(3) for _ in range(4)]
    if kind == "DPO":
        data = Dataset.from_dict(
            {
                "prompt": prompts,
                "chosen": [" " + words(4) for _ in range(4)],
                "rejected": [" " + words(4) for _ in range(4)],
            }
        )
    else:
        data = Dataset.from_dict(
            {
                "prompt": prompts,
                "completion": [" " + words(4) for _ in range(4)],
                "label": [True, False, True, False],
            }
        )
    args = getattr(trl, f"{kind}Config")(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                                         report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, max_grad_norm=0.0)  # fmt: skip
    return getattr(trl, f"{kind}Trainer")(model=model, ref_model=tiny_policy(), args=args, train_dataset=data, eval_dataset=data,
                                          processing_class=word_tokenizer(), callbacks=callbacks)  # fmt: skip


def row_statistics(grad: torch.Tensor, padding_idx: int | None) -> dict[str, float]:
    """float64 density, mean and max row norm of a ``(V, d_model)`` gradient over the rows that can train (the
    padding row out: headwatch's valid rows, for both matrices)."""
    norms = grad.double().norm(dim=1)
    if padding_idx is not None:
        norms = torch.cat([norms[:padding_idx], norms[padding_idx + 1 :]])
    return {
        "row_density": float((norms > 0).double().mean()),
        "row_norm_mean": float(norms.mean()),
        "row_norm_max": float(norms.max()),
    }


@pytest.mark.parametrize("kind", ["DPO", "KTO"])
def test_a_preference_trainer_refuses_the_logits_once_and_measures_the_gradients_exactly(
    tmp_path, kind
):
    """The logit statistics refused with one warning naming the trainer (its loss scores chosen against rejected
    completions with a reference model, not one completion against its labels): no ``logits/`` figure in training
    or evaluation, no NLL to compare; the gradient statistics equal float64 row statistics of the real ``.grad`` at
    each optimizer step."""
    from tests.helpers.trainer_matrix import GradRecorder

    cb, grads = (
        HeadwatchCallback(
            monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
        ),
        GradRecorder(),
    )
    model = untied_policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = preference_trainer(kind, tmp_path, model, [cb, grads])
        trainer.train()
        metrics = trainer.evaluate()
    said = [
        str(w.message)
        for w in caught
        if f"{kind}Trainer is not supported" in str(w.message)
    ]
    assert len(said) == 1 and "docs/rl.md" in said[0]
    assert not any(
        "/logits/" in k
        for r in trainer.state.log_history
        for k in r
        if k.startswith("headwatch/")
    )
    assert not any("headwatch/" in k and "/logits/" in k for k in metrics)
    assert not any(
        k.startswith("headwatch/check/") and "nll" in k for k in cb.latest
    )  # no NLL to compare: none shown
    assert not any(k.startswith("headwatch/rl/") for k in cb.latest)
    logged = [
        r for r in trainer.state.log_history if "headwatch/grad/head_row_density" in r
    ]
    assert len(logged) == len(grads.grads) == 2
    pad = model.get_input_embeddings().padding_idx
    for got, real in zip(logged, grads.grads, strict=True):
        assert got["headwatch/grad/tied"] == 0.0
        for name in ("embedding", "head"):
            for key, value in row_statistics(real[name], pad).items():
                assert got[f"headwatch/grad/{name}_{key}"] == pytest.approx(
                    value, rel=1e-5, abs=1e-7
                ), (name, key)


def test_dpo_refusal_is_said_once_at_construction(tmp_path, recwarn):
    """The message is said at the Trainer's construction (on_init_end), naming the trainer and what is supported."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_dict(
        {"prompt": ["w1 w2"] * 2, "chosen": [" w3"] * 2, "rejected": [" w4"] * 2}
    )
    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                     disable_tqdm=True, bf16=False, per_device_train_batch_size=2)  # fmt: skip
    torch.manual_seed(0)
    DPOTrainer(model=tiny_policy(), ref_model=tiny_policy(), args=args, train_dataset=data, processing_class=word_tokenizer(),
               callbacks=[HeadwatchCallback(figure_every_n_steps=0)])  # fmt: skip
    said = [
        str(w.message)
        for w in recwarn
        if "DPOTrainer is not supported" in str(w.message)
    ]
    assert len(said) == 1
    assert "GRPOTrainer" in said[0] and "docs/rl.md" in said[0]
    assert (
        "never fires" in said[0] and "update" in said[0]
    )  # what else it means for the user
