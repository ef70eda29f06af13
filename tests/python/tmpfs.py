"""A small tmpfs mounted for a test (a full disk on demand): needs root, as CI has; the test is
skipped where mounting is not allowed."""

from __future__ import annotations

import contextlib
import subprocess
import uuid

import pytest


@contextlib.contextmanager
def mounted_tmpfs(parent, size: str):
    """A new folder under `parent` with a tmpfs of `size` (mount's spelling: "1m") on it."""
    path = parent / f"drive-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
