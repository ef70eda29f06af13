"""tierlift: train models larger and faster than your GPUs allow.

    import tierlift
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)   # drop-in torch optimizer

Subpackages: optim (SIMD CPU / fused CUDA Adam), activations (saved activations in pinned RAM
and on NVMe), io (io_uring NVMe engine, SwapStore), gnn (zero-copy feature gathering), lowp
(FP8 training), reference (pure-torch kernels), ops (the torch.ops.tierlift wrappers).
`python -m tierlift info` prints what this build can do.
"""

from tierlift import _extension, activations, checkpoint, gnn, io, lowp, ops, optim, reference, zero
from tierlift._extension import MissingCapabilityError, build_info

__version__ = "0.1.0"
__all__ = [
    "MissingCapabilityError", "activations", "build_info", "checkpoint", "gnn", "io", "lowp",
    "ops", "optim", "reference", "zero", "_extension",
]
