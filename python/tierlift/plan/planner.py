"""The placement rule: keep everything on the GPU when it fits; else the fp32 master, m and v go
to host memory (offload="cpu"); else as much of them as host memory holds stays there and the
rest goes to NVMe (offload="hybrid"; "nvme" when host memory holds only the pipeline's pool).
Bytes per parameter (mixed precision): bf16 weight 2, bf16 gradient 2, fp32 master 4, m 4, v 4;
with compact state (state_dtype="bf16") m 2, v 1 and a 4-byte scale per 256 elements, taken
from the offload tiers' layout at the default chunk size (7.02 B/param of optimizer state
instead of 12). The bf16 weights and gradients stay on the GPU here (offload_params="none"): a
model whose weights do not fit there needs tierlift.zero stage 3 across GPUs, or its parameter
offload, which PlanInput(offload_params="cpu"|"nvme") plans (_params_offloaded, one rank).
Other weights (param_dtype): fp16 as bf16; fp32
weights and gradients 4 B each, and such a weight is its own master (m and v only) where the
runtime keeps none: with its state on the GPU (or in the device part) and streamed in one
generation (then copied down to be stepped: a D2H leg of 4 B). Stepped in place on the host
or in two generations a device weight keeps an fp32 master in the tiers whatever its dtype
(tierlift.offload.runner.Offloader._uses_master). Gradients come down and new weights go up
in param_dtype.
The NVMe part takes twice its bytes when the drive has room (a step reads one generation and
writes the other, so any failed step is undone), else once (nvme_generations=1: rewritten in
place; docs/offload.md); the plan refuses a drive without room for one generation.
The expected optimizer time per step is the sum of its legs (no overlap) and their maximum
(the pipelined bound that overlap=True aims at). offload="hybrid" steps only its NVMe chunks
(two generations) during backward; its chunks in host memory are one generation, stepped in
place in step() after it, without I/O (tiers.HybridTier): with f the NVMe share, the maximum
of f x the D2H, Adam and H2D legs and the NVMe reads and writes, plus (1 - f) x the sum of
those three; f = 0 (the sum) with nvme_generations=1, which steps nothing during backward.

The overlapped host tier (offload="cpu", overlap=True; PlanInput.overlap, `--overlap`), as the
runtime keeps it (tierlift.offload.host_budget, the rule runner.Offloader follows): the state
laid out in chunks (each parameter tensor from a 1024-element boundary: the planner, knowing
only the count, takes it as whole 1024s in one group), of `chunk_bytes` per kind made even.
Two generations (master, m, v twice, plus the staging pool: 6 slots x one chunk of master, m,
v and, for device parameters, fp32 grad and copy staging) when the host memory given holds
them: every chunk can be stepped during backward. Else one generation, the staging of device
gradients and weights (6 slots x grad and copy) and as many spare chunk blocks (one chunk of
every kind each) as the rest holds; the plan then sizes cpu_budget to exactly that. The
overlap steps ahead, during backward, as many chunks as there are spare blocks (each
speculative step needs a second copy until step() validates it); step() steps the rest in
place after backward. No spare block: overlap=False is planned (overlap=True would step
nothing during backward). Less than one generation and that staging: the state goes to NVMe,
or the plan is refused. Legs: with a fraction f of the chunks stepped during backward,
pipelined_s = f x max(legs) (the overlapped chunks' legs run beside each other) + (1 - f) x
sum(legs) (the rest, serial in step() after backward); f = 1 with two generations (the max,
as before), 0 with overlap=False (the sum). Without overlap the state is stepped in place,
one generation, and the runtime still stages device gradients and weights through its slots
(6 x grad and copy): the plan counts that pool in host memory and in its fit.
overlap=None (the default) plans overlap=True for
the bf16-on-GPU layout and overlap=False with offload_params, where a host shard is its own
master. device_staging=True adds the overlap's device shadow of the new weights to the GPU
(state_bytes.shadow_bytes); device_staging=None, durable=True and non-contiguous weights are
refused (inputs.py): their bytes are not counted.

Bytes per parameter, the offload tiers' layout and the host tier's sizing: state_bytes.py
(the parameters as PlanInput takes them: inputs.py; the printed plan: report.py)."""

from __future__ import annotations

import dataclasses

from tierlift.offload.host_budget import one_generation_bytes
from tierlift.offload.layout import chunk_bytes, state_kinds
from tierlift.plan.inputs import (
    MAX_PARAMS,
    POOL_BYTES,
    UNIT_SHARE,
    WEIGHT_BYTES,
    PlanInput,
    parse_bytes,
)
from tierlift.plan.measure import Bandwidths
from tierlift.plan.report import _PCIE_ASSUMED, Plan, _fmt, render
from tierlift.plan.state_bytes import (
    _COMPACT_NAMES,
    _GRAD_BYTES,
    _KIND_NAMES,
    HostTier,
    _host_layout,
    file_layout,
    host_room,
    host_tier,
    in_place_staging_bytes,
    model_bytes,
    own_master,
    param_bytes_per_param,
    reserved_elems,
    shadow_bytes,
    state_bytes_per_param,
    streamed_pool_bytes,
    working_set_bytes,
    working_set_per_param,
)

_SHADOW = "device staging shadow"  # the GPU tier's kind with device_staging=True
# Importable from here as before the split.
__all__ = ["MAX_PARAMS", "POOL_BYTES", "UNIT_SHARE", "HostTier", "Plan", "PlanInput",
           "host_room", "host_tier", "in_place_staging_bytes", "make_plan", "max_params",
           "param_bytes_per_param", "parse_bytes", "render", "reserved_elems",
           "state_bytes_per_param", "streamed_pool_bytes", "working_set_bytes"]


def _host_tier_plan(inp: PlanInput, host: HostTier, legs: dict, before: dict, what: str
                    ) -> Plan:
    """offload="cpu", overlap=True on `host` (spare blocks, or two generations). `before`:
    {kind: bytes} listed first in host memory (offloaded parameter shards); `what`: the
    note's opening."""
    names = _COMPACT_NAMES if inp.state_dtype == "bf16" else _KIND_NAMES
    kinds = state_kinds(False, inp.state_dtype)
    per_kind = {k: chunk_bytes({k: d}, host.chunk_elems, aligned=False) for k, d in kinds.items()}
    cpu = dict(before)
    if host.spare is None:
        cpu.update({f"{names[k]} (2 gens)": 2 * host.chunks * b for k, b in per_kind.items()})
        budget = inp.cpu_budget  # none needed: without one the runtime keeps two generations
        note = (f"{what} in two generations (offload='cpu', overlap=True: every chunk can be "
                f"stepped during backward)")
    else:
        cpu.update({names[k]: host.chunks * b for k, b in per_kind.items()})
        cpu[f"spare chunks ({host.spare} of {host.chunks})"] = host.spare * host.block_bytes
        budget = host.state_bytes + host.staging_bytes
        rest = host.chunks - host.spare
        note = (f"{what}: one generation plus {host.spare} spare chunks "
                f"({_fmt(host.spare * host.block_bytes)}) of {host.chunks} (offload='cpu', "
                f"overlap=True, cpu_budget={budget}); the overlap steps {host.fraction:.0%} of "
                f"the state during backward, the other {rest} chunks ({1 - host.fraction:.0%}) "
                "are stepped in step() after it")
    cpu["staging pool"] = host.staging_bytes
    return Plan(offload="cpu", tiers={"cpu": cpu}, legs_s=legs, note=note + _dtype_note(inp),
                overlap=True, cpu_budget=budget, host=host, overlap_fraction=host.fraction)


def make_plan(inp: PlanInput, bw: Bandwidths) -> Plan:
    try:
        plan = _make_plan(inp, bw)
    except ValueError as err:
        why = (f"host memory for the state is 80% of cpu_mem less the activations' "
               f"{_fmt(inp.act_cpu_budget)} (act_cpu_budget)")
        if not inp.act_cpu_budget or inp.cpu_budget is not None or why in str(err):
            raise
        raise ValueError(f"{err}; {why}") from None
    if inp.device_staging and _SHADOW not in plan.tiers.get("gpu", {}):
        raise ValueError(f"device_staging=True is planned with the optimizer state in host "
                         f"memory and overlap=True; this plan is offload={plan.offload!r}, "
                         f"overlap={plan.overlap}: give device_staging=False")
    return plan


def _make_plan(inp: PlanInput, bw: Bandwidths) -> Plan:
    if inp.offload_params != "none":
        return _params_offloaded(inp, bw)
    n = int(inp.params)
    model = model_bytes(inp, n)
    dt = inp.param_dtype
    # Offloaded, a device weight keeps an fp32 master in the tiers (in place and in two
    # generations, whatever its dtype); beside it on the GPU an fp32 one is its own.
    state = {k: b * n for k, b in state_bytes_per_param(inp.state_dtype).items()}
    resident = {k: b * n for k, b in state_bytes_per_param(
        inp.state_dtype, master=not own_master(inp)).items()}
    if inp.device_fraction and sum(model.values()) + sum(resident.values()) > inp.gpu_mem * (
            1 - inp.gpu_reserve):
        return _device_part_plan(inp, bw, n, model)
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    cpu_room = inp.cpu_budget if inp.cpu_budget is not None else host_room(inp)
    if sum(model.values()) > gpu_room:
        raise ValueError(
            f"the {dt} parameters and gradients ({_fmt(sum(model.values()))}) do not fit in "
            f"{_fmt(gpu_room)} of GPU memory (short by {_fmt(sum(model.values()) - gpu_room)}); "
            "plan tierlift.zero's parameter offload with offload_params='cpu' or 'nvme' "
            "(--offload-params), or use more GPUs with tierlift.zero stage 3")
    if sum(model.values()) + sum(resident.values()) <= gpu_room:
        touched = 2 * WEIGHT_BYTES[dt] + sum(resident.values()) / n  # weight, grad, state
        return Plan(offload="none", tiers={"gpu": {**model, **resident}},
                    legs_s={"gpu adam": touched * n / (3e12)},
                    note="everything fits on the GPU" + _dtype_note(inp))
    if inp.numels is not None:  # offloaded: the tiers' whole chunks of the padded tensors
        elems, chunks = _host_layout(inp, n, device=True)[:2]
        state = {k: b * elems * chunks for k, b in state_bytes_per_param(
            inp.state_dtype, chunk_elems=elems).items()}
    pcie_h2d = bw.h2d_bps or _PCIE_ASSUMED
    pcie_d2h = bw.d2h_bps or _PCIE_ASSUMED
    # Gradients come down and new weights go up in param_dtype (chunk_step stages both so).
    legs = {"d2h grads": WEIGHT_BYTES[dt] * n / pcie_d2h, "cpu adam": n / bw.adam_elems_per_s,
            "h2d params": WEIGHT_BYTES[dt] * n / pcie_h2d}
    host = None
    if inp.overlap is not False:
        host = host_tier(inp, n, device=True, room=cpu_room)
        if host is not None and host.spare != 0:
            plan = _host_tier_plan(inp, host, legs, {}, "optimizer state in pinned host memory")
            plan.tiers = {"gpu": model, **plan.tiers}
            if inp.device_staging:
                _add_shadow(inp, plan, n, gpu_room)
            return plan
    # In place, the runtime still stages the device gradients and weights through its slots.
    staging = in_place_staging_bytes(inp, n, device=True)
    in_place = {**state, "staging pool": staging}
    if sum(in_place.values()) <= cpu_room and (host is not None or inp.overlap is False):
        why = ("" if host is None else ": one generation and the staging leave no room for a "
               "spare chunk, so overlap=True would step nothing during backward")
        return Plan(offload="cpu", tiers={"gpu": model, "cpu": in_place}, legs_s=legs,
                    note=f"optimizer state in pinned host memory (offload='cpu', overlap=False"
                         f"{why})" + _dtype_note(inp), overlap=False, overlap_fraction=0.0)
    if inp.nvme is None or bw.disk_read_bps is None:
        if inp.overlap is not False and sum(state.values()) <= cpu_room:
            raise ValueError("offload='cpu' with overlap=True needs "
                             f"{_host_tier_short(inp, n, True, cpu_room)}; give --nvme PATH "
                             "for the NVMe tier")
        raise ValueError(
            f"the optimizer state ({_fmt(sum(state.values()))}) and the staging of device "
            f"gradients and weights ({_fmt(staging)}) do not fit in {_fmt(cpu_room)} of host "
            f"memory (short by {_fmt(sum(in_place.values()) - cpu_room)}); give --nvme PATH "
            "for the NVMe tier")
    if inp.numels is not None:  # NVMe chunks are cut otherwise: its bytes would not be these
        raise ValueError("numels plans the host tier's layout only (offload='cpu'); with state "
                         "on NVMe give numels=None (params as one tensor: low for small ones)")
    exact = inp.pool_bytes == POOL_BYTES  # not given: the runtime's slots and chunks
    if not own_master(inp):
        return _on_nvme(inp, bw, n, model, state, cpu_room, legs, exact=exact)
    try:  # two generations keep a master, to put the weights back after a failed step
        plan = _on_nvme(inp, bw, n, model, state, cpu_room, dict(legs), exact=exact)
    except ValueError:
        plan = None
    if plan is None or plan.generations == 1:
        # One generation cannot undo a step: an fp32 weight is its own master, copied down,
        # stepped in a slot and copied back (Offloader._uses_master).
        plan = _on_nvme(inp, bw, n, model, _state(inp, n, masters=0), cpu_room, legs,
                        one_gen=True, exact=exact)
        plan.legs_s["d2h device weights"] = 4 * n / pcie_d2h
        plan.note += "; fp32 weights are their own master"
    return plan


def _add_shadow(inp: PlanInput, plan: Plan, n: int, gpu_room: float) -> None:
    """AdamW(device_staging=True): the device shadow of the new weights beside them, refused
    where the GPU's room does not hold it (the runtime refuses it at construction there)."""
    shadow = shadow_bytes(inp, n)
    gpu = plan.tiers["gpu"]
    if sum(gpu.values()) + shadow > gpu_room:
        raise ValueError(
            f"device_staging=True: its shadow of the new weights ({_fmt(shadow)}) beside the "
            f"{inp.param_dtype} parameters and gradients ({_fmt(sum(gpu.values()))}) does not "
            f"fit in {_fmt(gpu_room)} of GPU memory (short by "
            f"{_fmt(sum(gpu.values()) + shadow - gpu_room)}); give device_staging=False")
    gpu[_SHADOW] = shadow
    plan.note += "; device_staging=True: the new weights are staged on the GPU during backward"


def _device_part_plan(inp: PlanInput, bw: Bandwidths, n: int, model: dict) -> Plan:
    """AdamW(device_fraction=f): at most f of the parameters (whole ones, the first) keep
    their state (fp32 master, m, v of bf16 or fp16 weights: 12 B/param; m and v only of fp32
    ones, their own master; compact: as many bytes as state_dtype's) on the GPU; the rest is
    planned as offloaded state of n - f n parameters.
    Both sides are bounds: the device part holds at most f n, the offloaded one at most n."""
    dev = int(inp.device_fraction * n)
    per = state_bytes_per_param(inp.state_dtype, master=not own_master(inp))
    part = {f"device part {k}": b * dev for k, b in per.items()}
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    if sum(model.values()) + sum(part.values()) > gpu_room:
        raise ValueError(
            f"device_fraction={inp.device_fraction:g}: its state ({_fmt(sum(part.values()))}) "
            f"beside the {inp.param_dtype} parameters and gradients "
            f"({_fmt(sum(model.values()))}) does not "
            f"fit in {_fmt(gpu_room)} of GPU memory (short by "
            f"{_fmt(sum(model.values()) + sum(part.values()) - gpu_room)}); lower it")
    # the GPU room left to the rest: gpu_room less the device part
    left = int(inp.gpu_mem - sum(part.values()) / (1 - inp.gpu_reserve))
    rest = dataclasses.replace(inp, device_fraction=0.0, gpu_mem=left)
    plan = make_plan(rest, bw)  # the offloaded part, as if the whole model were offloaded
    plan.tiers["gpu"] = {**plan.tiers.get("gpu", {}), **part}
    plan.note += (f"; device_fraction={inp.device_fraction:g}: the state of at most {dev} "
                  f"parameters ({_fmt(sum(part.values()))}) stays on the GPU")
    return plan


def _on_nvme(inp, bw, n, model, state, cpu_room, legs, shards=None, beside="",
             one_gen: bool = False, device: bool = True, exact: bool = False) -> Plan:
    """offload="hybrid": the pipeline's pool, as many whole chunks of state in host memory as
    the rest of the budget holds, the others on NVMe (each kind 4 KiB aligned), in two
    generations when the drive has room for them and in one (rewritten in place) when it has
    room only for that; slots and chunks as offload.sizing cuts them under the budget (with
    `exact`; else, a pool given, inp.pool_bytes and the state split by bytes). Where host
    memory would hold under 1% of it: offload="nvme" under the same cpu_budget. `shards`:
    {tier: {kind: bytes}} of offloaded parameter shards, listed first in their tiers;
    inp.nvme_free is then what the drive has beside them (`beside` says so in a refusal);
    `device`: some weights are on the GPU (their slots stage gradients, weights, a master)."""
    shards = shards or {}
    total = sum(state.values())
    budget = int(cpu_room)
    in_ram = {}
    if exact:  # the runtime's slots and chunks: whole chunks in host memory, the rest in files
        pool, elems, chunks, kinds = file_layout(inp, n, budget, state, device, "hybrid")
        block = {k: chunk_bytes(kd, elems, aligned=False) for k, kd in kinds.items()}
        n_ram = min(chunks, max(0, budget - pool) // sum(block.values()))
        in_ram = {k: n_ram * b for k, b in block.items()}
        ram = sum(in_ram.values())
        share = {k: (chunks - n_ram) * chunk_bytes(kd, elems) for k, kd in kinds.items()}
        total = ram + sum(share.values())
    else:
        pool = min(inp.pool_bytes, cpu_room // 4)
        ram = max(0, min(total, cpu_room - pool))
    if ram < total / 100:  # not worth a RAM part: all of the state on the drive
        pool, elems, chunks, kinds = file_layout(inp, n, budget, state, device, "nvme")
        share = {k: chunks * chunk_bytes(kd, elems) for k, kd in kinds.items()}
        ram, disk, in_ram = 0, sum(share.values()), {}
    else:
        disk = total - ram
        if not exact:
            share = {k: v * disk / total for k, v in state.items()}
    gens = 1 if one_gen else 2
    if inp.nvme_free is not None and gens * disk > inp.nvme_free:
        gens = 1
        if disk > inp.nvme_free:
            raise ValueError(
                f"the optimizer state needs {_fmt(disk)} under {inp.nvme} beyond the "
                f"{_fmt(ram)} host memory holds (one generation of {', '.join(state)}, "
                f"rewritten in place) and the drive has {_fmt(inp.nvme_free)} free{beside} "
                f"(short by {_fmt(disk - inp.nvme_free)}); host memory would be short by "
                f"{_fmt(total - cpu_room)}")
    legs["nvme read"] = disk / bw.disk_read_bps
    legs["nvme write"] = disk / bw.disk_write_bps
    label = "2 gens" if gens == 2 else "1 gen, in place"
    tiers = {"gpu": {**model, **shards.get("gpu", {})},
             "cpu": {**shards.get("cpu", {}), "staging pool": pool},
             "nvme": {**shards.get("nvme", {}),
                      **{f"{k} ({label})": gens * v for k, v in share.items()}}}
    if ram:
        tiers["cpu"].update(in_ram or {k: v - share[k] for k, v in state.items()})
        offload = "hybrid"
        note = (f"optimizer state {ram / total:.0%} in host memory, {disk / total:.0%} on NVMe "
                f"under {inp.nvme} (offload='hybrid', cpu_budget={int(cpu_room)}, "
                f"nvme_generations={gens})")
    else:
        offload = "nvme"
        note = (f"optimizer state on NVMe under {inp.nvme} (offload='nvme', cpu_budget="
                f"{int(cpu_room)}, nvme_generations={gens})")
    note += _dtype_note(inp)
    plan = Plan(offload=offload, tiers=tiers, legs_s=legs, note=note, generations=gens,
                cpu_budget=int(cpu_room))
    if ram:  # only two-generation NVMe chunks are stepped during backward (tiers.speculates)
        plan.overlap_fraction = 0.0 if gens == 1 else (
            1 - n_ram / chunks if exact else disk / total)
        plan.own_legs = ("nvme read", "nvme write")
    return plan


def _params_offloaded(inp: PlanInput, bw: Bandwidths) -> Plan:
    """offload_params="cpu"|"nvme": the first units keep their shards and gradients on the GPU
    (device_params: as many as its room beside the working set holds, unless given), the
    others' go where the runtime puts them. The optimizer state goes to host memory
    (offload="cpu": host shards are their own master, device shards keep one there) when what
    is left of it holds it, else it is split between host memory and the drive: two
    generations with a master of every shard when the drive has room for them, else one
    generation, where every fp32 shard is its own master."""
    n = int(inp.params)
    where = inp.offload_params
    per = param_bytes_per_param(where, inp.grad_dtype)
    work = working_set_bytes(inp)
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    if work > gpu_room:
        raise ValueError(
            f"the working set of gathered units ({_fmt(work)}: "
            f"{working_set_per_param(inp)} B per parameter of the "
            f"largest unit, {inp.unit_share:.3g} of the model) does not fit in {_fmt(gpu_room)} "
            f"of GPU memory (short by {_fmt(work - gpu_room)}); shard into smaller units")
    per_device = sum(per["gpu"].values())
    if inp.device_params is None:
        on_dev = min(n, int((gpu_room - work) // per_device))
    else:
        on_dev = min(n, inp.device_params)
        if work + on_dev * per_device > gpu_room:
            raise ValueError(
                f"device_params={inp.device_params}: their shards and gradients "
                f"({_fmt(on_dev * per_device)}) and the working set ({_fmt(work)}) do not fit "
                f"in {_fmt(gpu_room)} of GPU memory (short by "
                f"{_fmt(work + on_dev * per_device - gpu_room)})")
    off = n - on_dev
    shards = {t: {k: b * (on_dev if t == "gpu" else off) for k, b in kinds.items()}
              for t, kinds in per.items()}
    room = host_room(inp)
    on_host = sum(shards.get("cpu", {}).values())
    if on_host > room:
        raise ValueError(
            f"the fp32 parameter and gradient shards ({_fmt(on_host)}) do not fit in "
            f"{_fmt(room)} of host memory (short by {_fmt(on_host - room)}); use "
            "offload_params='nvme'")
    opt_room = room - on_host
    if inp.cpu_budget is not None:
        opt_room = min(opt_room, inp.cpu_budget)
    on_disk = sum(shards.get("nvme", {}).values())
    if where == "nvme":
        if inp.nvme is None or bw.disk_read_bps is None:
            raise ValueError("offload_params='nvme' needs --nvme PATH (the drive that holds the "
                             "parameter and gradient shards)")
        if inp.nvme_free is not None and on_disk > inp.nvme_free:
            raise ValueError(
                f"the fp32 parameter and gradient shards need {_fmt(on_disk)} under {inp.nvme} "
                f"and the drive has {_fmt(inp.nvme_free)} free (short by "
                f"{_fmt(on_disk - inp.nvme_free)})")
    pcie_h2d = bw.h2d_bps or _PCIE_ASSUMED
    pcie_d2h = bw.d2h_bps or _PCIE_ASSUMED
    # An offloaded unit is gathered twice a step (forward, and again in backward), in
    # param_dtype (converted on the host: ParamOffload.stage_in); a device unit's new fp32
    # weights go up once (4 B). Every gradient comes down.
    gathers = 2 * WEIGHT_BYTES[inp.param_dtype] * off + 4 * on_dev
    legs = {"d2h grads": _GRAD_BYTES[inp.grad_dtype] * n / pcie_d2h,
            "cpu adam": n / bw.adam_elems_per_s, "h2d params": gathers / pcie_h2d}
    if where == "nvme":
        # Two gathers read the fp32 shard (8 B), the step reads the gradient (4 B); the
        # backward writes the gradient and the step the shard (8 B).
        legs["nvme param read"] = 12 * off / bw.disk_read_bps
        legs["nvme param write"] = 8 * off / bw.disk_write_bps
    gpu = {"gathered units (working set)": work,
           **{k: v for k, v in shards.pop("gpu").items() if v}}
    label = (f"parameters offloaded (offload_params={where!r}, device_params={on_dev}: "
             f"{on_dev / n:.0%} of the shards stay on the GPU")
    # The tiers hold a kind for the whole param group: once a device shard needs a master,
    # every shard's chunk has room for one (offload.runner: _tier_kinds).
    state = _state(inp, n, masters=n if on_dev else 0)
    # overlap=True streams the host tier: a master of every shard; device shards staged.
    host = host_tier(inp, n, device=on_dev > 0, room=opt_room) if inp.overlap else None
    if host is not None and host.spare != 0:
        plan = _host_tier_plan(inp, host, legs, shards.get("cpu", {}),
                               f"{label}); optimizer state in host memory with a master of "
                               "every shard")
        plan.tiers = {"gpu": gpu, **plan.tiers, **({"nvme": shards["nvme"]}
                                                   if shards.get("nvme") else {})}
        plan.device_params = on_dev
        return plan
    # In place, device shards' gradients and weights are staged through the slots.
    staging = in_place_staging_bytes(inp, n, device=on_dev > 0)
    in_place = {**state, **({"staging pool": staging} if staging else {})}
    if sum(in_place.values()) <= opt_room:
        tiers = {"gpu": gpu, "cpu": {**shards.get("cpu", {}), **in_place}}
        if shards.get("nvme"):
            tiers["nvme"] = shards["nvme"]
        why = ""
        if inp.overlap and host is not None:
            why = (": one generation and the staging leave no room for a spare chunk, so "
                   "overlap=True would step nothing during backward")
        elif inp.overlap:
            why = f"; overlap=True would need {_host_tier_short(inp, n, on_dev > 0, opt_room)}"
        return Plan(offload="cpu", tiers=tiers, legs_s=legs, device_params=on_dev,
                    note=f"{label}); optimizer state in host memory (offload='cpu', "
                         f"overlap=False: host shards are their own master{why})"
                         + _dtype_note(inp), overlap=False, overlap_fraction=0.0)
    if inp.nvme is None or bw.disk_read_bps is None:
        staged = f" and the staging of device shards ({_fmt(staging)})" if staging else ""
        raise ValueError(
            f"the optimizer state ({_fmt(sum(state.values()))}){staged} does not fit in "
            f"{_fmt(opt_room)} of host memory beside the fp32 parameter and gradient shards "
            f"(short by {_fmt(sum(in_place.values()) - opt_room)}); give --nvme PATH for the "
            "NVMe tier")
    exact = inp.pool_bytes == POOL_BYTES  # not given: the runtime's slots and chunks
    sub = dataclasses.replace(inp, nvme_free=None if inp.nvme_free is None
                              else inp.nvme_free - on_disk)
    beside = (f" beside the {_fmt(on_disk)} of fp32 parameter and gradient shards"
              if on_disk else "")
    try:  # two generations keep a master of every shard, to restore it after a failed step
        plan = _on_nvme(sub, bw, n, gpu, _state(inp, n, masters=n), opt_room, dict(legs),
                        shards=shards, beside=beside, device=on_dev > 0, exact=exact)
    except ValueError:
        plan = None
    if plan is None or plan.generations == 1:  # one generation: every shard is its own master
        plan = _on_nvme(sub, bw, n, gpu, _state(inp, n, masters=0), opt_room, legs,
                        shards=shards, beside=beside, one_gen=True, device=on_dev > 0,
                        exact=exact)
    own = "a master of every shard" if plan.generations == 2 else \
        "every fp32 shard its own master"
    if plan.generations == 1 and on_dev:  # a device shard is stepped through a host copy
        plan.legs_s["d2h device weights"] = 4 * on_dev / pcie_d2h
    plan.note = f"{label}; {own}); " + plan.note
    plan.device_params = on_dev
    return plan


def _state(inp: PlanInput, n: int, masters: int) -> dict[str, float]:
    """Optimizer state bytes per kind: m and v of `n` parameters, fp32 masters of `masters`."""
    per = state_bytes_per_param(inp.state_dtype)
    return {k: b * (masters if k == "fp32 master" else n) for k, b in per.items()
            if k != "fp32 master" or masters}


def _host_tier_short(inp: PlanInput, n: int, device: bool, room: int) -> str:
    """What an overlapped host tier whose one generation and staging exceed `room` needs."""
    _, chunks, block, _, stage = _host_layout(inp, n, device)
    one = one_generation_bytes([block], [chunks])
    return (f"one generation of the optimizer state ({_fmt(one)}) and the staging of device "
            f"gradients and weights ({_fmt(stage)}) in host memory, which has {_fmt(room)} for "
            f"it ({int(room)} bytes; short by {_fmt(one + stage - room)})")


def _dtype_note(inp: PlanInput) -> str:
    note = "; compact state (state_dtype='bf16')" if inp.state_dtype == "bf16" else ""
    if inp.param_dtype != "bf16":
        note += f"; param_dtype={inp.param_dtype!r}"
    return note


def max_params(inp: PlanInput, bw: Bandwidths) -> tuple[int, Plan]:
    """The largest parameter count (and its plan) that fits these budgets, by bisection:
    whatever fits a tier, a smaller model fits too."""
    if inp.numels is not None:  # a larger model's tensors are not known
        raise ValueError("max_params plans a parameter count; give numels=None")
    if inp.device_staging:  # small models fit on the GPU, with no shadow to plan
        raise ValueError("max_params plans device_staging=False; plan device_staging=True for "
                         "a parameter count")

    def fits(n: int) -> Plan | None:
        try:
            return make_plan(dataclasses.replace(inp, params=n), bw)
        except ValueError:
            return None

    if fits(1) is None:
        raise ValueError("not even a one-parameter model fits these budgets")
    lo, hi = 1, 2
    while fits(hi) is not None:
        if hi >= MAX_PARAMS:  # the next count could not be planned: not "the largest" then
            raise ValueError(f"these budgets hold more than 2**53 ({MAX_PARAMS:.4g}) "
                             "parameters, the most the planner counts")
        lo, hi = hi, min(hi * 2, MAX_PARAMS)
    while hi - lo > max(1, lo // 1000):  # 0.1% is as exact as the byte counts are
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not None else (lo, mid)
    return lo, fits(lo)

