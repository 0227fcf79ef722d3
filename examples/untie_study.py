"""Untie a tied model mid-training, three ways, and measure the effect with headwatch's own monitors.

Trains the example's tied GPT (``tiny_lm.TinyLM``, the ``train_tiny_lm.py`` job's model and
data) for ``--pretrain-steps`` optimizer steps, saves a checkpoint, then forks three
continuations of ``--fork-steps`` steps each from that checkpoint:

- ``tied``: the model as it was;
- ``untied_copy``: ``untie_output_head(model, init="copy")``: the same logits at the fork;
- ``untied_normal_warmup``: ``untie_output_head(model, init="normal", std=0.02)`` (the model's
  own init std) and ``HeadWarmup`` (only the new head trains for ``--head-warmup-steps`` steps,
  at ``--head-lr``).

With the defaults the study is 1,000 optimizer steps of ``train_tiny_lm.py``'s model: measured
at 12.6 minutes wall on a 2-core machine shared with other jobs, 6 minutes of CPU time (README,
"Acting on what you see"). On a small shared CPU set ``OMP_NUM_THREADS=1``: thread
oversubscription made it about 10 times slower there.

Every branch loads the checkpoint's weights and its AdamW state by parameter name (the new
head has none: a fresh AdamW state, as after any untying), continues the learning-rate
schedule where the pre-training left it, sees the same batches (same seed), and has every
headwatch monitor attached. Each run writes to its own TensorBoard directory under
``--logdir``, so ``headwatch report <logdir>`` compares them; a ``study.json`` summary is
written there too and printed.

Usage::

    python examples/untie_study.py     # 1,000 optimizer steps of train_tiny_lm.py's model
    headwatch report runs/untie_study --html untie_study.html
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from headwatch import (
    GradientDensityMonitor,
    LogitStatsMonitor,
    SharpnessCollapseAlert,
    SynonymCollisionMonitor,
    TokenFrequency,
)
from headwatch.remedies import HeadWarmup, untie_output_head

_EXAMPLES_DIR = str(Path(__file__).resolve().parent)
if _EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, _EXAMPLES_DIR)
from console import TrainingLines, quiet_third_party, say  # noqa: E402
from tiny_lm import TinyLM, TinyLMConfig, TokenDataModule, encode_documents, lr_lambda, read_corpus  # noqa: E402
from tiny_lm import stdlib_source_files, train_tokenizer  # noqa: E402
from train_tiny_lm import ValLossHistory, _pad, last_scalars  # noqa: E402

BRANCHES = ("tied", "untied_copy", "untied_normal_warmup")
STATS = {
    "entropy": "headwatch/logits/entropy",
    "val_entropy": "headwatch/val/logits/entropy",
    "kl_to_uniform": "headwatch/logits/kl_to_uniform",
    "rare_rate_head": "headwatch/collision/rare_rate_head",
    "rare_rate_embedding": "headwatch/collision/rare_rate_embedding",
    "tied_flow_cosine_mean": "headwatch/grad/tied_flow_cosine_mean",
    "tied_flow_conflict_fraction": "headwatch/grad/tied_flow_conflict_fraction",
}
"""Summary field -> the headwatch scalar whose last value it reports."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="untie_study.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pretrain-steps", type=int, default=400, help="tied optimizer steps before the fork")
    p.add_argument("--fork-steps", type=int, default=200, help="optimizer steps of each continuation")
    p.add_argument("--max-corpus-mb", type=float, default=3.0, help="MiB of standard-library source to train on")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (padded to a multiple of 64)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine over all steps)")
    p.add_argument("--normal-std", type=float, default=0.02, help='std of init="normal" (TinyLM\'s init std)')
    p.add_argument("--head-warmup-steps", type=int, default=50, help="HeadWarmup steps of the third branch")
    p.add_argument("--head-lr", type=float, default=3e-3, help="the head's learning rate during HeadWarmup")
    p.add_argument("--val-check-interval", type=int, default=50)
    p.add_argument("--collision-every", type=int, default=100)
    p.add_argument("--log-every-n-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", default="runs/untie_study")
    p.add_argument("--progress-bar", action=argparse.BooleanOptionalAction, default=False)
    return p


class ForkedTinyLM(TinyLM):
    """TinyLM continuing a checkpoint: AdamW state by parameter name, the schedule from ``step_offset``."""

    fork_state: dict[str, dict[str, Any]] = {}
    step_offset: int = 0

    def configure_optimizers(self) -> dict[str, Any]:
        out = super().configure_optimizers()
        optimizer = out["optimizer"]
        names = {id(p): n for n, p in self.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = self.fork_state.get(names[id(p)])
                if state is not None:  # the untied head has none: a fresh AdamW state
                    optimizer.state[p] = {k: v.clone() for k, v in state.items()}
        hp, offset = self.hparams, self.step_offset
        out["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_lambda(step + offset, warmup_steps=hp.warmup_steps, max_steps=hp.max_steps,
                                   min_lr_ratio=hp.min_lr_ratio),
        )
        return out


def optimizer_state_by_name(checkpoint: dict[str, Any], model: TinyLM) -> dict[str, dict[str, Any]]:
    """The checkpoint's AdamW state keyed by parameter name (index order = ``model.configure_optimizers()``'s)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in model.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    saved = checkpoint["optimizer_states"][0]["state"]
    return {order[i]: state for i, state in saved.items()}


def _callbacks(tokenizer: Any, args: argparse.Namespace) -> list[Callback]:
    return [
        TokenFrequency(vocab_size=tokenizer.get_vocab_size()),
        LogitStatsMonitor(),
        GradientDensityMonitor(),
        SynonymCollisionMonitor(every_n_steps=args.collision_every, tokenizer=tokenizer),
        SharpnessCollapseAlert(entropy_floor=1.0, entropy_drop=0.3, window=5, warmup_steps=100),
    ]


def _trainer(name: str, steps: int, callbacks: list[Callback], args: argparse.Namespace) -> pl.Trainer:
    logger = TensorBoardLogger(save_dir=args.logdir, name=name, default_hp_metric=False)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, val_check_interval=min(args.val_check_interval, steps),
        check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=args.log_every_n_steps,
        logger=logger, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=args.progress_bar,
        enable_model_summary=False, default_root_dir=args.logdir,
    )


def _run(name: str, model: TinyLM, steps: int, extra: list[Callback], data: Any, tokenizer: Any,
         args: argparse.Namespace) -> tuple[pl.Trainer, dict[str, Any]]:
    """Validate, train ``steps`` steps with every monitor, validate; the run's figures."""
    pl.seed_everything(args.seed, workers=True, verbose=False)  # the same batches in every branch
    history = ValLossHistory()
    lines = [] if args.progress_bar else [TrainingLines()]
    say("training", f"{name}: {steps} optimizer steps" + ("" if args.progress_bar else ", a line every 10 s"))
    trainer = _trainer(name, steps, [history, *lines, *extra, *_callbacks(tokenizer, args)], args)
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.fit(model, datamodule=data)
    if history.history[-1][0] != trainer.global_step:
        trainer.validate(model, datamodule=data, verbose=False)
    trainer.logger.finalize("success")
    stats = last_scalars(trainer.logger.log_dir, list(STATS.values()))
    return trainer, {
        "log_dir": trainer.logger.log_dir,
        "val_loss_at_fork": history.history[0][1],
        "val_loss_end": history.history[-1][1],
        "val_history": history.history,
        **{field: stats.get(tag) for field, tag in STATS.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the study; returns (and writes to ``<logdir>/study.json``) its summary."""
    args = build_parser().parse_args(argv)
    quiet_third_party()  # Lightning's banners and tips, in this example only
    pl.seed_everything(args.seed, workers=True, verbose=False)
    say("corpus", f"reading up to {args.max_corpus_mb:g} MiB of the standard library's *.py files")
    docs = read_corpus(stdlib_source_files(), max_bytes=int(args.max_corpus_mb * 2**20))
    say("tokenizer", f"training a byte-level BPE tokenizer ({args.vocab_size:,} tokens) on {len(docs)} files, "
        "then encoding them to token ids")
    tokenizer = train_tokenizer(docs, vocab_size=args.vocab_size)
    data = TokenDataModule(encode_documents(tokenizer, docs), block_size=args.block_size, batch_size=args.batch_size)
    config = TinyLMConfig(vocab_size=_pad(tokenizer.get_vocab_size(), 64), block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, tie_weights=True)
    hparams = dict(learning_rate=args.lr, max_steps=args.pretrain_steps + args.fork_steps,
                   warmup_steps=min(20, args.pretrain_steps))

    say("model", f"tiny GPT, tied, {config.n_layer} layers, d_model {config.d_model}, {config.vocab_size:,} rows; "
        f"{args.pretrain_steps} steps, then {len(BRANCHES)} forks of {args.fork_steps}: {', '.join(BRANCHES)}")
    model = TinyLM(config, **hparams)
    trainer, pretrain = _run("pretrain", model, args.pretrain_steps, [], data, tokenizer, args)
    ckpt_path = Path(trainer.logger.log_dir) / "fork.ckpt"
    trainer.save_checkpoint(ckpt_path)
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    fork_state = optimizer_state_by_name(checkpoint, TinyLM(config, **hparams))

    summary: dict[str, Any] = {"seed": args.seed, "args": vars(args), "checkpoint": str(ckpt_path),
                               "vocab_size": config.vocab_size, "d_model": config.d_model,
                               "pretrain": pretrain, "branches": {}}
    for name in BRANCHES:
        branch = ForkedTinyLM(config, **hparams)
        branch.load_state_dict(checkpoint["state_dict"])
        branch.fork_state, branch.step_offset = fork_state, checkpoint["global_step"]
        extra: list[Callback] = []
        report = None
        if name == "untied_copy":
            report = untie_output_head(branch, init="copy")
        elif name == "untied_normal_warmup":
            report = untie_output_head(branch, init="normal", std=args.normal_std)
            extra = [HeadWarmup(warmup_steps=args.head_warmup_steps, head_lr=args.head_lr)]
        _, figures = _run(name, branch, args.fork_steps, extra, data, tokenizer, args)
        figures["params_added"] = 0 if report is None else report.params_added
        summary["branches"][name] = figures
    Path(args.logdir, "study.json").write_text(json.dumps(summary, indent=2, default=str))
    say("summary", f"written to {Path(args.logdir, 'study.json')}")
    print(format_summary(summary), flush=True)
    return summary


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_summary(s: dict[str, Any]) -> str:
    p = s["pretrain"]
    lines = [
        f"pretrain (tied, {s['args']['pretrain_steps']} steps, seed {s['seed']}): val loss {_f(p['val_loss_at_fork'])}"
        f" -> {_f(p['val_loss_end'])}; tied flows: cosine mean {_f(p['tied_flow_cosine_mean'])}, conflicting rows "
        f"{_f(p['tied_flow_conflict_fraction'])}; rare collision (head) {_f(p['rare_rate_head'])}",
        f"{'branch':<22} {'val@fork':>9} {'val@end':>9} {'entropy':>8} {'val_ent':>8} {'coll_head':>9} {'coll_emb':>9}",
    ]
    for name, b in s["branches"].items():
        lines.append(
            f"{name:<22} {_f(b['val_loss_at_fork']):>9} {_f(b['val_loss_end']):>9} {_f(b['entropy']):>8} "
            f"{_f(b['val_entropy']):>8} {_f(b['rare_rate_head']):>9} {_f(b['rare_rate_embedding']):>9}"
        )
    lines.append(f"compare: headwatch report {s['args']['logdir']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
