"""Loads the compiled extension tierlift._C once, and says clearly what is missing.

Importing tierlift never fails because the extension (or CUDA, or io_uring) is missing: the
first import warns once, and code that needs the missing piece calls `require(...)`, which raises
an error naming what is missing and how to get it.
"""

from __future__ import annotations

import functools
import warnings

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

_C = None
_load_error: str | None = None

try:
    from tierlift import _C  # noqa: F401  (registers torch.ops.tierlift.*)
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _load_error = str(exc)
    warnings.warn(
        f"tierlift: the compiled extension tierlift._C could not be loaded ({exc}); "
        "CPU kernels fall back to the pure-torch reference where one exists. "
        "Rebuild with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )


class MissingCapabilityError(RuntimeError):
    """A tierlift feature was used that this build or machine does not have."""


def available() -> bool:
    return _C is not None


def has_cuda_kernels() -> bool:
    return _C is not None and bool(_C.with_cuda)


def has_uring() -> bool:
    return _C is not None and bool(_C.with_uring)


@functools.cache
def _messages() -> dict[str, str]:
    return {
        "extension": f"tierlift's compiled extension is not loaded ({_load_error}); rebuild with "
        "`pip install --no-build-isolation -e .`",
        "cuda": "tierlift was built without CUDA kernels (torch without CUDA or no nvcc at build "
        "time); rebuild with TIERLIFT_CUDA=1 on a machine with nvcc",
        "uring": "tierlift was built without io_uring (liburing-dev missing at build time); "
        "`apt-get install liburing-dev` and rebuild",
    }


def require(capability: str) -> None:
    """Raise MissingCapabilityError unless `capability` (extension|cuda|uring) is present."""
    ok = {"extension": available, "cuda": has_cuda_kernels, "uring": has_uring}[capability]()
    if not ok:
        raise MissingCapabilityError(_messages()[capability])


def build_info() -> dict:
    """What this installation can do: for bug reports and `python -m tierlift info`."""

    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension": available(),
        "cuda_kernels": has_cuda_kernels(),
        "io_uring": has_uring(),
        "gpu": torch.cuda.is_available(),
    }
    if _C is not None:
        info["cpu_simd"] = _C.cpu_simd_level()
        info["active_simd"] = _C.active_simd_level()
        info["cpu_threads"] = _C.num_threads()
    else:
        info["load_error"] = _load_error
    return info
