"""The cause of a failed write, said plainly: a missing folder, one that is not writable, no
space left (blocks or inodes) or a quota reached, a file size limit.

torch.save and safetensors report these in their own words (torch: `[enforce fail at
inline_container.cc:...] unexpected pos 4564 vs 4509`; safetensors: `I/O error: ... (os error
28)`). The OSError underneath names the cause: tierlift's writers give torch.save a Python file,
so the OSError of its write becomes the context of torch's error, and safetensors puts the
errno into its text. explain() finds it and says which path could not be written, and why.

An OSError that names a file is explained only when that file is the destination's (inside its
temporary directory, or the destination's folder or one above it), so that a read of some other
file (an optimizer's state file, a checkpoint being exported) is never reported as a write.
One that names no file is explained only for the errors no read gives (ENOSPC, EDQUOT, EFBIG,
EROFS).
"""

from __future__ import annotations

import errno
import os
import re
import resource

from tierlift.checkpoint import format as fmt

# Rust's io::Error as safetensors shows it: `I/O error: ... (os error 28) at path "..."`
_OS_ERROR_TEXT = re.compile(r'\(os error (\d+)\)(?: at path "([^"]*)")?')
_WRITES_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def os_error(error: BaseException) -> OSError | None:
    """The OSError with an errno beneath `error` (it, or what it was raised from or during),
    or one made from safetensors' "(os error N) at path P"; None if there is none."""
    e: BaseException | None = error
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno:
            return e
        m = _OS_ERROR_TEXT.search(str(e))
        if m:
            n = int(m.group(1))
            return OSError(n, os.strerror(n), m.group(2))
        e = e.__cause__ or e.__context__
    return None


def _concerns(name: str, dest: str, tmp: str | None) -> bool:
    """Whether the file an OSError names is one the write of `dest` creates: inside `tmp`,
    `dest` itself, or `dest`'s folder or one above it (creating missing parents)."""
    name = os.path.abspath(name)
    dest = os.path.abspath(dest)
    if tmp is not None:
        tmp = os.path.abspath(tmp)
        if name == tmp or name.startswith(tmp + os.sep):
            return True
    return name == dest or dest.startswith(name.rstrip(os.sep) + os.sep)


# ENOSPC is not only a full disk: the file system may have run out of inodes (many small files),
# and XFS reports an exhausted project quota with it too; the counts said beside it tell which.
_NO_ROOM = {
    errno.ENOSPC: ("no space left", "ENOSPC: its blocks or its inodes are used up, or a project "
                   "quota is reached"),
    errno.EDQUOT: ("disk quota exceeded", "EDQUOT: this user's or group's quota there is used "
                   "up"),
}


def free_space(folder: str) -> str:
    """What is free on the drive of `folder`, for this user: bytes, and inodes where the file
    system counts them."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return "the free space there is unknown"
    free = f"{st.f_bavail * st.f_frsize} bytes"
    if st.f_files:  # 0: a file system without an inode limit (btrfs)
        free += f" and {st.f_favail} inodes"
    return free + " are free there"


def no_room(code: int, folder: str) -> str:
    """What ENOSPC or EDQUOT (`code`) says about the drive of `folder`, and what is free there."""
    what, why = _NO_ROOM[code]
    return f"{what} on the drive of {folder!r} ({why}): {free_space(folder)}"


def cause(code: int, folder: str, tmp: str | None = None) -> str | None:
    """What errno `code` means for a write into `folder` (through the temporary directory
    `tmp` there, if any), or None for another error."""
    if code == errno.ENOENT:
        if tmp is not None and os.path.isdir(folder):
            return (f"missing folder: its temporary directory {tmp!r} was removed while it was "
                    "being written")
        return f"missing parent folder: {folder!r} does not exist (removed while writing?)"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = folder
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)  # the folder it was to be created in
        if code == errno.EROFS:
            return f"not writable: {where!r} is on a read-only file system"
        return f"not writable: this user may not write in {where!r} (permission denied)"
    if code in _NO_ROOM:
        return no_room(code, folder)
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"file size limit (EFBIG): a file would grow past {limit} bytes, the most "
                    "this process may write (RLIMIT_FSIZE, ulimit -f)")
        return "file size limit (EFBIG): a file would grow past what the file system allows"
    return None


def explain(error: BaseException, dest: str, tmp: str | None, outcome: str) -> OSError | None:
    """An OSError saying that `dest` could not be written, the cause (missing parent folder,
    not writable, no space left, file size limit) and `outcome` (what was left behind), if `error`
    is one of those in writing `dest` or its temporary `tmp`; else None. The caller raises it
    from `error`."""
    e = os_error(error)
    if e is None:
        return None
    if e.filename is not None:
        if not _concerns(os.fsdecode(e.filename), dest, tmp):
            return None
    elif e.errno not in _WRITES_ONLY:
        return None
    # the folder as the OS reads `dest` (`link/..` included): its drive's free space is said
    text = cause(e.errno, os.path.dirname(fmt.absolute(dest)), tmp)
    if text is None:
        return None
    return OSError(e.errno, f"cannot write {dest!r}: {text}; {outcome}")
