"""Tensors whose memory is a mapped file (a FeatureStore's table built from a path, np.memmap,
torch.from_file; a NeighborSampler's or PyGGraphStore's CSC arrays), found from the process's
own mappings, so that a holder sent to another process (a spawned DataLoader worker) maps the same
file again there instead of carrying its bytes: torch's pickling for workers moves a tensor into
shared memory (/dev/shm), a copy of the whole table or graph, an OOM or a full /dev/shm for one
larger than RAM (and for torch.from_file tensors it fails with "Bad file descriptor").

Only multiprocessing's pickler (ForkingPickler: a spawned process's arguments, its queues) takes
that route. Plain pickle, torch.save and copy.copy carry the rows by value: an archived dataset
or model must not lose its rows when the file is moved or deleted.

Only memory that is still the file's bytes qualifies: a private (copy-on-write) mapping with
pages written since it was mapped holds rows the file does not, so such a table is sent by
value, as before.

A table mapped from its file by tierlift (a FeatureStore built from a path, or mapped again in
another process or by deepcopy) watches that file (WatchedFile, io/file_watch.py's FileWatch):
the mapping shows whatever is written to the file, so a rewrite in place is refused before the
table is read again. So do a holder's tensors that the user mapped (MappedFiles: a FeatureStore
built from such a tensor, a NeighborSampler's or PyGGraphStore's edge arrays).
"""

from __future__ import annotations

import copy
import os
import stat
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from tierlift.io.file_watch import FileWatch, file_identity


@dataclass(frozen=True)
class FileRegion:
    path: str
    offset: int
    nbytes: int
    # st_dev, st_ino, st_size, st_mtime_ns (None: not compared, in a watch's; see file_region)
    identity: tuple[int, int, int, int | None]

    def open(self, dtype: torch.dtype, shape: tuple[int, ...], *, owner: str = "FeatureStore",
             what: str = "feature file", holder: str = "store") -> torch.Tensor:
        """The tensor mapped again (copy-on-write, as FeatureStore maps a path): no bytes read.
        owner/what/holder name the pickled object in the errors ("FeatureStore", "feature
        file", "store")."""
        try:
            now = file_identity(os.stat(self.path))
        except OSError as e:
            raise FileNotFoundError(
                f"{owner}: the {what} {self.path!r} that this pickled {holder} maps "
                f"cannot be opened here ({e.strerror}); a file-backed {holder} pickles as a "
                "reference to its file, which must be reachable where it is unpickled") from None
        if now != self.identity:
            raise RuntimeError(
                f"{owner}: the {what} {self.path!r} was replaced or rewritten since "
                f"this {holder} was pickled (its inode, size or modification time differ), so "
                f"its contents are not the original {holder}'s; build the {holder} again from "
                "the file")
        array = np.memmap(self.path, dtype=np.uint8, mode="c", offset=self.offset,
                          shape=(self.nbytes,))
        return torch.from_numpy(array).view(dtype).view(shape)

    def watch(self, *, what: str, holder: str) -> WatchedFile:
        """A watch of the file from `identity` on (a rewrite since is refused)."""
        return WatchedFile(self.path, self.identity, what=what, holder=holder)


class WatchedFile:
    """The file a table maps, watched from `identity` (its file_identity when it was mapped):
    problem() says, before each read of the table, whether the file was rewritten in place since
    then: by anyone, seen by its size or modification time; by another process, any bytes at
    any time, seen by the process's fanotify group (where it is available). Replaced under its
    name or removed, the file is still what the mapping reads: not a problem. `what` and
    `holder` name the file and what maps it in the message ("feature file", "store")."""

    def __init__(self, path: str, identity: tuple, *, what: str, holder: str):
        self.path, self.identity = path, tuple(identity)
        self._names = {"what": what, "holder": holder}
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._watch = FileWatch()
        self._watch.add(self.path, self._names["what"], self.identity[2],
                        mapped_by=f"the {self._names['holder']}", identity=self.identity)

    def problem(self) -> str | None:
        """What changed (a message naming the file), or None; once found, always found."""
        if self._pid != os.getpid() and self._watch.problem is None:
            # A forked child (a DataLoader worker) does not read its parent's fanotify group:
            # it watches with a group of its own, from the same identity (so a rewrite since
            # the mapping is still seen by stat).
            self._start()
        found = self._watch.find()
        return None if found is None else found[1]

    def again(self) -> WatchedFile:
        """A watch of its own for another mapping of the same file (a deepcopy's)."""
        return WatchedFile(self.path, self.identity, **self._names)


@dataclass
class _Mapping:
    start: int
    end: int
    private: bool
    writable: bool
    offset: int
    inode: int
    path: str
    written_kb: int = 0  # copy-on-write pages: in memory (Anonymous) or swapped out (Swap)


_SMAPS = "/proc/self/smaps"
_MAPS = "/proc/self/maps"


def _mappings_over(start: int, end: int, source: str | None = None) -> list[_Mapping]:
    """The mappings of this process that overlap [start, end), in address order. From
    /proc/self/maps (`source`=_MAPS) without their written pages: the kernel writes it without
    walking page tables, which smaps does for every mapping up to `start` (tens of milliseconds
    in a process with torch and CUDA's libraries mapped)."""
    found: list[_Mapping] = []
    current = None
    with open(_SMAPS if source is None else source) as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo >= end:
                    break
                current = None
                if hi > start and lo < end:
                    current = _Mapping(lo, hi, head[1].endswith("p"), head[1][1] == "w",
                                       int(head[2], 16),
                                       int(head[4]), head[5].rstrip("\n") if len(head) > 5 else "")
                    found.append(current)
            elif current is not None and head[0] in ("Anonymous:", "Swap:"):
                # a written page swapped out leaves Anonymous for Swap: still not the file's
                current.written_kb += int(head[1])
    return found


_PAGEMAP = "/proc/self/pagemap"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # (Linux only)
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61  # a pagemap entry's flags
_PAGEMAP_CHUNK = 1 << 13  # pages read at a time (64 KiB of entries)


def _all_written(start: int, end: int) -> bool:
    """Whether every page of [start, end) is this process's own memory (a private mapping's
    page written copy-on-write: in memory and not the file's, or swapped out), so that no byte
    of it shows its file any more. Read from /proc/self/pagemap a chunk at a time, up to the
    first page that still shows the file (not faulted in yet, or the file's page in the page
    cache): usually in the first chunk. Not known (no pagemap): False."""
    page, last = start // _PAGE, (end - 1) // _PAGE
    try:
        fd = os.open(_PAGEMAP, os.O_RDONLY)
    except OSError:
        return False
    try:
        while page <= last:
            count = min(last + 1 - page, _PAGEMAP_CHUNK)
            data = os.pread(fd, 8 * count, 8 * page)
            if len(data) != 8 * count:
                return False
            entry = np.frombuffer(data, dtype=np.uint64)
            own = ((entry & np.uint64(_SWAPPED)) != 0) | (
                ((entry & np.uint64(_PRESENT)) != 0) & ((entry & np.uint64(_FILE_PAGE)) == 0))
            if not own.all():
                return False
            page += count
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def file_region(table: torch.Tensor, *, private_only: bool = False,
                watch: bool = False) -> FileRegion | None:
    """Where `table` (a contiguous CPU tensor) lies in a regular file, or None: not file memory,
    a file deleted or replaced since it was mapped, or private pages written since. With
    `private_only`, also None for a shared mapping (np.memmap "r+", torch.from_file(shared=
    True)): writes to `table` go to the file, so a mapping of it is no independent copy.

    With `watch`, where a rewrite of the file in place would change what `table` reads: also a
    private mapping with pages written since (its pages not written still show the file), unless
    every page of `table` was (from /proc/self/pagemap; smaps is not read); and for a writable
    shared mapping the identity's modification time is None: this process's own writes through
    the mapping (edits of the tensor, which the file system may stamp) move it, so only the size
    tells a rewrite there (io/file_watch.py)."""
    nbytes = table.numel() * table.element_size()
    if (table.device.type != "cpu" or nbytes == 0 or not table.is_contiguous()
            or not os.path.exists(_SMAPS)):
        return None
    start = table.data_ptr()
    end = start + nbytes
    maps = _mappings_over(start, end, _MAPS)
    if not watch and any(m.private for m in maps) and maps[0].path.startswith("/"):
        maps = _mappings_over(start, end)  # with their pages written copy-on-write
    if not maps or maps[0].start > start or maps[-1].end < end:
        return None
    first = maps[0]
    path = first.path
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    for prev, cur in zip(maps, maps[1:], strict=False):  # one file, laid out as in memory
        if (cur.start != prev.end or cur.path != path or cur.inode != first.inode
                or cur.offset - first.offset != cur.start - first.start):
            return None
    if watch and _all_written(start, end):
        return None  # no page of it shows the file any more
    if not watch and any(m.private and m.written_kb for m in maps):
        return None  # copy-on-write pages: rows the file does not hold
    if private_only and not all(m.private for m in maps):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_ino != first.inode:
        return None
    offset = first.offset + (start - first.start)
    if offset + nbytes > st.st_size:
        return None
    identity = file_identity(st)
    if watch and any(m.writable and not m.private for m in maps):
        identity = (*identity[:3], None)
    return FileRegion(path, offset, nbytes, identity)


class MappedFiles:
    """The files that a holder's tensors, as the user gave them, are mappings of (np.memmap,
    np.load(mmap_mode=...), torch.from_file, or tierlift's own mapping of a file), each watched
    from now on (a WatchedFile): problem() before each read of the tensors says whether one was
    rewritten in place since, which changes what they read. Found once, here, from the
    process's mappings; tensors in memory of their own map no file, and then problem() makes no
    system call at all. `what` and `holder` name the file and its holder in the messages
    ("graph file", "sampler")."""

    def __init__(self, tensors, *, what: str, holder: str):
        self.files: dict[tuple, WatchedFile] = {}  # (st_dev, st_ino) -> its watch
        for t in tensors:
            region = file_region(t, watch=True) if isinstance(t, torch.Tensor) else None
            if region is not None and region.identity[:2] not in self.files:
                self.files[region.identity[:2]] = region.watch(what=what, holder=holder)

    def problem(self) -> str | None:
        """The first change found (a message naming the file), or None; once found, always."""
        for file in self.files.values():
            problem = file.problem()
            if problem is not None:
                return problem
        return None


class WatchesItsFiles:
    """Mixin of a holder whose tensors may be mapped files, watched in `self._files` (made by
    its `_watch_files()`, checked by its `_check_files()`): pickling is refused once a file was
    rewritten under it (the copy's tensors, by value or as the file, would not be the holder's).
    The watches stay here: a copy watches the files its own tensors map (a spawned worker's,
    mapped again from the files)."""

    def __getstate__(self):
        self._check_files()
        state = self.__dict__.copy()
        state.pop("_files", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._files = self._watch_files()


@dataclass(frozen=True)
class FileTensor:
    """What a file-backed tensor pickles as: its file's place, dtype and shape."""
    region: FileRegion
    dtype: torch.dtype
    shape: tuple[int, ...]


def by_file(value):
    """A FileTensor in place of a plain tensor that is its file's bytes, else `value` itself
    (sent by value: memory of its own, edited copy-on-write pages, a tensor subclass, not a
    tensor)."""
    if type(value) is not torch.Tensor:
        return value
    region = file_region(value)
    return value if region is None else FileTensor(region, value.dtype, tuple(value.shape))


def mapped_again(value: torch.Tensor, **names) -> torch.Tensor | None:
    """For deepcopy: a private (copy-on-write) mapping of a file mapped again, not read whole
    into memory; None for anything else, which deepcopy copies. A shared mapping is copied too:
    edits of the original reach its file, and so a copy mapped from it."""
    region = file_region(value, private_only=True) if type(value) is torch.Tensor else None
    return None if region is None else region.open(value.dtype, tuple(value.shape), **names)


class FileBackedPickling:
    """Base of the holders of tensors that may be mapped files. Sent to another process through
    multiprocessing's ForkingPickler (spawned DataLoader workers, PyG's loaders, torch.
    multiprocessing.spawn), those of `_file_state_keys` travel as references to their files,
    which the other process maps again (refused there if a file is gone or changed). Everything
    else (pickle, torch.save, copy.copy) uses the class's own __getstate__: rows by value.
    deepcopy maps private mappings again and copies the rest.

    Registered with ForkingPickler by exact type, so each subclass registers itself."""

    _file_state_keys: tuple[str, ...] = ()  # state entries holding tensors (in tuples, dicts)
    _file_names: dict[str, str]  # owner, what, holder: how the errors name the pickled object

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ForkingPickler.register(cls, _reduce_for_another_process)

    def __deepcopy__(self, memo):
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = _state_of(self)

        def map_again(t):
            if id(t) in memo or type(t) is not torch.Tensor:
                return t  # copied already with another holder: deepcopy gives that copy
            mapped = mapped_again(t, **self._file_names)
            if mapped is None:
                return t
            memo[id(t)] = mapped
            memo[id(mapped)] = mapped  # so that deepcopy of the state keeps it as it is
            return mapped

        for key in self._file_state_keys:
            if key in state:
                state[key] = _each_tensor(state[key], map_again)
        _set_state(new, copy.deepcopy(state, memo))
        return new


def _each_tensor(value, fn, memo=None):
    """`value` with fn applied to its leaves, through tuples, lists and dicts (their values);
    a leaf met twice gives the same result (memo by id)."""
    memo = {} if memo is None else memo
    if type(value) in (tuple, list):
        return type(value)(_each_tensor(v, fn, memo) for v in value)
    if type(value) is dict:
        return {k: _each_tensor(v, fn, memo) for k, v in value.items()}
    if id(value) not in memo:
        memo[id(value)] = (value, fn(value))  # holding value keeps its id from being reused
    return memo[id(value)][1]


def _state_of(holder) -> dict:
    """A copy of what pickle carries for `holder` (object has no __getstate__ before 3.11)."""
    getstate = getattr(holder, "__getstate__", None)
    return dict(holder.__dict__ if getstate is None else getstate())


def _set_state(holder, state) -> None:
    setstate = getattr(holder, "__setstate__", None)
    if setstate is None:
        holder.__dict__.update(state)
    else:
        setstate(state)


def _reduce_for_another_process(holder):
    state = _state_of(holder)
    memo: dict = {}  # a tensor met twice goes as one FileTensor, mapped once on the other side
    for key in holder._file_state_keys:
        if key in state:
            state[key] = _each_tensor(state[key], by_file, memo)
    return _rebuild_mapping_files, (type(holder), state)


def _rebuild_mapping_files(cls, state):
    holder = cls.__new__(cls)
    memo: dict = {}
    regions = {key: state[key].region for key in cls._file_state_keys
               if isinstance(state.get(key), FileTensor)}
    for key in cls._file_state_keys:
        if key in state:
            state[key] = _each_tensor(state[key], lambda v: from_file(v, **cls._file_names), memo)
    _set_state(holder, state)
    hook = getattr(holder, "_mapped_again", None)
    if hook is not None:  # which of its tensors are files again here, and which files
        hook(regions)
    return holder


def from_file(value, *, owner: str, what: str, holder: str):
    """A FileTensor mapped again (refused if its file changed), else `value`."""
    if not isinstance(value, FileTensor):
        return value
    return value.region.open(value.dtype, value.shape, owner=owner, what=what, holder=holder)
