"""tierlift.offload: optimizer state in host memory or on NVMe, behind tierlift.optim.Adam/AdamW.

    opt = tierlift.optim.AdamW(model.parameters(), offload="nvme", nvme_path="/nvme0",
                               cpu_budget=2 << 30)
"""

from tierlift.offload.config import OffloadConfig
from tierlift.offload.runner import Offloader

__all__ = ["OffloadConfig", "Offloader"]
