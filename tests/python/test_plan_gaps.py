"""The planner's numbers where it used to derive them or leave them unplanned, against the
runtime's bytes, and the options it refuses.

The ZeRO-3 working set (offload_params): the device bytes a sharded model holds at the peak of
backward, counted on CPU as the runtime allocates them (every tensor an aten op makes, less the
host tensors parameter offload stages through; world 1, program order), against the planner's
bound. Before, the planner counted 12 B per parameter of the largest unit for bf16 units (16 for
fp32 ones) from a list of buffers that missed the prefetch's staged shard and the unit-size
buffers autograd summed a unit's gradient in (one per parameter, when the weights were sliced
out of the unit one by one): blocks of several parameters held 13.0 B (26.0 B). The weights
are now pieces of one split, whose gradient is one concatenation: 10 B (20 B) for blocks, 12 B
(24 B) for a weight read twice, the bound the plan counts.
Then the device shadow of AdamW(device_staging=True), the options whose bytes are not planned
(refused by name), and the hybrid tier's pipeline pool."""

from __future__ import annotations

import dataclasses
import os
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tierlift
from tierlift.plan import Bandwidths, PlanInput, make_plan, max_params

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

BW = Bandwidths(memory_bps=10e9, adam_elems_per_s=1e9, disk_read_bps=2e9, disk_write_bps=1e9)
G = 1 << 30
D = 256
# Storages below this are a one-row batch's activations, the biases' gradients and their
# like (at most 2 D elements), left to gpu_reserve; every buffer the working set counts holds
# at least D x D elements of 2 bytes or more.
_SMALL = D * D


class _DeviceBytes(TorchDispatchMode):
    """The largest sum of live storages made by aten ops (and those registered with add()),
    skipping what is made while `host` is set: the parameter offload's host staging."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.host = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if id(s) not in self.live:
            self.live[id(s)] = weakref.ref(s)
            weakref.finalize(s, self.live.pop, id(s), None)

    def now(self) -> int:
        # sizes read at each op: a unit's storage is resized to 0 when it is freed
        sizes = (r().nbytes() for r in list(self.live.values()) if r() is not None)
        return sum(b for b in sizes if b >= _SMALL)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.add(t)
        self.peak = max(self.peak, self.now())
        return out


def _backward_peak(model: nn.Module, x: torch.Tensor, monkeypatch) -> int:
    """Device bytes at the peak of the second backward (the first records the unit order the
    prefetch follows); the gathered units' buffers, made at shard(), are registered."""
    from tierlift.zero.param_offload import ParamOffload

    mode = _DeviceBytes()
    stage_in, stage_out = ParamOffload.stage_in, ParamOffload.stage_out

    def staged_in(self, *args, **kwargs):
        mode.host += 1  # the host staging buffer is not device memory; what it fills is
        try:
            dst = stage_in(self, *args, **kwargs)
        finally:
            mode.host -= 1
        mode.add(dst)
        return dst

    def staged_out(self, *args, **kwargs):
        mode.host += 1  # the gradient shard's host copy
        try:
            return stage_out(self, *args, **kwargs)
        finally:
            mode.host -= 1

    with monkeypatch.context() as patched:  # undone before the next model's
        patched.setattr(ParamOffload, "stage_in", staged_in)
        patched.setattr(ParamOffload, "stage_out", staged_out)
        model(x).float().sum().backward()
        model.zero_grad(set_to_none=True)
        loss = model(x).float().sum()
        with mode:
            for unit in model._tierlift_zero.units:
                mode.add(unit.full)
            loss.backward()
    return mode.peak


def _one_weight_units() -> nn.Module:
    return nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(4)])


def _blocks() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                           for _ in range(4)])


class _ReadTwice(nn.Module):
    """A unit of one weight read twice (as a tied weight is)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.lin(self.lin(x))


def _weights_read_twice() -> nn.Module:
    return nn.Sequential(*[_ReadTwice() for _ in range(4)])


@pytest.mark.parametrize("param_dtype,grad_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16)])
def test_working_set_is_the_bound_of_the_backward_peak(param_dtype, grad_dtype, monkeypatch):
    """Building a unit's gradient, 3 w U for the unit, the prefetch and its staged shard, and
    the gradient: units of one weight that fills them hold its gradient (w U: its view's
    gradient is the unit's), blocks of several parameters their parameters' gradients and the
    unit-size buffer those are concatenated into (w U + w W, W the weights' elements: the
    biases' gradients are under what is counted), a weight read twice its two gradients and
    their sum (3 w U). Landing it, 4 w U (the prefetch and its staged shard, the gradient, the
    reduce-scatter output) and its copy in grad_dtype where that differs (g U). The plan counts
    the bound, 6 w U, whatever grad_dtype."""
    w = param_dtype.itemsize
    g = grad_dtype.itemsize if grad_dtype != param_dtype else 0
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for build, built in ((_one_weight_units, lambda u, weights: 4 * w * u),
                         (_blocks, lambda u, weights: 4 * w * u + w * weights),
                         (_weights_read_twice, lambda u, weights: 6 * w * u)):
        torch.manual_seed(0)
        model = build()
        n = sum(p.numel() for p in model.parameters())
        mp = tierlift.zero.MixedPrecision(param_dtype=param_dtype, grad_dtype=grad_dtype)
        model = tierlift.zero.shard(model, stage=3, offload_params="cpu", mixed_precision=mp,
                                    device_params=0)
        try:
            largest = max(model._tierlift_zero.units, key=lambda u: u.padded)
            unit = largest.padded
            weights = sum(e.numel for e in largest.entries if e.numel >= _SMALL)
            peak = _backward_peak(model, torch.randn(1, D, dtype=param_dtype), monkeypatch)
        finally:
            tierlift.zero.close(model)
        assert peak == max(built(unit, weights), (4 * w + g) * unit), build.__name__
        plan = make_plan(PlanInput(params=n, gpu_mem=G, cpu_mem=G, offload_params="cpu",
                                   device_params=0, unit_share=unit / n,
                                   param_dtype=dt[param_dtype],
                                   grad_dtype=dt[grad_dtype]), BW)
        planned = plan.tiers["gpu"]["gathered units (working set)"]
        assert planned == pytest.approx(6 * w * unit, rel=1e-12)
        assert planned >= peak


def test_working_set_does_not_depend_on_the_gradients_dtype():
    """bf16 gradient shards halve the host bytes and the D2H leg, not the working set: the
    bound is the gradient's build in the units' dtype; fp32 gradients' copy of the reduced
    gradient lands under it."""
    inp = PlanInput(params=4e9, gpu_mem=80 * G, cpu_mem=128 * G, offload_params="cpu",
                    device_params=0)
    fp32, bf16 = (make_plan(dataclasses.replace(inp, grad_dtype=g), BW) for g in ("fp32", "bf16"))
    assert fp32.tiers["gpu"] == bf16.tiers["gpu"] == {
        "gathered units (working set)": pytest.approx(12 * 4e9 / 32)}
    assert bf16.tiers["cpu"]["bf16 grad shards"] == fp32.tiers["cpu"]["fp32 grad shards"] / 2


def test_weights_beyond_the_gpu_are_pointed_to_the_parameter_offload_the_planner_plans():
    """The refusal of bf16 weights and gradients the GPU cannot hold names offload_params,
    which make_plan places (it used to say the planner did not), and that input plans."""
    inp = PlanInput(params=20e9, gpu_mem=80 * G, cpu_mem=512 * G)
    with pytest.raises(ValueError, match=r"\(74\.5 GiB\) do not fit in 56\.0 GiB of GPU memory "
                                         r".*plan tierlift\.zero's parameter offload with "
                                         r"offload_params='cpu' or 'nvme'") as refused:
        make_plan(inp, BW)
    assert "does not place" not in str(refused.value)
    plan = make_plan(dataclasses.replace(inp, offload_params="cpu"), BW)
    assert plan.offload == "cpu" and "offload_params='cpu'" in plan.note


# ---- runtime options the plan counts or refuses ---------------------------------------------
CHUNK_BYTES = 64 << 10


@pytest.fixture
def staged_on_device(monkeypatch):
    """CPU weights taken for CUDA ones that device staging can shadow (its seams: the stand-in
    streams of test_offload_device_staging.py need only wait and synchronize here)."""
    from tierlift.offload import d2h, device_staging

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(d2h, "on_device", lambda t: True)
    monkeypatch.setattr(device_staging, "stageable", lambda p: True)
    monkeypatch.setattr(device_staging, "free_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(device_staging, "side_stream", lambda device: Stream())
    monkeypatch.setattr(device_staging, "current_stream", lambda device: Stream())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_device_staging_shadow_is_what_the_runtime_allocates(staged_on_device, dtype):
    """AdamW(offload="cpu", overlap=True, device_staging=True): the plan's GPU shadow is the
    runtime's (each of the 80 tensors from a 256-byte boundary: 2.18 B/param here), and its
    host tier and staging pool are those of the plan without it; a GPU without room for the
    shadow beside the weights is refused, as the runtime refuses it at construction."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(40)]).to(dtype)
    numels = [p.numel() for p in model.parameters()]
    n = sum(numels)
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    inp = PlanInput(params=n, gpu_mem=int(7 * n / 0.7), cpu_mem=G, chunk_bytes=CHUNK_BYTES,
                    numels=numels, param_dtype=dt, overlap=True, device_staging=True)
    plan = make_plan(inp, BW)
    without = make_plan(dataclasses.replace(inp, device_staging=False), BW)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu", overlap=True,
                               chunk_bytes=CHUNK_BYTES, device_staging=True)
    off = opt._offload
    try:
        shadows = [s.buffer.nbytes for s in off._device_staging.shadows if s is not None]
        assert plan.tiers["gpu"]["device staging shadow"] == sum(shadows) == 40 * (2048 + 256)
        assert plan.tiers["cpu"] == without.tiers["cpu"]
        assert sum(t.resident_bytes for t in off.tiers) + off.pool_bytes == \
            sum(plan.tiers["cpu"].values())
    finally:
        off.close()
    with pytest.raises(ValueError, match=r"device_staging=True: its shadow of the new weights "
                                         r"\(90\.0 KiB\) .* does not fit"):
        make_plan(dataclasses.replace(inp, gpu_mem=int(6 * n / 0.7)), BW)
    assert make_plan(dataclasses.replace(inp, gpu_mem=int(6 * n / 0.7), device_staging=False),
                     BW).offload == "cpu"


def test_options_whose_bytes_are_not_planned_are_refused_by_name():
    """durable=True (a gradient log, a journal, a master of fp32 weights in one generation),
    non-contiguous weights (a master of each, stepped through a copy) and device_staging=None
    (decided from the GPU's free memory after the first step) would be planned low: refused,
    as is device_staging=True where the plan has no overlapped host tier to stage for."""
    base = dict(params=8e9, gpu_mem=80 * G, cpu_mem=128 * G)
    refusals = [
        (dict(durable=True), r"durable=True is not planned: .*gradient log"),
        (dict(contiguous=False), r"non-contiguous weights \(contiguous=False.*not planned"),
        (dict(device_staging=None), r"device_staging=None is not planned"),
        (dict(device_staging=1), r"device_staging must be True, False or None"),
        (dict(device_staging=True, param_dtype="fp32"), r"device_staging=True is planned for "
                                                        r"bf16 or fp16 weights"),
        (dict(device_staging=True, offload_params="cpu"), r"offload_params='none'"),
        (dict(device_staging=True, overlap=False), r"with overlap=True"),
    ]
    for kw, message in refusals:
        with pytest.raises(ValueError, match=message):
            PlanInput(**base, **kw)
    # the plan itself without an overlapped host tier: all on the GPU, or on NVMe
    with pytest.raises(ValueError, match=r"this plan is offload='none'"):
        make_plan(PlanInput(params=1e9, gpu_mem=80 * G, cpu_mem=128 * G, device_staging=True),
                  BW)
    with pytest.raises(ValueError, match=r"this plan is offload='hybrid'"):
        make_plan(PlanInput(params=13e9, gpu_mem=80 * G, cpu_mem=128 * G, nvme="/x",
                            device_staging=True), BW)
    with pytest.raises(ValueError, match="max_params plans device_staging=False"):
        max_params(PlanInput(**base, device_staging=True), BW)


@pytest.mark.parametrize("budget_mib,slots", [(32, {"fp32": 6, "bf16": 6}),
                                              (20, {"fp32": 4, "bf16": 5})])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_hybrid_pool_is_the_slots_of_the_state_kinds(tmp_path, staged_on_device, state_dtype,
                                                     budget_mib, slots):
    """offload="hybrid" with weights on the GPU: the pipeline's pool is a chunk of every state
    kind and the fp32 grad and copy staging per slot, 6 slots or as many of 1 MiB per kind
    as the budget holds (at least 3; 20 MiB holds 4 of fp32 state, 5 compact), as the
    runtime allocates it (compact state: 15.25 B per
    slot element here; the plan took fp32 state's 20 B and 6 slots for any state and budget:
    960 MiB instead of 720.75 MiB at the default chunk), so the host memory the plan leaves
    the state is the runtime's budget less pool."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)]).bfloat16()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in model.parameters())
    budget = budget_mib << 20
    inp = PlanInput(params=n, gpu_mem=int(10 * n / 0.7), cpu_mem=G, nvme=str(tmp_path),
                    cpu_budget=budget, chunk_bytes=CHUNK_BYTES, state_dtype=state_dtype)
    plan = make_plan(inp, BW)
    assert plan.offload == "hybrid" and plan.cpu_budget == budget
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="hybrid",
                               nvme_path=str(tmp_path), cpu_budget=budget,
                               chunk_bytes=CHUNK_BYTES, state_dtype=state_dtype)
    off = opt._offload
    try:
        assert off.chunk_elems == CHUNK_BYTES // 4
        per_elem = 20 if state_dtype == "fp32" else 15.25
        assert plan.tiers["cpu"]["staging pool"] == off.pool_bytes == \
            slots[state_dtype] * per_elem * CHUNK_BYTES // 4
    finally:
        off.close()


def _allocated(directory) -> int:
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(directory)
               for f in fs if f != "owner.json")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_nvme_plan_is_the_runtimes_pool_and_files_under_its_budget(tmp_path, staged_on_device,
                                                                   state_dtype):
    """Host memory for under 1% of the state: offload="nvme" under the plan's cpu_budget (the
    plan named none, and the runtime's default pool is 6 slots of 32 MiB chunks: 960 MiB where
    the plan said the budget). Its pool (3 slots of the chunks the budget holds: 2048 elements
    of fp32 state, 1024 of compact state, whose small kinds take 4 KiB each) and files (every
    chunk of every kind 4 KiB aligned: 16 B/param of compact state at this chunk, not the 7.02
    of 32 MiB chunks) are the runtime's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)]).bfloat16()
    n = sum(p.numel() for p in model.parameters())
    budget = 128 << 10
    plan = make_plan(PlanInput(params=n, gpu_mem=int(10 * n / 0.7), cpu_mem=G,
                               nvme=str(tmp_path), cpu_budget=budget, state_dtype=state_dtype),
                     BW)
    assert plan.offload == "nvme" and plan.cpu_budget == budget and plan.generations == 2
    assert f"cpu_budget={budget}" in plan.note
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="nvme",
                               nvme_path=str(tmp_path), cpu_budget=budget,
                               state_dtype=state_dtype)
    off = opt._offload
    try:  # the files are reserved (fallocate) when the optimizer is built
        elems, slot, per_param = (2048, 20, 12) if state_dtype == "fp32" else (1024, 24, 16)
        assert off.chunk_elems == elems
        assert plan.tiers["cpu"] == {"staging pool": off.pool_bytes} == {
            "staging pool": 3 * slot * elems}
        assert sum(plan.tiers["nvme"].values()) == _allocated(tmp_path) == 2 * per_param * n
    finally:
        off.close()


@pytest.mark.parametrize("generations", [2, 1])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_hybrid_plan_is_the_runtimes_whole_chunks_under_its_budget(tmp_path, staged_on_device,
                                                                   state_dtype, generations):
    """offload="hybrid" under a budget of no whole number of chunks: host memory holds the pool
    and as many whole chunks as the rest holds, the drive the others (4 KiB aligned per kind),
    and the overlap steps the drive's chunks during backward, as the runtime lays them out.
    The plan took a quarter of this budget for the pool (the runtime's 6 slots of 64 KiB
    chunks are a sixteenth) and split the rest by bytes: host memory 20% low, the drive 15%
    high (52% with compact state), the overlapped share 0.67 for 0.58. At the default chunk
    and a 32 GB host the split was within a chunk (the overlapped share 0.7242 for 0.7243)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)]).bfloat16()
    n = sum(p.numel() for p in model.parameters())
    budget = (32 << 20) + 12 * 16384 // 2  # half a chunk of fp32 state over 32 MiB
    inp = PlanInput(params=n, gpu_mem=int(10 * n / 0.7), cpu_mem=G, nvme=str(tmp_path),
                    cpu_budget=budget, chunk_bytes=CHUNK_BYTES, state_dtype=state_dtype)
    plan = make_plan(inp, BW)
    if generations == 1:  # a drive with room for one generation and a half
        free = int(0.75 * sum(plan.tiers["nvme"].values()))
        plan = make_plan(dataclasses.replace(inp, nvme_free=free), BW)
    assert plan.offload == "hybrid" and plan.generations == generations
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="hybrid",
                               nvme_path=str(tmp_path), cpu_budget=budget,
                               chunk_bytes=CHUNK_BYTES, state_dtype=state_dtype,
                               nvme_generations=generations)
    off = opt._offload
    try:
        (tier,) = off.tiers
        chunks = len(off.layouts[0].chunks)
        assert 0 < tier.n_ram < chunks
        assert sum(plan.tiers["cpu"].values()) == tier.resident_bytes + off.pool_bytes
        assert plan.tiers["cpu"]["staging pool"] == off.pool_bytes
        assert sum(plan.tiers["nvme"].values()) == _allocated(tmp_path)
        assert plan.overlap_fraction == (1 - tier.n_ram / chunks if generations == 2 else 0)
    finally:
        off.close()


@pytest.mark.parametrize("generations", [2, 1])
def test_offloaded_parameters_hybrid_plan_is_the_runtimes_layout(tmp_path, generations):
    """shard(offload_params="cpu") with AdamW(offload="hybrid"): host shards only, so the slots
    hold the state kinds alone (no master in one generation, where every shard is its own:
    the plan counted one), and the tier, pool and files are the runtime's under the budget."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(16)])
    n = sum(p.numel() for p in model.parameters())
    mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)
    model = tierlift.zero.shard(model, stage=3, offload_params="cpu", mixed_precision=mp,
                                device_params=0)
    budget = 8 << 20
    inp = PlanInput(params=n, gpu_mem=G, cpu_mem=G, nvme=str(tmp_path), cpu_budget=budget,
                    chunk_bytes=CHUNK_BYTES, offload_params="cpu", device_params=0,
                    state_dtype="bf16")
    plan = make_plan(inp, BW)
    if generations == 1:  # a drive with room for one generation and a half
        plan = make_plan(dataclasses.replace(
            inp, nvme_free=int(0.75 * sum(plan.tiers["nvme"].values()))), BW)
    assert plan.offload == "hybrid" and plan.generations == generations
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="hybrid",
                               nvme_path=str(tmp_path), cpu_budget=budget,
                               chunk_bytes=CHUNK_BYTES, state_dtype="bf16",
                               nvme_generations=generations)
    off = opt._offload
    try:
        (tier,) = off.tiers
        assert 0 < tier.n_ram < len(off.layouts[0].chunks)
        shards = {"fp32 param shards": 4 * n, "fp32 grad shards": 4 * n}
        assert plan.tiers["cpu"] == {**shards, "staging pool": off.pool_bytes,
                                     **{k: v for k, v in plan.tiers["cpu"].items()
                                        if k not in shards and k != "staging pool"}}
        state = sum(v for k, v in plan.tiers["cpu"].items()
                    if k not in shards and k != "staging pool")
        assert state == tier.resident_bytes
        assert sum(plan.tiers["nvme"].values()) == _allocated(tmp_path)
    finally:
        off.close()
        tierlift.zero.close(model)
