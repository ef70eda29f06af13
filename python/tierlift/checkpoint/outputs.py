"""How the export commands write their output (export, export --format hf, export-optimizer):
into a temporary directory of their own beside it, renamed into place when complete, so that
nothing half-written is ever at the output's name.

The temporary directory is `.OUT.tmp-<host>-<pid>-<start>-<random>`: the exporting process's
pid and start time (so an unrelated process that got the pid later is not taken for it), and a
tag of its host name and pid namespace (a process of another machine or container cannot be
checked from here). An export killed on the way leaves it behind; the next export to the same
OUT removes those whose process is certainly gone (not running, or a zombie, or another process
holds its pid now), on this host and pid namespace only: a live export's, or one of another
host's, is left alone. A file output is written inside the directory too, so whatever the
writer puts beside its file (safetensors writes a temporary file and renames it) goes with it.

A failed write raises an OSError naming the output and the cause (write_errors.py), with the
temporary directory removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import targets, write_errors
from tierlift.io.fsync import fsync_path
from tierlift.offload.tiers import _owner_alive, _pid_namespace, _start_time

_TAG = re.compile(r"([0-9a-f]{8})-(\d+)-(\d+|x)-[0-9a-f]{8}")


def _host_tag() -> str:
    """8 hex digits naming this host and pid namespace."""
    who = f"{socket.gethostname()}\0{_pid_namespace()}"
    return hashlib.sha256(who.encode()).hexdigest()[:8]


def _parent(out: str) -> str:
    """The folder `out` is written in, as the OS reads the path (format.absolute: `link/..` is
    the folder above the link's target, where os.path.abspath would fold it away)."""
    return os.path.dirname(fmt.absolute(out))


def _prefix(out: str) -> str:
    return f".{os.path.basename(out)}.tmp-"


def temp_name(out: str) -> str:
    """A temporary directory for this process's write of `out`, beside it."""
    pid = os.getpid()
    start = _start_time(pid)
    marker = f"{_host_tag()}-{pid}-{'x' if start is None else start}-{uuid.uuid4().hex[:8]}"
    return os.path.join(_parent(out), _prefix(out) + marker)


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits for its parent to collect it (it writes nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0] == b"Z"
    except (OSError, ValueError, IndexError):
        return False


def _dead(name: str, tag: str) -> bool:
    """Whether the process that named its temporary directory `name` is certainly gone."""
    m = _TAG.fullmatch(name)
    if m is None or m.group(1) != tag:
        return False  # not ours to judge: another host's or container's, or not an export's
    pid = int(m.group(2))
    start = None if m.group(3) == "x" else int(m.group(3))
    return not _owner_alive(pid, start) or _zombie(pid)


def leftovers(out: str) -> list[str]:
    """The temporary directories of exports to `out` whose process is gone (sorted paths)."""
    parent = _parent(out)
    prefix, tag = _prefix(out), _host_tag()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith(prefix) and os.path.isdir(path) and not os.path.islink(path) and \
                _dead(name[len(prefix):], tag):
            found.append(path)
    return sorted(found)


def write_new(out: str, write, *, directory: bool = False) -> None:
    """`write(where)` writes the output: for a file, the file `where`; for a `directory`, into
    the (empty) directory `where`. `out` must not exist (a `directory` may be an empty one);
    its missing parent directories are created and the leftovers of dead exports to it
    removed first. Complete, it is renamed to `out`; on any failure nothing is left, and an
    OSError names `out` and the cause."""
    targets.check_new_output(out, directory=directory)
    tmp = temp_name(out)
    made = False
    try:
        targets.make_parent(out)
        for old in leftovers(out):
            shutil.rmtree(old, ignore_errors=True)
        os.mkdir(tmp)  # the usual permissions (mkdtemp's would be 0700)
        made = True
        inner = tmp if directory else os.path.join(tmp, os.path.basename(out))
        write(inner)
        targets.check_new_output(out, directory=directory)  # nothing appeared meanwhile
        # The writers flush their files; the entries and the rename are flushed here, so an
        # output reported written is still there after a power loss.
        if directory:
            fsync_path(tmp)
            if os.path.isdir(out):
                os.rmdir(out)  # empty, checked above
            os.rename(tmp, out)
        else:
            os.rename(inner, out)
            os.rmdir(tmp)
    except BaseException as e:
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        better = write_errors.explain(e, out, tmp, "nothing was written there and its "
                                      "temporary files were removed")
        if better is not None:
            raise better from e
        raise
    fsync_path(_parent(out))  # the rename (out is complete by now)
