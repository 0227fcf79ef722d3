"""Fine-tune a tiny Llama with the Hugging Face ``Trainer`` and watch both ends of it with headwatch.

The same corpus and tokenizer as ``examples/train_tiny_lm.py`` (the running Python's
standard-library source, a byte-level BPE trained on it; nothing is downloaded), a
``LlamaForCausalLM`` built from a small ``LlamaConfig`` (tied or untied head), and
``headwatch.integrations.transformers.HeadwatchCallback`` with every monitor (token
frequency, logit statistics, gradient density with the tied split, synonym collision).
The Trainer logs headwatch's values with its own (``report_to="tensorboard"``): they appear
as ``train/headwatch/...`` next to ``train/loss``, with the headwatch page under CUSTOM SCALARS.

Usage::

    pip install -e ".[examples]" transformers accelerate
    python examples/hf_trainer.py                     # tied
    python examples/hf_trainer.py --no-tie-weights    # untied
    tensorboard --logdir runs-hf

Tests import :func:`main` and call it with small settings; it returns a summary dict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tiny_lm import END_OF_TEXT, TokenWindows, encode_documents, read_corpus, stdlib_source_files, train_tokenizer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from headwatch.integrations.transformers import HeadwatchCallback  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-corpus-mb", type=float, default=2.0, help="megabytes of standard-library source to train on")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (>= 257)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per training window")
    p.add_argument("--d-model", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--logging-steps", type=int, default=10, help="the Trainer's logging_steps: headwatch measures on them")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=True, help="tie embed_tokens and lm_head")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out tail of the token stream")
    p.add_argument("--output-dir", default="runs-hf", help="Trainer output_dir (TensorBoard logs under it)")
    return p


def build_model(vocab_size: int, args: argparse.Namespace, eos_id: int) -> LlamaForCausalLM:
    """A small Llama from a config (random weights)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.d_model // 32), max_position_embeddings=args.block_size,
        tie_word_embeddings=args.tie_weights, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size must be >= 257 (the byte alphabet and {END_OF_TEXT}), got {args.vocab_size}")
    torch.manual_seed(0)
    docs = read_corpus(stdlib_source_files(), max_bytes=int(args.max_corpus_mb * 2**20))
    tokenizer = train_tokenizer(docs, vocab_size=args.vocab_size)
    tokens = encode_documents(tokenizer, docs)  # (N,) int64
    split = int(len(tokens) * (1 - args.val_fraction))
    train, val = TokenWindows(tokens[:split], args.block_size), TokenWindows(tokens[split:], args.block_size)
    model = build_model(tokenizer.get_vocab_size(), args, tokenizer.token_to_id(END_OF_TEXT))
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, logging_steps=args.logging_steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=max(1, args.max_steps // 20), lr_scheduler_type="cosine",
        eval_strategy="steps", eval_steps=max(args.logging_steps, args.max_steps // 2), report_to="tensorboard",
        save_strategy="no", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    callback = HeadwatchCallback()  # every monitor: tokens, logits, gradients, collision
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=val, callbacks=[callback])
    trainer.train()
    final = trainer.evaluate()
    summary = {
        "tie_weights": args.tie_weights,
        "vocab_size": tokenizer.get_vocab_size(),
        "steps": trainer.state.global_step,
        "logged_steps": sorted({r["step"] for r in trainer.state.log_history if "headwatch/logits/entropy" in r}),
        "final_eval_loss": final["eval_loss"],
        **{k.removeprefix("headwatch/"): v for k, v in callback.latest.items()},
    }
    print(
        f"{'tied' if args.tie_weights else 'untied'} Llama, V={summary['vocab_size']}: eval loss {final['eval_loss']:.3f} nats, "
        f"entropy {summary.get('logits/entropy', float('nan')):.3f} nats, embedding row density "
        f"{summary.get('grad/embedding_row_density', float('nan')):.3f}; TensorBoard: tensorboard --logdir {args.output_dir}"
    )
    return summary


if __name__ == "__main__":
    main()
