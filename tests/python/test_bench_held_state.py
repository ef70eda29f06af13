"""benchmarks/bench_held_state.py on a tiny model: both ways get a row with a positive time,
--plot draws the JSON, and the two write identical kind files (the comparison is of equal
work)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import tierlift

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_bench_held_state_tiny(tmp_path):
    out, png = tmp_path / "held.json", tmp_path / "held.png"
    plot = importlib.util.find_spec("matplotlib") is not None  # --plot needs it
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_held_state.py"),
                           "--params", "1e5", "--repeat", "1", "--dir", str(tmp_path),
                           "--out", str(out), *(["--plot", str(png)] if plot else [])],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["median s"] > 0 for r in rows)
    if plot:
        assert f"wrote {png}" in proc.stdout
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_both_ways_write_the_same_files(tmp_path):
    from bench_held_state import file_to_file, through_ram

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5000))
    q = torch.nn.Parameter(torch.randn(300))
    opt = tierlift.optim.AdamW([p, q], lr=1e-2, offload="nvme", nvme_path=str(tmp_path))
    for _ in range(2):
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt.step()
    through_ram(opt._offload, str(tmp_path / "a"))
    file_to_file(opt._offload, str(tmp_path / "b"))
    for kind in opt._offload.tiers[0].kinds:
        name = f"optim/g0.{kind}.f32"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    opt.close()
