"""A feature table whose memory is a mapped file (a FeatureStore built from a path, np.memmap,
torch.from_file), found from the process's own mappings, so that a pickled store maps the same
file again in the process that unpickles it (a spawned DataLoader worker) instead of carrying
its bytes: torch's pickling for workers moves a table into shared memory (/dev/shm), a copy of
the whole table, an OOM or a full /dev/shm for a table larger than RAM (and for torch.from_file
tables it fails with "Bad file descriptor").

Only memory that is still the file's bytes qualifies: a private (copy-on-write) mapping with
pages written since it was mapped holds rows the file does not, so such a table is pickled by
value, as before.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FileRegion:
    path: str
    offset: int
    nbytes: int
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns

    def open(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The table mapped again (copy-on-write, as FeatureStore maps a path): no bytes read."""
        try:
            now = _identity(os.stat(self.path))
        except OSError as e:
            raise FileNotFoundError(
                f"FeatureStore: the feature file {self.path!r} that this pickled store maps "
                f"cannot be opened here ({e.strerror}); a file-backed store pickles as a "
                "reference to its file, which must be reachable where it is unpickled") from None
        if now != self.identity:
            raise RuntimeError(
                f"FeatureStore: the feature file {self.path!r} was replaced or rewritten since "
                "this store was pickled (its inode, size or modification time differ), so its "
                "rows are not the original store's; build the store again from the file")
        array = np.memmap(self.path, dtype=np.uint8, mode="c", offset=self.offset,
                          shape=(self.nbytes,))
        return torch.from_numpy(array).view(dtype).view(shape)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class _Mapping:
    start: int
    end: int
    private: bool
    offset: int
    inode: int
    path: str
    anonymous_kb: int = 0


def _mappings_over(start: int, end: int) -> list[_Mapping]:
    """The mappings of this process that overlap [start, end), in address order."""
    found: list[_Mapping] = []
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo >= end:
                    break
                current = None
                if hi > start and lo < end:
                    current = _Mapping(lo, hi, head[1].endswith("p"), int(head[2], 16),
                                       int(head[4]), head[5].rstrip("\n") if len(head) > 5 else "")
                    found.append(current)
            elif current is not None and head[0] == "Anonymous:":
                current.anonymous_kb = int(head[1])
    return found


def file_region(table: torch.Tensor) -> FileRegion | None:
    """Where `table` (a contiguous CPU tensor) lies in a regular file, or None: not file memory,
    a file deleted or replaced since it was mapped, or private pages written since."""
    nbytes = table.numel() * table.element_size()
    if (table.device.type != "cpu" or nbytes == 0 or not table.is_contiguous()
            or not os.path.exists("/proc/self/smaps")):
        return None
    start = table.data_ptr()
    end = start + nbytes
    maps = _mappings_over(start, end)
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
    if any(m.private and m.anonymous_kb for m in maps):
        return None  # copy-on-write pages: rows the file does not hold
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_ino != first.inode:
        return None
    offset = first.offset + (start - first.start)
    if offset + nbytes > st.st_size:
        return None
    return FileRegion(path, offset, nbytes, _identity(st))
