"""Shared test fixtures."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def fresh_dynamo_caches():
    """Each test starts with dynamo's caches empty: compiled variants of one forward (the same transformers code
    object in many tests) would otherwise add up past ``recompile_limit``, after which dynamo runs that forward
    eagerly and a later compile test would test eager code."""
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
