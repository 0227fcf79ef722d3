"""The Hugging Face Trainer run of ``tests/workers/hf_ddp.py`` under DeepSpeed ZeRO (stage from argv), 2 CPU processes.

``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/workers/hf_deepspeed.py OUT STAGE``: the same model, data
and global batches as ``python tests/workers/hf_ddp.py OUT`` (one process, no DeepSpeed); each rank writes
``OUT/rank<r>.json`` (``{global_step: {name: value}}``) and ``OUT/warnings<r>.json`` (headwatch's warnings).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from deepspeed_plain import without_shared_memory_all_reduce
from hf_ddp import GLOBAL_BATCH, V, InOrder, Rows, write_records  # this directory is sys.path[0] under torchrun

from headwatch.integrations.transformers import HeadwatchCallback


def main(out: str, stage: int) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    without_shared_memory_all_reduce()  # before TrainingArguments, which starts DeepSpeed's process group
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}  # partition even the tiny matrices
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_allow_untested_optimizer": True, "zero_optimization": zero}  # fmt: skip
    args = TrainingArguments(
        output_dir=out, max_steps=4, logging_steps=2, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=1e-2, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, deepspeed=ds,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = InOrder(model=LlamaForCausalLM(config), args=args, train_dataset=Rows(), callbacks=[HeadwatchCallback()])
        trainer.train()
    rank = write_records(trainer, out)
    said = sorted({str(w.message) for w in caught if "Monitor" in str(w.message) or "headwatch" in str(w.message).lower()})
    (Path(out) / f"warnings{rank}.json").write_text(json.dumps(said))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
