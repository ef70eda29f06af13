"""What the planner is asked: PlanInput (a model's size, the machine's memories, how the optimizer
and tierlift.zero will be built) and parse_bytes for the sizes given on the command line."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tierlift.offload.config import check_fraction
from tierlift.offload.layout import ALIGN_ELEMS

# The NVMe pipeline's pool with the default chunk_bytes and pipeline_slots (6 slots x 32 MiB x
# master, m, v, grad and copy staging); a hybrid budget gives it at most a quarter.
POOL_BYTES = 6 * (32 << 20) * 5
_STATE_DTYPES = ("fp32", "bf16")
_OFFLOAD_PARAMS = ("none", "cpu", "nvme")
# The weights' dtype as PlanInput takes it (a name or a torch dtype), and its bytes per value.
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WEIGHT_BYTES = {name: dtype.itemsize for name, dtype in PARAM_DTYPES.items()}
# The largest ZeRO unit's share of the parameters (default_units makes a unit of each child
# holding at least 1/32 of the model).
UNIT_SHARE = 1 / 32
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SI_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # KB, MB, GB, TB
# The largest parameter count planned: params is a float, exact as an integer up to 2**53,
# and every byte count and time derived from it stays a finite float.
MAX_PARAMS = 2**53


# A memory's size given as a bare number below this is taken for a unit left out ("--gpu-mem 80"
# meant 80G, not 80 bytes) and refused rather than planned for.
MIN_BARE_CAPACITY = 1 << 20


def parse_bytes(text: str, what: str, *, capacity: bool = False) -> int:
    """80G, 80GiB: 80 x 2**30 bytes; 80GB: 80 x 10**9, as the plan prints GB (GB/s).
    capacity: `what` is a memory's size, so a bare number under MIN_BARE_CAPACITY is refused."""
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
    if capacity and not unit and not m.group(3) and value < MIN_BARE_CAPACITY:
        raise ValueError(f"{what} {text.strip()} would be {int(value)} bytes: give its unit, "
                         f"e.g. {m.group(1)}G for {m.group(1)} GiB ({m.group(1)}B if bytes are "
                         f"meant)")
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
    # The NVMe pipeline's pool; not given (POOL_BYTES), the runtime's slots and chunks under
    # the budget, and whole chunks in host memory (state_bytes.file_layout).
    pool_bytes: int = POOL_BYTES
    state_dtype: str = "fp32"  # "bf16": compact optimizer state (tierlift.optim state_dtype)
    # The trained weights' dtype ("bf16", "fp16", "fp32" or the torch dtype; taken as its name):
    # their gradients are in it too. An fp32 weight is its own master where the runtime keeps
    # none. With offload_params: the gathered units' dtype (MixedPrecision(param_dtype=...);
    # "fp32": no mixed precision), the shards being fp32 whatever it is.
    param_dtype: str | torch.dtype = "bf16"
    # tierlift.zero.shard(stage=3, offload_params=...): where the fp32 parameter shards and
    # their gradients live ("none": the weights and gradients on the GPU, in param_dtype).
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
    # AdamW(device_staging=...) with overlap=True: True plans the device shadow of the new
    # weights on the GPU (offload="cpu"); None, the runtime's default, is decided from the GPU's
    # free memory after the first step, so it is refused, as are the layouts not planned:
    # AdamW(durable=True) and non-contiguous weights (contiguous=False).
    device_staging: bool | None = False
    durable: bool = False
    contiguous: bool = True

    def __post_init__(self):
        self.param_dtype = _param_dtype_name(self.param_dtype)
        _refuse_unplanned(self)
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


def _param_dtype_name(dtype) -> str:
    """"bf16", "fp16" or "fp32" for a name or a torch dtype; anything else is refused."""
    for name, torch_dtype in PARAM_DTYPES.items():
        if dtype == name or dtype is torch_dtype:
            return name
    raise ValueError(f"param_dtype must be one of {tuple(PARAM_DTYPES)} or torch.bfloat16, "
                     f"torch.float16, torch.float32 (the dtypes tierlift's Adam steps), got "
                     f"{dtype!r}")


def _refuse_unplanned(inp: PlanInput) -> None:
    """Runtime options whose bytes the planner does not count, refused by name."""
    if inp.durable is not False:
        raise ValueError(
            f"durable={inp.durable!r} is not planned: its state folder adds a gradient log (the "
            "gradients' bytes per parameter), a journal of one chunk of every kind per pipeline "
            "slot, records and manifests, and keeps a master of fp32 weights in one generation; "
            "plan durable=False and add those")
    if inp.contiguous is not True:
        raise ValueError(
            "non-contiguous weights (contiguous=False: channels_last, transposed) are not "
            "planned: the offloader keeps an fp32 master of each in its tiers, an fp32 one too, "
            "and steps it through a contiguous copy; plan the model with contiguous weights")
    if inp.device_staging is None:
        raise ValueError(
            "device_staging=None is not planned: the runtime turns the device shadow of "
            "overlap=True's new weights on after the first step where the GPU's free memory "
            "holds twice it; plan device_staging=True (the shadow counted on the GPU) or False")
    if type(inp.device_staging) is not bool:
        raise ValueError(f"device_staging must be True, False or None, got "
                         f"{inp.device_staging!r}")
    if inp.device_staging and (inp.offload_params != "none" or inp.device_fraction
                               or inp.param_dtype == "fp32" or inp.overlap is False):
        # fp32 weights streamed are their own master, which the runtime does not stage
        raise ValueError("device_staging=True is planned for bf16 or fp16 weights on the GPU "
                         "(offload_params='none', device_fraction=0) with overlap=True")
