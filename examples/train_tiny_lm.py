"""Train a tiny GPT on CPU (about 3 minutes a run on 2 idle CPU cores) and watch both ends of it with headwatch.

What the example shows: headwatch's callbacks (``TokenFrequency``, ``LogitStatsMonitor``,
``GradientDensityMonitor``, ``SynonymCollisionMonitor``, ``SharpnessCollapseAlert``)
added to the ``callbacks`` of an ordinary Lightning run of a
nanoGPT-style causal language model, with the input embedding (``embed_tokens``) and
the output head (``lm_head``) tied or untied (``--tie-weights`` / ``--no-tie-weights``).
While it trains, TensorBoard charts ``train_loss``, ``val_loss`` and the headwatch
scalars, among them the entropy of the next-token distribution
(``headwatch/logits/entropy``, nats) and its distance from uniform
(``headwatch/logits/kl_to_uniform = log V - entropy``, nats), for training steps and
(under ``headwatch/val/...``) for validation epochs. Run it twice, tied and untied,
and compare the two runs in one TensorBoard.

Nothing is downloaded. The corpus is, by default, the source code of the running
Python's standard library (the first ``--max-corpus-mb`` megabytes of its ``*.py``
files, in sorted order); ``--data`` trains on your own text files or folders instead.
A byte-level BPE tokenizer is trained on the corpus first (``tokenizers`` library) and
saved next to the TensorBoard logs. Validation uses held-out files: a random sample of
whole files (about ``--val-fraction`` of the corpus bytes), drawn with ``--seed``, that
neither the tokenizer nor the model trains on; the validation loss is measured before
training starts and after it ends, and both are printed. ``--seed`` also seeds Python,
NumPy and torch, so one seed reproduces one run and several seeds show the spread; it is
written to the run's ``hparams.yaml``, where ``headwatch report`` reads it to pair a tied and
an untied run of one seed.

Usage::

    pip install -e ".[examples]"
    python examples/train_tiny_lm.py                    # tied: about 3 minutes a run on 2 idle CPU cores
    python examples/train_tiny_lm.py --no-tie-weights   # untied, for comparison
    tensorboard --logdir runs

Seeds of each setting, compared with verdicts::

    for s in 1 2 3; do
      python examples/train_tiny_lm.py --seed $s --run-name tied/seed$s
      python examples/train_tiny_lm.py --seed $s --no-tie-weights --run-name untied/seed$s
    done
    headwatch report runs

On Linux, ``MALLOC_MMAP_THRESHOLD_=4000000000 python examples/train_tiny_lm.py`` runs
about 10% faster on CPU: glibc otherwise maps and unmaps every (B, T, V) logits buffer
(32 MiB here) at each step, and the page faults cost system time.

Tests import :func:`main` and call it with small settings, e.g.
``main(["--max-steps", "5", "--max-corpus-mb", "0.2", "--vocab-size", "512"])``; it
returns the summary as a dict (see :func:`main`).
"""

from __future__ import annotations

import time

_T_IMPORT = time.perf_counter()  # the imports below (torch, Lightning) take seconds: report them
if __name__ == "__main__":
    print("[start] importing torch, Lightning and headwatch (10-20 s on a cold start)", flush=True)

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from headwatch import (
    GradientDensityMonitor,
    LogitStatsMonitor,
    SharpnessCollapseAlert,
    SynonymCollisionMonitor,
    TokenFrequency,
)

_EXAMPLES_DIR = str(Path(__file__).resolve().parent)
if _EXAMPLES_DIR not in sys.path:  # tiny_lm.py sits next to this file
    sys.path.insert(0, _EXAMPLES_DIR)
from console import Clock, TrainingLines, quiet_third_party, say  # noqa: E402
from tiny_lm import (  # noqa: E402
    TinyLM,
    TinyLMConfig,
    TokenDataModule,
    TokenWindows,
    collect_text_files,
    encode_documents,
    read_corpus,
    stdlib_source_files,
    train_tokenizer,
)

IMPORT_TIME_S = time.perf_counter() - _T_IMPORT
"""Seconds this module spent importing torch, Lightning, headwatch and tiny_lm."""

RUN_TIME = "about 3 minutes a run on 2 idle CPU cores"
"""How long one run with the defaults takes, said once: the module docstring, ``--help``, the README and
``docs/getting-started/lightning.md`` give this text (``tests/test_report_example.py`` keeps them equal).
From the parts measured on an idle 2-core machine (the table in ``docs/getting-started/lightning.md``):
600 steps at 0.19 s (114 s), importing torch and Lightning (13-18 s), the tokenizer (about 18 s) and
seven validations."""

HEADWATCH_KEYS = {
    "entropy": "headwatch/logits/entropy",
    "kl_to_uniform": "headwatch/logits/kl_to_uniform",
    "val_entropy": "headwatch/val/logits/entropy",
    "val_kl_to_uniform": "headwatch/val/logits/kl_to_uniform",
    "embedding_row_density": "headwatch/grad/embedding_row_density",
    "head_row_density": "headwatch/grad/head_row_density",
    "update_embedding_row_density": "headwatch/update/embedding_row_density",
    "update_head_row_density": "headwatch/update/head_row_density",
    "update_shared_row_density": "headwatch/update/shared_row_density",
    "tied_flow_cosine_mean": "headwatch/grad/tied_flow_cosine_mean",
    "tied_flow_conflict_fraction": "headwatch/grad/tied_flow_conflict_fraction",
    "rare_rate_head": "headwatch/collision/rare_rate_head",
    "rare_rate_embedding": "headwatch/collision/rare_rate_embedding",
    "rare_count": "headwatch/collision/rare_count",
    "drift_raw_rate_head": "headwatch/collision/drift/raw_rate_head",
}
"""Summary field -> headwatch scalar name."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (the help text says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _int_or_float(text: str) -> int | float:
    """Lightning's convention for batch limits: an int is a count, a float a fraction."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface; ``--help`` documents every option."""
    parser = argparse.ArgumentParser(
        prog="train_tiny_lm.py",
        description=(
            f"Train a tiny GPT-style causal LM on CPU ({RUN_TIME} with the defaults) "
            "with every headwatch monitor and the collapse alert attached, then print a summary: validation "
            "loss before and after, logit entropy and sharpness, gradient densities, synonym collision, "
            "alerts. Watch it live with: tensorboard --logdir runs"
        ),
        formatter_class=_HelpFormatter,
    )
    data = parser.add_argument_group("data and tokenizer")
    data.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        default=None,
        help="text files or folders (read recursively; files that are not UTF-8 text are skipped) "
        "to train on instead of the standard library's *.py files",
    )
    data.add_argument(
        "--max-corpus-mb",
        type=float,
        default=3.0,
        help="read files in sorted order until this many megabytes (MiB) of text",
    )
    data.add_argument("--vocab-size", type=int, default=8192, help="target size of the byte-level BPE vocabulary")
    data.add_argument(
        "--pad-vocab-multiple",
        type=int,
        default=64,
        help="pad the model's vocabulary (embed_tokens and lm_head rows) up to a multiple of this "
        "(nanoGPT does, for efficiency; padded rows never occur in the data); 1 disables",
    )
    data.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="fraction of the corpus bytes held out for validation, as a random sample of whole files drawn "
        "with --seed (one document only: the last fraction of its tokens)",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--tie-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share one matrix between embed_tokens and lm_head (lm_head.weight = embed_tokens.weight)",
    )
    model.add_argument("--d-model", type=int, default=128, help="hidden size")
    model.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    model.add_argument("--n-head", type=int, default=4, help="attention heads (must divide --d-model)")
    model.add_argument("--block-size", type=int, default=128, help="context length in tokens")
    model.add_argument("--dropout", type=float, default=0.0, help="dropout probability")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--max-steps", type=int, default=600, help="optimizer steps")
    optim.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    optim.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    optim.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak (cosine decay)")
    optim.add_argument("--warmup-steps", type=int, default=20, help="linear warmup steps")
    optim.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    optim.add_argument(
        "--seed", type=int, default=0, help="seed for Python, NumPy and torch, and for the held-out validation files"
    )

    run = parser.add_argument_group("trainer and logging")
    run.add_argument("--accelerator", default="auto", help='Lightning accelerator: "cpu", "gpu", "auto", ...')
    run.add_argument("--devices", default="1", help="Lightning devices (a count, a list like 0,1, or auto)")
    run.add_argument("--precision", default="32-true", help='Lightning precision, e.g. "32-true", "bf16-mixed"')
    run.add_argument("--val-check-interval", type=int, default=100, help="validate every this many training steps")
    run.add_argument(
        "--limit-val-batches",
        type=_int_or_float,
        default=1.0,
        help="validation batches per validation: a fraction of the split (a float, e.g. 0.5) or a count (an int)",
    )
    run.add_argument("--log-every-n-steps", type=int, default=10, help="log training scalars every this many steps")
    run.add_argument("--logdir", default="runs", help="TensorBoard save_dir")
    run.add_argument(
        "--run-name",
        default=None,
        help='TensorBoard run name (default: "tied" or "untied"); runs/<name>/version_<n>/ holds the logs '
        '(for seeds: tied/seed3, which headwatch report groups and pairs by seed)',
    )
    watch = parser.add_argument_group("headwatch")
    watch.add_argument(
        "--induce-collapse",
        type=int,
        default=None,
        metavar="STEP",
        help="from STEP on, add the mean prediction entropy to the training loss (times --collapse-weight): "
        "the predictions collapse to a few tokens and SharpnessCollapseAlert fires (a demonstration)",
    )
    watch.add_argument("--collapse-weight", type=float, default=1.0, help="weight of the entropy term of --induce-collapse")
    watch.add_argument(
        "--stop-on-collapse",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="save a checkpoint and stop training when the collapse alert fires",
    )
    watch.add_argument(
        "--alert-warmup-steps", type=int, default=100, help="steps the collapse alert ignores (the fast fall from log V)"
    )
    watch.add_argument("--collision-every", type=int, default=100, help="measure synonym collision every this many steps")
    run.add_argument(
        "--headwatch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attach headwatch's monitors and alert (--no-headwatch to measure their overhead)",
    )
    run.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="save a checkpoint (model, optimizer, callbacks' state) to <run dir>/checkpoints/last.ckpt at the end",
    )
    run.add_argument(
        "--progress-bar", action=argparse.BooleanOptionalAction, default=True, help="show Lightning's progress bar"
    )
    run.add_argument(
        "--print-every-s",
        type=float,
        default=10.0,
        help="with --no-progress-bar, print a [training] line (step, loss, elapsed) every this many seconds",
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ("vocab_size", "pad_vocab_multiple", "d_model", "n_layer", "n_head", "block_size", "max_steps",
                "batch_size", "val_check_interval", "log_every_n_steps")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size < 257:
        parser.error(f"--vocab-size must be >= 257 (256 bytes + <|endoftext|>), got {args.vocab_size}")
    if args.d_model % args.n_head:
        parser.error(f"--d-model must be a multiple of --n-head, got {args.d_model} and {args.n_head}")
    if not args.max_corpus_mb > 0:
        parser.error(f"--max-corpus-mb must be > 0, got {args.max_corpus_mb}")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.warmup_steps < 0 or args.lr <= 0 or not 0.0 <= args.min_lr_ratio <= 1.0:
        parser.error("--warmup-steps must be >= 0, --lr > 0 and --min-lr-ratio in [0, 1]")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    limit = args.limit_val_batches
    if (isinstance(limit, int) and limit < 1) or (isinstance(limit, float) and not 0.0 < limit <= 1.0):
        parser.error(f"--limit-val-batches must be an int >= 1 or a float in (0, 1], got {limit}")


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out a random sample of whole documents (files) for validation.

    The documents are shuffled with ``random.Random(seed)`` and taken in that order until the
    held-out bytes reach ``val_fraction`` of the corpus; at least one document goes to each
    side. Both lists keep the corpus order. A file never straddles the split, so no text of a
    held-out file is trained on.

    Returns:
        ``(train_docs, val_docs)``.

    Raises:
        ValueError: fewer than 2 documents, or ``val_fraction`` outside ``(0, 1)``.
    """
    if len(docs) < 2:
        raise ValueError(f"holding out files needs at least 2 documents, got {len(docs)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction!r}")
    sizes = [len(d.encode("utf-8")) for d in docs]
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    held: set[int] = set()
    taken = 0
    for index in order[:-1]:  # the last one always trains
        if held and taken >= val_fraction * sum(sizes):
            break
        held.add(index)
        taken += sizes[index]
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


class HeldOutFilesDataModule(TokenDataModule):
    """:class:`TokenDataModule` whose validation windows come from held-out files, not a stream's tail."""

    def __init__(self, train_tokens: Any, val_tokens: Any, *, block_size: int, batch_size: int) -> None:
        pl.LightningDataModule.__init__(self)  # TokenDataModule's own __init__ splits one stream
        self.train_tokens = train_tokens
        self.val_tokens = val_tokens
        self.batch_size = batch_size
        self.train_set = TokenWindows(train_tokens, block_size)
        self.val_set = TokenWindows(val_tokens, block_size)


class ValLossHistory(Callback):
    """Records ``(global_step, val_loss)`` at the end of every validation run."""

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.history.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))
            say("validation", f"step {trainer.global_step}: val loss {self.history[-1][1]:.3f} nats")


def _metric(metrics: dict[str, Any], key: str) -> float | None:
    """``key`` (or its ``_step`` / ``_epoch`` variant) from a Lightning metrics dict, as a float."""
    for name in (key, f"{key}_step", f"{key}_epoch"):
        if name in metrics:
            return float(metrics[name])
    return None


def last_scalars(log_dir: str | Path, tags: list[str]) -> dict[str, float]:
    """The last value of each of ``tags`` in the TensorBoard event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    available = set(accumulator.Tags().get("scalars", []))
    return {tag: accumulator.Scalars(tag)[-1].value for tag in tags if tag in available}


def _pad(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def _fmt(value: float | None, unit: str = "nats") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f} {unit}".rstrip()


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable end-of-run report of the dict :func:`main` returns."""
    tying = "tied (lm_head.weight is embed_tokens.weight)" if s["tie_weights"] else "untied (two matrices)"
    saved = s["vocab_size"] * s["d_model"]
    other = (
        f"untied: {s['total_params'] + saved:,}" if s["tie_weights"] else f"tied: {s['total_params'] - saved:,}"
    )
    params = (
        f"{s['total_params']:,} parameters ({other}); tying saves vocab_size * d_model = "
        f"{s['vocab_size']:,} * {s['d_model']} = {saved:,}"
    )
    lines = [
        "",
        f"=== headwatch example: tiny GPT, {tying} ===",
        f"corpus          {s['corpus_bytes'] / 2**20:.2f} MiB from {s['corpus_files']} files -> "
        f"{s['train_tokens']:,} train / {s['val_tokens']:,} val tokens "
        + (f"(val: {s['val_files']} held-out files, seed {s['seed']})" if s["val_files"] else "(val: the last tokens)"),
        f"tokenizer       byte-level BPE, {s['tokenizer_vocab_size']:,} tokens (model rows: {s['vocab_size']:,}) "
        f"-> {s['tokenizer_path']}",
        f"model           {params}",
        f"val loss        {_fmt(s['initial_val_loss'])} before training -> {_fmt(s['final_val_loss'])} "
        f"after {s['steps']} steps (uniform would be log V = {math.log(s['vocab_size']):.3f})",
        f"train loss      {_fmt(s['final_train_loss'])} (last logged step)",
    ]
    if s["headwatch"]:
        # headwatch's own end-of-training summary (printed above, when fit ends) gives its figures beside
        # their references; this one only says where to find them
        alerts = s.get("alerts") or []
        lines.append(
            "headwatch       its end-of-training summary is printed above; alerts "
            + f"{len(alerts)}" + (f" (log: {s['alerts_file']})" if alerts else "")
        )
    else:
        lines.append("headwatch       off (--no-headwatch)")
    lines += [
        f"wall time       {s['wall_time_s']:.1f} s in main(), of which training {s['fit_time_s']:.1f} s "
        f"(+ {s['import_time_s']:.1f} s importing torch and Lightning)",
        f"logs            {s['log_dir']}",
        *([f"checkpoint      {s['checkpoint_path']}"] if s["checkpoint_path"] else []),
        f"watch it:       tensorboard --logdir {s['logdir']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example job with command-line ``argv`` (``sys.argv[1:]`` when None).

    Returns:
        The summary: ``tie_weights`` (bool), ``initial_val_loss``, ``final_val_loss``,
        ``final_train_loss`` (nats/token), ``entropy``, ``kl_to_uniform``,
        ``val_entropy``, ``val_kl_to_uniform`` (nats; None when not logged, e.g. with
        ``--no-headwatch``), ``val_history`` (list of ``(step, val_loss)``),
        ``total_params``, ``params_saved_by_tying`` (``vocab_size * d_model``),
        ``vocab_size`` (model rows), ``tokenizer_vocab_size``, ``d_model``, ``steps``,
        ``corpus_files``, ``corpus_bytes``, ``train_tokens``, ``val_tokens``,
        ``val_files`` (held-out files; 0 for a one-document corpus), ``seed``,
        ``log_dir``, ``tokenizer_path``, ``checkpoint_path`` (None without
        ``--checkpoint``), ``logdir``, ``headwatch`` (bool),
        ``wall_time_s`` (seconds since ``main`` started), ``fit_time_s`` (in
        ``trainer.fit``), ``import_time_s`` (this module's imports, once per process).
    """
    t_main = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    quiet_third_party()  # Lightning's banners and tips, in this example only (never in the library)
    pl.seed_everything(args.seed, workers=True, verbose=False)

    # --- corpus and tokenizer
    clock = Clock()
    source = " ".join(args.data) if args.data else "the standard library's *.py files"
    say("corpus", f"reading up to {args.max_corpus_mb:g} MiB of {source}")
    try:
        files = collect_text_files(args.data) if args.data else stdlib_source_files()
    except FileNotFoundError as err:
        parser.error(str(err))
    docs = read_corpus(files, max_bytes=int(args.max_corpus_mb * 2**20))
    if not docs:
        parser.error(f"no UTF-8 text found in {args.data or 'the standard library'}")
    if len(docs) >= 2:  # validation: a random sample of whole files, drawn with the seed
        train_docs, val_docs = split_documents(docs, args.val_fraction, args.seed)
    else:  # one document: its last --val-fraction of tokens
        train_docs, val_docs = docs, []
    say("corpus", f"{len(docs)} files, {sum(len(d.encode()) for d in docs) / 2**20:.2f} MiB; {len(val_docs)} held out "
        f"for validation (seed {args.seed}) {clock}")
    clock = Clock()
    say("tokenizer", f"training a byte-level BPE tokenizer ({args.vocab_size:,} tokens) on the {len(train_docs)} "
        "training files, then encoding every file to token ids")
    tokenizer = train_tokenizer(train_docs, vocab_size=args.vocab_size)  # never sees the held-out files
    vocab_size = _pad(tokenizer.get_vocab_size(), args.pad_vocab_multiple)
    try:
        if val_docs:
            datamodule: TokenDataModule = HeldOutFilesDataModule(
                encode_documents(tokenizer, train_docs),  # (N,) int64
                encode_documents(tokenizer, val_docs),
                block_size=args.block_size,
                batch_size=args.batch_size,
            )
        else:
            datamodule = TokenDataModule(
                encode_documents(tokenizer, docs), block_size=args.block_size, batch_size=args.batch_size,
                val_fraction=args.val_fraction,
            )
    except ValueError as err:
        parser.error(f"{err} (held-out files: {len(val_docs)}; raise --val-fraction or --max-corpus-mb)")
    if len(datamodule.train_set) < args.batch_size:
        parser.error(
            f"only {len(datamodule.train_set)} training windows of {args.block_size} tokens, fewer than "
            f"--batch-size {args.batch_size}: raise --max-corpus-mb or lower --batch-size / --block-size"
        )
    say("tokenizer", f"{tokenizer.get_vocab_size():,} tokens; {len(datamodule.train_tokens):,} train / "
        f"{len(datamodule.val_tokens):,} val tokens {clock}")

    # --- model, logger, trainer
    config = TinyLMConfig(
        vocab_size=vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        dropout=args.dropout,
        tie_weights=args.tie_weights,
    )
    model = TinyLM(
        config,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        max_steps=args.max_steps,
        min_lr_ratio=args.min_lr_ratio,
    )
    model.collapse_from_step = args.induce_collapse
    model.collapse_weight = args.collapse_weight
    logger = TensorBoardLogger(
        save_dir=args.logdir,
        name=args.run_name or ("tied" if args.tie_weights else "untied"),
        default_hp_metric=False,  # no placeholder "hp_metric" chart
    )
    # the seed in the run's hparams.yaml (Lightning writes it with the model's own hyperparameters):
    # `headwatch report` reads it to pair a tied and an untied run of one seed
    logger.log_hyperparams({"seed": args.seed})
    log_dir = Path(logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path = log_dir / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))

    say("model", f"tiny GPT, {'tied' if args.tie_weights else 'untied'} embed_tokens/lm_head, {args.n_layer} layers, "
        f"d_model {args.d_model}, {vocab_size:,} rows: {model.num_parameters():,} parameters"
        + ("; headwatch monitors and the collapse alert attached" if args.headwatch else "; headwatch off"))
    history = ValLossHistory()
    callbacks: list[Callback] = [history]
    if not args.progress_bar:
        callbacks.append(TrainingLines(every_s=args.print_every_s))
    alert = None
    if args.headwatch:
        alert = SharpnessCollapseAlert(
            entropy_floor=1.0,  # nats: the predictions sit on a handful of tokens
            entropy_drop=0.3,  # or the smoothed entropy lost 30% over the last 5 logged values...
            window=5,
            warmup_steps=args.alert_warmup_steps,  # ...after the fast initial fall from log V
            stop_training=args.stop_on_collapse,
            save_checkpoint=args.stop_on_collapse,
        )
        callbacks += [
            # the tokenizer's own size: rows padded beyond it can never occur
            TokenFrequency(vocab_size=tokenizer.get_vocab_size()),
            # the self-check compares headwatch's target NLL with the loss training_step logs (check/nll_gap)
            LogitStatsMonitor(compare_loss="train_loss"),
            GradientDensityMonitor(),
            SynonymCollisionMonitor(every_n_steps=args.collision_every, tokenizer=tokenizer),
            alert,
        ]
    devices: Any = args.devices if args.devices == "auto" or "," in args.devices else int(args.devices)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.val_check_interval,
        check_val_every_n_epoch=None,  # count val_check_interval in steps across epochs
        limit_val_batches=args.limit_val_batches,
        num_sanity_val_steps=0,  # the full validation below replaces the sanity check
        log_every_n_steps=args.log_every_n_steps,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,  # --checkpoint saves once, at the end, below
        enable_progress_bar=args.progress_bar,
        enable_model_summary=args.progress_bar,
        default_root_dir=args.logdir,
    )

    # --- validate, train, validate
    say("validation", f"measuring the validation loss before training ({len(datamodule.val_set)} windows)")
    trainer.validate(model, datamodule=datamodule, verbose=False)  # the starting point, logged at step 0
    say("training", f"{args.max_steps} optimizer steps of {args.batch_size} x {args.block_size} tokens; "
        + ("Lightning's progress bar below" if args.progress_bar else f"a line every {args.print_every_s:g} s"))
    t_fit = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_time = time.perf_counter() - t_fit
    say("training", f"done: {trainer.global_step} steps in {fit_time:.1f} s")
    metrics = {k: v for k, v in trainer.callback_metrics.items()}
    if not history.history or history.history[-1][0] != trainer.global_step:
        # The last scheduled validation did not fall on the last step: measure the end point.
        say("validation", "measuring the validation loss after the last step")
        trainer.validate(model, datamodule=datamodule, verbose=False)
        metrics.update(trainer.callback_metrics)
    checkpoint_path = None
    if args.checkpoint:
        checkpoint_path = log_dir / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(checkpoint_path)
    logger.finalize("success")

    # Headwatch values: from the callback metrics when the callback logs through Lightning,
    # else from the event files (a callback may write straight to the logger).
    found = {field: _metric(metrics, key) for field, key in HEADWATCH_KEYS.items()}
    missing = [HEADWATCH_KEYS[f] for f, v in found.items() if v is None]
    if args.headwatch and missing:
        from_events = last_scalars(log_dir, missing)
        for field, key in HEADWATCH_KEYS.items():
            if found[field] is None and key in from_events:
                found[field] = from_events[key]
    train_loss = _metric(metrics, "train_loss")
    if train_loss is None:
        train_loss = last_scalars(log_dir, ["train_loss"]).get("train_loss")

    summary: dict[str, Any] = {
        "tie_weights": model.tie_weights,
        "initial_val_loss": history.history[0][1] if history.history else None,
        "final_val_loss": history.history[-1][1] if history.history else None,
        "final_train_loss": train_loss,
        **found,
        "val_history": list(history.history),
        "total_params": model.num_parameters(),
        "params_saved_by_tying": vocab_size * args.d_model,
        "vocab_size": vocab_size,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "d_model": args.d_model,
        "steps": trainer.global_step,
        "corpus_files": len(docs),
        "val_files": len(val_docs),
        "seed": args.seed,
        "corpus_bytes": sum(len(d.encode("utf-8")) for d in docs),
        "train_tokens": len(datamodule.train_tokens),
        "val_tokens": len(datamodule.val_tokens),
        "log_dir": str(log_dir),
        "tokenizer_path": str(tokenizer_path),
        "checkpoint_path": None if checkpoint_path is None else str(checkpoint_path),
        "logdir": args.logdir,
        "headwatch": args.headwatch,
        "alerts": [] if alert is None else [{"step": a.step, "rule": a.rule, "message": a.message} for a in alert.alerts],
        "alerts_file": None if alert is None or alert.jsonl_path is None else str(alert.jsonl_path),
        "wall_time_s": time.perf_counter() - t_main,
        "fit_time_s": fit_time,
        "import_time_s": IMPORT_TIME_S,
    }
    say("summary", f"run finished {time.perf_counter() - t_main:.1f} s after start; the figures:")
    print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
