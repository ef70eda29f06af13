"""python -m tierlift plan --nodes: bytes across nodes per step and the link's time for them."""

from __future__ import annotations

import pytest

from tierlift.plan.comm import LAYOUTS, comm_plan, inter_node_bytes_per_rank


def test_one_node_sends_nothing_across():
    for layout in LAYOUTS:
        assert inter_node_bytes_per_rank(7e9, 1, 8, layout) == 0


def test_rows_for_two_nodes_of_eight():
    rows = comm_plan(13e9, 2, 8, inter_node_gbps=200)
    flat, hier, quant = rows
    # Flat ZeRO-3 in bf16: 8 ranks x 13e9 x 1/2 x (2*2 + 2) bytes.
    assert flat.per_node_bytes == pytest.approx(8 * 13e9 * 0.5 * 6)
    assert flat.seconds == pytest.approx(flat.per_node_bytes / 25e9)
    # Hierarchical: the bf16 gradient shard's all-reduce only: 2/(3*8) of flat.
    assert hier.vs_flat == pytest.approx(2 / 24)
    # int8 gradients: about half of that again (1 + 1/64 bytes instead of 2).
    assert quant.vs_flat == pytest.approx(2 * (1 + 1 / 64) / (6 * 8))
    assert quant.vs_flat <= 0.25


def test_accumulation_multiplies_flat_gathers_only():
    one = comm_plan(1e9, 4, 4, 100)
    four = comm_plan(1e9, 4, 4, 100, micro_batches=4)
    assert four[0].per_node_bytes == pytest.approx(one[0].per_node_bytes * (2 * 4 * 2 + 2) / 6)
    assert four[1].per_node_bytes == one[1].per_node_bytes


@pytest.mark.parametrize("args", [(1e9, 0, 8, 100), (1e9, 2, 0, 100), (1e9, 2, 8, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        comm_plan(*args)


def test_cli_prints_and_returns_the_rows():
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "..", "python"),
         os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tierlift", "plan", "--params", "7e9", "--gpu-mem", "80G",
           "--cpu-mem", "512G", "--probe-mib", "8", "--nodes", "4", "--gpus-per-node", "8",
           "--inter-node-gbps", "400"]
    out = json.loads(subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    rows = out["across_nodes"]
    assert [r["layout"] for r in rows][0] == "ZeRO-3"
    assert rows[0]["per_node_bytes"] == pytest.approx(8 * 7e9 * 0.75 * 6)
    assert rows[2]["vs_flat"] <= 0.25
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert "across nodes per step (4 nodes x 8 GPUs, 400 Gb/s per node" in text
    bad = subprocess.run(cmd[:-2], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "go together" in bad.stderr


def test_reducing_every_micro_batch_multiplies_the_gradient_bytes(capsys):
    """Without model.no_sync() each backward reduces its gradient: m times the gradient bytes
    (tests/python/test_plan_measured.py counts them at the c10d calls)."""
    import json

    from tierlift.__main__ import main
    from tierlift.plan.comm import render_comm

    once = comm_plan(1e9, 4, 4, 100, micro_batches=4)
    every = comm_plan(1e9, 4, 4, 100, micro_batches=4, reduce_every_micro_batch=True)
    assert every[0].per_node_bytes == pytest.approx(once[0].per_node_bytes * (16 + 8) / (16 + 2))
    assert every[1].per_node_bytes == pytest.approx(4 * once[1].per_node_bytes)
    assert "reduced once (model.no_sync()" in render_comm(once, 4, 4, 100, 4)
    assert "reduced after each" in render_comm(every, 4, 4, 100, 4, True)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        inter_node_bytes_per_rank(1e9, 2, 8, LAYOUTS[0], micro_batches=0)
    argv = ["plan", "--params", "1e9", "--gpu-mem", "80G", "--cpu-mem", "64G", "--probe-mib",
            "4", "--nodes", "4", "--gpus-per-node", "4", "--inter-node-gbps", "100",
            "--micro-batches", "4", "--json"]
    assert main([*argv, "--reduce-every-micro-batch"]) == 0
    rows = json.loads(capsys.readouterr().out)["across_nodes"]
    assert rows[0]["per_node_bytes"] == pytest.approx(every[0].per_node_bytes)
