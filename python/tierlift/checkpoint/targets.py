"""What a save, an export or an import may write over, checked before anything is written.

A save replaces `path` (and uses `path`.tmp and `path`.old on the way, format.replace_dir), so
each of them must be absent, an empty directory, or a tierlift checkpoint (or, for `.tmp`, a
save's leftover): a file or a directory of anything else is refused, never deleted. An import
(import-dcp) and the exports write only to a new path, or an empty directory. Every writer
creates missing parent directories, as save() always has.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint.manifest import FORMAT as MANIFEST_FORMAT
from tierlift.checkpoint.manifest import MANIFEST

OWNER = ".owner.json"  # written first into `path`.tmp by a save (background.claim)


def _format_of(file: str) -> str | None:
    try:
        with open(file) as f:
            value = json.load(f)
        return value.get("format") if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def is_checkpoint(path: str) -> bool:
    """A directory with a tierlift metadata.json or manifest.json (a damaged checkpoint of
    tierlift's is still one: a new save may replace it)."""
    return os.path.isdir(path) and not os.path.islink(path) and (
        _format_of(os.path.join(path, MANIFEST)) == MANIFEST_FORMAT  # the smaller file first
        or _format_of(os.path.join(path, fmt.METADATA)) == fmt.FORMAT)


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _what(path: str) -> str:
    if os.path.islink(path):
        return "a symbolic link"
    if os.path.isdir(path):
        return "a directory that is not a tierlift checkpoint (no tierlift metadata.json)"
    return "a file" if os.path.isfile(path) else "not a directory"


def check_save_target(path: str, *, replace: bool = True) -> None:
    """Raises FileExistsError, changing nothing, unless a save may write `path`: absent, an
    empty directory, or (with `replace`) a tierlift checkpoint; `path`.old likewise, and
    `path`.tmp absent, empty or left by a save."""
    if os.path.lexists(path) and not _empty_dir(path):
        if not replace:
            raise FileExistsError(f"{path!r} exists and is not an empty directory; nothing "
                                  "was written (pass a new path, or remove it first)")
        if not is_checkpoint(path):
            raise FileExistsError(f"{path!r} exists and is {_what(path)}; a save replaces only "
                                  "a tierlift checkpoint, so nothing was written (save "
                                  "elsewhere, or remove it first)")
    old, tmp = path + ".old", path + ".tmp"
    if os.path.lexists(old) and not _empty_dir(old) and not is_checkpoint(old):
        raise FileExistsError(f"{old!r} exists and is {_what(old)}; a save uses that name on "
                              "its way, so nothing was written (rename it, or save elsewhere)")
    if os.path.lexists(tmp) and not _empty_dir(tmp) and not (
            os.path.isdir(tmp) and not os.path.islink(tmp)
            and os.path.isfile(os.path.join(tmp, OWNER))):
        raise FileExistsError(f"{tmp!r} exists and was not left by a tierlift save; a save "
                              "writes there first, so nothing was written (rename it, or save "
                              "elsewhere)")


def check_new_output(out: str, *, directory: bool = False) -> None:
    """Raises FileExistsError unless `out` is absent (or, for a `directory` output, an empty
    directory): an export never writes over anything."""
    if not os.path.lexists(out):
        return
    if directory and _empty_dir(out):
        return
    what = "and is not an empty directory" if directory else "already"
    raise FileExistsError(f"{out!r} exists {what}; nothing was written (pass a new path, or "
                          "remove it first)")


def make_parent(path: str) -> None:
    """Creates the missing parent directories of `path` (a clear error where one is a file)."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot create the parent directory of "
                                 f"{path!r}: a part of {parent!r} is a file") from None


def no_space(error: BaseException, path: str, needed: int | None) -> OSError | None:
    """An OSError(ENOSPC) naming checkpoint `path`, the bytes the save needs and the bytes free,
    if `error` (or what caused it) is a full drive; else None."""
    e: BaseException | None = error
    for _ in range(8):  # the error, or what it was raised from
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or \
                "No space left on device" in str(e):
            break
        e = e.__cause__ or e.__context__
    else:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(parent).free} bytes are free there"
    except OSError:
        free = "the free space there is unknown"
    need = f"this save writes about {needed} bytes" if needed is not None else \
        "this save needs more room"
    where = getattr(e, "filename", None)
    failed = f" writing {where}" if where else ""
    return OSError(errno.ENOSPC, f"no space left on the device for checkpoint {path!r}: {need} "
                   f"(on this rank) and {free}; nothing was saved and the temporary directory "
                   f"{path + '.tmp'!r} was removed (the error{failed}: {e})")
