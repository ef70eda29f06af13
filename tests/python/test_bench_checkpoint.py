"""benchmarks/bench_checkpoint.py on a tiny model: one process and 2 gloo ranks under torchrun,
every contender gets a row with positive times and bytes, the JSON goes to --out (not the
committed file) and --plot draws from it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_checkpoint_tiny(tmp_path):
    out, png = tmp_path / "ckpt.json", tmp_path / "ckpt.png"
    flags = ["--params", "1e5", "--repeat", "1", "--warmup", "0", "--ranks", "1", "2",
             "--dir", str(tmp_path), "--out", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        flags += ["--plot", str(png)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_checkpoint.py"),
                           *flags], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    got = {(r["ranks"], r["config"], r["contender"]) for r in data["rows"]}
    for ranks, config in [(1, "optim in RAM"), (1, "optim on NVMe"), (2, "ZeRO-3 / FSDP2")]:
        for contender in ("tierlift save", "tierlift save(blocking=False)",
                          "tierlift save(blocking=False, budget 1/8)", "dcp save",
                          "dcp async_save"):
            assert (ranks, config, contender) in got, got
    for r in data["rows"]:
        assert 0 < r["stall s"] <= r["total s"] * (1 + 1e-9), r
        assert r["GB written"] > 0 and r["GB/s"] > 0, r
    assert data["model"]["params"] > 0
    assert "checkpoint save" in proc.stdout and "tierlift save" in proc.stdout
    assert not list(tmp_path.glob("bench_checkpoint-*"))  # the checkpoints were cleaned up
    if has_mpl:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
