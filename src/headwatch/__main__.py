"""``python -m headwatch COMMAND ...``: the same as the ``headwatch`` command (:mod:`headwatch.cli`)."""

from __future__ import annotations

import sys

from headwatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
