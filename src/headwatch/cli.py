"""The ``headwatch`` command: ``headwatch report ...`` and ``headwatch cost ...``.

Each subcommand lives in its own module and is imported only when it runs, so ``headwatch
--help`` stays fast and a missing optional piece only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "report": "did a setting change anything? runs or seeds compared headline by headline, with verdicts (headwatch report --help)",
    "cost": "what untying the output head costs: parameters and memory (headwatch cost --help)",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it only names the subcommands; each parses its own arguments."""
    import headwatch

    parser = argparse.ArgumentParser(prog="headwatch", description="Tools for the metrics headwatch logs to TensorBoard.")
    parser.add_argument("--version", action="version", version=f"headwatch {headwatch.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _cost(argv: list[str]) -> int:
    try:
        module = importlib.import_module("headwatch.remedies.cost")
    except ModuleNotFoundError as err:
        if err.name != "headwatch.remedies.cost":
            raise
        print("headwatch cost: error: this headwatch has no `headwatch.remedies.cost` module; upgrade headwatch", file=sys.stderr)
        return 2
    return int(module.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (without the program name) to a subcommand; returns its exit status.

    ``report`` runs :func:`headwatch.report.main`; ``cost`` imports ``headwatch.remedies.cost`` lazily
    and runs its ``main(argv)``; ``--version`` prints ``headwatch <version>`` (exit status 0). Anything
    else is a usage error (exit status 2).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        build_parser().parse_args(args)  # prints help (exit 0) or the usage error (exit 2)
        return 2  # pragma: no cover - parse_args exits for anything but a known command
    if args[0] == "report":
        from headwatch.report import main as report_main

        return report_main(args)
    return _cost(args[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
