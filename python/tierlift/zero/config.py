"""Typed configuration of tierlift.zero.shard (unknown keys are errors, values are checked)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OFFLOAD_PARAMS = ("none", "cpu", "nvme")
HIERARCHIES = (None, "node")
GRAD_COMMS = (None, "int8", "fp8")


@dataclass(kw_only=True, frozen=True)
class MixedPrecision:
    """Compute in `param_dtype`, keep fp32 master shards, reduce gradients in `reduce_dtype`.

    reduce_dtype=None reduces in param_dtype. The gradient shards (p.grad) are kept in
    `grad_dtype`: fp32 by default; grad_dtype=torch.bfloat16 with a bf16 reduction keeps them
    as reduced (no precision lost for one synced backward per step: the sum already has bf16
    precision), at half the bytes (host memory with offload_params="cpu", and the D2H copy).
    A shard's gradient then differs from its dtype (Tensor.grad_dtype, torch >= 2.10), which
    tierlift.optim's Adam and AdamW take; torch's optimizers do not (a step is refused).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.param_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"MixedPrecision.param_dtype must be float32, bfloat16 or float16, "
                            f"got {self.param_dtype}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"MixedPrecision.reduce_dtype must be float32, bfloat16, float16 or "
                            f"None, got {self.reduce_dtype}")
        if self.grad_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"MixedPrecision.grad_dtype must be float32, bfloat16 or float16, "
                            f"got {self.grad_dtype}")
        if self.grad_dtype != torch.float32 and not hasattr(torch.Tensor, "grad_dtype"):
            raise ValueError(f"MixedPrecision.grad_dtype={self.grad_dtype} needs torch >= 2.10 "
                             f"(Tensor.grad_dtype); this is torch {torch.__version__}")

    @property
    def effective_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype


@dataclass(kw_only=True, frozen=True)
class ShardConfig:
    """Everything shard() was asked for; stored on the model as model._tierlift_zero.config.

    offload_params: "none", "cpu" (stage 3: fp32 shards in host memory, pinned with CUDA) or
    "nvme" (stage 3: fp32 shards in a mapped file under `nvme_path`). gpu_budget: bytes of
    gathered unit weights allowed on the device at once (stage 3, with reshard_after_forward),
    or None for no cap. broadcast_buffers: rank 0's module buffers broadcast before forward, as
    DDP's (zero/buffers.py).
    """

    stage: int
    mixed_precision: MixedPrecision | None = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    min_unit_numel: int | None = None
    offload_params: str = "none"
    gpu_budget: int | None = None
    fp8_all_gather: bool = False
    nvme_path: str | None = None
    hierarchy: str | None = None
    grad_comm: str | None = None
    device_params: int = 0
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision,
                                                               MixedPrecision):
            raise TypeError("mixed_precision must be None or tierlift.zero.MixedPrecision, got "
                            f"{type(self.mixed_precision).__name__}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError("reshard_after_forward must be a bool, got "
                            f"{type(self.reshard_after_forward).__name__}")
        if not isinstance(self.broadcast_buffers, bool):
            raise TypeError("broadcast_buffers must be a bool, got "
                            f"{type(self.broadcast_buffers).__name__}")
        if not isinstance(self.fp8_all_gather, bool):
            raise TypeError("fp8_all_gather must be a bool, got "
                            f"{type(self.fp8_all_gather).__name__}")
        if self.fp8_all_gather and self.stage != 3:
            raise ValueError(f"fp8_all_gather=True needs stage=3 (stages 1/2 keep the weights "
                             f"gathered between steps), got stage={self.stage}")
        if self.min_unit_numel is not None and self.min_unit_numel < 1:
            raise ValueError(f"min_unit_numel must be >= 1, got {self.min_unit_numel}")
        if self.offload_params not in _OFFLOAD_PARAMS:
            raise ValueError(f"offload_params must be one of {_OFFLOAD_PARAMS}, got "
                             f"{self.offload_params!r}")
        if self.offload_params == "nvme" and self.nvme_path is None:
            raise ValueError("offload_params='nvme' needs nvme_path= (a directory on the drive "
                             "that holds the parameter shards)")
        if self.nvme_path is not None and self.offload_params != "nvme":
            raise ValueError(f"nvme_path is only used with offload_params='nvme', got "
                             f"offload_params={self.offload_params!r}")
        if self.fp8_all_gather and self.offload_params != "none":
            raise ValueError("fp8_all_gather=True cannot be combined with offload_params="
                             f"{self.offload_params!r} yet (the FP8 gather quantizes the shard "
                             "on the device); use one or the other")
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"hierarchy must be one of {HIERARCHIES}, got {self.hierarchy!r}")
        if self.grad_comm not in GRAD_COMMS:
            raise ValueError(f"grad_comm must be one of {GRAD_COMMS}, got {self.grad_comm!r}")
        if self.grad_dtype != torch.float32 and self.offload_params == "nvme":
            raise ValueError(f"MixedPrecision.grad_dtype={self.grad_dtype} cannot be combined "
                             "with offload_params='nvme' yet (its gradients' file holds fp32); "
                             "use offload_params='cpu' or grad_dtype=torch.float32")
        if isinstance(self.device_params, bool) or not isinstance(self.device_params, int) \
                or self.device_params < 0:
            raise ValueError(f"device_params must be an int >= 0 (parameters whose shards stay "
                             f"on the device), got {self.device_params!r}")
        if self.device_params and self.offload_params == "none":
            raise ValueError("device_params keeps some shards on the device when the others are "
                             "offloaded: it needs offload_params='cpu' or 'nvme'")
        if self.offload_params != "none" and self.stage != 3:
            raise ValueError(f"offload_params={self.offload_params!r} needs stage=3 (stages 1/2 "
                             f"keep the gathered weights on the device), got stage={self.stage}")
        if self.gpu_budget is not None:
            if isinstance(self.gpu_budget, bool) or not isinstance(self.gpu_budget, int):
                raise TypeError(f"gpu_budget must be an int (bytes) or None, got "
                                f"{self.gpu_budget!r}")
            if self.gpu_budget <= 0:
                raise ValueError(f"gpu_budget must be > 0 bytes, got {self.gpu_budget}")
            if self.stage != 3:
                raise ValueError(f"gpu_budget needs stage=3 (stages 1/2 keep every unit "
                                 f"gathered), got stage={self.stage}")
            if not self.reshard_after_forward:
                raise ValueError("gpu_budget needs reshard_after_forward=True (otherwise every "
                                 "unit stays gathered until backward)")

    @property
    def param_dtype(self) -> torch.dtype | None:
        return None if self.mixed_precision is None else self.mixed_precision.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        mp = self.mixed_precision
        return None if mp is None else mp.effective_reduce_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradient shards the optimizer gets."""
        mp = self.mixed_precision
        return torch.float32 if mp is None else mp.grad_dtype
