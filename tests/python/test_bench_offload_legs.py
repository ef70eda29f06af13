"""benchmarks/bench_offload.py --legs on a tiny model: every leg gets a row for every
configuration, the worker's time shows only where the overlap is on, and the parameter copies
move the same bytes everywhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import tierlift

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def test_legs_table_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    import offload_legs

    saved = {}
    monkeypatch.setattr(offload_legs, "write_json", lambda name, payload: saved.update(payload))
    args = argparse.Namespace(dir=str(tmp_path), repeats=1, legs_dim=32, legs_layers=3,
                              legs_batch=8, legs_chunk_bytes=4096)
    assert offload_legs.bench_legs(args) == 0
    out = capsys.readouterr().out
    for label, _ in offload_legs.ROWS:
        assert label in out, out
    configs = saved["configs"]
    assert list(configs) == ["cpu", "cpu + overlap", "nvme", "nvme + overlap"]
    for name, legs in configs.items():
        overlapped = name.endswith("overlap")
        assert (legs["overlapped_s"] > 0) == overlapped, (name, legs)
        assert legs["cpu_step_s"] > 0 and legs["bwd_s"] > 0
        assert legs["h2d_bytes"] == configs["cpu"]["h2d_bytes"] > 0
        assert legs["d2h_bytes"] == configs["cpu"]["d2h_bytes"] > 0
    assert configs["nvme"]["nvme_read_wait_s"] > 0 and configs["cpu"]["nvme_read_wait_s"] == 0
