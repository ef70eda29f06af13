"""Paths given by the user, kept as the OS reads them."""

from __future__ import annotations

import os


def absolute(path) -> str:
    """`path` (str or os.PathLike) made absolute as the OS reads it: joined to the working
    directory, not normalized (os.path.abspath folds `link/..` to `.`, where the OS goes up from
    the folder the link points to). Folders that are reopened, watched or removed by path later
    take it once, when made: a relative one would name other files after an os.chdir."""
    return os.path.join(os.getcwd(), os.fspath(path))
