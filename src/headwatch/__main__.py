"""``python -m headwatch report LOGDIR [LOGDIR ...]``: the same as the ``headwatch`` command."""

from __future__ import annotations

import sys

from headwatch.report import main

if __name__ == "__main__":
    sys.exit(main())
