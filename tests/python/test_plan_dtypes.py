"""The plan for weights that are not bf16 (PlanInput(param_dtype=...), --param-dtype) against
what the runtime holds for the same model, per tier: fp32 weights and gradients take 4 B each on
the GPU, and an fp32 weight is its own master (m and v only) beside its state on the GPU and
streamed in one generation, while a device weight stepped in place or in two generations keeps
an fp32 master in the tiers whatever its dtype. Planned as bf16, an fp32 model's GPU bytes were
half the runtime's, and its one-generation NVMe state planned at 12 B/param instead of 8 (a
drive that holds it was refused). No GPU here: CPU tensors are taken for device ones
(d2h.on_device), the copies counted as the D2H and H2D legs' bytes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch import nn

import tierlift
from tierlift.__main__ import main
from tierlift.plan import Bandwidths, PlanInput, make_plan

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

# PCIe at 1 B/s: a D2H or H2D leg's seconds are its bytes.
BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9,
                h2d_bps=1.0, d2h_bps=1.0)
CHUNK_BYTES = 64 << 10
ELEMS = CHUNK_BYTES // 4  # 16384: 8 x 512 x 512 parameters are 128 whole chunks
# offload="hybrid" with device weights: 3 slots (the budget affords no more) of master, m, v,
# grad and copy staging, and host memory for 48 chunks of 12 B (72 of 8 B) per element.
POOL = 3 * 20 * ELEMS
RAM = 48 * 12 * ELEMS


@pytest.fixture
def on_device(monkeypatch):
    """CPU tensors taken for device ones; {"d2h": bytes, "h2d": bytes} copied between them."""
    from tierlift.offload import d2h, h2d

    moved = {"d2h": 0, "h2d": 0}

    def copy(self, pairs, ready):
        for dst, src in pairs:
            dst.copy_(src)
            moved["d2h"] += src.nbytes
        return []

    upload = h2d.Uploader.upload

    def counted(self, pairs, buffer):
        moved["h2d"] += sum(src.nbytes for _, src in pairs)
        return upload(self, pairs, buffer)

    monkeypatch.setattr(d2h, "on_device", lambda t: True)
    monkeypatch.setattr(d2h, "ready_events", lambda tensors: [])
    monkeypatch.setattr(d2h.Copier, "copy", copy)
    monkeypatch.setattr(h2d.Uploader, "upload", counted)
    return moved


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)]).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _allocated(directory) -> int:
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(directory)
               for f in fs if f != "owner.json")


def _cases(n: int, numels: list[int], own: bool, nvme: str) -> dict:
    """{placement: (PlanInput arguments, AdamW arguments)}; the GPU holds 8 B/param, not 12."""
    gpu = int(10 * n / 0.7)
    hybrid = dict(gpu_mem=gpu, nvme=nvme, cpu_budget=POOL + RAM, pool_bytes=POOL)
    return {
        "gpu": (dict(gpu_mem=1 << 34), {}),
        "cpu": (dict(gpu_mem=gpu, overlap=False, numels=numels), dict(offload="cpu")),
        "cpu-overlap": (dict(gpu_mem=gpu, overlap=True, numels=numels),
                        dict(offload="cpu", overlap=True)),
        "hybrid": (hybrid, dict(offload="hybrid", cpu_budget=POOL + RAM, nvme_path=nvme)),
        # a drive with room for one generation only: m and v alone of an fp32 weight
        "hybrid-1-gen": ({**hybrid, "nvme_free": (8 if own else 12) * n - RAM},
                         dict(offload="hybrid", cpu_budget=POOL + RAM, nvme_path=nvme,
                              nvme_generations=1)),
    }


# Compact state where its chunks are whole at these budgets (the hybrid ones are cut for 12 B).
_PLACEMENTS = [(p, "fp32") for p in ("gpu", "cpu", "cpu-overlap", "hybrid", "hybrid-1-gen")] + [
    (p, "bf16") for p in ("gpu", "cpu", "cpu-overlap")]


@pytest.mark.parametrize("placement,state_dtype", _PLACEMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_planned_bytes_per_tier_are_what_the_runtime_holds(tmp_path, on_device, dtype,
                                                           placement, state_dtype):
    """Each tier's planned bytes are the runtime's after a step: weights and gradients (the
    GPU), the optimizer state there or in the tiers with their staging pool (host memory), the
    state files' allocated blocks (the drive); and the D2H and H2D legs are the bytes the step
    copied (fp32 in one generation: each weight copied down to be stepped, as its own
    master)."""
    model = _model(dtype)
    numels = [p.numel() for p in model.parameters()]
    n = sum(numels)
    own = dtype is torch.float32
    plan_kw, opt_kw = _cases(n, numels, own, str(tmp_path))[placement]
    plan = make_plan(PlanInput(params=n, cpu_mem=1 << 30, chunk_bytes=CHUNK_BYTES,
                               param_dtype=dtype, state_dtype=state_dtype, **plan_kw), BW)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=CHUNK_BYTES,
                               state_dtype=state_dtype, **opt_kw)
    opt.step()
    got = {"gpu": sum(p.nbytes + p.grad.nbytes for p in model.parameters())}
    off = opt._offload
    if off is None:
        got["gpu"] += sum(t.nbytes for s in opt.state.values() for k, t in s.items()
                          if k != "step")
        assert plan.offload == "none"
    else:
        got["cpu"] = sum(t.resident_bytes for t in off.tiers) + off.pool_bytes
        if _allocated(tmp_path):
            got["nvme"] = _allocated(tmp_path)
        assert plan.offload == opt_kw["offload"]
        assert plan.generations == opt_kw.get("nvme_generations", 2 if "nvme_path" in opt_kw
                                              else None)
        planned_d2h = plan.legs_s["d2h grads"] + plan.legs_s.get("d2h device weights", 0)
        assert (planned_d2h, plan.legs_s["h2d params"]) == (on_device["d2h"],
                                                            on_device["h2d"])
        off.close()
    assert {t: sum(kinds.values()) for t, kinds in plan.tiers.items()} == got
    dt = {torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    assert plan.tiers["gpu"][f"{dt} params"] == plan.tiers["gpu"][f"{dt} grads"] == \
        dtype.itemsize * n
    # A master where the runtime keeps one: not for an fp32 weight beside its state on the
    # GPU, or streamed in one generation.
    masters = [k for t in plan.tiers.values() for k in t if "master" in k]
    assert bool(masters) == (not own or placement not in ("gpu", "hybrid-1-gen"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_device_part_state_is_what_the_runtime_keeps_beside_the_weights(dtype):
    """AdamW(device_fraction=0.25) on 8 equal tensors: two keep their state beside them, m and
    v only for fp32 (their own master), with an fp32 master for fp16; the plan's device part is
    those bytes."""
    model = _model(dtype)
    n = sum(p.numel() for p in model.parameters())
    inp = PlanInput(params=n, gpu_mem=int(16 * n / 0.7), cpu_mem=1 << 30, overlap=False,
                    chunk_bytes=CHUNK_BYTES, device_fraction=0.25, param_dtype=dtype)
    plan = make_plan(inp, BW)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=CHUNK_BYTES,
                               offload="cpu", device_fraction=0.25)
    opt.step()
    params = list(model.parameters())
    (pis,) = opt._offload.device_part.pis
    assert pis == {0, 1}
    beside = sum(t.nbytes for pi in pis for k, t in opt.state[params[pi]].items() if k != "step")
    part = {k: v for k, v in plan.tiers["gpu"].items() if k.startswith("device part")}
    assert sum(part.values()) == beside == (8 if dtype is torch.float32 else 12) * n // 4
    opt._offload.close()


def test_bf16_is_the_default_and_its_numbers_do_not_move():
    G = 1 << 30
    for kw in ({}, {"offload_params": "cpu"}, {"nvme": "/x", "cpu_mem": 32 * G}):
        inp = PlanInput(**{"params": 8e9, "gpu_mem": 80 * G, "cpu_mem": 128 * G, **kw})
        given = make_plan(dataclasses.replace(inp, param_dtype=torch.bfloat16), BW)
        assert inp.param_dtype == "bf16" and make_plan(inp, BW) == given
        assert "param_dtype" not in given.note


def test_fp32_on_the_gpu_takes_twice_the_bytes_and_fp32_units_a_larger_working_set():
    """fp32 weights and gradients: 8 B/param on the GPU, so a model bf16 holds there no longer
    fits; with offload_params the gathered fp32 units hold twice bf16's bytes per parameter of
    the largest unit (24 B, counted on CPU in test_plan_gaps.py), and each offloaded unit goes
    up twice in fp32."""
    G = 1 << 30
    inp = PlanInput(params=8e9, gpu_mem=80 * G, cpu_mem=128 * G)
    assert make_plan(inp, BW).tiers["gpu"] == {"bf16 params": 16e9, "bf16 grads": 16e9}
    with pytest.raises(ValueError, match=r"the fp32 parameters and gradients \(59\.6 GiB\) do "
                                         r"not fit in 56\.0 GiB"):
        make_plan(dataclasses.replace(inp, param_dtype="fp32"), BW)
    zero = dataclasses.replace(inp, cpu_mem=256 * G, offload_params="cpu", device_params=0)
    for dt, per, up in (("bf16", 12, 2), ("fp16", 12, 2), ("fp32", 24, 4)):
        plan = make_plan(dataclasses.replace(zero, param_dtype=dt), BW)
        assert plan.tiers["gpu"] == {"gathered units (working set)": per * 8e9 / 32}
        assert plan.legs_s["h2d params"] == 2 * up * 8e9
        # the shards, their gradients and the state do not depend on the units' dtype
        assert plan.tiers["cpu"] == make_plan(zero, BW).tiers["cpu"]
    with pytest.raises(ValueError, match=r"working set of gathered units \(.*: 24 B per"):
        make_plan(dataclasses.replace(zero, param_dtype="fp32", unit_share=1.0), BW)


@pytest.mark.parametrize("grad", [torch.float32, torch.bfloat16])
def test_fp32_offloaded_units_go_up_twice_in_fp32(grad):
    """One forward and backward of a sharded model with offload_params='cpu': the H2D bytes of
    its gathers are the plan's (2 x 4 B per offloaded parameter in fp32, 2 x 2 B in bf16), and
    its D2H bytes and host gradient shards those of grad_dtype (fp32 units with bf16 gradients
    cast each reduced shard: 2 B, planned since the working set's bound holds that copy)."""
    gd = {torch.float32: "fp32", torch.bfloat16: "bf16"}[grad]
    for dtype, dt in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
        n = sum(p.numel() for p in model.parameters())
        mp = tierlift.zero.MixedPrecision(param_dtype=dtype, grad_dtype=grad)
        model = tierlift.zero.shard(model, stage=3, offload_params="cpu", mixed_precision=mp)
        try:
            model(torch.randn(2, 256, dtype=dtype)).float().square().mean().backward()
            plan = make_plan(PlanInput(params=n, gpu_mem=1 << 30, cpu_mem=1 << 30,
                                       offload_params="cpu", device_params=0,
                                       param_dtype=dt, grad_dtype=gd), BW)
            stats = model._tierlift_zero.stats
            assert stats["h2d_bytes"] == plan.legs_s["h2d params"] == 2 * dtype.itemsize * n
            assert stats["d2h_bytes"] == plan.legs_s["d2h grads"] == grad.itemsize * n
            assert sum(p.grad.nbytes for p in model.parameters()) == \
                plan.tiers["cpu"][f"{gd} grad shards"] == grad.itemsize * n
        finally:
            tierlift.zero.close(model)


def test_param_dtypes_that_cannot_be_planned_are_refused(capsys):
    base = dict(params=1e9, gpu_mem=1 << 34, cpu_mem=1 << 34)
    with pytest.raises(ValueError, match=r"param_dtype must be one of \('bf16', 'fp16', "
                                         r"'fp32'\).*got torch\.float64"):
        PlanInput(**base, param_dtype=torch.float64)
    with pytest.raises(ValueError, match="got 'float32'"):
        PlanInput(**base, param_dtype="float32")
    argv = ["plan", "--params", "1e8", "--gpu-mem", "4G", "--cpu-mem", "4G", "--probe-mib", "4",
            "--json"]
    assert main([*argv, "--param-dtype", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["param_dtype"] == "fp32" and out["tiers"]["gpu"]["fp32 params"] == 4e8
    assert out["offload"] == "none" and "fp32 master" not in out["tiers"]["gpu"]
    with pytest.raises(SystemExit):
        main([*argv, "--param-dtype", "fp64"])
    assert "invalid choice: 'fp64'" in capsys.readouterr().err


def test_bytes_across_nodes_follow_param_dtype(capsys):
    """--nodes with --param-dtype fp32: flat ZeRO-3 and the hierarchy's gradient all-reduce
    move fp32, twice bf16's bytes; the int8 codes are the same (test_plan_measured.py counts
    both at the c10d calls)."""
    argv = ["plan", "--params", "1e9", "--gpu-mem", "80G", "--cpu-mem", "64G", "--probe-mib", "4",
            "--nodes", "2", "--gpus-per-node", "8", "--inter-node-gbps", "200", "--json"]
    rows = {}
    for dt in ("bf16", "fp32"):
        assert main([*argv, "--param-dtype", dt]) == 0
        rows[dt] = [r["per_node_bytes"] for r in json.loads(capsys.readouterr().out)[
            "across_nodes"]]
    assert rows["fp32"] == [2 * rows["bf16"][0], 2 * rows["bf16"][1], rows["bf16"][2]]
    assert main([*argv[:-1], "--param-dtype", "fp32"]) == 0
    assert "fp32 weights and gradients" in capsys.readouterr().out
