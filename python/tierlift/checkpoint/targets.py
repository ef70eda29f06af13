"""What a save, an export or an import may write over, checked before anything is written.

A save replaces `path` (and uses `path`.tmp and `path`.old on the way, format.replace_dir), so
each of them must be absent, an empty directory, or a tierlift checkpoint (or, for `.tmp`, a
save's leftover): a file or a directory of anything else is refused, never deleted. A
checkpoint directory that also holds files tierlift did not write (a notes.txt put there) is
refused too: the save swaps the directory whole, and would delete them. An import (import-dcp)
and the exports write only to a new path, or an empty directory. Every writer creates missing
parent directories, as save() always has.

A lone `path`.old (a save killed between its two renames) is the checkpoint at `path`
(format.resolve_dir): every writer sees it so. A save replaces it (keeping it until the new
one is in place); an import or an export to `path` is refused, as for an existing checkpoint.
Only the copy a save moved aside counts (format.moved_aside): a `path`.old its user renamed or
copied there is refused, never deleted nor read. A `path` that is a mount point is refused
too: it cannot be renamed aside.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import write_errors
from tierlift.checkpoint.manifest import FORMAT as MANIFEST_FORMAT
from tierlift.checkpoint.manifest import MANIFEST

OWNER = ".owner.json"  # written first into `path`.tmp by a save (background.claim)
# The names a save gives its files (for a checkpoint without a readable manifest.json).
_OURS = re.compile(r"metadata\.json|manifest\.json|\.owner\.json|rank\d{5}\.(pt|sha256)|"
                   r"(rank\d{5}\.optim|optim)/(state\.json|g\d+\.\w+\.(f32|bf16|u8))")
_OUR_DIRS = re.compile(r"rank\d{5}\.optim|optim")


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


def _listed(path: str) -> set[str] | None:
    """The files the manifest.json of checkpoint `path` lists; None without a readable one."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            value = json.load(f)
        files = value["files"]
        if value.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            return None
        return set(files)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def foreign_files(path: str) -> list[str]:
    """What checkpoint directory `path` holds that tierlift did not write, as sorted relative
    paths (an empty folder with a trailing /): anything its manifest.json does not list, or,
    without a readable manifest, anything not named as a save names its files."""
    listed = _listed(path)
    # Folders a save makes: an empty one is what a removal (format.remove_dir) killed after
    # emptying it and before its rmdir leaves, not something of the user's.
    ours_dirs = {f.rsplit("/", 1)[0] for f in listed if "/" in f} if listed is not None \
        else None
    out = []
    for root, dirs, names in os.walk(path):
        rel_root = os.path.relpath(root, path).replace(os.sep, "/")
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # not walked into
        for name in names + links:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if rel in (MANIFEST, OWNER, fmt.MOVED_ASIDE) or (
                    rel in listed if listed is not None else _OURS.fullmatch(rel)):
                continue
            out.append(rel)
        if not names and not dirs and rel_root != "." and not (
                rel_root in ours_dirs if ours_dirs is not None
                else _OUR_DIRS.fullmatch(rel_root)):
            out.append(rel_root + "/")
    return sorted(out)


def _refuse_foreign(path: str) -> None:
    found = foreign_files(path)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise FileExistsError(
            f"{path!r} holds files tierlift did not write ({', '.join(found[:3])}{more}); a "
            "save replaces the checkpoint directory whole and would delete them, so nothing was "
            "written (move them out, or save elsewhere)")


def lone_old(path: str) -> bool:
    """Whether `path`.old is the checkpoint at `path` (format.resolve_dir's rule): `path` is
    absent or an empty directory, and `path`.old is a tierlift checkpoint."""
    return (not os.path.lexists(path) or _empty_dir(path)) and is_checkpoint(path + ".old") \
        and fmt.moved_aside(path + ".old")


def _refuse_lone_old(path: str) -> None:
    if lone_old(path):
        old = path + ".old"
        raise FileExistsError(
            f"{old!r} is the checkpoint at {path!r} (a save was interrupted while replacing "
            f"it; load({path!r}) reads it from there); nothing was written (rename {old!r} to "
            f"{path!r} first, or write elsewhere)")


def _empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _removal_left(old: str) -> bool:
    """Whether `old` holds nothing but a save's moved-aside marker: what a removal of the copy
    a save moved aside (format.remove_dir) leaves when it is killed right before its end."""
    return os.path.isdir(old) and not os.path.islink(old) and \
        os.listdir(old) == [fmt.MOVED_ASIDE] and fmt.moved_aside(old)


def _what(path: str) -> str:
    if os.path.islink(path):
        return "a symbolic link"
    if os.path.isdir(path):
        return "a directory that is not a tierlift checkpoint (no tierlift metadata.json)"
    return "a file" if os.path.isfile(path) else "not a directory"


def check_save_target(path: str, *, replace: bool = True) -> None:
    """Raises FileExistsError, changing nothing, unless a save may write `path`: absent, an
    empty directory, or (with `replace`) a tierlift checkpoint holding only its own files;
    `path`.old likewise (without `replace`, not the checkpoint at `path`: lone_old), and
    `path`.tmp absent, empty or left by a save."""
    if os.path.ismount(path):
        raise FileExistsError(f"{path!r} is a mount point, which cannot be renamed, and a save "
                              "replaces the checkpoint folder by renames beside it; nothing was "
                              f"written (save into a folder inside it, e.g. "
                              f"{os.path.join(path, 'ckpt')!r})")
    if os.path.lexists(path) and not _empty_dir(path):
        if not replace:
            raise FileExistsError(f"{path!r} exists and is not an empty directory; nothing "
                                  "was written (pass a new path, or remove it first)")
        if not is_checkpoint(path):
            raise FileExistsError(f"{path!r} exists and is {_what(path)}; a save replaces only "
                                  "a tierlift checkpoint, so nothing was written (save "
                                  "elsewhere, or remove it first)")
        _refuse_foreign(path)
    old, tmp = path + ".old", path + ".tmp"
    if os.path.lexists(old) and not _empty_dir(old) and not _removal_left(old):
        if not is_checkpoint(old):
            raise FileExistsError(f"{old!r} exists and is {_what(old)}; a save uses that name "
                                  "on its way, so nothing was written (rename it, or save "
                                  "elsewhere)")
        if not fmt.moved_aside(old):  # a save of `path` would delete it as its own leftover
            raise FileExistsError(f"{old!r} is a checkpoint that no save of {path!r} moved "
                                  "aside (saved under that name, or renamed or copied there "
                                  f"by hand), and a save of {path!r} uses that name on its way "
                                  "(it would delete it), so nothing was written (rename it, "
                                  "or save elsewhere)")
        if not replace:
            _refuse_lone_old(path)
        _refuse_foreign(old)
    if os.path.lexists(tmp) and not _empty_dir(tmp) and not (
            os.path.isdir(tmp) and not os.path.islink(tmp)
            and os.path.isfile(os.path.join(tmp, OWNER))):
        raise FileExistsError(f"{tmp!r} exists and was not left by a tierlift save; a save "
                              "writes there first, so nothing was written (rename it, or save "
                              "elsewhere)")


def check_new_output(out: str, *, directory: bool = False) -> None:
    """Raises FileExistsError unless `out` is absent (or, for a `directory` output, an empty
    directory), and is not the name of a checkpoint that lives at `out`.old (lone_old): an
    export never writes over anything. A file output named with a trailing separator is
    refused first: its parent would be made as `out` itself, left behind as an empty folder."""
    if not directory and os.fspath(out).endswith(os.sep):
        raise IsADirectoryError(errno.EISDIR, f"{out!r} names a directory, and this output is "
                                f"a file; nothing was written (give the file's name, e.g. "
                                f"{os.fspath(out).rstrip(os.sep)!r})")
    if not os.path.lexists(out) or directory and _empty_dir(out):
        _refuse_lone_old(os.fspath(out).rstrip(os.sep) or out)
        return
    what = "and is not an empty directory" if directory else "already"
    raise FileExistsError(f"{out!r} exists {what}; nothing was written (pass a new path, or "
                          "remove it first)")


def _not_a_folder(parent: str) -> tuple[int, str] | None:
    """Why folder `parent` cannot be created, as (errno, text): the first of it and the folders
    above it that exists but is not a folder, said plainly; None if there is none."""
    here = ""
    for part in pathlib.Path(parent).parts:
        here = os.path.join(here, part)
        if not os.path.lexists(here):
            return None  # it and what is below it can be created
        if os.path.isdir(here):
            continue
        if not os.path.islink(here):
            return errno.ENOTDIR, f"{here!r} is a file"
        target = os.path.normpath(os.path.join(os.path.dirname(here), os.readlink(here)))
        try:
            os.stat(here)
        except FileNotFoundError:
            return errno.ENOENT, (f"{here!r} is a symbolic link to a missing folder ({target!r} "
                                  "does not exist); create that folder, or fix or remove the "
                                  "link")
        except OSError as e:  # ELOOP: a link that leads back to itself
            return e.errno, f"{here!r} is a symbolic link that cannot be followed ({e.strerror})"
        return errno.ENOTDIR, f"{here!r} is a symbolic link to a file ({target!r})"
    return None


def make_parent(path: str) -> None:
    """Creates the missing parent directories of `path`; where one of them cannot be (a file,
    or a symbolic link to nothing, is in the way), an OSError says which and why."""
    parent = os.path.dirname(fmt.absolute(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError:
        found = _not_a_folder(parent)
        if found is None:
            raise
        code, why = found
        raise OSError(code, f"cannot create the parent directory of {path!r}: {why}") from None


def no_space(error: BaseException, path: str, needed: int | None) -> OSError | None:
    """An OSError (ENOSPC, or EDQUOT for a quota) naming checkpoint `path`, what is free on its
    drive and the bytes the save writes, if `error` (or what caused it) is one of those; else
    None."""
    e: BaseException | None = error
    for _ in range(8):  # the error, or what it was raised from
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            code = e.errno
            break
        if "No space left on device" in str(e):
            code = errno.ENOSPC
            break
        e = e.__cause__ or e.__context__
    else:
        return None
    room = write_errors.no_room(code, os.path.dirname(fmt.absolute(path)))  # `link/..` too
    need = f", and this save writes about {needed} bytes (on this rank)" \
        if needed is not None else ""
    where = getattr(e, "filename", None)
    failed = f" writing {where}" if where else ""
    return OSError(code, f"cannot save checkpoint {path!r}: {room}{need}; nothing was saved and "
                   f"the temporary directory {path + '.tmp'!r} was removed (the error{failed}: "
                   f"{e})")
