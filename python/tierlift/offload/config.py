"""OffloadConfig: where an optimizer's state lives and how much host memory it may hold."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

_KINDS = ("none", "cpu", "nvme", "hybrid")
_ALIGN_ELEMS = 1024  # 4 KiB of fp32: the O_DIRECT alignment of every chunk


def check_fraction(fraction) -> None:
    """A device_fraction as OffloadConfig takes it: a number in [0, 1)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"device_fraction must be a float in [0, 1), got {fraction!r}")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"device_fraction must be in [0, 1) (the share of the parameters, by "
                         f"elements, whose state stays beside them), got {fraction!r}")


@dataclass(kw_only=True)
class OffloadConfig:
    """offload: "none" (state next to the parameter), "cpu" (fp32 master, m, v in host memory,
    pinned when CUDA is available), "nvme" (master, m, v in files under `nvme_path`, streamed
    through a pool of `cpu_budget` bytes) or "hybrid" (as many whole chunks of the state in host
    memory as `cpu_budget` holds beside the pipeline's pool, stepped in place without I/O; the
    rest on NVMe as with "nvme"). `nvme_generations`: 2 (a step writes the other copy of each
    chunk, so any failure leaves the state as it was) or 1 (chunks rewritten in place: half the
    disk; a step that fails while rewriting them leaves the optimizer refusing to step until a
    checkpoint is loaded). `durable`: the NVMe state outlives the process (offload="nvme"
    only): a process killed mid-step leaves it at the last step or the next, never a mix, and
    the next optimizer built the same way on the same nvme_path reopens it
    (tierlift.offload.durable). A folder with state files but no manifest is refused, never
    zeroed; durable="fresh" discards whatever state the folder holds and starts a new one (then
    use True again, to reopen it). `chunk_bytes` caps the fp32 bytes per state kind that
    one streamed chunk holds (the budget may lower it). `pipeline_slots`: how many chunks the
    NVMe pipeline holds at most (one stepped, one written back, the rest read ahead), all inside
    `cpu_budget`: more slots read further ahead in smaller chunks (a budget too small for 1 MiB
    per kind and slot gets fewer slots, never fewer than 3). `block_bytes`:
    the largest request the io engine sends the device (1, 2 and 4 MiB measured the same on the
    development VM's virtio disk, whose max_sectors_kb is 4096). `overlap`: step
    each chunk in a background thread as soon as its gradients are ready (see
    tierlift.offload.overlap); with offload="cpu" that keeps two generations of the state, or,
    under a `cpu_budget` that does not hold them, one generation and as many spare chunks as the
    budget does (the chunks stepped ahead; the others wait for step()). `max_grad_norm`: clip
    by the global norm inside step(), exactly as torch.nn.utils.clip_grad_norm_ would just
    before it, without invalidating the overlap when
    no scaling is needed. `skip_nonfinite`: a step whose gradients hold inf/NaN is skipped
    (warned; weights, state and step counts unchanged) instead of stepped as torch steps it,
    NaN into the weights; under a GradScaler such a step is always skipped, as torch does.
    `device_staging` (overlap=True, CUDA parameters): the chunks stepped during backward also
    upload their new weights, on a side stream, into a device shadow of the weights (2 B/param
    of device memory for bf16), and step() publishes them by a device-to-device copy instead of
    rounding and uploading them after backward (tierlift.offload.device_staging). None: on
    from the second step, for each param group with CUDA parameters on one device, where the
    device still has twice the shadow's bytes free after the first step (its forward and
    backward included), so a model that fits without it is never pushed out of memory; True:
    on from the start, refused at construction where a shadow cannot be made or does not fit;
    False: off. `device_fraction` (DeepSpeed ZeRO-Offload++'s "ratio"): the share of the
    parameters, by elements, whose state is not offloaded but kept beside them and stepped by
    the optimizer's own kernel after the offloaded part: whole parameters from the first of the
    first param group on, whose gradients come last in backward (tierlift.offload.device_part;
    docs/offload-device-fraction.md). `overlap_threads` (overlap=True): how
    many of tierlift's CPU threads (TIERLIFT_NUM_THREADS) the chunks stepped ahead use while
    training runs, from the first gradient of a backward until step() waits for them (then
    all of them): None leaves an eighth of them (at least one) to the thread that launches
    a GPU's kernels where the model trains on CUDA (as DeepSpeed's SuperOffload keeps a share
    of the cores from its CPU Adam), and takes all of them on a CPU; an int caps them there."""

    offload: str = "none"
    nvme_path: str | os.PathLike | None = None
    cpu_budget: int | None = None
    chunk_bytes: int = 32 << 20
    queue_depth: int = 32
    pipeline_slots: int = 6
    block_bytes: int = 1 << 20
    overlap: bool = False
    max_grad_norm: float | None = None
    nvme_generations: int = 2
    durable: bool | Literal["fresh"] = False
    skip_nonfinite: bool = False
    device_staging: bool | None = None
    device_fraction: float = 0.0
    overlap_threads: int | None = None

    def __post_init__(self):
        check_fraction(self.device_fraction)
        if self.overlap_threads is not None:
            if isinstance(self.overlap_threads, bool) or not isinstance(self.overlap_threads,
                                                                        int):
                raise TypeError(f"overlap_threads must be None or an int, got "
                                f"{self.overlap_threads!r}")
            if self.overlap_threads < 1:
                raise ValueError(f"overlap_threads must be >= 1, got {self.overlap_threads}")
            if not self.overlap:
                raise ValueError("overlap_threads needs overlap=True (it caps the threads of "
                                 "the chunks stepped during backward)")
        if self.device_fraction and self.offload == "none":
            raise ValueError("device_fraction needs offload='cpu', 'nvme' or 'hybrid' (without "
                             "offload all of the state stays beside the parameters)")
        if self.device_fraction and self.durable:
            raise ValueError("device_fraction cannot be combined with durable=True: a reopen "
                             "finds only the state on NVMe, and the device part's would be lost")
        if not isinstance(self.skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {self.skip_nonfinite!r}")
        if self.device_staging is not None and not isinstance(self.device_staging, bool):
            raise TypeError(f"device_staging must be None, True or False, got "
                            f"{self.device_staging!r}")
        if self.device_staging is True and not self.overlap:
            raise ValueError("device_staging=True needs overlap=True (it stages the weights of "
                             "the chunks stepped during backward)")
        if self.offload not in _KINDS:
            raise ValueError(f"offload must be one of {_KINDS}, got {self.offload!r}")
        if self.offload in ("nvme", "hybrid"):
            if self.nvme_path is None:
                raise ValueError(f"offload={self.offload!r} needs nvme_path (a directory on "
                                 "the drive)")
            if self.offload == "hybrid" and self.cpu_budget is None:
                raise ValueError("offload='hybrid' needs cpu_budget: the host memory its RAM "
                                 "part and the NVMe pipeline may hold")
            path = os.fspath(self.nvme_path)
            if not os.path.isdir(path):
                raise ValueError(f"nvme_path {path!r} is not an existing directory")
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(f"nvme_path {path!r} is not writable")
        elif self.offload == "none" and (self.overlap or self.max_grad_norm is not None):
            raise ValueError("overlap=True and max_grad_norm need offload='cpu', 'nvme' or "
                             "'hybrid' (without offload, clip with torch.nn.utils."
                             "clip_grad_norm_ before step())")
        elif self.offload == "none" and self.skip_nonfinite is True:
            raise ValueError("skip_nonfinite=True needs offload='cpu', 'nvme' or 'hybrid' "
                             "(without offload a step with inf/NaN gradients is stepped, as "
                             "torch's; use GradScaler to skip such steps)")
        elif self.nvme_path is not None:
            raise ValueError(f"nvme_path is only used with offload='nvme' or 'hybrid', not "
                             f"{self.offload!r}")
        if self.cpu_budget is not None:
            if isinstance(self.cpu_budget, bool) or not isinstance(self.cpu_budget, int):
                raise TypeError(f"cpu_budget must be an int (bytes), got {self.cpu_budget!r}")
            if self.cpu_budget <= 0:
                raise ValueError(f"cpu_budget must be > 0 bytes, got {self.cpu_budget}")
        if self.chunk_bytes < 4 * _ALIGN_ELEMS or self.chunk_bytes % (4 * _ALIGN_ELEMS):
            raise ValueError(
                f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.block_bytes < 4096 or self.block_bytes % 4096:
            raise ValueError(
                f"block_bytes must be a positive multiple of 4096, got {self.block_bytes}")
        if isinstance(self.pipeline_slots, bool) or not isinstance(self.pipeline_slots, int):
            raise TypeError(f"pipeline_slots must be an int, got {self.pipeline_slots!r}")
        if not 3 <= self.pipeline_slots <= 64:
            raise ValueError(f"pipeline_slots must be in [3, 64] (read, step, write), got "
                             f"{self.pipeline_slots}")
        if self.nvme_generations not in (1, 2) or isinstance(self.nvme_generations, bool):
            raise ValueError(f"nvme_generations must be 1 or 2, got {self.nvme_generations!r}")
        if self.nvme_generations != 2 and self.offload not in ("nvme", "hybrid"):
            raise ValueError("nvme_generations is only used with offload='nvme' or 'hybrid'")
        if not isinstance(self.durable, bool) and self.durable != "fresh":
            raise ValueError(f"durable must be True, False or 'fresh' (discard the state in "
                             f"nvme_path and start a new one), got {self.durable!r}")
        if self.durable and self.offload != "nvme":
            raise ValueError(f"durable={self.durable!r} needs offload='nvme' (host memory does "
                             f"not outlive the process), got offload={self.offload!r}")
        if not 1 <= self.queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {self.queue_depth}")
