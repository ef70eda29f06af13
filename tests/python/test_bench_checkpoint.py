"""benchmarks/bench_checkpoint.py on a tiny model: one process and 2 gloo ranks under torchrun,
every contender gets a row with positive times and bytes, the JSON goes to --out (not the
committed file) and --plot draws from it; --device cuda runs on a GPU (one process) and is
refused clearly elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_checkpoint.py"),
                           *flags], capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_checkpoint_tiny(tmp_path):
    out, png = tmp_path / "ckpt.json", tmp_path / "ckpt.png"
    flags = ["--params", "1e5", "--repeat", "1", "--warmup", "0", "--ranks", "1", "2",
             "--dir", str(tmp_path), "--out", str(out)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        flags += ["--plot", str(png)]
    proc = _run(flags)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"] == {"type": "cpu"}
    assert all(r["device"] == "cpu" for r in data["rows"])
    got = {(r["ranks"], r["config"], r["contender"]) for r in data["rows"]}
    for ranks, config in [(1, "optim in RAM"), (1, "optim on NVMe"), (2, "ZeRO-3 / FSDP2")]:
        for contender in ("tierlift save", "tierlift save(blocking=False)",
                          "tierlift save(blocking=False, budget 1/8)", "dcp save",
                          "dcp async_save"):
            assert (ranks, config, contender) in got, got
    for r in data["rows"]:
        assert 0 < r["stall s"] <= r["total s"] * (1 + 1e-9), r
        assert r["returned s"] == r["stall s"], r  # on the CPU, the call is the stall
        assert r["GB written"] > 0 and r["GB/s"] > 0, r
    assert data["model"]["params"] > 0
    assert "checkpoint save" in proc.stdout and "tierlift save" in proc.stdout
    assert not list(tmp_path.glob("bench_checkpoint-*"))  # the checkpoints were cleaned up
    if has_mpl:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_contenders_run_in_the_order_named(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = _run(["--params", "1e5", "--repeat", "1", "--warmup", "0", "--ranks", "1",
                 "--configs", "ram", "--contenders", "dcp-async", "background", "--dir",
                 str(tmp_path), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["contender"] for r in rows] == ["dcp async_save", "tierlift save(blocking=False)"]


def test_cuda_with_several_ranks_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = _run(["--device", "cuda", "--ranks", "1", "2", "--out", str(out)])
    assert proc.returncode == 2
    assert "--device cuda runs one process only: pass --ranks 1" in proc.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without one")
def test_cuda_without_a_gpu_is_refused(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = _run(["--device", "cuda", "--ranks", "1", "--out", str(out)])
    assert proc.returncode == 2
    assert "--device cuda needs a CUDA GPU" in proc.stderr
    assert not out.exists()


@pytest.mark.gpu
def test_bench_checkpoint_tiny_on_the_gpu(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = _run(["--device", "cuda", "--params", "1e5", "--repeat", "1", "--warmup", "0",
                 "--ranks", "1", "--configs", "ram", "--contenders", "background", "dcp-async",
                 "sync", "--dir", str(tmp_path), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"]["type"] == "cuda" and data["device"]["name"]
    assert "on cuda" in data["optimizer"]["optim in RAM"]
    assert [r["contender"] for r in data["rows"]] == [
        "tierlift save(blocking=False)", "dcp async_save", "tierlift save"]
    for r in data["rows"]:
        assert r["device"] == "cuda"
        assert 0 < r["returned s"] <= r["stall s"] <= r["total s"] * (1 + 1e-9), r
        assert r["GB written"] > 0, r
    assert not list(tmp_path.glob("bench_checkpoint-*"))
