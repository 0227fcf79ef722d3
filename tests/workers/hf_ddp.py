"""A Hugging Face Trainer run with every headwatch monitor, on 1 process or under torchrun (gloo, CPU).

``python tests/workers/hf_ddp.py OUT`` (one process, batch 4) or ``torchrun --nproc_per_node 2
tests/workers/hf_ddp.py OUT`` (two processes, batch 2 each): the same global batches, in order.
Each rank writes ``OUT/rank<r>.json``: ``{global_step: {name: value}}`` of every headwatch record; the
Trainer saves ``OUT/checkpoint-4`` (with headwatch's ``headwatch_state.pt``) at the last step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from headwatch.integrations.transformers import HeadwatchCallback

V, T, ROWS, GLOBAL_BATCH = 64, 10, 8, 4


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 48, (ROWS, T), generator=g)
        self.ids[:, ::3] = 5  # a frequent token

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i], "labels": labels, "attention_mask": torch.ones(T, dtype=torch.long)}


class InOrder(Trainer):
    """Sequential batches, so that 2 x 2 rows per step are the 4 rows one process takes."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def write_records(trainer: Trainer, out: str) -> int:
    """``OUT/rank<r>.json``: ``{global_step: {name: value}}`` of every headwatch record; returns the rank."""
    records: dict[int, dict[str, float]] = {}
    for r in trainer.state.log_history:
        records.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k.startswith("headwatch/")})
    rank = trainer.args.process_index
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({s: v for s, v in records.items() if v}))
    return rank


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    args = TrainingArguments(
        output_dir=out, max_steps=4, logging_steps=2, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=1e-2, report_to="none", use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        save_strategy="steps", save_steps=4, save_only_model=True, disable_tqdm=True, ddp_find_unused_parameters=False, seed=0,
    )  # fmt: skip
    cb = HeadwatchCallback()
    trainer = InOrder(model=LlamaForCausalLM(config), args=args, train_dataset=Rows(), callbacks=[cb])
    trainer.train()
    rank = write_records(trainer, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
