"""The placement rule: keep everything on the GPU when it fits; else the fp32 master, m and v go
to host memory (offload="cpu"); else as much of them as host memory holds stays there and the
rest goes to NVMe (offload="hybrid"; "nvme" when host memory holds only the pipeline's pool).
Bytes per parameter (mixed precision): bf16 weight 2, bf16 gradient 2, fp32 master 4, m 4, v 4;
with compact state (state_dtype="bf16") m 2, v 1 and a 4-byte scale per 256 elements, taken
from the offload tiers' layout at the default chunk size (7.02 B/param of optimizer state
instead of 12). The bf16 weights and gradients always stay on the GPU here: a model whose
weights do not fit there needs tierlift.zero stage 3 (across GPUs, or offload_params="cpu" or
"nvme"), which this planner does not place.
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
master.

offload_params="cpu"|"nvme" (tierlift.zero.shard(model, stage=3, offload_params=...), one
rank) places what that runtime really holds, per parameter, measured (tests/python/test_plan.py
ties these numbers to a sharded model's tensors and files):
  parameter shard  fp32, 4 B: host memory (one arena) with "cpu"; a fallocate'd file on the
                   drive with "nvme" (mapped; ranges dropped from RAM after use: ~0 B of RAM).
                   The first units keep theirs on the GPU (shard(device_params=N)): by
                   default as many as the GPU's room beside the working set holds.
  gradient shard   4 B fp32, or 2 B with MixedPrecision(grad_dtype=bf16) ("cpu" only), held
                   whole from backward until zero_grad(), beside its parameter shard (the
                   gradients file on the drive with "nvme").
  optimizer state  offload="cpu" (overlap=False) steps the host shards in place: m + v only
                   (8 B, or 3.02 B compact); with device shards, a master kind for the
                   whole group (4 B for every shard: the tiers lay each kind out over all of
                   the group's chunks) and the slots staging their gradients and weights. Streamed
                   (offload="hybrid"/"nvme") it keeps a master of every shard in two
                   generations (a failed step restores the shards from it: 12 B or 7.02 B,
                   twice on the drive), and none in one generation, which cannot undo a step
                   anyway: every fp32 shard is its own master there (a device shard is copied
                   down, stepped and copied back). Asked for overlap=True, offload="cpu"
                   streams too: the overlapped host tier above, with a master of every shard;
                   grad and copy staging only for device shards.
  pipeline pool    6 slots x one chunk of master, m, v (576 MiB fp32, 336.75 MiB compact).
  GPU              the working set, the gathered bf16 units: per unit of U parameters (world
                   1), backward holds its bf16 weights (2U), the previous unit's prefetch (2U),
                   the bf16 gradient (2U), the reduce-scatter output (2U) and its fp32 copy
                   before the D2H (4U): 12 B x the largest unit, which is `unit_share` of the
                   model (1/32: shard()'s default_units threshold; note that default_units
                   leaves blocks smaller than 1/32 of the model in the root unit, gathered as a
                   whole, so deep models need units= or min_unit_numel). Beside it the device
                   units' shards and gradients (6 B with bf16 gradients). Activations and
                   workspace are in gpu_reserve as before.
So with compact state and bf16 gradients an offloaded parameter costs 4 + 2 + 3.02 = 9.02 B
of host memory and drive together (one generation), a device one 6 B of GPU memory and 3.02 B
of host memory and drive."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

from tierlift.offload.config import check_fraction
from tierlift.offload.host_budget import (
    host_chunk_elems,
    one_generation_bytes,
    spare_chunks,
    staging_bytes,
)
from tierlift.offload.layout import ALIGN_ELEMS, chunk_bytes, state_kinds
from tierlift.plan.measure import Bandwidths

_PCIE_ASSUMED = 25e9  # PCIe 4.0 x16, used when no GPU is here to measure
# The NVMe pipeline's pool with the default chunk_bytes and pipeline_slots (6 slots x 32 MiB x
# master, m, v, grad and copy staging); a hybrid budget gives it at most a quarter.
POOL_BYTES = 6 * (32 << 20) * 5
_CHUNK_ELEMS = (32 << 20) // 4  # the default chunk_bytes, in elements
_STATE_DTYPES = ("fp32", "bf16")
_OFFLOAD_PARAMS = ("none", "cpu", "nvme")
_GRAD_BYTES = {"fp32": 4.0, "bf16": 2.0}  # a gradient shard's bytes per parameter
_SLOTS = 6  # the default pipeline_slots
# The largest ZeRO unit's share of the parameters (default_units makes a unit of each child
# holding at least 1/32 of the model).
UNIT_SHARE = 1 / 32
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SI_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # KB, MB, GB, TB
# The largest parameter count planned: params is a float, exact as an integer up to 2**53,
# and every byte count and time derived from it stays a finite float.
MAX_PARAMS = 2**53


def parse_bytes(text: str, what: str) -> int:
    """80G, 80GiB: 80 x 2**30 bytes; 80GB: 80 x 10**9, as the plan prints GB (GB/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]?)(i?B)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{what} must be a size like 80G, 512M or 1e9, got {text!r}")
    unit = m.group(2).upper()
    decimal = unit and (m.group(3) or "").upper() == "B"
    value = float(m.group(1)) * (_SI_UNITS if decimal else _UNITS)[unit]
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite size, got {text!r}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {text!r}")
    return int(value)


@dataclass(kw_only=True)
class PlanInput:
    params: float
    gpu_mem: int
    cpu_mem: int
    nvme: str | None = None
    cpu_budget: int | None = None
    nvme_free: int | None = None  # bytes free under `nvme` (checked when the state goes there)
    gpu_reserve: float = 0.3  # share of GPU memory kept for activations and workspace
    pool_bytes: int = POOL_BYTES  # the NVMe pipeline's pool (smaller with a smaller chunk_bytes)
    state_dtype: str = "fp32"  # "bf16": compact optimizer state (tierlift.optim state_dtype)
    # tierlift.zero.shard(stage=3, offload_params=...): where the fp32 parameter shards and
    # their gradients live ("none": bf16 weights and gradients on the GPU, as before).
    offload_params: str = "none"
    unit_share: float = UNIT_SHARE  # the largest ZeRO unit's share (offload_params only)
    # offload_params only: the gradient shards' dtype (MixedPrecision(grad_dtype=...)), and
    # shard(device_params=...): how many parameters keep their shards on the GPU (None: as
    # many as its room beside the working set holds).
    grad_dtype: str = "fp32"
    device_params: int | None = None
    # offload="cpu" with overlap=True (the overlapped host tier) or False (in place); None: True
    # for bf16 weights on the GPU, False with offload_params (see the module docstring).
    overlap: bool | None = None
    chunk_bytes: int = 32 << 20  # the optimizer's chunk_bytes (sizes the overlapped host tier)
    # AdamW(device_fraction=...): the share of the parameters whose state stays on the GPU
    # beside them (offload/device_part.py); the plan counts it there, at most this share.
    device_fraction: float = 0.0
    # The parameter tensors' element counts ([p.numel() for p in model.parameters()]): the
    # offload tiers lay each out from a 1024-element boundary, which a model of many small
    # tensors pays for (None: `params` taken as one tensor, whole 1024s).
    numels: tuple[int, ...] | None = None
    # Host memory the saved activations take (tierlift.activations' RAM tier, --act-cpu-budget):
    # without a cpu_budget the state gets the rest of the 80% of cpu_mem the plan uses.
    act_cpu_budget: int = 0

    def __post_init__(self):
        check_fraction(self.device_fraction)
        if self.numels is not None:
            self.numels = tuple(self.numels)
            if not all(type(k) is int and k >= 0 for k in self.numels):
                raise ValueError("numels must be the parameter tensors' element counts, "
                                 "integers >= 0")
            if sum(self.numels) != self.params:
                raise ValueError(f"numels add up to {sum(self.numels)} elements, not params "
                                 f"({self.params:.17g})")
            if self.offload_params != "none" or self.device_fraction:
                raise ValueError("numels is planned with the bf16 weights on the GPU "
                                 "(offload_params='none', device_fraction=0)")
        if self.device_fraction and self.offload_params != "none":
            raise ValueError("device_fraction is planned with the bf16 weights on the GPU "
                             "(offload_params='none')")
        if self.overlap not in (None, True, False):
            raise ValueError(f"overlap must be True, False or None, got {self.overlap!r}")
        if (isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int)
                or self.chunk_bytes <= 0 or self.chunk_bytes % (4 * ALIGN_ELEMS)):
            raise ValueError(f"chunk_bytes must be a positive multiple of {4 * ALIGN_ELEMS}, "
                             f"got {self.chunk_bytes!r}")
        if self.offload_params not in _OFFLOAD_PARAMS:
            raise ValueError(f"offload_params must be one of {_OFFLOAD_PARAMS}, got "
                             f"{self.offload_params!r}")
        if self.grad_dtype not in _STATE_DTYPES:
            raise ValueError(f"grad_dtype must be one of {_STATE_DTYPES}, got "
                             f"{self.grad_dtype!r}")
        if self.grad_dtype == "bf16" and self.offload_params == "nvme":
            raise ValueError("grad_dtype='bf16' cannot be combined with offload_params='nvme' "
                             "(its gradients' file holds fp32)")
        if self.device_params is not None and self.device_params < 0:
            raise ValueError(f"device_params must be >= 0, got {self.device_params}")
        if not 0 < self.unit_share <= 1:
            raise ValueError(f"unit_share must be in (0, 1], got {self.unit_share}")
        if self.state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {_STATE_DTYPES}, got "
                             f"{self.state_dtype!r}")
        if not (math.isfinite(self.params) and self.params > 0):
            raise ValueError(f"params must be a finite number > 0, got {self.params}")
        if self.params > MAX_PARAMS:
            raise ValueError(f"params must be at most 2**53 ({MAX_PARAMS:.4g}), got "
                             f"{self.params:.4g}")
        if self.cpu_budget is not None and self.cpu_budget > self.cpu_mem:
            raise ValueError(f"cpu_budget ({self.cpu_budget} bytes) is more than cpu_mem "
                             f"({self.cpu_mem} bytes), the host memory it is a part of")
        if self.act_cpu_budget < 0:
            raise ValueError(f"act_cpu_budget must be >= 0, got {self.act_cpu_budget}")
        if self.act_cpu_budget > self.cpu_mem - (self.cpu_budget or 0):
            raise ValueError(f"act_cpu_budget ({self.act_cpu_budget} bytes) and cpu_budget "
                             f"({self.cpu_budget or 0} bytes) are more than cpu_mem "
                             f"({self.cpu_mem} bytes), the host memory both are a part of")
        if not 0 <= self.gpu_reserve < 1:
            raise ValueError(f"gpu_reserve must be in [0, 1), got {self.gpu_reserve}")


@dataclass(kw_only=True)
class HostTier:
    """The overlapped host tier a plan recommends (offload="cpu", overlap=True), in the bytes
    tiers.MemoryTier and the staging slots allocate."""

    chunk_elems: int
    chunks: int
    block_bytes: int  # one chunk of every state kind (a spare block is one)
    staging_bytes: int  # the slots: the pool the optimizer reports as pool_bytes
    spare: int | None  # spare blocks beside one generation; None: two generations

    @property
    def generations(self) -> int:
        return 2 if self.spare is None else 1

    @property
    def state_bytes(self) -> int:
        """What the tier holds: its generations, or one and the spare blocks."""
        blocks = 2 * self.chunks if self.spare is None else self.chunks + self.spare
        return blocks * self.block_bytes

    @property
    def fraction(self) -> float:
        """The share of the chunks the overlap can step during backward."""
        return 1.0 if self.spare is None else self.spare / self.chunks


@dataclass(kw_only=True)
class Plan:
    offload: str
    tiers: dict = field(default_factory=dict)  # tier -> {state kind: bytes}
    legs_s: dict = field(default_factory=dict)  # leg -> seconds per step
    note: str = ""
    generations: int | None = None  # of the NVMe part
    device_params: int | None = None  # offload_params: parameters whose shards stay on the GPU
    overlap: bool | None = None  # offload="cpu": whether the plan steps during backward
    cpu_budget: int | None = None  # the optimizer's cpu_budget to give (None: none needed)
    host: HostTier | None = None  # the overlapped host tier
    # The share of the chunks stepped during backward (pipelined); None: the NVMe tiers'
    # bound, the maximum of the legs.
    overlap_fraction: float | None = None
    # Legs that only those chunks have (a hybrid's NVMe reads and writes: its chunks in host
    # memory do no I/O), whole where those chunks are stepped; the others scale with the share.
    own_legs: tuple[str, ...] = ()

    @property
    def serial_s(self) -> float:
        return sum(self.legs_s.values())

    def _fraction(self) -> float:
        return 1.0 if self.overlap_fraction is None else self.overlap_fraction

    @property
    def during_backward_s(self) -> float:
        """The overlapped chunks' legs, pipelined beside each other during backward."""
        f = self._fraction()
        if f == 0:
            return 0.0
        return max((s if leg in self.own_legs else f * s for leg, s in self.legs_s.items()),
                   default=0.0)

    @property
    def after_backward_s(self) -> float:
        """The other chunks' legs, one after another in step() after backward."""
        f = self._fraction()
        return sum((s if f == 0 else 0.0) if leg in self.own_legs else (1 - f) * s
                   for leg, s in self.legs_s.items())

    @property
    def pipelined_s(self) -> float:
        return self.during_backward_s + self.after_backward_s


# The tier tables' name of each state kind.
_KIND_NAMES = {"master": "fp32 master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_COMPACT_NAMES = {**_KIND_NAMES, "exp_avg": "exp_avg (bf16)", "exp_avg_sq": "exp_avg_sq (8-bit)",
                  "exp_avg_sq_scale": "exp_avg_sq scales"}


def state_bytes_per_param(state_dtype: str = "fp32", master: bool = True,
                          chunk_elems: int | None = None) -> dict[str, float]:
    """Bytes per parameter of each optimizer state kind (fp32 master included unless `master`
    is False: offload="cpu" steps an fp32 host shard in place), as the offload tiers lay them
    out in chunks of the default size (each kind of a chunk 4 KiB aligned), or per element of
    a host tier's chunks of `chunk_elems` (not aligned, as tiers.MemoryTier holds them)."""
    kinds = state_kinds(False, state_dtype)
    if not master:
        kinds.pop("master")
    names = _COMPACT_NAMES if state_dtype == "bf16" else _KIND_NAMES
    if chunk_elems is not None:
        return {names[k]: chunk_bytes({k: d}, chunk_elems, aligned=False) / chunk_elems
                for k, d in kinds.items()}
    return {names[k]: chunk_bytes({k: d}, _CHUNK_ELEMS) / _CHUNK_ELEMS for k, d in kinds.items()}


def param_bytes_per_param(offload_params: str, grad_dtype: str = "fp32"
                          ) -> dict[str, dict[str, float]]:
    """{tier: {kind: bytes per parameter}} of the ZeRO-3 parameter and gradient shards that
    shard(stage=3, offload_params=...) keeps off the GPU (fp32 shards; gradients in
    `grad_dtype`, held whole until zero_grad()); "gpu": those of the units it keeps there
    (device_params)."""
    grad = _GRAD_BYTES[grad_dtype]
    on_gpu = {"fp32 param shards (device_params)": 4.0,
              f"{grad_dtype} grad shards (device_params)": grad}
    if offload_params == "cpu":
        return {"cpu": {"fp32 param shards": 4.0, f"{grad_dtype} grad shards": grad},
                "gpu": on_gpu}
    if offload_params == "nvme":
        return {"nvme": {"fp32 param shards (file)": 4.0, "fp32 grad shards (file)": 4.0},
                "gpu": on_gpu}
    raise ValueError(f"offload_params must be 'cpu' or 'nvme' here, got {offload_params!r}")


def streamed_pool_bytes(state_dtype: str = "fp32") -> int:
    """The NVMe pipeline's pool for parameters that are host tensors (offload_params): the
    default slots x one default chunk of each state kind (master included), no GPU staging."""
    return _SLOTS * chunk_bytes(state_kinds(False, state_dtype), _CHUNK_ELEMS)


def working_set_bytes(inp: PlanInput) -> float:
    """GPU bytes of gathered units at the peak of a unit's backward (offload_params): 12 B per
    parameter of the largest unit (see the module docstring)."""
    return 12 * inp.unit_share * int(inp.params)


def host_room(inp: PlanInput) -> int:
    """The host memory the training state may take: 80% of cpu_mem (the rest for the system
    and the data pipeline) less the saved activations' RAM tier."""
    return max(0, int(inp.cpu_mem * 0.8) - inp.act_cpu_budget)


def reserved_elems(inp: PlanInput, n: int) -> int:
    """Elements the offload tiers reserve for `n` parameters: each tensor from a
    1024-element boundary (inp.numels; without them, one tensor)."""
    if inp.numels is None:
        return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS
    return sum(-(-max(k, 1) // ALIGN_ELEMS) * ALIGN_ELEMS for k in inp.numels)


def _host_layout(inp: PlanInput, n: int, device: bool) -> tuple[int, int, int, int, int]:
    """(chunk elements, chunks, bytes of one chunk of every kind, staging with two generations,
    staging with one) of the overlapped host tier of `n` parameters (one group, whole 1024s);
    `device`: the parameters are on the GPU (their gradients and weights are staged)."""
    kinds = state_kinds(False, inp.state_dtype)
    reserved = reserved_elems(inp, n)
    elems = host_chunk_elems(inp.chunk_bytes, reserved)
    stage = dict.fromkeys(("grad", "copy"), torch.float32) if device else {}
    slot = {**kinds, **stage}
    two, one = (staging_bytes(_SLOTS, k, slot, elems) for k in (slot, stage))
    return elems, -(-reserved // elems), chunk_bytes(kinds, elems, aligned=False), two, one


def in_place_staging_bytes(inp: PlanInput, n: int, device: bool) -> int:
    """The pinned staging of offload="cpu" without overlap (the state stepped in place): the
    slots x one chunk of fp32 grad and copy for device parameters, none for host ones
    (tierlift.offload.host_budget; the chunk as the overlapped host tier cuts it)."""
    return _host_layout(inp, n, device)[4]


def host_tier(inp: PlanInput, n: int, device: bool, room: int) -> HostTier | None:
    """The overlapped host tier of `n` parameters in `room` bytes (tierlift.offload.host_budget,
    as runner.Offloader sizes it; `device` as in _host_layout). None: `room` holds less than
    one generation and the staging of device gradients and weights."""
    elems, chunks, block, staging_two, staging_one = _host_layout(inp, n, device)
    room = int(room)  # whole bytes (shard bytes per parameter are floats): a budget to give
    spare = spare_chunks([block], [chunks], room, staging_two, staging_one)
    if spare is None:
        return HostTier(chunk_elems=elems, chunks=chunks, block_bytes=block,
                        staging_bytes=staging_two, spare=None)
    if one_generation_bytes([block], [chunks]) + staging_one > room:
        return None
    return HostTier(chunk_elems=elems, chunks=chunks, block_bytes=block,
                    staging_bytes=staging_one, spare=spare[0])


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
        return _make_plan(inp, bw)
    except ValueError as err:
        why = (f"host memory for the state is 80% of cpu_mem less the activations' "
               f"{_fmt(inp.act_cpu_budget)} (act_cpu_budget)")
        if not inp.act_cpu_budget or inp.cpu_budget is not None or why in str(err):
            raise
        raise ValueError(f"{err}; {why}") from None


def _make_plan(inp: PlanInput, bw: Bandwidths) -> Plan:
    if inp.offload_params != "none":
        return _params_offloaded(inp, bw)
    n = int(inp.params)
    model = {"bf16 params": 2 * n, "bf16 grads": 2 * n}
    state = {k: b * n for k, b in state_bytes_per_param(inp.state_dtype).items()}
    if inp.device_fraction and sum(model.values()) + sum(state.values()) > inp.gpu_mem * (
            1 - inp.gpu_reserve):
        return _device_part_plan(inp, bw, n, model)
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    cpu_room = inp.cpu_budget if inp.cpu_budget is not None else host_room(inp)
    if sum(model.values()) > gpu_room:
        raise ValueError(
            f"the bf16 parameters and gradients ({_fmt(sum(model.values()))}) do not fit in "
            f"{_fmt(gpu_room)} of GPU memory (short by {_fmt(sum(model.values()) - gpu_room)}); "
            "use more GPUs with tierlift.zero stage 3, or its parameter offload "
            "(offload_params='cpu' or 'nvme'), which this planner does not place")
    if sum(model.values()) + sum(state.values()) <= gpu_room:
        return Plan(offload="none", tiers={"gpu": {**model, **state}},
                    legs_s={"gpu adam": (4 + sum(state.values()) / n) * n / (3e12)},
                    note="everything fits on the GPU" + _dtype_note(inp))
    if inp.numels is not None:  # offloaded: the tiers' whole chunks of the padded tensors
        elems, chunks = _host_layout(inp, n, device=True)[:2]
        state = {k: b * elems * chunks for k, b in state_bytes_per_param(
            inp.state_dtype, chunk_elems=elems).items()}
    pcie_h2d = bw.h2d_bps or _PCIE_ASSUMED
    pcie_d2h = bw.d2h_bps or _PCIE_ASSUMED
    legs = {"d2h grads": 2 * n / pcie_d2h, "cpu adam": n / bw.adam_elems_per_s,
            "h2d params": 2 * n / pcie_h2d}
    host = None
    if inp.overlap is not False:
        host = host_tier(inp, n, device=True, room=cpu_room)
        if host is not None and host.spare != 0:
            plan = _host_tier_plan(inp, host, legs, {}, "optimizer state in pinned host memory")
            plan.tiers = {"gpu": model, **plan.tiers}
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
    return _on_nvme(inp, bw, n, model, state, cpu_room, legs)


def _device_part_plan(inp: PlanInput, bw: Bandwidths, n: int, model: dict) -> Plan:
    """AdamW(device_fraction=f): at most f of the parameters (whole ones, the first) keep
    their state (fp32 master, m, v of bf16 weights: 12 B/param; compact: as many bytes as
    state_dtype's) on the GPU; the rest is planned as offloaded state of n - f n parameters.
    Both sides are bounds: the device part holds at most f n, the offloaded one at most n."""
    dev = int(inp.device_fraction * n)
    per = state_bytes_per_param(inp.state_dtype)
    part = {f"device part {k}": b * dev for k, b in per.items()}
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    if sum(model.values()) + sum(part.values()) > gpu_room:
        raise ValueError(
            f"device_fraction={inp.device_fraction:g}: its state ({_fmt(sum(part.values()))}) "
            f"beside the bf16 parameters and gradients ({_fmt(sum(model.values()))}) does not "
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
             one_gen: bool = False) -> Plan:
    """offload="hybrid": the pipeline's pool, as many whole chunks of state in host memory as
    the rest of the budget holds, the remainder on NVMe, in two generations when the drive has
    room for them and in one (rewritten in place) when it has room only for that. `shards`:
    {tier: {kind: bytes}} of offloaded parameter shards, listed first in their tiers;
    inp.nvme_free is then what the drive has beside them (`beside` says so in a refusal)."""
    shards = shards or {}
    total = sum(state.values())
    pool = min(inp.pool_bytes, cpu_room // 4)
    ram = max(0, min(total, cpu_room - pool))
    if ram < total / 100:  # not worth a RAM part: the whole budget is the pipeline's pool
        pool, ram = cpu_room, 0
    disk = total - ram
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
        tiers["cpu"].update({k: v - share[k] for k, v in state.items()})
        offload = "hybrid"
        note = (f"optimizer state {ram / total:.0%} in host memory, {disk / total:.0%} on NVMe "
                f"under {inp.nvme} (offload='hybrid', cpu_budget={int(cpu_room)}, "
                f"nvme_generations={gens})")
    else:
        offload = "nvme"
        note = f"optimizer state on NVMe under {inp.nvme} (nvme_generations={gens})"
    note += _dtype_note(inp)
    plan = Plan(offload=offload, tiers=tiers, legs_s=legs, note=note, generations=gens,
                cpu_budget=int(cpu_room) if offload == "hybrid" else None)
    if ram:  # only two-generation NVMe chunks are stepped during backward (tiers.speculates)
        plan.overlap_fraction = disk / total if gens == 2 else 0.0
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
            f"the working set of gathered units ({_fmt(work)}: 12 B per parameter of the "
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
    # An offloaded unit is gathered twice a step (forward, and again in backward): 2 x 2 B of
    # bf16 up; a device unit's new fp32 weights go up once (4 B). Every gradient comes down.
    legs = {"d2h grads": _GRAD_BYTES[inp.grad_dtype] * n / pcie_d2h,
            "cpu adam": n / bw.adam_elems_per_s, "h2d params": 4 * n / pcie_h2d}
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
    pool = inp.pool_bytes if inp.pool_bytes != POOL_BYTES else streamed_pool_bytes(
        inp.state_dtype)
    sub = dataclasses.replace(inp, pool_bytes=pool, nvme_free=None if inp.nvme_free is None
                              else inp.nvme_free - on_disk)
    beside = (f" beside the {_fmt(on_disk)} of fp32 parameter and gradient shards"
              if on_disk else "")
    try:  # two generations keep a master of every shard, to restore it after a failed step
        plan = _on_nvme(sub, bw, n, gpu, _state(inp, n, masters=n), opt_room, dict(legs),
                        shards=shards, beside=beside)
    except ValueError:
        plan = None
    if plan is None or plan.generations == 1:  # one generation: every shard is its own master
        plan = _on_nvme(sub, bw, n, gpu, _state(inp, n, masters=0), opt_room, legs,
                        shards=shards, beside=beside, one_gen=True)
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
    return "; compact state (state_dtype='bf16')" if inp.state_dtype == "bf16" else ""


def max_params(inp: PlanInput, bw: Bandwidths) -> tuple[int, Plan]:
    """The largest parameter count (and its plan) that fits these budgets, by bisection:
    whatever fits a tier, a smaller model fits too."""
    if inp.numels is not None:  # a larger model's tensors are not known
        raise ValueError("max_params plans a parameter count; give numels=None")

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


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def render(plan: Plan, bw: Bandwidths) -> str:
    lines = [f"offload={plan.offload!r}: {plan.note}", "",
             f"tier   {'state':30} bytes"]
    for tier, kinds in plan.tiers.items():
        for kind, nbytes in kinds.items():
            lines.append(f"{tier:6} {kind:30} {_fmt(nbytes)}")
    lines += ["", "measured: " + ", ".join(
        f"{k}={v / 1e9:.2f} GB/s" if k.endswith("bps") else f"{k}={v / 1e9:.2f} G/s"
        for k, v in vars(bw).items() if v is not None)]
    if bw.h2d_bps is None:
        lines.append(f"(no GPU here: PCIe assumed {_PCIE_ASSUMED / 1e9:.0f} GB/s each way)")
    lines += ["", "leg              s/step"]
    lines += [f"{leg:16} {s:.3f}" for leg, s in plan.legs_s.items()]
    lines.append(_step_line(plan))
    return "\n".join(lines)


def _step_line(plan: Plan) -> str:
    """What the legs add up to, and which of them run during backward."""
    serial = f"optimizer step: {plan.serial_s:.3f} s serial"
    if plan.overlap is False:
        return f"{serial} (overlap=False: every chunk is stepped in step(), after backward)"
    host = plan.host
    if host is not None and host.spare is None:
        return (f"{serial}, {plan.pipelined_s:.3f} s pipelined (overlap=True, two generations: "
                "every chunk can be stepped during backward)")
    if host is not None:
        return (f"{serial}, {plan.pipelined_s:.3f} s with overlap=True: {host.spare} of "
                f"{host.chunks} chunks ({host.fraction:.0%}, the spare blocks) pipelined during "
                f"backward ({plan.during_backward_s:.3f} s), the other "
                f"{host.chunks - host.spare} serial in step() after it "
                f"({plan.after_backward_s:.3f} s)")
    if plan.offload == "hybrid" and plan.overlap_fraction == 0:
        return (f"{serial}, {plan.pipelined_s:.3f} s pipelined (nvme_generations=1: nothing is "
                "stepped during backward; every chunk is rewritten in place in step())")
    if plan.offload == "hybrid":
        f = plan.overlap_fraction
        return (f"{serial}, {plan.pipelined_s:.3f} s with overlap=True: the NVMe part ({f:.0%} "
                f"of the state, two generations) pipelined during backward "
                f"({plan.during_backward_s:.3f} s), the part in host memory ({1 - f:.0%}, one "
                f"generation) stepped in place in step() after it ({plan.after_backward_s:.3f} "
                "s)")
    how = ("overlap=True" if plan.generations != 1 else
           "within step(): chunks kept in one generation cannot overlap backward")
    return f"{serial}, {plan.pipelined_s:.3f} s pipelined ({how})"
