"""benchmarks/bench_activations.py on a tiny model: every contender gets a row with a positive
step time, the NVMe row moved bytes and read them back ahead of backward, the JSON goes to
--out (not the committed file) and --plot draws from it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_activations_tiny(tmp_path):
    out, png = tmp_path / "act.json", tmp_path / "act.png"
    flags = ["--layers", "2", "--dim", "64", "--seq-len", "64", "--batch", "4", "--repeats", "1",
             "--warmup", "0", "--min-bytes", "1024", "--device", "cpu", "--dir", str(tmp_path),
             "--out", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        flags += ["--plot", str(png)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_activations.py"),
                           *flags], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["contender"]: r for r in data["rows"]}
    assert set(rows) == {"keep", "save_on_cpu", "checkpoint", "tierlift ram", "tierlift nvme"}
    assert all(r["step s"] > 0 for r in rows.values())
    nv = data["nvme"]
    assert nv["bytes"] == data["saved_bytes_per_step"] > 0
    assert nv["reads_ahead"] > 0 and nv["reads_on_demand"] == 0
    assert 0 <= nv["hidden_fraction"] <= 1 and nv["io_alone_s"] > 0
    assert "of the I/O hidden behind compute" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["act.json"] + (["act.png"] if has_mpl else []))  # no activation files left
    if has_mpl:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
