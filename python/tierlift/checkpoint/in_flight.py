"""The background save this process has in flight (at most one): a new save waits for it, a
read of its path waits for it to commit, and the process's exit waits for it. A module of its
own, importing nothing of tierlift.checkpoint, so that the readers (format, io, replicated)
and the writer (background) can all reach it without importing each other."""

from __future__ import annotations

import atexit
import os
import sys

_pending = None  # background.SaveHandle of the save in flight, or None
_pending_at: tuple = ()  # where it writes (_where), taken when it started


def _where(path) -> tuple:
    """Where `path` is: its real path, and its folder's (st_dev, st_ino) with its name, so
    that a symbolic link, a relative path, `a/../a`, a trailing slash or a bind mount of the
    same folder all name the same place (the checkpoint itself is renamed into place by each
    save, so its folder, which stays, is what is compared)."""
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    folder, name = os.path.split(real)
    try:
        st = os.stat(folder)
    except OSError:
        return (real, None)
    return (real, (st.st_dev, st.st_ino, name))


def started(handle) -> None:
    """`handle` (a SaveHandle) is the save in flight now. Where it writes is taken now: a
    relative path means the folder it names at the save, not after a chdir."""
    global _pending, _pending_at
    _pending_at = _where(handle.path)
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
    if _pending is None:
        return
    real, ident = _where(path)
    if real == _pending_at[0] or (ident is not None and ident == _pending_at[1]):
        before_save()


@atexit.register
def _at_exit() -> None:
    if _pending is not None and not _pending._reported:
        try:
            _pending.wait()
        except BaseException as e:  # noqa: BLE001 - nothing can raise at exit
            print(f"tierlift.checkpoint: the background save to {_pending.path} failed: {e!r}; "
                  "the previous checkpoint there is intact", file=sys.stderr)
