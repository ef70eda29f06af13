"""python -m tierlift plan: placement per tier, measured bandwidths, and argument errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

import tierlift
from tierlift.__main__ import main
from tierlift.plan import Bandwidths, PlanInput, make_plan, max_params, parse_bytes
from tierlift.plan.planner import POOL_BYTES, state_bytes_per_param

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)
G = 1 << 30


def test_parse_bytes():
    assert parse_bytes("80G", "--gpu-mem") == 80 * G
    assert parse_bytes("512MiB", "x") == 512 << 20
    assert parse_bytes("1e9", "x") == 10**9
    with pytest.raises(ValueError, match="--gpu-mem must be a size"):
        parse_bytes("lots", "--gpu-mem")
    with pytest.raises(ValueError, match="x must be > 0"):
        parse_bytes("0", "x")


def test_placement_by_size():
    assert make_plan(PlanInput(params=1e9, gpu_mem=80 * G, cpu_mem=128 * G), BW).offload == "none"
    cpu = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=128 * G), BW)
    assert cpu.offload == "cpu" and cpu.tiers["cpu"]["exp_avg"] == 32e9
    assert cpu.legs_s["cpu adam"] == pytest.approx(8.0)
    # Host memory short: what it holds beside the pool stays there, the rest goes to NVMe.
    hyb = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x"), BW)
    pool = min(POOL_BYTES, int(0.8 * 32 * G) // 4)
    ram, disk = int(0.8 * 32 * G) - pool, 96e9 - (int(0.8 * 32 * G) - pool)
    assert hyb.offload == "hybrid" and hyb.generations == 2
    assert hyb.tiers["cpu"]["staging pool"] == pool
    assert sum(v for k, v in hyb.tiers["cpu"].items() if k != "staging pool") == \
        pytest.approx(ram)
    assert hyb.legs_s["nvme read"] == pytest.approx(disk / 2e9)
    assert hyb.legs_s["nvme write"] == pytest.approx(disk / 1e9)
    assert hyb.serial_s > hyb.pipelined_s
    # Two generations of the NVMe part when the drive has room, one when it has only that.
    assert sum(hyb.tiers["nvme"].values()) == pytest.approx(2 * disk)
    one = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x",
                              nvme_free=int(1.5 * disk)), BW)
    assert one.generations == 1 and sum(one.tiers["nvme"].values()) == pytest.approx(disk)
    assert "nvme_generations=1" in one.note
    with pytest.raises(ValueError, match=r"needs 64\.7 GiB under /x beyond the 24\.7 GiB "
                                         r"host .* 64\.7 GiB free .*short by 1\.0 B"):
        make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x",
                            nvme_free=int(disk) - 1), BW)
    # With host memory for the pool only, all of the state is on NVMe.
    nvme = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x",
                               cpu_budget=1 << 20), BW)
    assert nvme.offload == "nvme" and sum(nvme.tiers["nvme"].values()) == pytest.approx(192e9)
    with pytest.raises(ValueError, match="give --nvme PATH"):
        make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G), BW)
    with pytest.raises(ValueError, match="zero stage 3"):
        make_plan(PlanInput(params=70e9, gpu_mem=80 * G, cpu_mem=32 * G), BW)


def test_refusals_say_which_tier_is_short_and_by_how_much():
    with pytest.raises(ValueError, match=r"short by 12\.0 GiB\); host memory would be short"):
        make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x",
                            cpu_budget=1 << 20, nvme_free=96e9 - 12 * G), BW)
    with pytest.raises(ValueError, match=r"GPU memory \(short by "):
        make_plan(PlanInput(params=70e9, gpu_mem=80 * G, cpu_mem=32 * G), BW)


def test_max_params_is_the_largest_model_that_fits():
    # The box users get: 80 GB GPU, 128 GB RAM, a 64 GB drive. Host memory (80% of it, less
    # the pool) and one generation on the drive hold the fp32 state of 13B and more.
    box = PlanInput(params=1, gpu_mem=80 * G, cpu_mem=128 * G, nvme="/x", nvme_free=64 * G)
    plan = make_plan(dataclasses.replace(box, params=13e9), BW)
    assert plan.offload == "hybrid" and plan.generations == 1
    n, plan = max_params(box, BW)
    assert plan.offload == "hybrid" and plan.generations == 1
    room = int(0.8 * 128 * G) - POOL_BYTES + 64 * G
    assert n == pytest.approx(room / 12, rel=1e-3)
    make_plan(dataclasses.replace(box, params=n), BW)
    with pytest.raises(ValueError, match="short by"):
        make_plan(dataclasses.replace(box, params=int(n * 1.01)), BW)
    # With little RAM the drive sets the limit; with a small GPU, the bf16 weights and grads.
    n, plan = max_params(dataclasses.replace(box, cpu_mem=8 * G), BW)
    assert plan.offload == "hybrid" and n == pytest.approx(
        (int(0.8 * 8 * G) - POOL_BYTES + 64 * G) / 12, rel=1e-3)
    n, plan = max_params(dataclasses.replace(box, gpu_mem=16 * G), BW)
    assert n == pytest.approx(0.7 * 16 * G / 4, rel=1e-3)


def test_compact_state_bytes_come_from_the_offload_layout():
    # master 4, bf16 m 2, 8-bit v 1, a 4-byte scale per 256 elements: 3.02 B of moments
    per = state_bytes_per_param("bf16")
    assert sum(per.values()) == pytest.approx(4 + 2 + 1 + 4 / 256)
    assert sum(state_bytes_per_param("fp32").values()) == 12
    box = PlanInput(params=13e9, gpu_mem=80 * G, cpu_mem=128 * G, nvme="/x", nvme_free=64 * G)
    assert make_plan(box, BW).offload == "hybrid"  # 156 GB of fp32 state: RAM and drive
    compact = make_plan(dataclasses.replace(box, state_dtype="bf16"), BW)
    assert compact.offload == "cpu" and "state_dtype='bf16'" in compact.note
    assert sum(compact.tiers["cpu"].values()) == pytest.approx(13e9 * 7.015625)
    # 20B: the bf16 weights and gradients (80 GB) alone overflow the GPU; the planner keeps
    # them there (parameter offload is not placed), so the refusal names the GPU.
    with pytest.raises(ValueError, match=r"GPU memory \(short by .*offload_params"):
        make_plan(dataclasses.replace(box, params=20e9, state_dtype="bf16"), BW)
    # The state bytes alone: with room for the weights on the GPU, compact state lets the
    # box's RAM and drive hold 25B parameters where fp32 state holds 15B.
    big_gpu = dataclasses.replace(box, gpu_mem=160 * G)
    room = int(0.8 * 128 * G) - POOL_BYTES + 64 * G
    n32, _ = max_params(big_gpu, BW)
    n16, plan = max_params(dataclasses.replace(big_gpu, state_dtype="bf16"), BW)
    assert n32 == pytest.approx(room / 12, rel=1e-3)
    assert n16 == pytest.approx(room / 7.015625, rel=1e-3) and n16 > 20e9
    assert plan.offload == "hybrid" and plan.generations == 1
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        PlanInput(params=1, gpu_mem=G, cpu_mem=G, state_dtype="int8")


def test_cli_max_params(tmp_path, capsys):
    assert main(["plan", "--max-params", "--gpu-mem", "2G", "--cpu-mem", "1G",
                 "--nvme", str(tmp_path), "--probe-mib", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_params"] == out["params"] > 0
    assert main(["plan", "--max-params", "--gpu-mem", "2G", "--cpu-mem", "1G",
                 "--probe-mib", "4"]) == 0
    assert "largest model that fits" in capsys.readouterr().out
    assert main(["plan", "--params", "2e8", "--gpu-mem", "2G", "--cpu-mem", "1G",
                 "--nvme", str(tmp_path), "--probe-mib", "4", "--state-dtype", "bf16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_dtype"] == "bf16" and "exp_avg_sq scales" in out["tiers"]["cpu"]


def test_cli_measures_and_prints(tmp_path, capsys):
    # 2.4 GB of state, 0.8 GB of it in host memory: within the free space it measures.
    assert main(["plan", "--params", "2e8", "--gpu-mem", "2G", "--cpu-mem", "1G",
                 "--nvme", str(tmp_path), "--probe-mib", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload"] == "hybrid" and out["nvme_generations"] in (1, 2)
    assert out["bandwidths"]["disk_read_bps"] > 0 and out["bandwidths"]["disk_write_bps"] > 0
    assert out["bandwidths"]["memory_bps"] > 0 and out["bandwidths"]["adam_elems_per_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert main(["plan", "--params", "1e8", "--gpu-mem", "80G", "--cpu-mem", "64G",
                 "--probe-mib", "4"]) == 0
    assert "offload='none'" in capsys.readouterr().out


def test_cli_plans_activation_tiers_per_block(tmp_path, capsys):
    base = ["plan", "--params", "1e8", "--gpu-mem", "80G", "--cpu-mem", "64G", "--probe-mib",
            "4", "--act-blocks", "6", "--act-block-bytes", "1G", "--act-cpu-budget", "2G"]
    assert main([*base, "--nvme", str(tmp_path), "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["activations"]
    assert tiers == ["nvme"] * 3 + ["ram"] * 2 + ["keep"]  # no speeds given: NVMe over recompute
    # A block forward of 1 us cannot hide 2 GB of I/O on any disk: recompute instead.
    assert main([*base, "--nvme", str(tmp_path), "--act-block-forward-ms", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "activations per block, first to last (tierlift.activations.Policy): recompute x3, " \
           "ram x2, keep x1" in out
    assert main([*base]) == 0  # without --nvme: RAM, then recompute
    assert "recompute x3, ram x2, keep x1" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--params", "many"], "--params must be a number"),
    (["--params", "8e9", "--nvme", "/does/not/exist"], "--nvme '/does/not/exist' is not"),
    (["--params", "8e9", "--cpu-mem", "lots"], "--cpu-mem must be a size"),
    (["--params", "8e9", "--act-blocks", "4"], "--act-blocks and --act-block-bytes go together"),
])
def test_cli_bad_arguments(argv, message, capsys):
    base = {"--gpu-mem": "80G", "--cpu-mem": "64G"}
    for k, v in base.items():
        if k not in argv:
            argv = [*argv, k, v]
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--probe-mib", "4"])
    assert message in capsys.readouterr().err
