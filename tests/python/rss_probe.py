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
import os, sys, torch, tierlift
from tierlift import _peak_rss
def growth(fn):
    return _peak_rss.growth(fn)[0]
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
