"""Bandwidths the plan's step time is computed from, measured on this machine: the disk under the
NVMe path through tierlift.io (write then read of a probe file), host memory (a tensor copy),
PCIe (pinned copies, only with a GPU) and the SIMD CPU Adam (elements per second)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class Bandwidths:
    memory_bps: float
    adam_elems_per_s: float
    disk_read_bps: float | None = None
    disk_write_bps: float | None = None
    h2d_bps: float | None = None
    d2h_bps: float | None = None


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def disk_bandwidth(path: str, nbytes: int, *, repeats: int = 2,
                   direct: bool = True) -> tuple[float, float]:
    """(read, write) bytes/s of one nbytes request to a probe file under `path` through
    tierlift.io. direct=True takes the buffer from the engine's 4 KiB-aligned pool, so the I/O
    is O_DIRECT as in the offloaded step; direct=False uses an ordinary (unaligned) tensor,
    which goes through the page cache."""
    from tierlift.io import EngineConfig, IoEngine

    nbytes = -(-nbytes // 4096) * 4096
    free = shutil.disk_usage(path).free
    if free < nbytes:  # refused before writing: a drive filled to the last block helps no one
        raise OSError(errno.ENOSPC, f"the disk probe needs a {nbytes}-byte file under {path!r}, "
                      f"which has {free} bytes free")
    with IoEngine(EngineConfig(pool_bytes=nbytes if direct else 8 << 20)) as eng:
        buf = eng.pool_tensor(nbytes) if direct else _buffer(nbytes + 1)[1:]
        buf.fill_(7)
        fd, probe = tempfile.mkstemp(prefix="tierlift-plan-", dir=path)
        os.close(fd)
        try:
            def write():
                eng.write(buf, probe, 0).wait()
                eng.sync()
            tw = _best(write, repeats)
            tr = _best(lambda: eng.read(buf, probe, 0).wait(), repeats)
        except OSError as err:  # a drive that filled up meanwhile, an I/O error
            raise OSError(err.errno, f"the disk probe ({nbytes} bytes) under {path!r} failed: "
                          f"{err.strerror or err}") from err
        finally:
            eng.forget(probe)
            os.unlink(probe)
    return nbytes / tr, nbytes / tw


def host_memory_available() -> int | None:
    """Bytes of host memory this process can still take: MemAvailable, or less where a cgroup
    limit is lower (a container); None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            room = max(0, int(limit) - used)
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _buffer(nbytes: int, **kwargs) -> torch.Tensor:
    """A probe buffer; a failed allocation is a MemoryError that says how large it was."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, **kwargs)
    except (MemoryError, RuntimeError) as err:  # torch's allocators raise RuntimeError
        where = "GPU" if kwargs.get("device") == "cuda" else "host"
        raise MemoryError(f"could not allocate a {nbytes}-byte bandwidth probe in {where} "
                          f"memory: {str(err).splitlines()[0] if str(err) else err!r}") from err


def _memory_bps(probe_bytes: int) -> float:
    """Host memory bandwidth (read + write) of a copy of `probe_bytes`; both buffers are freed
    on return, before the next probe takes its own."""
    src = _buffer(probe_bytes // 4 * 4).view(torch.float32).fill_(1.0)
    dst = _buffer(src.nbytes).view(torch.float32)
    return 2 * src.nbytes / _best(lambda: dst.copy_(src))


def measure(nvme_path: str | None = None, probe_bytes: int = 256 << 20) -> Bandwidths:
    """Host memory holds two probes of `probe_bytes` at a time (copy source and destination,
    then a pinned buffer and the disk probe's), the GPU one, the disk one probe file."""
    from tierlift import ops

    memory = _memory_bps(probe_bytes)
    n = 1 << 22
    p, g, m, v = (torch.full((n,), 0.5) for _ in range(4))

    def adam():
        ops.adam_step_([p], [g], [m], [v], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, step=1, decoupled=True, amsgrad=False, maximize=False)
    bw = Bandwidths(memory_bps=memory, adam_elems_per_s=n / _best(adam))
    if nvme_path is not None:
        bw.disk_read_bps, bw.disk_write_bps = disk_bandwidth(nvme_path, probe_bytes)
    if torch.cuda.is_available():
        host = _buffer(probe_bytes, pin_memory=True)
        dev = _buffer(probe_bytes, device="cuda")

        def h2d():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        def d2h():
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
        bw.h2d_bps = probe_bytes / _best(h2d)
        bw.d2h_bps = probe_bytes / _best(d2h)
    return bw
