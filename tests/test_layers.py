"""The package's layers (docs/core.md, "Where code lives"), checked on the source itself.

- the import-linter contracts in ``pyproject.toml`` hold (functional <- distributed <- model <- core <-
  (alerts, report, remedies, tensorboard) <- integrations <- cli; nothing below the doors imports a trainer);
- no import cycle between modules (grimp's graph, every import statement, lazy ones included);
- no module imports a private name (``_x``) of another module, or a private module;
- 0.2's module paths still import, as the same module object as their new home.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (test extra) is not installed")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "headwatch"


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter) not found next to the interpreter"
    done = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (or with a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    g = grimp.build_graph("headwatch")
    # a package's __init__ re-exporting its children is not a cycle of code: drop package -> child edges
    graph = {
        m: {t for t in g.find_modules_directly_imported_by(m) if not t.startswith(m + ".")}
        for m in g.modules
    }
    # the root package is the public facade (lazy names of every layer) and the documented compat name
    graph.pop("headwatch", None)
    graph["headwatch.alerts"] -= {"headwatch.integrations.lightning.alert"}
    assert _strongly_connected(graph) == []


def test_tarjan_finds_a_planted_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def _private_imports(path: Path, module: str) -> list[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("headwatch"):
                continue
            if any(part.startswith("_") for part in target.split(".")):
                bad.append(f"{module}: from {target} import ...")
            bad += [f"{module}: from {target} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            bad += [f"{module}: import {a.name}" for a in node.names
                    if a.name.startswith("headwatch") and any(p.startswith("_") for p in a.name.split("."))]
    return bad


def test_no_module_imports_a_private_name():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        bad += _private_imports(path, module)
    assert bad == []


def test_private_import_check_catches_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from headwatch.functional.logits import _x\nfrom headwatch._errors import E\nimport headwatch._y\n")
    assert len(_private_imports(f, "headwatch.m")) == 3


@pytest.mark.parametrize("old", sorted(__import__("headwatch").MOVED_MODULES))
def test_a_moved_module_imports_at_its_old_path(old):
    import headwatch

    assert importlib.import_module(old) is importlib.import_module(headwatch.MOVED_MODULES[old])


def test_folders_are_the_layers():
    """The top level holds the packages and a handful of modules, nothing else (was 24 modules in 0.2)."""
    modules = sorted(p.stem for p in SRC.glob("*.py"))
    assert modules == ["__init__", "__main__", "cli", "errors", "lazy", "names"]
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    assert packages == ["alerts", "core", "distributed", "functional", "integrations", "model", "remedies",
                        "report", "tensorboard"]
