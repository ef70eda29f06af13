"""tierlift.io: the NVMe tier. An asynchronous tensor I/O engine (io_uring with O_DIRECT, or a
pread/pwrite thread pool where io_uring is unavailable) and a checksummed swap store.

    eng = tierlift.io.IoEngine(tierlift.io.EngineConfig(queue_depth=32))
    h = eng.write(tensor, "/nvme/x.bin", 0); h.wait()
    store = tierlift.io.SwapStore("/nvme/swap"); store.put("m.0", t); store.get("m.0")
"""

from tierlift.io.engine import EngineConfig, IoEngine, IoHandle
from tierlift.io.swap_store import ChecksumError, PutHandle, SwapStore

__all__ = [
    "ChecksumError", "EngineConfig", "IoEngine", "IoHandle", "PutHandle", "SwapStore",
]
