"""Peak RSS growth measured in a fresh interpreter, for the tests that bound how much host
memory a save or a load holds. `run(body, *args)` runs PRELUDE + body with `args` in sys.argv;
the body calls growth(fn) and prints what the test parses."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

PRELUDE = r"""
import ctypes, os, sys, torch, tierlift
libc = ctypes.CDLL("libc.so.6")
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def growth(fn):
    libc.malloc_trim(0)  # freed heap goes back to the OS, so reuse cannot hide growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before
torch.set_num_threads(1)
"""


def run(body: str, *args) -> str:
    out = subprocess.run([sys.executable, "-c", PRELUDE + body, *map(str, args)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python"),
                              # no dynamic mmap threshold: big frees leave RSS at once
                              "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
