"""docs/supported.md says what the tests show: every cell has a verdict, names tests that exist, and
the counts under the table are the table's.

The table is the user's answer to "does headwatch measure my set-up exactly?", so a cell naming a test
that was renamed or removed, or a count left behind by an edit, would be a promise nothing checks.
"""

from __future__ import annotations

import re
from collections import Counter

from tests.helpers.paths import ROOT

SUPPORTED = ROOT / "docs" / "supported.md"
DOORS = ("HF Trainer", "TRL SFTTrainer", "Lightning", "plain loop")
# the verdict a cell starts with, and the name it is counted under in the counts table
VERDICTS = (("exact", "exact"), ("refused", "refused"), ("not tested", "not tested"), ("n/a", "n/a"),
            ("not run", "not run"))


def _table() -> list[list[str]]:
    lines = SUPPORTED.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| feature |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows


def _verdict(cell: str) -> str:
    for prefix, name in VERDICTS:
        if cell.startswith(prefix):
            return name
    raise AssertionError(f"a cell without a verdict (exact, refused, not run, n/a): {cell[:80]!r}")


def _defined_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def test_every_cell_has_a_verdict_and_names_only_tests_that_exist():
    rows = _table()
    assert len(rows) > 30
    defined = _defined_tests()
    missing = []
    for row in rows:
        assert len(row) == 1 + len(DOORS), row[0]
        for cell in row[1:]:
            verdict = _verdict(cell)
            named = re.findall(r"`(?:[\w/.]+::)?(test_\w+)", cell)
            if verdict in ("exact", "refused"):
                assert named, f"{row[0]!r}: an {verdict} cell names no test: {cell[:100]!r}"
            missing += [(row[0], name) for name in named if name not in defined]
    assert not missing, f"cells name tests that do not exist: {missing}"


def test_the_counts_are_the_tables():
    rows = _table()
    text = SUPPORTED.read_text()
    total = Counter(_verdict(cell) for row in rows for cell in row[1:])
    header = re.search(r"Over the (\d+) features x 4 doors = (\d+) cells", text)
    assert header is not None
    assert (int(header[1]), int(header[2])) == (len(rows), 4 * len(rows))
    for name, count in total.items():
        assert f"**{name} {count}**" in text, (name, count)
    for door_index, door in enumerate(DOORS, start=1):
        line = next(line for line in text.splitlines() if line.startswith(f"| {door} |"))
        stated = [int(x) for x in re.findall(r"\|\s*(\d+)\s*", line)]
        per_door = Counter(_verdict(row[door_index]) for row in rows)
        columns = re.search(r"\| door \|(.*)\|", text)[1]
        names = [c.strip() for c in columns.split("|")]
        assert stated == [per_door.get(name, 0) for name in names], (door, stated, dict(per_door))
