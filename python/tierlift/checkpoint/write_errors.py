"""The cause of a failed write, said plainly: a missing folder, one that is not writable, a full
drive, a file size limit.

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
import shutil

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
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(folder).free} bytes are free there"
        except OSError:
            free = "the free space there is unknown"
        what = "disk full (ENOSPC)" if code == errno.ENOSPC else \
            "disk quota exceeded (EDQUOT)"
        return f"{what} on the drive of {folder!r}: {free}"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"file size limit (EFBIG): a file would grow past {limit} bytes, the most "
                    "this process may write (RLIMIT_FSIZE, ulimit -f)")
        return "file size limit (EFBIG): a file would grow past what the file system allows"
    return None


def explain(error: BaseException, dest: str, tmp: str | None, outcome: str) -> OSError | None:
    """An OSError saying that `dest` could not be written, the cause (missing parent folder,
    not writable, disk full, file size limit) and `outcome` (what was left behind), if `error`
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
    text = cause(e.errno, os.path.dirname(os.path.abspath(dest)), tmp)
    if text is None:
        return None
    return OSError(e.errno, f"cannot write {dest!r}: {text}; {outcome}")
