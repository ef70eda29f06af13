"""benchmarks/bench_offload.py --legs on a tiny model: every leg of last_step_stats["legs"] gets
a row for every configuration with its time and exposed part (never more than the time), the
serialized step leaves all of CPU Adam exposed on the training thread, the overlap runs it on
its worker, and the copies and the NVMe legs move what the step moved. (That the overlap hides
Adam is checked on timed stand-ins, test_offload_schedule.py: real kernels of a tiny model on
two shared cores are too short to tell.)"""

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
    from tierlift.offload.legs import LEGS, TRAINING

    saved = {}
    monkeypatch.setattr(offload_legs, "write_json", lambda name, payload: saved.update(payload))
    args = argparse.Namespace(dir=str(tmp_path), repeats=1, legs_dim=32, legs_layers=3,
                              legs_batch=8, legs_chunk_bytes=4096)
    assert offload_legs.bench_legs(args) == 0
    out = capsys.readouterr().out
    for label, _ in offload_legs.LEG_LABELS + offload_legs.WALL:
        assert label in out, out
    for name in offload_legs.NAMES:
        assert f"{name} ms" in out and f"{name} exp" in out, out
    configs = saved["configs"]
    assert list(configs) == ["cpu", "cpu+ovl", "nvme", "nvme+ovl"]
    for name, run in configs.items():
        legs = run["legs"]
        assert set(legs) == set(LEGS)
        for leg, v in legs.items():
            assert v["total_s"] >= 0 and v["bytes"] >= 0, (name, leg, v)
            assert 0 <= v["exposed_s"] <= v["total_s"], (name, leg, v)
        overlapped = name.endswith("ovl")
        assert (run["overlapped_s"] > 0) == overlapped, (name, run)
        adam = legs["adam"]
        assert adam["total_s"] > 0 and legs["backward"]["total_s"] > 0
        if overlapped:  # every chunk stepped ahead on the worker, none redone by step()
            assert TRAINING not in adam["threads"], (name, adam)
            assert any(t.startswith("tierlift-offload") for t in adam["threads"]), (name, adam)
        else:  # the serialized step: all of it on the training thread, all exposed
            assert list(adam["threads"]) == [TRAINING] and \
                adam["exposed_s"] == adam["total_s"], (name, adam)
        assert legs["h2d"]["bytes"] == configs["cpu"]["legs"]["h2d"]["bytes"] > 0
        assert legs["d2h"]["bytes"] == configs["cpu"]["legs"]["d2h"]["bytes"] > 0
        on_disk = name.startswith("nvme")
        for leg in ("nvme_read", "nvme_write"):
            assert (legs[leg]["bytes"] > 0) == on_disk and (legs[leg]["total_s"] > 0) == on_disk
        # the exposed parts split the training thread's time (less the loss and zero_grad)
        exposed = sum(v["exposed_s"] for v in legs.values())
        assert exposed <= run["iter_s"], (name, exposed, run["iter_s"])


def test_legs_host_idle_prints_the_optimizer_work_ratio(tmp_path, monkeypatch, capsys):
    """--legs-host-idle: each unit's compute is a stand-in the host sleeps through, forward and
    backward take at least those sleeps, and the last lines give per tier the optimizer's CPU
    work with the overlap over that without it, as the JSON's legs say."""
    import re

    import offload_legs

    saved = {}
    monkeypatch.setattr(offload_legs, "write_json",
                        lambda name, payload: saved.update(payload, name=name))
    layers = 2
    args = argparse.Namespace(dir=str(tmp_path), repeats=1, legs_dim=32, legs_layers=layers,
                              legs_batch=8, legs_chunk_bytes=4096, legs_host_idle=True)
    assert offload_legs.bench_legs(args) == 0
    out = capsys.readouterr().out
    fwd_s, bwd_s = offload_legs.HOST_IDLE_S
    assert f"a stand-in the host waits for ({fwd_s * 1e3:.0f}/{bwd_s * 1e3:.0f} ms" in out, out
    assert saved["name"] == "bench_offload_legs-host-idle" and saved["host_idle"] is True
    configs = saved["configs"]
    for name, run in configs.items():
        assert run["fwd_s"] >= layers * fwd_s and run["bwd_s"] >= layers * bwd_s, (name, run)
    for tier in ("cpu", "nvme"):
        m = re.search(rf"^{tier}: the optimizer's CPU work \(CPU Adam \+ optimizer other, every "
                      r"thread\) ([0-9.]+) ms without the overlap, ([0-9.]+) ms with it: "
                      r"([0-9.]+)x$", out, re.M)
        assert m, out
        without, with_, ratio = (float(x) for x in m.groups())
        work = [sum(configs[name]["legs"][leg]["total_s"] for leg in ("adam", "other")) * 1e3
                for name in (tier, f"{tier}+ovl")]
        assert (without, with_) == pytest.approx(work, abs=0.051)
        assert ratio == pytest.approx(work[1] / work[0], abs=0.006)


def test_clipped_table_on_a_small_model(monkeypatch, capsys):
    """bench_offload.py --clipped: every contender clips every step (the bench asserts it),
    the row for each is there, and those that wait leave no chunk."""
    import offload_clipped

    saved = {}
    monkeypatch.setattr(offload_clipped, "write_json", lambda name, payload: saved.update(payload))
    assert offload_clipped.bench_clipped(argparse.Namespace(params=8.4e6, repeats=1)) == 0
    rows = {r["contender"]: r for r in saved["rows"]}
    assert list(rows) == list(offload_clipped.CONTENDERS)
    assert rows["wait"]["chunks_left"] == 0 and rows["no-overlap"]["chunks_left"] == 0
    assert rows["torch-clip"]["chunks_left"] == 0  # a clip before step(): nothing to leave
    # the optimizer's own clip scales inside step(): nothing stepped ahead is kept
    assert rows["abandon"]["chunks_kept"] == 0 and rows["wait"]["chunks_kept"] == 0
    assert all(r["chunks"] >= 2 and r["step_ms"] > 0 for r in rows.values())
    assert "Clipped steps, overlapped" in capsys.readouterr().out
