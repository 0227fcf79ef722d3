"""Names and texts from users' folders, made safe to show: printable in a terminal, distinct in a column.

A run name, a tag or an alert message is whatever a folder, a logger or a rule wrote; it may hold
terminal control sequences (``ESC ] 0 ; title BEL`` sets a window title, ``ESC [ 2 J`` clears the
screen), bidirectional overrides that reorder the text around them, or line breaks that forge a
line of the report. :func:`printable` shows every such character as an escape instead.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

_VISIBLE_FORMAT = frozenset("\u00ad\u200d")  # soft hyphen, zero-width joiner (emoji sequences): harmless


def _unsafe(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category in ("Cc", "Zl", "Zp", "Cs", "Co", "Cn") or (category == "Cf" and ch not in _VISIBLE_FORMAT)


def printable(text: object, keep_newlines: bool = False) -> str:
    """``text`` with every control, format (bidirectional), separator, surrogate or unassigned character
    written as a Python escape (``\\x1b``, ``\\u202e``, ``\\U000e0001``).

    Args:
        text: anything; ``str(text)`` is shown.
        keep_newlines: keep ``"\\n"`` (a whole report); otherwise it is escaped too (one name, one cell).
    """
    text = str(text)
    if text.isprintable() and (keep_newlines or "\n" not in text):
        return text
    out = []
    for ch in text:
        if ch == "\n" and keep_newlines:
            out.append(ch)
        elif _unsafe(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters in the middle (``tied/seed…/version_0``), the ends kept."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


_SEPARATORS = "/_-.= "


def _distinct_cores(names: Sequence[str], width: int) -> list[str]:
    """Each name's part where the names differ (from a separator before it), marked ``…`` where cut."""
    first, last = min(names), max(names)
    p = 0
    while p < min(len(first), len(last)) and first[p] == last[p]:
        p += 1
    shortest = min(len(n) for n in names)
    q = 0
    while q < shortest - p and len({n[len(n) - q - 1] for n in names}) == 1:
        q += 1
    while p > 0 and names[0][p - 1] not in _SEPARATORS:  # start at a separator: "seed1", not "d1"
        p -= 1
    while q > 0 and names[0][len(names[0]) - q] not in _SEPARATORS:  # end at one: "tied", not "ti"
        q -= 1
    labels = []
    for n in names:
        core = n[p : len(n) - q]
        marks = ("…" if p else "") , ("…" if q else "")
        room = max(1, width - len(marks[0]) - len(marks[1]))
        labels.append(marks[0] + shorten(core, room) + marks[1])
    return labels


def column_labels(names: Sequence[str], width: int) -> list[str]:
    """Printable, distinct labels of at most ``width`` characters for ``names`` (column headers).

    Each name is made :func:`printable`; when one is too long, each label shows the part where the names
    differ (``…seed3…``, ``tied…``), else each name is cut in the middle (:func:`shorten`); when labels
    still agree, every label becomes its position, ``#1`` ... ``#k``, and the caller lists what each is.
    """
    shown = [printable(n) for n in names]
    if all(len(n) <= width for n in shown):
        return shown
    if len(set(shown)) == len(shown) and len(shown) > 1:
        labels = _distinct_cores(shown, width)
        if len(set(labels)) == len(labels) and all(len(label) <= width for label in labels):
            return labels
    labels = [shorten(n, width) for n in shown]
    if len(set(labels)) == len(labels):
        return labels
    return [f"#{i + 1}" for i in range(len(names))]
