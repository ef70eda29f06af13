"""Settings of one activation offload, checked once, and the errors it raises."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from tierlift._paths import absolute

TIERS = ("keep", "ram", "nvme", "recompute")


class BudgetError(RuntimeError):
    """A budget cannot hold what one forward saves. `smallest` is the smallest value of
    `argument` that works for the forward that was measured."""

    def __init__(self, message: str, *, argument: str, smallest: int):
        super().__init__(message)
        self.argument = argument
        self.smallest = smallest


class ActivationsDiscardedError(RuntimeError):
    """backward() reached activations whose forward failed and was abandoned."""


@dataclass(kw_only=True)
class OffloadConfig:
    """cpu_budget: host bytes for saved tensors held in RAM until backward (pinned when a GPU is
    present). nvme_path: a directory; saved tensors that do not fit in cpu_budget go to an
    anonymous file there (never a name on disk, so nothing is left behind, even after a crash).
    io_bytes: host bytes for NVMe write-behind and read-ahead on top of cpu_budget (with
    nvme_path only); it must hold the largest saved tensor. gpu_budget: bytes of saved tensors
    left in place (on their device) before offloading starts. min_bytes: smaller tensors stay
    in place."""

    cpu_budget: int
    nvme_path: str | None = None
    io_bytes: int = 64 << 20
    gpu_budget: int = 0
    min_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("cpu_budget", "io_bytes", "gpu_budget", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
        if self.nvme_path is not None:
            # each forward makes its spill file there, after any os.chdir
            self.nvme_path = absolute(self.nvme_path)
            check_directory(self.nvme_path)
            if self.io_bytes < 4096:
                raise ValueError(f"io_bytes must be >= 4096 with nvme_path, got {self.io_bytes}")


def check_directory(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"nvme_path {path!r} does not exist") from None
    except PermissionError:
        raise PermissionError(f"nvme_path {path!r} cannot be reached (permission denied on a "
                              "parent directory)") from None
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(f"nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path {path!r} is not writable")
