"""tierlift: train models larger and faster than your GPUs allow.

    import tierlift
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)   # drop-in torch optimizer

Subpackages: optim (SIMD CPU / fused CUDA Adam), reference (pure-torch kernels), ops (the
torch.ops.tierlift wrappers). `python -m tierlift info` prints what this build can do.
"""

from tierlift import _extension, checkpoint, ops, optim, reference, zero
from tierlift._extension import MissingCapabilityError, build_info

__version__ = "0.1.0"
__all__ = ["MissingCapabilityError", "build_info", "checkpoint", "ops", "optim", "reference",
           "zero", "_extension"]
