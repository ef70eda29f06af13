"""python -m tierlift plan with offload="hybrid": only the NVMe chunks (two generations) are
stepped during backward; the chunks in host memory are one generation, stepped in place in
step() after it, with no I/O. The pipelined time counts that (checked against the optimizer's
own count of the chunks it kept from backward), and nvme_generations=1 steps nothing early."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import tierlift
from tierlift.__main__ import main
from tierlift.plan import Bandwidths, PlanInput, make_plan
from tierlift.plan.planner import POOL_BYTES, render

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)
G = 1 << 30
# 8e9 parameters, 32 GB of host memory: 96 GB of fp32 state, most of it on the drive.
HYBRID = PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=32 * G, nvme="/x")
PER_CHUNK_LEGS = ("d2h grads", "cpu adam", "h2d params")


def test_only_the_nvme_part_is_pipelined_during_backward():
    plan = make_plan(HYBRID, BW)
    assert plan.offload == "hybrid" and plan.generations == 2
    # The runtime cuts 8e9 elements into 954 even chunks and keeps 263 whole ones in host
    # memory beside the pool (test_plan.py counts them): the other 691 are on the drive.
    f = (954 - 263) / 954
    assert plan.overlap_fraction == pytest.approx(f, abs=1e-12) and 0 < f < 1
    legs = plan.legs_s
    # The NVMe chunks: their share of the per-chunk legs and all of the I/O, side by side.
    assert plan.during_backward_s == pytest.approx(max(
        *(f * legs[k] for k in PER_CHUNK_LEGS), legs["nvme read"], legs["nvme write"]))
    # The chunks in host memory: their share of the per-chunk legs, one after another.
    assert plan.after_backward_s == pytest.approx((1 - f) * sum(legs[k] for k in PER_CHUNK_LEGS))
    assert plan.pipelined_s == pytest.approx(plan.during_backward_s + plan.after_backward_s)
    assert max(legs.values()) < plan.pipelined_s < plan.serial_s
    text = render(plan, BW)
    assert (f"with overlap=True: the NVMe part ({f:.0%} of the state, two generations) "
            f"pipelined during backward ({plan.during_backward_s:.3f} s), the part in host "
            f"memory ({1 - f:.0%}, one generation) stepped in place in step() after it "
            f"({plan.after_backward_s:.3f} s)") in text
    # More host memory, a larger part stepped after backward: nearer the serial sum.
    more = make_plan(dataclasses.replace(HYBRID, cpu_mem=64 * G), BW)
    assert more.offload == "hybrid" and more.overlap_fraction < f
    assert (more.pipelined_s - max(more.legs_s.values())) / more.serial_s > \
        (plan.pipelined_s - max(legs.values())) / plan.serial_s


def test_one_generation_steps_nothing_during_backward():
    disk = 96e9 - (int(0.8 * 32 * G) - min(POOL_BYTES, int(0.8 * 32 * G) // 4))
    plan = make_plan(dataclasses.replace(HYBRID, nvme_free=int(1.5 * disk)), BW)
    assert plan.offload == "hybrid" and plan.generations == 1
    assert plan.overlap_fraction == 0.0 and plan.during_backward_s == 0.0
    assert plan.pipelined_s == pytest.approx(plan.serial_s)
    assert "(nvme_generations=1: nothing is stepped during backward; every chunk is rewritten " \
           "in place in step())" in render(plan, BW)


def test_nvme_only_plans_are_unchanged():
    for free in (None, int(100e9)):  # two generations, then room for one only
        plan = make_plan(dataclasses.replace(HYBRID, cpu_budget=1 << 20, nvme_free=free), BW)
        assert plan.offload == "nvme" and plan.overlap_fraction is None
        assert plan.pipelined_s == max(plan.legs_s.values())
    assert plan.generations == 1


def test_cli_json_says_the_hybrid_fraction(tmp_path, capsys):
    assert main(["plan", "--params", "8e9", "--gpu-mem", "80G", "--cpu-mem", "32G", "--nvme",
                 str(tmp_path), "--nvme-free", "1T", "--probe-mib", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload"] == "hybrid" and out["nvme_generations"] == 2
    assert 0 < out["overlap_fraction"] < 1
    assert out["pipelined_s"] == pytest.approx(out["during_backward_s"] + out["after_backward_s"])
    assert out["after_backward_s"] > 0


CHUNK_BYTES = 64 << 10  # 16384 elements: 128 chunks of the 2097152 parameters


@pytest.mark.parametrize("generations", [2, 1])
def test_fraction_is_the_chunks_the_optimizer_steps_during_backward(tmp_path, generations):
    """AdamW(offload="hybrid", overlap=True) keeps from backward exactly the NVMe chunks (two
    generations) or none (one); the plan, given the optimizer's pool and budget, says that
    share. The budget holds the pool and 96 whole chunks of master, m and v (bf16 weights, as
    the plan's, have a master in one generation too)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)]).bfloat16()
    n = sum(p.numel() for p in model.parameters())
    pool = 6 * 12 * 16384  # 6 slots x one chunk of master, m and v (no device staging)
    budget = pool + 96 * 12 * 16384
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="hybrid", overlap=True,
                               nvme_path=str(tmp_path), cpu_budget=budget,
                               chunk_bytes=CHUNK_BYTES, nvme_generations=generations)
    off = opt._offload
    chunks = len(off.layouts[0].chunks)
    assert off.pool_bytes == pool and off.tiers[0].n_ram == 96 and chunks == 128
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 512, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
    stats = opt.last_step_stats
    kept = stats.get("overlap_kept_chunks", 0)
    assert kept == (chunks - 96 if generations == 2 else 0)
    assert stats["ram_chunks"] == 96
    off.close()
    inp = PlanInput(params=n, gpu_mem=16 << 20, cpu_mem=1 << 30, nvme=str(tmp_path),
                    cpu_budget=budget, pool_bytes=pool, chunk_bytes=CHUNK_BYTES,
                    nvme_free=None if generations == 2 else 12 * (n - 96 * 16384))
    plan = make_plan(inp, BW)
    assert plan.offload == "hybrid" and plan.generations == generations
    assert plan.overlap_fraction == pytest.approx(kept / chunks, abs=1e-12)
