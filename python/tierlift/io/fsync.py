"""fsync by name: what makes a written file's data, or a rename or unlink inside a directory,
survive a power loss. Every layer that replaces files whole (the durable optimizer state, the
export commands) uses this one helper."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """Flushes `path` to the drive: a file (its data, before it is renamed into place) or a
    directory (the renames and unlinks done in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
