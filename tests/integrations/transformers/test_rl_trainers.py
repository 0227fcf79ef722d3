"""TRL's preference trainers through the Hugging Face door (docs/rl.md). ``DPOTrainer``: the policy's forward with
gradient through TRL's fused LM head, over the chosen and rejected completions, is measured in training and in
evaluation (TRL's own per-token values); the reference model's pass never is. ``KTOTrainer`` (its KL pass over
mismatched completions comes first in evaluation, where no gradient tells it apart) is refused by the logit
statistics with ONE message naming it. Under both, the gradient statistics equal float64 row statistics of the real
``.grad``.

References, independent of headwatch: TRL's logged ``entropy``, ``eval_entropy`` and ``mean_token_accuracy``; the
fused head's ``log_probs`` and ``label_mask`` of each policy forward (a hook of the test's own); the real ``.grad``
at each optimizer step.
"""

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


class FusedPolicy:
    """Each forward of the policy through TRL's fused head: (training, log-probabilities, label mask)."""

    def __init__(self, model):
        self.records: list[tuple[bool, torch.Tensor, torch.Tensor]] = []
        model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, out):
        if kwargs.get("fused_lm_head"):
            record = (
                module.training and torch.is_grad_enabled(),
                out.log_probs.detach().double(),
                out.label_mask.clone(),
            )
            self.records.append(record)

    def nll(self, training: bool) -> list[float]:
        """The token-mean negative log-probability of each forward (training: with gradient; else evaluation's)."""
        return [
            float(-lp[m].sum() / m.sum()) for t, lp, m in self.records if t == training
        ]

    def positions(self, training: bool) -> list[int]:
        return [int(m.sum()) for t, _, m in self.records if t == training]


def assert_gradients(trainer, grads, model) -> None:
    """Each logging step's gradient statistics against float64 row statistics of the real ``.grad``."""
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


def test_dpo_is_measured_at_its_fused_head_in_training_and_evaluation(tmp_path):
    """Training: ``logits/entropy`` equals TRL's logged ``entropy`` (1e-4 relative), ``logits/target_nll`` the fused
    head's per-token log-probabilities over the chosen and rejected completions (the values the loss sums; 1e-6
    relative), the token accuracy TRL's; the self-check agrees. ``evaluate()``: the same against ``eval_entropy`` and
    the policy's evaluation forward (the reference model's never pooled); gradients exact."""
    from tests.helpers.trainer_matrix import GradRecorder, headwatch_warnings

    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    grads, model = GradRecorder(), untied_policy()
    fused = FusedPolicy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = preference_trainer("DPO", tmp_path, model, [cb, grads])
        trainer.train()
        metrics = trainer.evaluate()
    assert headwatch_warnings(caught) == []
    history = trainer.state.log_history
    ours = [r for r in history if "headwatch/logits/entropy" in r]
    trl = [r for r in history if "entropy" in r and "loss" in r]
    nll, positions = fused.nll(True), fused.positions(True)
    assert len(ours) == len(trl) == len(nll) == 2
    for i, got in enumerate(ours):
        assert (
            abs(got["headwatch/logits/entropy"] - trl[i]["entropy"])
            <= 1e-4 * trl[i]["entropy"]
        )
        assert abs(got["headwatch/logits/target_nll"] - nll[i]) <= 1e-6 * nll[i]
        assert got["headwatch/logits/positions"] == positions[i] > 0
        assert got["headwatch/logits/target_argmax_rate"] == pytest.approx(
            trl[i]["mean_token_accuracy"], abs=1e-6
        )
        assert (
            got["headwatch/check/mismatch"] == 0
            and abs(got["headwatch/check/nll_gap"]) < 1e-5
        )
    (val_nll,), (val_positions,) = (
        fused.nll(False),
        fused.positions(False),
    )  # one policy forward of the 4 rows
    val = "eval_headwatch/val/logits"
    assert (
        abs(metrics[f"{val}/entropy"] - metrics["eval_entropy"])
        <= 1e-4 * metrics["eval_entropy"]
    )
    assert abs(metrics[f"{val}/target_nll"] - val_nll) <= 1e-6 * val_nll
    assert metrics[f"{val}/positions"] == val_positions
    assert_gradients(trainer, grads, model)


def test_kto_refuses_the_logits_once_and_measures_the_gradients_exactly(tmp_path):
    """The logit statistics refused with one warning naming the trainer: no ``logits/`` figure in training or
    evaluation, no NLL to compare; the gradient statistics exact."""
    from tests.helpers.trainer_matrix import GradRecorder

    cb = HeadwatchCallback(
        monitors=["tokens", "logits", "gradients"], figure_every_n_steps=0
    )
    grads, model = GradRecorder(), untied_policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = preference_trainer("KTO", tmp_path, model, [cb, grads])
        trainer.train()
        metrics = trainer.evaluate()
    said = [
        str(w.message)
        for w in caught
        if "KTOTrainer is not supported" in str(w.message)
    ]
    assert len(said) == 1 and "docs/rl.md" in said[0] and "KL" in said[0]
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
    assert_gradients(trainer, grads, model)


def test_the_refusal_is_said_once_at_construction(tmp_path, recwarn):
    """The message is said at the Trainer's construction (on_init_end), naming the trainer and what is supported."""
    preference_trainer(
        "KTO", tmp_path, tiny_policy(), [HeadwatchCallback(figure_every_n_steps=0)]
    )
    said = [
        str(w.message)
        for w in recwarn
        if "KTOTrainer is not supported" in str(w.message)
    ]
    assert len(said) == 1
    assert (
        "GRPOTrainer" in said[0] and "DPOTrainer" in said[0] and "docs/rl.md" in said[0]
    )
    assert (
        "never fires" in said[0] and "update" in said[0]
    )  # what else it means for the user


def test_an_evaluations_repeated_rows_under_two_rows_an_example():
    """The rows a distributed sampler repeats in an evaluation's last batch: one process has none (every row kept,
    DPO's two rows an example included); several processes and one row an example: the first ``remainder`` kept;
    several processes under ``DPOTrainer``: they cannot be told apart, so all are kept and it is said once."""
    import weakref
    from types import SimpleNamespace

    cb = HeadwatchCallback(monitors=["logits"], figure_every_n_steps=0)
    dpo = type("DPOTrainer", (), {"__module__": "trl.trainer.dpo_trainer"})()
    sft = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})()
    state = SimpleNamespace(end_of_dataloader=True, remainder=3)
    batch = {"input_ids": torch.zeros(8, 4, dtype=torch.long)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for trainer, processes, want in (
            (dpo, 1, None),
            (sft, 1, None),
            (sft, 2, 3),
            (dpo, 2, None),
            (dpo, 2, None),
        ):
            trainer.accelerator = SimpleNamespace(
                num_processes=processes, process_index=0, gradient_state=state
            )
            cb._trainer = weakref.ref(trainer)  # as set_trainer holds it
            assert cb.real_rows(batch, training=False) == want, (
                type(trainer).__name__,
                processes,
            )
    said = [
        str(w.message)
        for w in caught
        if "collates several rows per example" in str(w.message)
    ]
    assert (
        len(said) == 1
        and "DPOTrainer" in said[0]
        and "multiple of the processes" in said[0]
    )
