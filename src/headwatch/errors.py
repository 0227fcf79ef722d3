"""The package's one exception class."""

from __future__ import annotations


class HeadwatchError(Exception):
    """Raised for bad input or configuration anywhere in headwatch.

    Every error says what was expected, what was received, and, where it applies, how to
    fix it (for example which argument to pass).
    """
