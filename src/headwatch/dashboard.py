"""The headwatch page of TensorBoard's Custom Scalars dashboard.

Every headwatch callback writes this layout into the run's TensorBoard log directory at
fit start (once per writer), so ``tensorboard --logdir runs`` shows a "headwatch" page
under CUSTOM SCALARS with the related charts grouped. The same layout is kept in
``dashboards/headwatch.json``; regenerate it with ``python -m headwatch.dashboard --json``,
or write it into an existing log directory with ``python -m headwatch.dashboard --write LOGDIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

# Multiline charts take regular expressions over tags; Margin charts take exact tags
# (value, lower, upper).
_CHARTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("entropy and sharpness, train (nats)", "Multiline", (r"{p}/logits/entropy$", r"{p}/logits/kl_to_uniform$", r"{p}/logits/kl_from_uniform$")),
    ("entropy and sharpness, validation (nats)", "Multiline", (r"{p}/val/logits/entropy$", r"{p}/val/logits/kl_to_uniform$", r"{p}/val/logits/kl_from_uniform$")),
    ("entropy median with p05-p95 band, train (nats)", "Margin", ("{p}/logits/entropy_p50", "{p}/logits/entropy_p05", "{p}/logits/entropy_p95")),
    ("target NLL vs loss (nats)", "Multiline", (r"{p}/logits/target_nll$", r"{p}/val/logits/target_nll$", r"^train_loss$", r"^val_loss$")),
    ("gradient row density: embedding vs head", "Multiline", (r"{p}/grad/embedding_row_density$", r"{p}/grad/head_row_density$", r"{p}/grad/shared_row_density$")),
    ("update row density (rows the optimizer moved)", "Multiline", (r"{p}/update/\w+_row_density$",)),
    ("tied matrix: cosine of the lookup and scoring flows", "Multiline", (r"{p}/grad/tied_flow_cosine_mean$", r"{p}/grad/tied_flow_conflict_fraction$")),
    ("rare / frequent gradient norm ratio", "Multiline", (r"{p}/grad/\w+_rare_to_frequent_norm_ratio$",)),
    ("frequency gravity: Spearman(log frequency, row norm)", "Multiline", (r"{p}/freq/\w+_norm_spearman$",)),
    ("rare-token collision rate", "Multiline", (r"{p}/collision/rare_rate_\w+$", r"{p}/collision/synonym_pair_rate_\w+$")),
    ("nearest-neighbour cosine by frequency bucket", "Multiline", (r"{p}/collision/\w+/\w+_nn_cosine_mean$",)),
    ("alerts (1 at the alert step)", "Multiline", (r"{p}/alerts/\w+$",)),
)


def build_layout(prefix: str = "headwatch") -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout, ``{category: {chart: [kind, [tags or regexes]]}}``."""
    return {prefix: {title: [kind, [t.format(p=prefix) for t in tags]] for title, kind, tags in _CHARTS}}


_written: "weakref.WeakSet[Any]" = weakref.WeakSet()


@rank_zero_only
def write_layout(trainer: pl.Trainer, prefix: str = "headwatch") -> None:
    """Write the layout into every TensorBoard logger of the trainer, once per writer."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            writer = logger.experiment
            if writer in _written:
                continue
            writer.add_custom_scalars(build_layout(prefix))
            writer.flush()
            _written.add(writer)


@rank_zero_only
def flush_tensorboard(trainer: pl.Trainer) -> None:
    """Flush TensorBoard event files now, so a point is on disk at once.

    Lightning's ``TensorBoardLogger`` flushes every 120 s by default; TensorBoard reloads
    every 5 s, so flushing after each logging step makes headwatch charts live.
    """
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headwatch.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="headwatch")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--json", action="store_true", help="print the layout as JSON (dashboards/headwatch.json)")
    group.add_argument("--write", metavar="LOGDIR", help="write the layout into LOGDIR as a TensorBoard event file")
    args = parser.parse_args(argv)
    layout = build_layout(args.prefix)
    if args.json:
        sys.stdout.write(json.dumps(layout, indent=2) + "\n")
        return 0
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(args.write)
    writer.add_custom_scalars(layout)
    writer.close()
    print(f"wrote the headwatch layout into {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
