"""The Hugging Face door's tests: a tiny Llama with a planted collision, one batch, Trainer arguments, a word tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from headwatch.integrations.transformers import HeadwatchCallback

V, B, T = 64, 4, 10
RARE, TWIN_OF = 61, 3  # token 61 occurs once; its head row is planted parallel to row 3's


def tiny_llama(tie: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[RARE] = 3 * model.lm_head.weight[TWIN_OF]  # a planted collision (cosine 1)
    return model


def one_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (B, T), generator=g)
    ids[:, ::2] = 3  # token 3 is frequent
    ids[0, 1] = RARE
    labels = ids.clone()
    labels[:, 0] = -100  # the Trainer's token count (num_items_in_batch) then equals the shifted one
    mask = torch.ones(B, T, dtype=torch.long)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch: dict[str, torch.Tensor], repeat: int = 1):
        self.batch, self.repeat = batch, repeat

    def __len__(self):
        return B * self.repeat

    def __getitem__(self, i):
        return {k: v[i % B] for k, v in self.batch.items()}


def hf_args(tmp_path: Path, **kw) -> TrainingArguments:
    opts = dict(
        output_dir=str(tmp_path), max_steps=1, logging_steps=1, logging_first_step=True, per_device_train_batch_size=B,
        learning_rate=0.0, max_grad_norm=0.0, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    opts.update(kw)
    return TrainingArguments(**opts)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 2)} | {"<pad>": V - 2, "<eos>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def uneven_batch(seed: int = 2) -> dict[str, torch.Tensor]:
    """One batch of B rows whose rows keep different numbers of labels (so micro-batches weigh differently)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    for row, first in enumerate((1, 6, 3, 8)):  # rows label 9, 4, 7, 2 next tokens
        labels[row, :first] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(B, T, dtype=torch.long)}


def alert_run(out, max_steps: int, resume: str | None = None, extra: list | None = None) -> tuple[HeadwatchCallback, Trainer]:
    from headwatch.alerts import CollapseRules

    cb = HeadwatchCallback(monitors=["tokens", "logits"], alert=CollapseRules(entropy_floor=9.0, entropy_drop=0.01, window=2))
    args = hf_args(out, max_steps=max_steps, logging_steps=1, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    batch = one_batch()
    batch["input_ids"][:, 1] = torch.arange(40, 44)
    trainer = Trainer(model=tiny_llama(tie=True), args=args, train_dataset=Rows(batch, 3), callbacks=[cb, *(extra or [])])
    trainer.train(resume_from_checkpoint=resume)
    return cb, trainer
