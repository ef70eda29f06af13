"""Peak host memory (RSS) growth of this process over a piece of work, for the tests and
benchmarks that bound how much host memory a load, a save or a step holds (Linux only)."""

from __future__ import annotations

import ctypes
import os


def status(key: str, pid="self") -> int:
    """A byte count from /proc/PID/status, e.g. status("VmRSS:")."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Resets the peak (VmHWM) to the current RSS and returns that RSS in bytes. Freed heap goes
    back to the system first, so that reusing it cannot hide growth."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS:")


def growth(fn) -> tuple[int, object]:
    """(peak RSS growth in bytes while fn() runs, fn's result)."""
    before = reset_peak()
    out = fn()
    return status("VmHWM:") - before, out


def descendants(pid: int) -> list[int]:
    """The live processes under `pid` (by their parent ids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def peak_with_children() -> int:
    """The peak RSS (VmHWM) of this process plus that of its live child processes (a
    benchmark case's own workers, e.g. DeepSpeed SuperOffload's CPU Adam process), in bytes.
    Pages two processes share (/dev/shm) count in each; a child gone meanwhile counts 0."""
    total = status("VmHWM:")
    for pid in descendants(os.getpid()):
        try:
            total += status("VmHWM:", pid)
        except (OSError, KeyError):  # exited, or a zombie without memory lines
            pass
    return total
