"""TRL trainers the Hugging Face door does not understand (docs/rl.md): ``DPOTrainer`` is
refused by the logit statistics with ONE message naming it; the other monitors go on; no logits/ figure."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("trl")

from headwatch.integrations.transformers import HeadwatchCallback  # noqa: E402
from tests.helpers.rl import V, tiny_policy, word_tokenizer  # noqa: E402


def test_dpo_trainer_is_refused_with_one_message(tmp_path):
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{i}" for i in torch.randint(0, V - 2, (n,), generator=g).tolist())

    data = Dataset.from_dict({"prompt": [words(3) for _ in range(4)], "chosen": [" " + words(4) for _ in range(4)],
                              "rejected": [" " + words(4) for _ in range(4)]})  # fmt: skip
    args = DPOConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                     report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False)  # fmt: skip
    cb = HeadwatchCallback(figure_every_n_steps=0)
    trainer = DPOTrainer(model=tiny_policy(), ref_model=tiny_policy(), args=args, train_dataset=data, processing_class=word_tokenizer(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "DPOTrainer is not supported" in str(w.message)]
    assert len(said) <= 1  # once (it may have been said at the Trainer's construction already)
    assert not any(k.startswith("headwatch/logits/") for r in trainer.state.log_history for k in r)
    assert any(k.startswith("headwatch/grad/") for k in cb.latest)  # the other monitors go on
    assert not any(k.startswith("headwatch/rl/") for k in cb.latest)
    assert not any(k.startswith("headwatch/check/") and "nll" in k for k in cb.latest)  # no NLL to compare: none shown


def test_dpo_refusal_is_said_once_at_construction(tmp_path, recwarn):
    """The message is said at the Trainer's construction (on_init_end), naming the trainer and what is supported."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_dict({"prompt": ["w1 w2"] * 2, "chosen": [" w3"] * 2, "rejected": [" w4"] * 2})
    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                     disable_tqdm=True, bf16=False, per_device_train_batch_size=2)  # fmt: skip
    torch.manual_seed(0)
    DPOTrainer(model=tiny_policy(), ref_model=tiny_policy(), args=args, train_dataset=data, processing_class=word_tokenizer(),
               callbacks=[HeadwatchCallback(figure_every_n_steps=0)])  # fmt: skip
    said = [str(w.message) for w in recwarn if "DPOTrainer is not supported" in str(w.message)]
    assert len(said) == 1
    assert "GRPOTrainer" in said[0] and "docs/rl.md" in said[0]
    assert "never fires" in said[0] and "update" in said[0]  # what else it means for the user
