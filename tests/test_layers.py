"""The package's layers (docs/core.md, "Where code lives"), checked on the source itself.

- the import-linter contracts in ``pyproject.toml`` hold (functional <- distributed <- model <- core <-
  (alerts, report, remedies, tensorboard) <- integrations <- cli; nothing below the doors imports a trainer);
- no import cycle between modules (grimp's graph, every import statement, lazy ones included);
- no module imports a private name (``_x``) of another module, or a private module;
- each layer imported alone, in a fresh interpreter, loads no module of a higher layer (lazy imports and
  ``importlib`` calls made at import time included), and the layers below the front doors load no trainer.
"""

from __future__ import annotations

import ast
import json
import os
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
    # the root package is the public facade (lazy names of every layer)
    graph.pop("headwatch", None)
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


# The layers of the import-linter contract (pyproject.toml), bottom first: the packages or modules of each.
LAYERS = [
    ["headwatch.names", "headwatch.errors", "headwatch.lazy"],
    ["headwatch.functional"],
    ["headwatch.distributed"],
    ["headwatch.model"],
    ["headwatch.core"],
    ["headwatch.alerts", "headwatch.report", "headwatch.remedies", "headwatch.tensorboard"],
    ["headwatch.integrations"],
    ["headwatch.cli"],
]
TRAINERS = ("lightning", "pytorch_lightning", "transformers", "trl", "accelerate")
NO_TRAINER = {"headwatch.functional", "headwatch.distributed", "headwatch.model", "headwatch.core",
              "headwatch.alerts", "headwatch.report", "headwatch.tensorboard"}  # the second contract's sources

LOADED = """
import builtins, importlib, json, pkgutil, sys
TRAINERS = %r
asked = []  # [importing module, trainer module]: every request, also of a module already loaded


def is_trainer(name):
    return name.split(".")[0] in TRAINERS


def __import__(name, globals=None, locals=None, fromlist=(), level=0, _import=builtins.__import__):
    if level == 0 and is_trainer(name):
        asked.append([(globals or {}).get("__name__", "?"), name])
    return _import(name, globals, locals, fromlist, level)


def import_module(name, package=None, _import_module=importlib.import_module):
    if is_trainer(name):
        asked.append([sys._getframe(1).f_globals.get("__name__", "?"), name])
    return _import_module(name, package)


builtins.__import__, importlib.import_module = __import__, import_module
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []) if name.startswith("headwatch") else [], name + "."):
        importlib.import_module(info.name)
print(json.dumps({"modules": sorted(sys.modules), "asked": asked}))
""" % (TRAINERS,)


def _loaded(*names: str) -> dict[str, list]:
    """What a fresh interpreter holds after importing ``names`` (and, for headwatch's, every module below them): ``modules`` (the
    names in ``sys.modules``) and ``asked`` (``[importer, trainer module]`` for every import of a trainer, by an
    import statement or ``importlib.import_module``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOADED, *names], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _above(index: int) -> tuple[str, ...]:
    return tuple(name for layer in LAYERS[index + 1 :] for name in layer)


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.fixture(scope="module")
def dependencies_trainers() -> set[str]:
    """Trainer packages that headwatch's own dependencies load by themselves (torchmetrics imports transformers
    when it is installed, for its text metrics): present in ``sys.modules`` through no import of headwatch's."""
    return {m for m in _loaded("torch", "numpy", "torchmetrics", "tensorboard")["modules"] if _within(m, TRAINERS)}


@pytest.mark.parametrize("index", range(len(LAYERS) - 1), ids=[" ".join(layer) for layer in LAYERS[:-1]])
def test_a_layer_imported_alone_loads_no_higher_layer(index, dependencies_trainers):
    """Every module of the layer is imported in a fresh interpreter: no module of a layer above it is loaded
    then, whatever the import statement (a lazy name, an ``importlib`` call); below the doors, headwatch asks
    for no trainer and none is loaded but what its dependencies load by themselves."""
    layer = LAYERS[index]
    got = _loaded(*layer)
    assert set(layer) <= set(got["modules"])
    assert [m for m in got["modules"] if _within(m, _above(index))] == []
    if set(layer) <= NO_TRAINER:
        assert [pair for pair in got["asked"] if _within(pair[0], ["headwatch"])] == []
        assert [m for m in got["modules"] if _within(m, TRAINERS) and m not in dependencies_trainers] == []


def test_the_layer_check_sees_a_higher_layer_and_a_trainer():
    """The check itself: importing the Lightning door loads ``headwatch.core`` (above ``headwatch.functional``)
    and is seen asking for Lightning."""
    got = _loaded("headwatch.integrations.lightning")
    assert [m for m in got["modules"] if _within(m, _above(LAYERS.index(["headwatch.functional"])))]
    assert any(_within(importer, ["headwatch"]) and _within(name, ["lightning"]) for importer, name in got["asked"])


def test_the_layers_here_are_the_contracts_layers():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    assert [sorted(x.strip() for x in layer.split(":")) for layer in reversed(layers)] == [sorted(x) for x in LAYERS]
    (forbidden,) = [c for c in config["contracts"] if c["type"] == "forbidden"]
    assert set(forbidden["source_modules"]) == NO_TRAINER and tuple(forbidden["forbidden_modules"]) == TRAINERS
    assert all("ignore_imports" not in c for c in config["contracts"])  # the contracts have no exception


def test_folders_are_the_layers():
    """The top level holds the packages and a handful of modules, nothing else (was 24 modules in 0.2)."""
    modules = sorted(p.stem for p in SRC.glob("*.py"))
    assert modules == ["__init__", "__main__", "cli", "errors", "lazy", "names"]
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    assert packages == ["alerts", "core", "distributed", "functional", "integrations", "model", "remedies",
                        "report", "tensorboard"]
