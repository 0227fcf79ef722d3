"""Shared test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def room_to_recompile():
    """Compiled variants of one forward (the same transformers code object, in many tests) add up over the
    session; past dynamo's ``recompile_limit`` (8) it would run that forward eagerly, and a later compile test
    would test eager code. The limits are raised for the session instead of emptying the caches after each test:
    a warm cache keeps the compile tests fast (a cold compile of a Hugging Face model takes up to 40 s here)."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=100_000, accumulated_recompile_limit=1_000_000):
        yield
