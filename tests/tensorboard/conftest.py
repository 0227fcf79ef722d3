"""Fixtures of the TensorBoard tests: a size-limited tmpfs for the storage faults."""

from __future__ import annotations

import subprocess
import uuid

import pytest


@pytest.fixture
def tmpfs(tmp_path):
    """A 256 KiB tmpfs mounted at ``tmp_path / "fs"`` (unmounted after the test)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", f"headwatch-{uuid.uuid4().hex[:8]}", str(mount)],
                       check=True, capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {err}")
    yield mount
    subprocess.run(["mount", "-o", "remount,rw", str(mount)], capture_output=True, timeout=30)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
