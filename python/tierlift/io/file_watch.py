"""FileWatch: tells whether files a running job keeps its state in were changed by anyone else.

The NVMe tiers (zero/param_nvme.py's parameter shards, offload/tiers.py's optimizer state) keep
data only in their files. A file cut short, truncated and regrown (`truncate -s 0 f; truncate -s
N f`), rewritten (`cp x f`), overwritten in part (`dd conv=notrunc`) or replaced under the same
name would otherwise be read back as zeros or someone else's bytes and trained on. check() is
called before every gather and step reads a file, and raises OSError(EIO) naming the file, what
it held and "resume from a checkpoint"; once a file is found changed, every later check of it
raises.

Two checks, both a syscall or two:
* stat(path): the name still points to the file this job made (st_dev, st_ino) and it is not
  shorter than the job made it. This alone catches a file cut short, removed or replaced.
* fanotify (unprivileged since Linux 5.13, FAN_REPORT_FID): one process-wide group with a mark
  per watched file, asking for FAN_MODIFY, which every write(2), pwrite, io_uring write and
  truncate raises, by anyone. An event reports the writer's pid (to an unprivileged listener:
  its own pid, or 0 for any other process), so this process's own writes, the tiers' pwrites
  and io_uring writes (their kernel workers are threads of this process), are told apart from
  all others and ignored; writes through this process's mappings raise no event at all. A
  read of the group is one syscall and the kernel queues an event as the write happens, so a
  write by another process that returned before the check is seen.
Not inotify: it reports no pid, and the tiers' own pwrites raise the same IN_MODIFY as another
process's. Not (st_ctime, st_mtime): the tiers' own writes through the mapping move them at
page-fault time, from whatever thread writes. Not a sentinel word: it sees no overwrite of the
data before it, and a copy of the file carries the same word.

A file the job only reads through its own mapping of it (a GNN feature file: add(...,
mapped_by=...)) is checked the other way round by stat: a name that now points to another file,
or to none, is harmless (the mapping keeps the file it mapped), while a change of its size or
modification time, by this process too, is refused (a rewrite in place, which the mapping shows);
only its size where this process may write through a shared mapping of it (a user's np.memmap
"r+": those writes are edits, which move the modification time too).

Not seen: another process writing through its own shared mapping of the file (no event), and
writes from another machine to a network file system. Refused though harmless: `touch -m`
(setting only the mtime raises FAN_MODIFY). TIERLIFT_FILE_WATCH=0 turns fanotify off. Where
fanotify is unavailable (an older kernel, a container whose seccomp profile refuses
fanotify_init, a file system without file handles) the stat check still runs and a warning
says once that a file truncated and regrown or overwritten in place is not detected.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
import warnings
import weakref

_FAN_CLOEXEC, _FAN_NONBLOCK, _FAN_REPORT_FID = 0x1, 0x2, 0x200
_FAN_MARK_ADD, _FAN_MARK_REMOVE = 0x1, 0x2
_FAN_MODIFY, _FAN_Q_OVERFLOW = 0x2, 0x4000
_FAN_EVENT_INFO_TYPE_FID = 1
_AT_FDCWD = -100
_AT_HANDLE_FID = 0x200  # name_to_handle_at: the handle fanotify reports (Linux 6.5+)
_MAX_HANDLE = 128
_METADATA = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_FID_HEAD = struct.Struct("=BBHiiIi")  # info header, fsid, file_handle's bytes and type

_warned = False


def _warn_unwatched(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"tierlift: the files a job keeps its state in or reads (the NVMe tiers' "
                  f"files, GNN feature files) are not watched for writes by other processes "
                  f"({reason}); a file cut short, removed or replaced under the running job (a "
                  f"feature file: rewritten with a new size or modification time) is still "
                  f"refused, but one truncated and regrown, or overwritten in place, by another "
                  f"process is not detected", RuntimeWarning, stacklevel=4)


class _Handle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * _MAX_HANDLE)]


class _Notifier:
    """The process's fanotify group: marks files, drains events, hands other processes' writes
    to the watch of the file (by its file handle)."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self.libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                            ctypes.c_int, ctypes.c_char_p]
        self.libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p,
                                                ctypes.POINTER(_Handle),
                                                ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        fd = self.libc.fanotify_init(_FAN_CLOEXEC | _FAN_NONBLOCK | _FAN_REPORT_FID, os.O_RDONLY)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        self.fd = fd
        # Serialises reads of the group. Not taken by mark() or unmark(): a watch's finalizer
        # unmarks, and the garbage collector may run it inside drain() (a deadlock, seen).
        # `files` is read only by single dict operations, atomic under the GIL, and its values
        # are tuples, replaced whole.
        self.lock = threading.Lock()
        # Serialises mark() and unmark(). Reentrant: the collector may run a finalizer (an
        # unmark) inside either, on the same thread.
        self.marks = threading.RLock()
        # file handle -> ((weakref to a watch, path), ...): every watch of that file (several
        # GNN stores may map one file)
        self.files: dict[tuple, tuple] = {}

    def handle(self, path: str) -> tuple:
        h, mount = _Handle(), ctypes.c_int()
        for flags in (_AT_HANDLE_FID, 0):
            h.handle_bytes = _MAX_HANDLE
            if self.libc.name_to_handle_at(_AT_FDCWD, os.fsencode(path), ctypes.byref(h),
                                           ctypes.byref(mount), flags) == 0:
                return h.handle_type, bytes(h.f_handle[:h.handle_bytes])
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                break
        raise OSError(err, f"name_to_handle_at({path!r}): {os.strerror(err)}")

    def mark(self, path: str, ref: weakref.ref) -> tuple:
        """Marks `path` for the watch `ref` refers to; returns the file's handle."""
        # Events already queued (the file written while other watches marked it) are theirs:
        # handed out before this watch is recorded, they would refuse the new one for a write
        # made before it was taken. (Outside `marks`: drain() may run a finalizer's unmark.)
        self.drain()
        with self.marks:
            key = self.handle(path)
            # Recorded before the kernel mark is added: an unmark of the same file run by the
            # collector in between then sees this watch and leaves the mark in place.
            self.files[key] = (*self.files.get(key, ()), (ref, path))
            if self.libc.fanotify_mark(self.fd, _FAN_MARK_ADD, _FAN_MODIFY, _AT_FDCWD,
                                       os.fsencode(path)) != 0:
                err = ctypes.get_errno()
                self.unmark(key, path, ref)
                raise OSError(err, f"fanotify_mark({path!r}): {os.strerror(err)}")
            return key

    def unmark(self, key: tuple, path: str, ref: weakref.ref) -> None:
        """The watch `ref` stops watching the file; its mark goes with the last live watch."""
        if self.fd < 0:
            return  # (the parent's group, in a forked child: nothing to unmark, and its lock
            # may have been held by another of the parent's threads at the fork)
        with self.marks:
            left = tuple(e for e in self.files.get(key, ()) if e[0] is not ref and e[0]())
            if left:
                self.files[key] = left
                return
            self.files.pop(key, None)
            # By name, only while the name is still this file: a file removed or replaced
            # under the job loses its mark with its inode.
            try:
                if self.handle(path) == key:
                    self.libc.fanotify_mark(self.fd, _FAN_MARK_REMOVE, _FAN_MODIFY, _AT_FDCWD,
                                            os.fsencode(path))
            except OSError:
                pass

    def drain(self) -> None:
        """Reads every queued event; tells each watch whose file another process wrote."""
        if self.fd < 0:
            return  # (the parent's group, in a forked child)
        me, found = os.getpid(), []
        with self.lock:
            while True:
                try:
                    buf = os.read(self.fd, 16384)
                except BlockingIOError:
                    break
                at = 0
                while at + _METADATA.size <= len(buf):
                    length, _, _, meta_len, mask, _, pid = _METADATA.unpack_from(buf, at)
                    if mask & _FAN_Q_OVERFLOW:
                        found += [(ref, None, None) for watches in list(self.files.values())
                                  for ref, _ in watches]
                    elif pid != me:
                        key = None
                        if meta_len + _FID_HEAD.size <= length:
                            kind, _, _, _, _, nbytes, htype = _FID_HEAD.unpack_from(
                                buf, at + meta_len)
                            start = at + meta_len + _FID_HEAD.size
                            if kind == _FAN_EVENT_INFO_TYPE_FID:
                                key = (htype, bytes(buf[start:start + nbytes]))
                        hit = self.files.get(key)
                        # A handle not recognised: every watched file may be the one written.
                        found += [(ref, path, pid) for ref, path in hit] if hit else [
                            (ref, "", pid) for watches in list(self.files.values())
                            for ref, _ in watches]
                    at += length
        for ref, path, pid in found:
            watch = ref()
            if watch is not None:
                watch._written(path, pid)


_NOTIFIER: _Notifier | None = None
_NOTIFIER_ERROR: str | None = None
_NOTIFIER_LOCK = threading.Lock()


def _notifier() -> _Notifier | None:
    global _NOTIFIER, _NOTIFIER_ERROR
    with _NOTIFIER_LOCK:
        if _NOTIFIER is None and _NOTIFIER_ERROR is None:
            if os.environ.get("TIERLIFT_FILE_WATCH", "1") == "0":
                _NOTIFIER_ERROR = "TIERLIFT_FILE_WATCH=0"
            else:
                try:
                    _NOTIFIER = _Notifier()
                except (OSError, AttributeError) as e:  # AttributeError: a libc without it
                    _NOTIFIER_ERROR = f"fanotify is unavailable: {e}"
        return _NOTIFIER


def _forget_in_child() -> None:
    # The group's queue is the parent's: a child reading it would take the parent's events.
    # Watches inherited from the parent keep their stat checks; new ones get a group of the
    # child's own.
    global _NOTIFIER, _NOTIFIER_ERROR
    if _NOTIFIER is not None:
        os.close(_NOTIFIER.fd)
        _NOTIFIER.fd = -1
    _NOTIFIER, _NOTIFIER_ERROR = None, None


os.register_at_fork(after_in_child=_forget_in_child)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """Which file (st_dev, st_ino), and its size and modification time, which a rewrite in place
    changes (a rewrite of the same size within the file system's timestamp granularity, or with
    the time set back, keeps them: the fanotify watch sees that one)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _File:
    __slots__ = ("what", "size", "identity", "key", "fd", "mapped_by")

    def __init__(self, what: str, size: int, identity: tuple, key, fd: int | None,
                 mapped_by: str | None = None):
        self.what, self.size, self.identity, self.key, self.fd = what, size, identity, key, fd
        self.mapped_by = mapped_by


def _unmark_all(notifier: _Notifier | None, files: dict, ref: weakref.ref) -> None:
    while files:
        path, f = files.popitem()
        if notifier is not None and f.key is not None:
            notifier.unmark(f.key, path, ref)


class FileWatch:
    """The files of one store. add(path, what, size, fd) once the file is made (`what`: what
    it holds, for the error; `fd`: a descriptor the job keeps it open and mapped by, which makes
    a removed file harmless: nothing was lost); check() before reading or writing them (or
    find(), which says what check() would raise); forget(path) before this job removes a file
    itself; close() when done. `watching`: whether writes by other processes are seen
    (fanotify), else only files cut short, removed or replaced."""

    def __init__(self):
        self.files: dict[str, _File] = {}
        # path -> why it is refused, once found (kept); None: which file is not known
        self.problems: dict[str | None, str] = {}
        self._notifier = _notifier()
        self.watching = self._notifier is not None
        if not self.watching:
            _warn_unwatched(_NOTIFIER_ERROR or "")
        # Files kept after the job (a durable state) lose their marks when the watch goes.
        self._ref = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _unmark_all, self._notifier, self.files,
                                           self._ref)

    def add(self, path: str, what: str, size: int, fd: int | None = None, *,
            mapped_by: str | None = None, identity: tuple | None = None) -> None:
        """`mapped_by` (who maps it: "the store"): a file the job only reads through its own
        mapping, checked by stat for a rewrite in place (see the module's docstring).
        `identity`: its file_identity when it was mapped (default: now), so that a rewrite
        between the mapping and this call is refused too; a modification time of None is not
        compared (a file this process may write through a shared mapping of its own)."""
        st = os.stat(path)
        identity = file_identity(st) if identity is None else tuple(identity)
        if mapped_by is None:
            identity = identity[:2]
        key = None
        # (a mapped file replaced under its name before this call: nothing to mark, the name is
        # another file's)
        if self.watching and identity[:2] == (st.st_dev, st.st_ino):
            try:
                key = self._notifier.mark(path, self._ref)
            except OSError as e:  # a file system without file handles or fanotify marks
                self.watching = False
                _warn_unwatched(f"{path!r} cannot be watched: {e}")
        self.files[path] = _File(what, size, identity, key, fd, mapped_by)

    def forget(self, path: str) -> None:
        f = self.files.pop(path, None)
        if f is not None and f.key is not None:
            self._notifier.unmark(f.key, path, self._ref)

    def close(self) -> None:
        self._finalizer()

    @property
    def problem(self) -> str | None:
        """The first change found (its message), or None."""
        return next(iter(self.problems.values()), None)

    def _written(self, path: str | None, pid: int | None) -> None:
        if path is None:
            self.problems.setdefault(None, (
                f"one of {sorted(self.files)} may have been written by another process under "
                f"the running job: the kernel's queue of file events overflowed, so which "
                f"bytes changed is not known"))
            return
        # (an unprivileged listener is told the pid of no other process)
        who = f" (pid {pid})" if pid else ""
        if not path:  # an event whose file handle is not one this process recorded
            self.problems.setdefault(None, (
                f"one of {sorted(self.files)} was written by another process{who} under "
                f"the running job (which one is not known): truncated, rewritten or "
                f"overwritten in part, so what it held is lost"))
            return
        f = self.files.get(path)
        if f is not None:
            self.problems.setdefault(path, (
                f"{path!r} ({f.what}) was written by another process{who} under the running "
                f"job: truncated, rewritten or overwritten in part, so what it held is lost"))

    def _stat_problem(self, path: str, f: _File) -> str | None:
        if f.mapped_by is not None:
            try:
                st = os.stat(path)
            except OSError:  # removed: the mapping keeps the file
                return None
            now = file_identity(st)
            if now[:2] != f.identity[:2] or all(
                    then is None or then == n for n, then in zip(now, f.identity, strict=True)):
                return None  # (replaced: the mapping keeps the file it mapped)
            return (f"{path!r} ({f.what}) was rewritten in place since {f.mapped_by} mapped it "
                    f"(its size or modification time changed), so what the mapping shows is no "
                    f"longer what it held")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if f.fd is None:
                return (f"{path!r} ({f.what}) was removed under the running job, so what it "
                        f"held is no longer on the disk")
            st = os.fstat(f.fd)  # removed, but open and mapped here: only its size matters
        if (st.st_dev, st.st_ino) != f.identity:
            return (f"{path!r} ({f.what}) was replaced under the running job: the name now "
                    f"points to another file, and what the job's file held is no longer there")
        if st.st_size < f.size:
            return (f"{path!r} ({f.what}) was cut short under the running job: {st.st_size} "
                    f"of its {f.size} bytes are left and what was past them is lost")
        return None

    def find(self, paths=None) -> tuple[str | None, str] | None:
        """The first change of a file found, now or at an earlier check: (its path, or None
        where which file is not known; the message), else None. `paths`: only these files
        (default: all)."""
        targets = list(self.files) if paths is None else [p for p in paths if p in self.files]
        for path in targets:  # first: a file cut short or replaced says so precisely
            if path not in self.problems:
                msg = self._stat_problem(path, self.files[path])
                if msg is not None:
                    self.problems[path] = msg
        if self._notifier is not None and self.files:
            self._notifier.drain()
        for path, msg in list(self.problems.items()):  # (another thread may add one)
            if path is None or path in targets:
                return path, msg
        return None

    def check(self, prefix=None, paths=None) -> None:
        """Raises OSError(EIO) if a file was changed by another process, cut short, removed or
        replaced, now or at an earlier check. `prefix(path)`: text to put before the message
        (what was being done with that file), or None. `paths`: only these files (default:
        all): a file found changed once refuses every later check that includes it."""
        found = self.find(paths)
        if found is not None:
            path, msg = found
            head = (prefix(path) or "") if prefix is not None and path else ""
            raise OSError(errno.EIO, f"{head}{msg}; nothing more is read from it or "
                                     f"stepped: resume from a checkpoint")
