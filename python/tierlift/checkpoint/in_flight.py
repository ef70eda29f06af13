"""The background save this process has in flight (at most one): a new save waits for it, a
read of its path waits for it to commit, and the process's exit waits for it. A module of its
own, importing nothing of tierlift.checkpoint, so that the readers (format, io, replicated)
and the writer (background) can all reach it without importing each other."""

from __future__ import annotations

import atexit
import os
import sys

_pending = None  # background.SaveHandle of the save in flight, or None


def started(handle) -> None:
    """`handle` (a SaveHandle) is the save in flight now."""
    global _pending
    _pending = handle


def before_save() -> None:
    """A new save waits for the one before, and raises its error if it failed."""
    global _pending
    prev, _pending = _pending, None
    if prev is not None:
        prev.wait()


def before_load(path) -> None:
    """A read of the path this process's background save is writing waits for that save (and
    raises its error): until it commits, the checkpoint there is still the one before it, which
    the read would have returned without a word."""
    if _pending is not None and (os.path.realpath(os.fsdecode(os.fspath(path)))
                                 == os.path.realpath(_pending.path)):
        before_save()


@atexit.register
def _at_exit() -> None:
    if _pending is not None and not _pending._reported:
        try:
            _pending.wait()
        except BaseException as e:  # noqa: BLE001 - nothing can raise at exit
            print(f"tierlift.checkpoint: the background save to {_pending.path} failed: {e!r}; "
                  "the previous checkpoint there is intact", file=sys.stderr)
