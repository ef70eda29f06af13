"""tierlift.activations: saved activations in pinned RAM and on NVMe during forward, brought
back (read ahead, in reverse order) for backward, bit for bit.

    with tierlift.activations.offload(cpu_budget=8 << 30, nvme_path="/nvme"):
        loss = model(x, y)            # saved tensors >= min_bytes leave the GPU / process heap
    loss.backward()

    tierlift.activations.offload_blocks(model, "auto", cpu_budget=8 << 30, nvme_path="/nvme")
    tierlift.activations.offload_blocks(model, Policy(("nvme",) * 20 + ("ram",) * 3 + ("keep",)),
                                        cpu_budget=...)   # keep / ram / nvme / recompute per block
"""

from tierlift.activations.blocks import BlockOffload, find_blocks, offload_blocks
from tierlift.activations.config import ActivationsDiscardedError, BudgetError, OffloadConfig
from tierlift.activations.context import offload
from tierlift.activations.policy import Policy

__all__ = [
    "ActivationsDiscardedError", "BlockOffload", "BudgetError", "OffloadConfig", "Policy",
    "find_blocks", "offload", "offload_blocks",
]
