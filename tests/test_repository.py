"""The repository's own rules, checked on its files.

- a Python file in ``src/`` or ``tests/`` has at most :data:`MAX_LINES` lines (generated files exempt, listed);
- the project speaks of itself only: no words about how its work was organised (ticket, meeting or review
  numbers, reports of trial runs) in ``src/``, ``tests/``, ``docs/``, ``bench/`` or their file names; library
  terms (TensorBoard's ``SessionLog``, a hyperparameter-search trial) are fine;
- tests sit in packages that mirror the library (``tests/core/``, ``tests/integrations/lightning/``, ...), and a
  test file imports shared code from ``tests/helpers/`` (or a worker script from ``tests/workers/``), never from
  another test file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

MAX_LINES = 600

GENERATED: dict[str, str] = {}
"""Generated Python files (path from the repository root -> what generates them): exempt from :data:`MAX_LINES`.
None today; the generated files (the dashboard layout, the metric reference) are not Python."""

NOT_YET_SPLIT: dict[str, str] = {}
"""Files still over :data:`MAX_LINES`, each with where it goes; an entry fails once its file is within the limit
(delete the entry then)."""

# Words about how the work was organised, not about the library (case-insensitive). Written so that this file
# does not match itself.
PROCESS_WORDS = [
    r"\bissues?\s?#?\d+",  # "issue 12", "issue #12", "issues 19-21"
    r"\bsessions?\s?\d+",  # "session 27", "session27_quiet.txt"
    r"\bsession of \d{4}",  # "Session of 2026-12-02"
    r"\b(this|that|each|every|another|previous|next|earlier|later) session\b",
    r"\bstop\s\d+",  # "stop 3"
    r"\bturns?\s\d+\b(?! (steps?|of))",  # "turn 4" (not a count of steps: "in turns of 1")
    r"\bacceptance\s(points?|criteri)",
    r"§\s?\d",
    r"\b(new|fresh)-user\s(trial|walkthrough)",
    r"\bbreak-it\strial",
    r"\btrial\sreports?\b",
    r"\bclosing\snotes?\b",
    r"\bmerge\snote\b",
    r"\bwave-\d\b",
]
WORDS = re.compile("|".join(f"(?:{p})" for p in PROCESS_WORDS), re.IGNORECASE)
SCANNED = ("src", "tests", "docs", "bench")
TEXT = {".py", ".md", ".txt", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".html", ".js", ".css", ".csv", ""}

NOT_YET_REWORDED: dict[str, str] = {}
"""``path:line`` still saying such words, each with where it goes; an entry fails once its line is clean (delete the
entry then)."""

TOP_LEVEL_TESTS = {"test_layers.py", "test_names_declarations.py", "test_package.py", "test_repository.py"}
"""Tests of the package as a whole (its layers, its packaging, ``headwatch.names``, this file) sit in ``tests/``."""


def _files(*folders: str, suffixes: set[str] | None = None) -> list[Path]:
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or any(p.startswith(".") for p in path.relative_to(ROOT).parts):
                continue
            if suffixes is None or path.suffix in suffixes:
                found.append(path)
    return found


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_python_files_are_at_most_600_lines():
    lengths = {_rel(p): len(p.read_text(encoding="utf-8").splitlines()) for p in _files("src", "tests", suffixes={".py"})}
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in GENERATED and path not in NOT_YET_SPLIT}
    assert too_long == {}, f"over {MAX_LINES} lines (split along a real seam): {too_long}"
    assert set(GENERATED) <= set(lengths), "a generated file listed here no longer exists"
    within = [path for path in NOT_YET_SPLIT if lengths.get(path, 0) <= MAX_LINES]
    assert within == [], f"within {MAX_LINES} lines now (or gone): delete their entries from NOT_YET_SPLIT: {within}"


def _process_words(text: str) -> list[str]:
    return [m.group(0) for m in WORDS.finditer(text)]


@pytest.mark.parametrize(
    "text, found",
    [
        ("measured for issue 12, see issue #7 and issues 19-21", ["issue 12", "issue #7", "issues 19"]),
        ("bench/results/overhead/session27_quiet.txt; Session of 2026-12-02; this session", ["session27", "Session of 2026", "this session"]),
        ("after stop 3, at turn 4; a new-user trial and a fresh-user walkthrough", ["stop 3", "turn 4", "new-user trial", "fresh-user walkthrough"]),
        ("acceptance point 4 (§2), a break-it trial, the closing note", ["acceptance point", "§2", "break-it trial", "closing note"]),
        ("SessionLog(status=SessionLog.START); each hyperparameter-search trial; scope='session'", []),
        ("bare and watched steps in turns of one step, in turns of 1; torchmetrics#3510 (github.com/a/b/issues/3510)", []),
    ],
)
def test_the_process_words_pattern(text, found):
    assert _process_words(text) == found


def test_the_project_speaks_of_itself_only():
    this = Path(__file__).resolve()
    said = {}
    for path in _files(*SCANNED):
        name_hits = _process_words(_rel(path).replace("_", " "))
        if name_hits:
            said[_rel(path) + " (file name)"] = name_hits
        if path.suffix not in TEXT or path.resolve() == this:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            hits = _process_words(line)
            if hits:
                said[f"{_rel(path)}:{number}"] = hits
    clean = [where for where in NOT_YET_REWORDED if where not in said]
    said = {where: hits for where, hits in said.items() if where not in NOT_YET_REWORDED}
    assert said == {}, "words about how the work was organised, not about the library:\n" + "\n".join(
        f"  {where}: {hits}" for where, hits in said.items()
    )
    assert clean == [], f"clean now: delete their entries from NOT_YET_REWORDED: {clean}"


def _test_module(name: str) -> bool:
    """``tests.core.test_x`` (a test file), not ``tests.helpers.x`` or ``tests.workers.x``."""
    parts = name.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:])


def _imports_of_test_files(source: str, module: str) -> list[str]:
    """What ``source`` (the module ``module``) imports from a test file: import statements at any depth, relative
    ones resolved, and ``from tests... import`` lines inside strings (worker scripts written at run time)."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
            found += [t for t in targets if _test_module(t)][:1]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _test_module(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [m.group(1) for m in re.finditer(r"^\s*from\s+(tests\.[\w.]+)\s+import", node.value, re.M) if _test_module(m.group(1))]
    return found


def test_no_test_file_imports_another_test_file():
    bad = {}
    for path in _files("tests", suffixes={".py"}):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found = _imports_of_test_files(path.read_text(encoding="utf-8"), module)
        if found:
            bad[_rel(path)] = found
    assert bad == {}, f"import shared code from tests/helpers/ instead: {bad}"


def test_the_import_check_sees_each_form():
    source = (
        "from PKG.core.test_core import StepLogger\n"
        "import PKG.model.test_weights\n"
        "from .test_sources import run_captured\n"
        "from PKG.core import test_monitor\n"
        "def f():\n    from PKG.helpers import loader\n"
        "WORKER = '''\nfrom PKG.integrations.loop.test_loop_robust import Tiny\n'''\n"
    ).replace("PKG", "tests")  # (spelt so that this file does not import a test file itself)
    assert _imports_of_test_files(source, "tests.model.test_x") == [
        "tests.core.test_core", "tests.model.test_weights", "tests.model.test_sources", "tests.core.test_monitor",
        "tests.integrations.loop.test_loop_robust",
    ]  # fmt: skip


def test_tests_sit_in_packages_that_mirror_the_library():
    tests = ROOT / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert set(top) <= TOP_LEVEL_TESTS, f"put these in the folder of what they test: {sorted(set(top) - TOP_LEVEL_TESTS)}"
    folders = [p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")]
    missing = [_rel(p) for p in folders if not (p / "__init__.py").exists()]
    assert missing == [], f"a test folder is a package (two test files of one name must not clash): {missing}"
    library = {p.name for p in (ROOT / "src" / "headwatch").iterdir() if (p / "__init__.py").exists()}
    outside = {"helpers", "workers", "docs", "examples"}  # shared code, scripts run as processes, the rest of the repository
    assert {p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists()} <= library | outside
