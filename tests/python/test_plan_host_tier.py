"""python -m tierlift plan with the overlapped host tier (offload="cpu", overlap=True): two
generations where host memory holds them, else one generation and the spare chunks the budget
holds (the plan sizes cpu_budget), in the bytes the runtime allocates (checked against
AdamW(offload="cpu", overlap=True) built on the plan's budget); the legs of the spare fraction
pipelined during backward, the rest serial after it; a budget below one generation and the
staging refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import tierlift
from tierlift.__main__ import main
from tierlift.plan import Bandwidths, PlanInput, make_plan, max_params
from tierlift.plan.planner import render

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)
G = 1 << 30
# 8e9 parameters on the 80 GB GPU, 128 GB host box: 96 GB of fp32 state fits host memory (80%
# of it) once, not twice. The default 32 MiB chunks, made even: 954 chunks of 8386560 elements.
BOX = PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=128 * G)
CHUNKS, ELEMS = 954, 8386560
BLOCK = 12 * ELEMS  # master, m and v of one chunk
STAGING = 6 * 8 * ELEMS  # 6 slots x the fp32 grad and copy staging of device parameters


def test_once_not_twice_gives_one_generation_and_spare_chunks():
    assert -(-8e9 // ELEMS) == CHUNKS and CHUNKS * ELEMS >= 8e9 > (CHUNKS - 1) * ELEMS
    plan = make_plan(BOX, BW)
    room = int(0.8 * 128 * G)
    spare = (room - CHUNKS * BLOCK - STAGING) // BLOCK
    assert 0 < spare < CHUNKS
    host = plan.host
    assert (plan.offload, plan.overlap, host.generations) == ("cpu", True, 1)
    assert (host.chunks, host.chunk_elems, host.spare) == (CHUNKS, ELEMS, spare)
    # The budget it sizes is what the tier and its staging hold: the smallest that gives them.
    assert plan.cpu_budget == (CHUNKS + spare) * BLOCK + STAGING <= room
    assert sum(plan.tiers["cpu"].values()) == plan.cpu_budget
    assert plan.tiers["cpu"]["exp_avg"] == 4 * CHUNKS * ELEMS
    assert plan.tiers["cpu"][f"spare chunks ({spare} of {CHUNKS})"] == spare * BLOCK
    assert plan.tiers["cpu"]["staging pool"] == STAGING
    assert f"one generation plus {spare} spare chunks" in plan.note
    assert f"cpu_budget={plan.cpu_budget}" in plan.note
    f = spare / CHUNKS
    assert f"steps {f:.0%} of the state during backward, the other {CHUNKS - spare} chunks" \
        in plan.note
    # Legs: the spare fraction pipelined during backward, the rest serial in step() after it.
    legs = plan.legs_s
    assert plan.overlap_fraction == f
    assert plan.pipelined_s == pytest.approx(f * max(legs.values()) + (1 - f) * sum(legs.values()))
    assert max(legs.values()) < plan.pipelined_s < plan.serial_s
    text = render(plan, BW)
    assert f"cpu    spare chunks ({spare} of {CHUNKS})" in text
    assert f"with overlap=True: {spare} of {CHUNKS} chunks ({f:.0%}, the spare blocks) " \
           f"pipelined during backward ({plan.during_backward_s:.3f} s), the other " \
           f"{CHUNKS - spare} serial in step() after it ({plan.after_backward_s:.3f} s)" in text


def test_twice_gives_two_generations():
    plan = make_plan(dataclasses.replace(BOX, params=3e9, gpu_mem=24 * G), BW)
    host = plan.host
    assert plan.offload == "cpu" and host.generations == 2 and host.spare is None
    assert plan.cpu_budget is None  # without a budget the runtime keeps two generations
    kinds = {k: v for k, v in plan.tiers["cpu"].items() if k != "staging pool"}
    assert set(kinds) == {"fp32 master (2 gens)", "exp_avg (2 gens)", "exp_avg_sq (2 gens)"}
    assert sum(kinds.values()) == 2 * host.chunks * 12 * host.chunk_elems >= 2 * 12 * 3e9
    # The staging of two generations: 6 slots x master, m, v, grad and copy.
    assert plan.tiers["cpu"]["staging pool"] == 6 * 20 * host.chunk_elems
    assert "two generations" in plan.note and plan.overlap_fraction == 1.0
    assert plan.pipelined_s == max(plan.legs_s.values())
    assert "pipelined (overlap=True, two generations: every chunk can be stepped during " \
           "backward)" in render(plan, BW)
    # A budget one byte short of two generations and their staging: one and spare chunks.
    two = sum(plan.tiers["cpu"].values())
    one = make_plan(dataclasses.replace(BOX, params=3e9, gpu_mem=24 * G, cpu_budget=two - 1), BW)
    assert one.host.spare == one.host.chunks  # every chunk has its block: same overlap
    assert make_plan(dataclasses.replace(BOX, params=3e9, gpu_mem=24 * G, cpu_budget=two),
                     BW).host.spare is None


def test_no_overlap_is_in_place():
    plan = make_plan(dataclasses.replace(BOX, overlap=False), BW)
    assert plan.offload == "cpu" and plan.overlap is False and plan.host is None
    # The state stepped in place, and the slots that stage the device gradients and weights.
    assert plan.tiers["cpu"]["staging pool"] == STAGING
    assert sum(plan.tiers["cpu"].values()) == 12 * 8e9 + STAGING
    assert plan.pipelined_s == plan.serial_s and plan.overlap_fraction == 0.0
    assert "(overlap=False: every chunk is stepped in step(), after backward)" in \
        render(plan, BW)


def test_no_room_for_a_spare_chunk_plans_no_overlap_and_short_budgets_are_refused():
    one = CHUNKS * BLOCK + STAGING
    plan = make_plan(dataclasses.replace(BOX, cpu_budget=one + BLOCK - 1), BW)
    assert plan.overlap is False and plan.host is None
    assert "no room for a spare chunk, so overlap=True would step nothing" in plan.note
    assert make_plan(dataclasses.replace(BOX, cpu_budget=one + BLOCK), BW).host.spare == 1
    # Less than one generation and the staging of device gradients and weights: refused, by
    # exactly what is missing (the state alone, 96e9 bytes, would fit).
    short = dataclasses.replace(BOX, cpu_budget=one - 1)
    assert short.cpu_budget > 96e9
    with pytest.raises(ValueError, match=r"offload='cpu' with overlap=True needs one generation "
                                         r"of the optimizer state \(89\.4 GiB\) and the staging "
                                         r"of device gradients and weights \(383\.9 MiB\) in host "
                                         r"memory, which has .*short by 1\.0 B\); give --nvme"):
        make_plan(short, BW)
    # With a drive, the state that does not fit goes there (offload="hybrid"), as before.
    assert make_plan(dataclasses.replace(short, nvme="/x"), BW).offload == "hybrid"


def test_no_overlap_counts_the_staging_in_its_fit():
    """A budget that holds the state but not its staging is not planned in place: refused
    without a drive (by exactly what is missing), the rest to NVMe with one; and the largest
    model planned in place leaves room for the staging."""
    state = 12 * 8 * 10**9
    fits = make_plan(dataclasses.replace(BOX, overlap=False, cpu_budget=state + STAGING), BW)
    assert fits.offload == "cpu" and sum(fits.tiers["cpu"].values()) == state + STAGING
    short = dataclasses.replace(BOX, overlap=False, cpu_budget=state + STAGING - 1)
    with pytest.raises(ValueError, match=r"the optimizer state \(89\.4 GiB\) and the staging of "
                                         r"device gradients and weights \(383\.9 MiB\) do not "
                                         r"fit in .*short by 1\.0 B\); give --nvme"):
        make_plan(short, BW)
    assert make_plan(dataclasses.replace(short, nvme="/x"), BW).offload == "hybrid"
    room = int(0.8 * 128 * G)
    n, plan = max_params(dataclasses.replace(BOX, overlap=False), BW)
    assert plan.offload == "cpu" and 12 * n + plan.tiers["cpu"]["staging pool"] <= room
    assert n == pytest.approx((room - STAGING) / 12, rel=1e-3)
    # Overlapped, the largest model is at least one spare chunk smaller: never larger.
    assert max_params(BOX, BW)[0] <= n


def test_offloaded_parameters_in_place_stage_device_shards_only():
    inp = PlanInput(params=4e9, gpu_mem=80 * G, cpu_mem=128 * G, offload_params="cpu",
                    device_params=10**9)
    elems = 8386560  # 4e9 in 477 even chunks of at most 32 MiB of fp32
    plan = make_plan(inp, BW)
    assert plan.overlap is False and plan.tiers["cpu"]["staging pool"] == 6 * 8 * elems
    none = make_plan(dataclasses.replace(inp, device_params=0), BW)
    assert none.overlap is False and "staging pool" not in none.tiers["cpu"]


def _model() -> nn.Module:
    """Six 256 x 256 layers: every tensor whole 1024s, so the planner's count is the layout's."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(6)])


CHUNK_BYTES = 64 << 10  # 16384 elements: 24 chunks of the 393216 parameters


def _train_step(model, opt):
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    return dict(opt.last_step_stats)


def test_planned_budget_is_what_the_runtime_allocates():
    """The plan's spare chunks, tier bytes and chunk layout are the optimizer's, built on the
    plan's budget. The plan is for bf16 weights on the GPU, whose gradients and weights the
    runtime stages in host memory; these CPU parameters need no staging (pool_bytes 0), so the
    optimizer is given the plan's budget less that staging."""
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    inp = PlanInput(params=n, gpu_mem=3 << 20, cpu_mem=1 << 30, chunk_bytes=CHUNK_BYTES)
    two = make_plan(inp, BW).host  # 1 GiB of host memory: two generations
    assert two.generations == 2 and two.chunks == 24
    block = 12 * two.chunk_elems
    plan = make_plan(dataclasses.replace(inp, cpu_budget=(24 + 10) * block + 6 * 8 * 16384
                                         + block // 2), BW)
    host = plan.host
    assert host.spare == 10 and host.chunks == 24
    budget = plan.cpu_budget - host.staging_bytes
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu", overlap=True,
                               cpu_budget=budget, chunk_bytes=CHUNK_BYTES)
    off = opt._offload
    tier = off.tiers[0]
    assert off.chunk_elems == host.chunk_elems and len(off.layouts[0].chunks) == host.chunks
    assert tier.spare == host.spare and tier.generations == 1
    assert tier.resident_bytes == host.state_bytes == sum(
        v for k, v in plan.tiers["cpu"].items() if k != "staging pool")
    assert off.pool_bytes == 0 and tier.resident_bytes == budget
    # The fraction the plan says: as many chunks stepped during backward as there are blocks.
    _train_step(model, opt)
    stats = _train_step(model, opt)
    assert stats["overlap_kept_chunks"] == host.spare
    assert stats["ram_chunks"] == host.chunks - host.spare
    off.close()
    # The plan's budget is the smallest for its spare chunks: a byte less holds one fewer.
    opt = tierlift.optim.AdamW(_model().parameters(), lr=1e-3, offload="cpu", overlap=True,
                               cpu_budget=budget - 1, chunk_bytes=CHUNK_BYTES)
    assert opt._offload.tiers[0].spare == host.spare - 1
    opt._offload.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spare", [True, False], ids=["one-generation", "two-generations"])
def test_offloaded_parameters_budget_is_literally_the_runtimes(spare, state_dtype):
    """offload_params="cpu" (host shards, none on the device: no device staging) with
    overlap=True: the optimizer built with the plan's cpu_budget holds exactly the plan's
    bytes, staging included (two generations stage every state kind: 6 slots of them, each
    kind 4 KiB aligned; the tier's own blocks are not, which compact state's scales show)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    model = tierlift.zero.shard(model, stage=3, offload_params="cpu", device_params=0)
    inp = PlanInput(params=n, gpu_mem=1 << 30, cpu_mem=1 << 30, offload_params="cpu",
                    device_params=0, overlap=True, chunk_bytes=CHUNK_BYTES,
                    state_dtype=state_dtype)
    per_param = 12 if state_dtype == "fp32" else 7 + 4 / 256
    if spare:
        inp = dataclasses.replace(inp, cpu_budget=int(1.5 * per_param * n))
    plan = make_plan(inp, BW)
    host = plan.host
    assert plan.offload == "cpu" and plan.overlap is True and host.chunks == n // 16384
    assert (host.spare is not None) == spare and "a master of every shard" in plan.note
    assert plan.tiers["cpu"]["fp32 param shards"] == 4 * n
    assert host.block_bytes == per_param * host.chunk_elems
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu", overlap=True,
                               cpu_budget=plan.cpu_budget, chunk_bytes=CHUNK_BYTES,
                               state_dtype=state_dtype)
    off = opt._offload
    assert [t.spare for t in off.tiers] == [host.spare or 0]
    assert sum(t.resident_bytes for t in off.tiers) == host.state_bytes
    assert off.pool_bytes == host.staging_bytes == plan.tiers["cpu"]["staging pool"]
    if spare:
        assert 0 < host.spare < host.chunks and host.staging_bytes == 0
        assert plan.cpu_budget == host.state_bytes  # the smallest budget for these blocks
    else:
        aligned = {"fp32": 12 * host.chunk_elems, "bf16": 7 * host.chunk_elems + 4096}
        assert plan.cpu_budget is None and host.staging_bytes == 6 * aligned[state_dtype]
    off.close()
    tierlift.zero.close(model)


def test_offloaded_parameters_without_room_for_the_overlap_step_in_place():
    """offload_params plans overlap=False unless asked; asked, a budget below one generation
    with a master of every shard plans the in-place tier (m and v only) and says why."""
    inp = PlanInput(params=4e9, gpu_mem=80 * G, cpu_mem=128 * G, offload_params="cpu",
                    device_params=0)
    assert make_plan(inp, BW).overlap is False
    asked = make_plan(dataclasses.replace(inp, overlap=True), BW)
    room = int(0.8 * 128 * G) - 32 * 10**9  # beside the fp32 shards and their gradients
    host = asked.host
    assert asked.overlap is True and type(host.spare) is int and type(asked.cpu_budget) is int
    assert host.spare == (room - host.chunks * host.block_bytes) // host.block_bytes
    assert 0 < host.spare < host.chunks and asked.cpu_budget <= room
    assert "fp32 master" in asked.tiers["cpu"] and asked.tiers["cpu"]["staging pool"] == 0
    short = make_plan(dataclasses.replace(inp, overlap=True, cpu_budget=40 * 10**9), BW)
    assert short.overlap is False and short.host is None
    assert "overlap=True would need one generation of the optimizer state (44.7 GiB)" in \
        short.note
    assert "fp32 master" not in short.tiers["cpu"]


def test_cli_prints_the_overlapped_host_tier(capsys):
    base = ["plan", "--params", "8e9", "--gpu-mem", "80G", "--cpu-mem", "128G", "--probe-mib",
            "4"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overlap"] is True and out["host_tier"]["generations"] == 1
    assert out["host_tier"]["spare"] > 0 and out["host_tier"]["chunks"] == CHUNKS
    assert out["cpu_budget"] == sum(out["tiers"]["cpu"].values())
    assert out["pipelined_s"] == pytest.approx(out["during_backward_s"] + out["after_backward_s"])
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "one generation plus" in text and "pipelined during backward" in text
    assert main([*base, "--no-overlap", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overlap"] is False and out["host_tier"] is None
    assert out["pipelined_s"] == out["serial_s"]


def _device_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(6)]).to(
        device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", [
    "taken-for-device",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")),
])
def test_in_place_plan_is_what_the_runtime_allocates(device, monkeypatch):
    """offload="cpu", overlap=False on bf16 weights on the GPU: the plan's state and staging
    are the optimizer's tier and slots, and the budget the plan takes as enough is the one the
    optimizer accepts (a byte less: both refuse). Without CUDA, CPU weights are taken for
    device ones while the optimizer is built (d2h.on_device, which decides the staging), and
    nothing is stepped."""
    if device != "cuda":
        from tierlift.offload import d2h

        monkeypatch.setattr(d2h, "on_device", lambda t: True)
    model = _device_model("cuda" if device == "cuda" else "cpu")
    n = sum(p.numel() for p in model.parameters())
    inp = PlanInput(params=n, gpu_mem=3 << 20, cpu_mem=1 << 30, chunk_bytes=CHUNK_BYTES,
                    overlap=False)
    plan = make_plan(inp, BW)
    cpu = plan.tiers["cpu"]
    assert plan.offload == "cpu" and plan.overlap is False
    assert cpu["staging pool"] == 6 * 8 * 16384 > 0

    def build(budget):
        return tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu",
                                    chunk_bytes=CHUNK_BYTES, cpu_budget=budget)._offload

    off = build(None)
    assert off._cuda and off.chunk_elems == 16384
    slots = sum(t.nbytes for slot in off._slots for t in slot.values())
    assert off.pool_bytes == slots == cpu["staging pool"]
    assert sum(t.resident_bytes for t in off.tiers) == sum(
        v for k, v in cpu.items() if k != "staging pool")
    off.close()
    total = int(sum(cpu.values()))  # whole bytes: the state is counted per parameter
    assert make_plan(dataclasses.replace(inp, cpu_budget=total), BW).offload == "cpu"
    build(total).close()
    with pytest.raises(ValueError, match=r"do not fit in .* \(short by 1\.0 B\)"):
        make_plan(dataclasses.replace(inp, cpu_budget=total - 1), BW)
    with pytest.raises(ValueError, match="smaller than the optimizer state"):
        build(total - 1)
