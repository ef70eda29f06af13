"""Peak host memory (RSS) growth of this process over a piece of work, for the tests and
benchmarks that bound how much host memory a load, a save or a step holds (Linux only)."""

from __future__ import annotations

import ctypes


def status(key: str) -> int:
    """A byte count from /proc/self/status, e.g. status("VmRSS:")."""
    with open("/proc/self/status") as f:
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
