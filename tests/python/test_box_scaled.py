"""benchmarks/box_scaled.py at 1/1024 of the 80 GB GPU / 128 GB RAM / 64 GB drive machine: the
planned layout for the scaled 13B model (hybrid, one NVMe generation) trains bit-identically to
the in-memory optimizer and within the scaled RAM budget and drive. Needs root to mount the
scaled drive (a loop-mounted ext4 image); skips elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the scaled drive needs root")
def test_the_scaled_13b_model_trains_within_the_scaled_box(tmp_path):
    out = tmp_path / "box.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "box_scaled.py"),
                           "--scale", "1024", "--steps", "2", "--probe-mib", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    if "could not mount" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert all(got["checks"].values()), got["checks"]
    assert got["offload"]["offload"] == "hybrid" and got["offload"]["nvme_generations"] == 1
    assert got["params"] >= 0.95 * 13e9 / 1024
    assert got["runs"]["tierlift hybrid"]["state_disk_bytes"] > 0
