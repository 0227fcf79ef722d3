"""Where the repository's files are, for the tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (``tests/`` is one of its folders)."""

WORKERS = ROOT / "tests" / "workers"
"""The scripts the tests run as processes (gloo, torchrun, a killed run, a LightningCLI app)."""
