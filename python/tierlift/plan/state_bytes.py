"""Bytes per parameter of each kind of training state, as the runtime lays it out, and the
overlapped host tier's layout (tierlift.offload.host_budget's rule).

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
  pipeline pool    6 slots x one chunk of each kind the tiers hold (master, m, v: 576 MiB
                   fp32, 336.75 MiB compact; no master in one generation), as
                   offload.sizing cuts them under the budget (file_layout).
  GPU              the working set, the gathered units at the peak of backward (program
                   order, world 1; counted on CPU by tests/python/test_plan_gaps.py): with w
                   the units' bytes per weight (2 bf16/fp16, 4 fp32) and U the largest unit's
                   parameters, three gathered copies (the unit in backward, the next one
                   prefetched and that prefetch's staged shard, held until it is waited for:
                   3wU), and the unit's gradient as autograd builds it: the parameters'
                   gradients (wU together), held until the last one is made, and concatenated
                   into one buffer of the unit (wU; zeros for the padding): 5wU for weights
                   read once per backward (4.997wU measured for Linear-GELU-Linear blocks,
                   whose biases' gradients are under what is counted; 4wU for a unit of one
                   weight that fills it, whose view's gradient is the unit's). A weight read
                   twice (tied weights, a module called twice) has its two gradients summed
                   out of place, three copies of it at once: 4wU + 2wP for a weight of P
                   elements, 6wU measured where it fills the unit. The landing of a reduced
                   gradient holds 4wU + gU: the prefetch and its staged shard, the gradient,
                   the reduce-scatter output, and its copy in grad_dtype where that differs
                   from the units' dtype (g its bytes, at most 2w), so grad_dtype does not
                   change the bound. The plan counts it, 6w: 12 B per parameter of the
                   largest unit in bf16/fp16, 24 B in fp32 (it was 7w, when each parameter's
                   gradient was scattered into a zeroed buffer of the whole unit and those
                   were summed: 6wU + wP). The largest unit is `unit_share` of the model
                   (1/32: shard()'s default_units threshold;
                   note that default_units leaves blocks smaller than 1/32 of the model in
                   the root unit, gathered as a whole, so deep models need units= or
                   min_unit_numel). On a GPU a gradient copy still in flight to host memory
                   keeps its device buffer (record_stream) past this program order: not
                   counted. Beside it the device units' shards and gradients (6 B with bf16
                   gradients). Activations and workspace are in gpu_reserve as before.
So with compact state and bf16 gradients an offloaded parameter costs 4 + 2 + 3.02 = 9.02 B
of host memory and drive together (one generation), a device one 6 B of GPU memory and 3.02 B
of host memory and drive."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tierlift.offload.device_staging import segment_bytes
from tierlift.offload.host_budget import (
    host_chunk_elems,
    one_generation_bytes,
    spare_chunks,
    staging_bytes,
)
from tierlift.offload.layout import ALIGN_ELEMS, chunk_bytes, state_kinds
from tierlift.offload.sizing import slots_and_chunk
from tierlift.plan.inputs import WEIGHT_BYTES, PlanInput

_CHUNK_ELEMS = (32 << 20) // 4  # the default chunk_bytes, in elements
_GRAD_BYTES = {"fp32": 4.0, "bf16": 2.0}  # a gradient shard's bytes per parameter
_SLOTS = 6  # the default pipeline_slots


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


def file_layout(inp: PlanInput, n: int, budget: int, state: dict[str, float], device: bool,
                offload: str) -> tuple[int, int, int, dict]:
    """offload="nvme" or "hybrid" under cpu_budget=`budget`, as offload.sizing cuts it: (the
    pool, chunk elements, chunks, {state kind's name: its dtypes}) for `n` parameters (one
    tensor, whole 1024s). `state`: the kinds planned (names as state_bytes_per_param gives
    them); `device`: weights on the GPU, whose slots also stage a master, gradients and
    weights."""
    names = _COMPACT_NAMES if inp.state_dtype == "bf16" else _KIND_NAMES
    kinds = {names[k]: {k: d} for k, d in state_kinds(False, inp.state_dtype).items()
             if names[k] in state}
    slot = {k: d for kd in kinds.values() for k, d in kd.items()}
    if device:
        slot = {"master": torch.float32, **slot, "grad": torch.float32, "copy": torch.float32}
    reserved = reserved_elems(inp, n)
    config = SimpleNamespace(offload=offload, cpu_budget=budget, chunk_bytes=inp.chunk_bytes,
                             pipeline_slots=_SLOTS)
    slots, elems = slots_and_chunk(config, slot, reserved)
    return slots * chunk_bytes(slot, elems), elems, -(-reserved // elems), kinds


def streamed_pool_bytes(state_dtype: str = "fp32") -> int:
    """The NVMe pipeline's pool for parameters that are host tensors (offload_params): the
    default slots x one default chunk of each state kind (master included), no GPU staging."""
    return _SLOTS * chunk_bytes(state_kinds(False, state_dtype), _CHUNK_ELEMS)


def working_set_bytes(inp: PlanInput) -> float:
    """GPU bytes of gathered units at the peak of a unit's backward (offload_params): 12 B per
    parameter of the largest unit, 24 B for fp32 units (see the module docstring)."""
    return working_set_per_param(inp) * inp.unit_share * int(inp.params)


def working_set_per_param(inp: PlanInput) -> int:
    """Bytes per parameter of the largest unit at the peak of its backward (offload_params):
    three gathered copies and the bound of its gradient's build (its parameters' gradients and
    the buffer of the unit they are concatenated into; a weight read twice, two more copies of
    its gradient while they are summed: at most the unit), 6 x the units' bytes per weight.
    The landing of the reduced gradient holds no more (4 x, and its copy in grad_dtype)."""
    return 6 * WEIGHT_BYTES[inp.param_dtype]


def shadow_bytes(inp: PlanInput, n: int) -> int:
    """The device shadow of the new weights (AdamW(device_staging=True), overlap=True): every
    parameter in param_dtype, each from a 256-byte boundary (offload.device_staging; numels,
    or `n` as one tensor)."""
    each = WEIGHT_BYTES[inp.param_dtype]
    return sum(segment_bytes(k * each) for k in (inp.numels or (n,)))


def model_bytes(inp: PlanInput, n: int) -> dict[str, float]:
    """The weights and their gradients on the GPU (offload_params="none"), in param_dtype."""
    each = WEIGHT_BYTES[inp.param_dtype]
    return {f"{inp.param_dtype} params": each * n, f"{inp.param_dtype} grads": each * n}


def own_master(inp: PlanInput) -> bool:
    """Whether a weight is its own master where the runtime keeps no second copy (an fp32 one,
    Offloader._uses_master): on the GPU with its state, in the device part, and streamed in
    one generation. A device weight stepped in place on the host, or in two generations,
    keeps an fp32 master in the tiers whatever its dtype."""
    return inp.param_dtype == "fp32"


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

