"""The headwatch page of TensorBoard's Custom Scalars dashboard.

Every headwatch front door writes this layout (:func:`headwatch.tensorboard.write_layout`) into the run's TensorBoard log directory at
fit start (once per writer), so ``tensorboard --logdir runs`` shows a "headwatch" page
under CUSTOM SCALARS with the related charts grouped. The same layout is kept in
``dashboards/headwatch.json``; regenerate it with ``python -m headwatch.tensorboard.layout --json``,
or write it into an existing log directory with ``python -m headwatch.tensorboard.layout --write LOGDIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from headwatch.names import CHARTS, chart_tag

def build_layout(prefix: str = "headwatch", category: str | None = None) -> dict[str, dict[str, list[Any]]]:
    """The Custom Scalars layout, ``{category: {chart: [kind, [tags or regexes]]}}``, from :data:`headwatch.names.CHARTS`.

    The charts read the tags under ``prefix``; the page (category) is named ``category``, default
    ``prefix`` (the Hugging Face front door reads ``train/headwatch/...`` on a page named ``headwatch``).
    """
    return {category or prefix: {c.title: [c.kind, [chart_tag(s, c.kind, prefix) for s in c.series]] for c in CHARTS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headwatch.tensorboard.layout", description=__doc__.splitlines()[0])
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
