"""python -m tierlift plan: placement per tier, measured bandwidths, and argument errors."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import tierlift
from tierlift.__main__ import main
from tierlift.offload.host_budget import host_chunk_elems
from tierlift.plan import Bandwidths, PlanInput, make_plan, max_params, parse_bytes
from tierlift.plan.planner import (
    POOL_BYTES,
    param_bytes_per_param,
    state_bytes_per_param,
)

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)
G = 1 << 30


def test_parse_bytes():
    assert parse_bytes("80G", "--gpu-mem") == 80 * G
    assert parse_bytes("512MiB", "x") == 512 << 20
    assert parse_bytes("1e9", "x") == 10**9
    # GB is 10**9 bytes, as the plan prints GB and GB/s; G and GiB 2**30.
    assert parse_bytes("80GB", "x") == 80 * 10**9 and parse_bytes("80GiB", "x") == 80 * G
    assert parse_bytes("1.5tb", "x") == 1.5e12 and parse_bytes("4KB", "x") == 4000
    assert parse_bytes("100B", "x") == 100
    with pytest.raises(ValueError, match="--gpu-mem must be a size"):
        parse_bytes("lots", "--gpu-mem")
    with pytest.raises(ValueError, match="x must be > 0"):
        parse_bytes("0", "x")
    with pytest.raises(ValueError, match="x must be a finite size"):
        parse_bytes("1e400", "x")
    with pytest.raises(ValueError, match="params must be a finite number"):
        PlanInput(params=float("inf"), gpu_mem=G, cpu_mem=G)


def test_a_memory_size_without_its_unit_is_refused():
    # "--gpu-mem 80" meant 80 GiB: planning for 80 bytes would print a plan for no GPU at all.
    with pytest.raises(ValueError, match=r"--gpu-mem 80 would be 80 bytes: give its unit, e.g. "
                                         r"80G"):
        parse_bytes("80", "--gpu-mem", capacity=True)
    with pytest.raises(ValueError, match="would be 1048575 bytes"):
        parse_bytes(str((1 << 20) - 1), "x", capacity=True)
    assert parse_bytes(str(1 << 20), "x", capacity=True) == 1 << 20
    assert parse_bytes("1e9", "x", capacity=True) == 10**9
    assert parse_bytes("100B", "x", capacity=True) == 100  # bytes said outright
    assert parse_bytes("80", "x") == 80  # not a memory's size: a bare count stays bytes


def test_placement_by_size():
    assert make_plan(PlanInput(params=1e9, gpu_mem=80 * G, cpu_mem=128 * G), BW).offload == "none"
    cpu = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=128 * G, overlap=False), BW)
    assert cpu.offload == "cpu" and cpu.tiers["cpu"]["exp_avg"] == 32e9
    assert cpu.legs_s["cpu adam"] == pytest.approx(8.0)
    # Host memory short: as many whole chunks as it holds beside the pool stay there, the rest
    # goes to NVMe. The runtime cuts 8e9 elements into 954 even chunks of 8386560; the pool is
    # 6 slots of master, m, v, grad and copy staging.
    hyb = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x"), BW)
    elems, block = 8386560, 12 * 8386560
    pool = 6 * 20 * elems
    n_ram = (int(0.8 * 32 * G) - pool) // block
    ram, disk = n_ram * block, (954 - n_ram) * block
    assert (n_ram, ram, disk) == (263, 26467983360, 69541355520)
    assert hyb.offload == "hybrid" and hyb.generations == 2
    assert hyb.tiers["cpu"]["staging pool"] == pool
    assert sum(v for k, v in hyb.tiers["cpu"].items() if k != "staging pool") == ram
    assert hyb.legs_s["nvme read"] == pytest.approx(disk / 2e9)
    assert hyb.legs_s["nvme write"] == pytest.approx(disk / 1e9)
    assert hyb.serial_s > hyb.pipelined_s
    # Two generations of the NVMe part when the drive has room, one when it has only that.
    assert sum(hyb.tiers["nvme"].values()) == pytest.approx(2 * disk)
    one = make_plan(PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x",
                              nvme_free=int(1.5 * disk)), BW)
    assert one.generations == 1 and sum(one.tiers["nvme"].values()) == pytest.approx(disk)
    assert "nvme_generations=1" in one.note
    with pytest.raises(ValueError, match=r"needs 64\.8 GiB under /x beyond the 24\.7 GiB "
                                         r"host .* 64\.8 GiB free .*short by 1\.0 B"):
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
    compact = make_plan(dataclasses.replace(box, state_dtype="bf16", overlap=False), BW)
    assert compact.offload == "cpu" and "state_dtype='bf16'" in compact.note
    # In place, beside the state: 6 slots x fp32 grad and copy staging of the device weights.
    staging = 6 * 8 * host_chunk_elems(32 << 20, 13 * 10**9)
    assert compact.tiers["cpu"]["staging pool"] == staging
    assert sum(compact.tiers["cpu"].values()) == pytest.approx(13e9 * 7.015625 + staging)
    # Overlapped (the default): one generation of it and spare chunks fill the host memory.
    spare = make_plan(dataclasses.replace(box, state_dtype="bf16"), BW)
    assert spare.host.spare > 0 and spare.cpu_budget <= int(0.8 * 128 * G)
    assert sum(spare.tiers["cpu"].values()) == spare.cpu_budget
    # 20B: the bf16 weights and gradients (80 GB) alone overflow the GPU with
    # offload_params='none', so the refusal names the GPU and points to offload_params.
    with pytest.raises(ValueError, match=r"GPU memory \(short by .*offload_params"):
        make_plan(dataclasses.replace(box, params=20e9, state_dtype="bf16"), BW)
    # The state bytes alone: with room for the weights on the GPU, compact state lets the
    # box's RAM and drive hold 25B parameters where fp32 state holds 15B.
    big_gpu = dataclasses.replace(box, gpu_mem=160 * G)
    room = int(0.8 * 128 * G) - POOL_BYTES + 64 * G
    n32, _ = max_params(big_gpu, BW)
    n16, plan = max_params(dataclasses.replace(big_gpu, state_dtype="bf16"), BW)
    assert n32 == pytest.approx(room / 12, rel=1e-3)
    # compact state's slots: 6 x (4 + 2 + 1 + 4/256 + 4 + 4) B x 8 Mi elements, not POOL_BYTES
    room16 = room + POOL_BYTES - 6 * 120.125 * (1 << 20)
    assert n16 == pytest.approx(room16 / 7.015625, rel=1e-3) and n16 > 20e9
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
    (["--params", "inf"], "--params must be a finite number > 0"),
    (["--params", "1e999"], "--params must be a finite number > 0"),
    (["--params", "nan"], "--params must be a finite number > 0"),
    (["--params", "-5"], "--params must be a finite number > 0"),
    (["--params", "8e9", "--gpu-mem", "1e999"], "--gpu-mem must be a finite size"),
    (["--params", "8e9", "--nvme", "/does/not/exist"], "--nvme '/does/not/exist' is not"),
    (["--params", "8e9", "--cpu-mem", "lots"], "--cpu-mem must be a size"),
    (["--params", "8e9", "--gpu-mem", "80"], "--gpu-mem 80 would be 80 bytes: give its unit"),
    (["--params", "8e9", "--cpu-mem", "128", "--cpu-budget", "96"], "--cpu-mem 128 would be"),
    (["--params", "1e8", "--act-blocks", "4", "--act-block-bytes", "1G", "--act-gpu-budget", "8"],
     "--act-gpu-budget 8 would be 8 bytes"),
    (["--params", "8e9", "--act-blocks", "4"], "--act-blocks and --act-block-bytes go together"),
    (["--params", "8e9", "--offload-params", "cpu", "--device-params", "some"],
     "--device-params must be auto or a count like 4e9"),
])
def test_cli_bad_arguments(argv, message, capsys):
    base = {"--gpu-mem": "80G", "--cpu-mem": "64G"}
    for k, v in base.items():
        if k not in argv:
            argv = [*argv, k, v]
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--probe-mib", "4"])
    assert message in capsys.readouterr().err


# ---- ZeRO-3 parameter offload (tierlift.zero.shard(stage=3, offload_params=...)) ------------
# device_params=0: every shard offloaded (the default, None, fills the GPU's room first).
BOX = PlanInput(params=1, gpu_mem=80 * G, cpu_mem=128 * G, nvme="/x", nvme_free=64 * G,
                device_params=0)
HOST = int(0.8 * 128 * G)


def test_offload_params_bytes_per_tier():
    compact = state_bytes_per_param("bf16", master=False)
    assert sum(compact.values()) == pytest.approx(2 + 1 + 4 / 256) and "fp32 master" not in compact
    # 4B, compact state, shards in host memory: 4 + 4 B of fp32 shard and gradient, m and v
    # beside them (offload="cpu": the fp32 shard is its own master); the GPU holds 12 B per
    # parameter of the largest unit (1/32 of the model; test_plan_gaps.py counts it).
    plan = make_plan(dataclasses.replace(BOX, params=4e9, state_dtype="bf16",
                                         offload_params="cpu"), BW)
    assert plan.offload == "cpu" and "nvme" not in plan.tiers
    assert plan.tiers["gpu"] == {"gathered units (working set)": pytest.approx(12 * 4e9 / 32)}
    assert plan.tiers["cpu"] == pytest.approx({
        "fp32 param shards": 16e9, "fp32 grad shards": 16e9, "exp_avg (bf16)": 8e9,
        "exp_avg_sq (8-bit)": 4e9, "exp_avg_sq scales": 4e9 / 64})
    assert plan.legs_s["d2h grads"] == pytest.approx(4 * 4e9 / 25e9)  # fp32 gradients come down
    # The shards in files on the drive: host memory holds m and v only.
    plan = make_plan(dataclasses.replace(BOX, params=4e9, state_dtype="bf16",
                                         offload_params="nvme"), BW)
    assert plan.offload == "cpu" and "fp32 param shards" not in plan.tiers["cpu"]
    assert plan.tiers["nvme"] == {"fp32 param shards (file)": 16e9,
                                  "fp32 grad shards (file)": 16e9}
    assert plan.legs_s["nvme param read"] == pytest.approx(12 * 4e9 / 2e9)
    # Beyond host memory: the drive gets the rest of the state in one generation (two would
    # not fit), where the fp32 shards are their own master: m and v only (3.02 B compact).
    plan = make_plan(dataclasses.replace(BOX, params=11e9, state_dtype="bf16",
                                         offload_params="cpu"), BW)
    assert plan.offload == "hybrid" and plan.generations == 1
    # The pool: 6 slots of one chunk of m, v and the scales (no master: every shard is its own
    # in one generation), the runtime cutting 11e9 elements into 1312 even chunks of 8384512.
    elems = 8384512
    pool = 6 * (3 * elems + 4096 * -(-elems // 256 * 4 // 4096))
    cpu = plan.tiers["cpu"]
    assert cpu["staging pool"] == pool and cpu["fp32 param shards"] == 44e9
    assert HOST - 3.02 * elems < sum(cpu.values()) <= HOST  # whole chunks in host memory
    assert sum(cpu.values()) + sum(plan.tiers["nvme"].values()) == pytest.approx(
        11e9 * (8 + 3.015625) + pool, rel=1e-4)
    assert not any("master" in k for t in plan.tiers.values() for k in t)
    assert f"cpu_budget={HOST - 88 * 10**9}" in plan.note
    assert "every fp32 shard its own master" in plan.note
    # A drive with room for two generations: a master of every shard, twice.
    plan = make_plan(dataclasses.replace(BOX, params=11e9, state_dtype="bf16",
                                         offload_params="cpu", nvme_free=1 << 40), BW)
    assert plan.generations == 2 and "a master of every shard" in plan.note
    assert sum(v for k, v in plan.tiers["nvme"].items() if "master" in k) + \
        plan.tiers["cpu"]["fp32 master"] == pytest.approx(11e9 * 4 * 2, rel=0.2)
    # bf16 gradient shards: 2 B of host memory instead of 4, and half the D2H.
    plan = make_plan(dataclasses.replace(BOX, params=4e9, state_dtype="bf16",
                                         offload_params="cpu", grad_dtype="bf16"), BW)
    assert plan.tiers["cpu"]["bf16 grad shards"] == 8e9
    assert plan.legs_s["d2h grads"] == pytest.approx(2 * 4e9 / 25e9)


def test_device_params_fill_the_gpu_room_first():
    """device_params=None (the default): as many shards and gradients as the GPU holds beside
    the working set stay there; device shards cost no host memory but their m and v."""
    inp = dataclasses.replace(BOX, params=20e9, state_dtype="bf16", offload_params="cpu",
                              grad_dtype="bf16", device_params=None)
    plan = make_plan(inp, BW)
    room = 0.7 * 80 * G
    work = 12 * 20e9 / 32
    on_dev = plan.device_params
    assert on_dev == int((room - work) // 6)
    gpu = plan.tiers["gpu"]
    assert gpu["fp32 param shards (device_params)"] == 4 * on_dev
    assert gpu["bf16 grad shards (device_params)"] == 2 * on_dev
    assert sum(gpu.values()) <= room
    assert plan.tiers["cpu"]["fp32 param shards"] == 4 * (20e9 - on_dev)
    assert plan.legs_s["d2h device weights"] == pytest.approx(4 * on_dev / 25e9)
    # Given explicitly, and refused where it does not fit.
    plan = make_plan(dataclasses.replace(inp, device_params=8 * 10**9), BW)
    assert plan.device_params == 8 * 10**9
    with pytest.raises(ValueError, match=r"device_params=10000000000: their shards and "
                                         r"gradients \(55\.9 GiB\) and the working set .* do "
                                         r"not fit in 56\.0 GiB of GPU memory"):
        make_plan(dataclasses.replace(inp, device_params=10**10), BW)
    with pytest.raises(ValueError, match="grad_dtype='bf16' cannot be combined with "
                                         "offload_params='nvme'"):
        dataclasses.replace(inp, offload_params="nvme")


def test_offload_params_refusals_say_which_tier_is_short():
    with pytest.raises(ValueError, match=r"fp32 parameter and gradient shards \(149\.0 GiB\) "
                                         r"do not fit in 102\.4 GiB of host memory \(short by "
                                         r"46\.6 GiB\)"):
        make_plan(dataclasses.replace(BOX, params=20e9, offload_params="cpu"), BW)
    with pytest.raises(ValueError, match=r"shards need 74\.5 GiB under /x and the drive has "
                                         r"64\.0 GiB free \(short by 10\.5 GiB\)"):
        make_plan(dataclasses.replace(BOX, params=10e9, offload_params="nvme"), BW)
    with pytest.raises(ValueError, match="offload_params='nvme' needs --nvme"):
        make_plan(dataclasses.replace(BOX, params=1e9, nvme=None, offload_params="nvme"), BW)
    with pytest.raises(ValueError, match=r"drive has 1\.0 GiB free beside the 8\.0 GiB of fp32 "
                                         r"parameter and gradient shards"):
        make_plan(dataclasses.replace(BOX, params=2**30, cpu_mem=4 * G, offload_params="nvme",
                                      nvme_free=9 * G), BW)
    with pytest.raises(ValueError, match=r"working set of gathered units .* GPU memory "
                                         r"\(short by"):
        make_plan(dataclasses.replace(BOX, params=4e9, unit_share=1.0, gpu_mem=16 * G,
                                      offload_params="cpu"), BW)
    with pytest.raises(ValueError, match="offload_params must be one of"):
        dataclasses.replace(BOX, offload_params="gpu")


def test_max_params_with_offloaded_parameters():
    # The box: 80 GB GPU, 128 GB RAM, a 64 GB drive. Every shard offloaded: host memory holds
    # the fp32 shards and their gradients (8 B/param, 6 with bf16 gradients), which sets the
    # limit; the optimizer state (no master in one generation) goes to the drive.
    n, plan = max_params(dataclasses.replace(BOX, state_dtype="bf16", offload_params="cpu"), BW)
    assert plan.generations == 1 and n == pytest.approx(HOST / 8, rel=2e-3)
    n, plan = max_params(dataclasses.replace(BOX, state_dtype="bf16", offload_params="cpu",
                                             grad_dtype="bf16"), BW)
    assert plan.generations == 1 and n == pytest.approx(HOST / 6, rel=2e-3)
    # The GPU's room holds a third of the shards beside the working set: >= 20B.
    box = dataclasses.replace(BOX, state_dtype="bf16", offload_params="cpu", grad_dtype="bf16",
                              device_params=None)
    n, plan = max_params(box, BW)
    assert 25e9 < n < 26e9 and plan.generations == 1
    assert 0.3 < plan.device_params / n < 0.35
    caps = {"gpu": 0.7 * 80 * G, "cpu": HOST, "nvme": 64 * G}
    for tier, kinds in plan.tiers.items():
        assert sum(kinds.values()) <= caps[tier] * (1 + 1e-9), tier
    with pytest.raises(ValueError):
        make_plan(dataclasses.replace(box, params=int(n * 1.01)), BW)
    n32, _ = max_params(dataclasses.replace(box, state_dtype="fp32"), BW)
    assert 16e9 < n32 < n  # fp32 m and v (8 B) fill the drive first
    # Shards on the drive: 8 B/param of files there set the limit.
    n, plan = max_params(dataclasses.replace(BOX, state_dtype="bf16", offload_params="nvme"), BW)
    assert plan.offload == "cpu" and n == pytest.approx(64 * G / 8, rel=1e-3)
    n16, _ = max_params(dataclasses.replace(BOX, state_dtype="bf16"), BW)  # unchanged default
    assert n16 == pytest.approx(0.7 * 80 * G / 4, rel=1e-3)


def _allocated(directory) -> int:
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(directory)
               for f in fs if f != "owner.json")


@pytest.mark.parametrize("where,offload,grad", [("cpu", "cpu", "fp32"), ("nvme", "nvme", "fp32"),
                                              ("cpu", "nvme", "bf16")])
def test_planned_bytes_are_what_the_runtime_allocates(tmp_path, where, offload, grad):
    """A sharded model's shards, gradients and optimizer state, per parameter, are the bytes
    the planner counts for that placement (so the two cannot drift apart). The first block
    stays on the device (device_params; the CPU here)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    pdir, odir = tmp_path / "params", tmp_path / "state"
    pdir.mkdir()
    odir.mkdir()
    kw = {"nvme_path": str(pdir)} if where == "nvme" else {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[grad]
    mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, grad_dtype=dtype)
    model = tierlift.zero.shard(model, stage=3, offload_params=where, mixed_precision=mp,
                                device_params=512 * 512, **kw)
    okw = dict(nvme_path=str(odir), nvme_generations=1) if offload == "nvme" else {}
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload=offload, state_dtype="bf16",
                               **okw)
    model(torch.randn(4, 512, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    shards = list(model.parameters())
    assert sum(p.numel() for p in shards) == n
    assert {(p.dtype, p.device.type) for p in shards} == {(torch.float32, "cpu")}
    # Gradients: host tensors in the planned dtype, every unit's held until zero_grad().
    assert all(p.grad is not None and p.grad.dtype == dtype for p in shards)
    zero = model._tierlift_zero
    on_dev = [u.shard for u in zero.units if u.offload is None]
    assert sum(p.numel() for p in on_dev) == 512 * 512  # the first block
    off = n - 512 * 512
    planned = param_bytes_per_param(where, grad)
    assert {k: v * 512 * 512 for k, v in planned["gpu"].items()} == {
        "fp32 param shards (device_params)": sum(p.nbytes for p in on_dev),
        f"{grad} grad shards (device_params)": sum(p.grad.nbytes for p in on_dev)}
    offloaded = [u.shard for u in zero.units if u.offload is not None]
    if where == "cpu":
        got = {"fp32 param shards": zero.offload.arena.nbytes,
               f"{grad} grad shards": sum(p.grad.nbytes for p in offloaded)}
        assert {k: v / off for k, v in got.items()} == planned["cpu"]
    else:
        store = zero.offload.store
        got = {"fp32 param shards (file)": os.stat(store.path).st_blocks * 512,
               "fp32 grad shards (file)": os.stat(store.grad_path).st_blocks * 512}
        assert {k: v / off for k, v in got.items()} == planned["nvme"]
        assert store.resident_bytes() == 0 and store.resident_bytes(grads=True) == 0
    # No master: the host fp32 shards step in place (offload="cpu") or are their own master
    # (one generation); m and v in RAM or on the drive.
    assert not any(map(opt._offload._uses_master, shards))
    m_v = sum(state_bytes_per_param("bf16", master=False).values())
    if offload == "cpu":
        assert sum(t.resident_bytes for t in opt._offload.tiers) / n == m_v
        assert _allocated(odir) == 0
    else:
        assert _allocated(odir) / n == m_v
    opt.zero_grad(set_to_none=True)
    tierlift.zero.close(model)


def test_cli_offload_params(tmp_path, capsys):
    assert main(["plan", "--params", "1e8", "--gpu-mem", "2G", "--cpu-mem", "2G",
                 "--offload-params", "cpu", "--state-dtype", "bf16", "--probe-mib", "4",
                 "--device-params", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload_params"] == "cpu" and out["offload"] == "cpu"
    assert out["tiers"]["cpu"]["fp32 grad shards"] == 4e8
    assert main(["plan", "--max-params", "--gpu-mem", "2G", "--cpu-mem", "1G", "--nvme",
                 str(tmp_path), "--offload-params", "nvme", "--probe-mib", "4"]) == 0
    assert "offload_params='nvme'" in capsys.readouterr().out
    # The box (80G GPU, 128G RAM, a 64 GB drive): compact state, parameters offloaded with
    # bf16 gradients, the GPU's room holding what it can: more than 20B parameters.
    assert main(["plan", "--max-params", "--gpu-mem", "80G", "--cpu-mem", "128G", "--nvme",
                 str(tmp_path), "--nvme-free", "64G", "--state-dtype", "bf16",
                 "--offload-params", "cpu", "--grad-dtype", "bf16", "--probe-mib", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_params"] > 20e9 and out["device_params"] > 0
    assert out["nvme_generations"] == 1 and out["grad_dtype"] == "bf16"


def test_device_shards_give_the_whole_group_a_master_kind(monkeypatch):
    """With some shards on the device the tiers hold a master kind over all of the group's
    chunks: 4 B for every shard, as the plan counts it (not only for the device shards). No GPU
    here: the first block's shards are taken for device ones where the Offloader asks."""
    torch = pytest.importorskip("torch")
    from tierlift.offload.runner import Offloader

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)
    model = tierlift.zero.shard(model, stage=3, offload_params="cpu", mixed_precision=mp,
                                device_params=512 * 512)
    try:
        device = {id(u.shard) for u in model._tierlift_zero.units if u.offload is None}
        assert len(device) == 1
        real = Offloader._uses_master
        monkeypatch.setattr(Offloader, "_uses_master",
                            lambda self, p: id(p) in device or real(self, p))
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu",
                                   state_dtype="bf16")
        got = {k: sum(t.flat[(k, 0)].nbytes for t in opt._offload.tiers) for k in ("master",)}
        plan = make_plan(dataclasses.replace(BOX, params=n, state_dtype="bf16",
                                             offload_params="cpu", device_params=512 * 512,
                                             overlap=False), BW)
        assert plan.device_params == 512 * 512
        assert got["master"] == plan.tiers["cpu"]["fp32 master"] == 4 * n
    finally:
        tierlift.zero.close(model)
