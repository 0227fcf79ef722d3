"""Packaging: cheap import, typed marker, public names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import headwatch


def test_import_is_cheap():
    code = (
        "import sys, headwatch, headwatch.functional; "
        "heavy = [m for m in ('tensorboard', 'matplotlib', 'lightning', 'torchmetrics') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing headwatch loaded {out}"


def test_public_names_and_py_typed():
    assert Path(headwatch.__file__).with_name("py.typed").exists()
    for name in headwatch.__all__:
        assert getattr(headwatch, name) is not None
    assert issubclass(headwatch.HeadwatchError, Exception)
    try:
        headwatch.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("unknown attribute did not raise")


def test_lazy_names_load_their_module_on_first_use():
    """``headwatch.remedies`` (``headwatch.lazy.lazy_names``): nothing loaded before the name is used, then bound."""
    code = (
        "import sys, headwatch.remedies as r; "
        "before = 'headwatch.remedies.warmup' in sys.modules; "
        "value = r.HeadWarmupCore; "
        "print(before, 'headwatch.remedies.warmup' in sys.modules, vars(r)['HeadWarmupCore'] is value, "
        "value.__module__, dir(r) == sorted(r.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True", "headwatch.remedies.warmup", "True"]
    import headwatch.remedies

    try:
        headwatch.remedies.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert str(err) == "module 'headwatch.remedies' has no attribute 'NoSuchThing'"
    else:
        raise AssertionError("unknown attribute did not raise")
