"""The file-backed tiers' construction (offload="nvme" and "hybrid"): the state folder (a fresh
one, or the durable one claimed or reopened), the io engine whose pool holds the pipeline's
slots, and one tier per param group. A failure here leaves nothing behind: a new folder is
removed, a reopened one is given back as it was."""

from __future__ import annotations

import contextlib
import os
import shutil

import torch.distributed as dist

from tierlift._paths import absolute
from tierlift.io import EngineConfig, IoEngine
from tierlift.offload.durable import DurableState, claim_dir, durable_dir, read_manifest
from tierlift.offload.layout import chunk_bytes
from tierlift.offload.tiers import (
    HybridTier,
    MemoryTier,
    NvmeTier,
    make_state_dir,
    remove_stale_dirs,
)


def build(off, slots: int) -> None:
    """Sets off._dir, off._engine, off._slots, off.pool_bytes, off.tiers (and off._durable
    with durable=True)."""
    config, slot_dtypes, chunk_elems = off.config, off._slot_dtypes, off.chunk_elems
    pool = slots * chunk_bytes(slot_dtypes, chunk_elems)
    nvme_path = absolute(config.nvme_path)  # the files are reopened, watched, removed by path
    remove_stale_dirs(nvme_path)
    fresh = True
    if config.durable:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Each rank's folder commits on its own: ranks killed a moment apart reopen at
            # different steps, DDP replicas then train apart and ZeRO shards mix steps.
            raise ValueError(
                f"durable=True is for one process, and this one is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}: each rank's state folder commits its steps on its "
                "own, so ranks killed a moment apart would reopen at different steps (DDP "
                "replicas training apart, ZeRO shards of different steps) without an error. "
                "Resume several ranks from tierlift.checkpoint.save(), which every rank "
                "commits together")
        off._dir = durable_dir(nvme_path)
        fresh = claim_dir(off._dir, start_fresh=config.durable == "fresh")
    else:
        off._dir = make_state_dir(nvme_path)
    try:
        off._engine = IoEngine(EngineConfig(
            queue_depth=config.queue_depth, pool_bytes=pool,
            block_size=min(config.block_bytes, chunk_elems * 4)))
        off.pool_bytes = pool
        off._slots = [{k: off._engine.pool_tensor(chunk_bytes({k: d}, chunk_elems)).view(d)
                       for k, d in slot_dtypes.items()} for _ in range(slots)]
        if not fresh:  # before any file is opened: the state must be this one's
            read_manifest(off, off._dir)
        ram = (config.cpu_budget - pool) if config.offload == "hybrid" else 0
        off.tiers = []
        for gi, (k, lay, dt) in enumerate(zip(off._tier_kinds, off.layouts, off._dtypes)):
            n = len(lay.chunks)
            in_ram = chunk_bytes({kd: dt[kd] for kd in k}, chunk_elems, aligned=False)
            n_ram = min(n, max(0, ram) // in_ram)
            ram -= n_ram * in_ram
            nvme = NvmeTier(off._engine, off._dir, gi, k, n, chunk_elems,
                            [lay.used_elems(c.ci) for c in lay.chunks],
                            first=n_ram, generations=config.nvme_generations, dtypes=dt,
                            reopen=not fresh)
            off.tiers.append(nvme if config.offload == "nvme" else HybridTier(
                MemoryTier(k, n_ram, chunk_elems, off._pin, 1, dtypes=dt), nvme))
        if config.durable:
            off._durable = DurableState(off, off._dir, fresh)
    except BaseException:
        off._slots = []
        if off._durable is not None:
            off._durable.close()
        if off._engine is not None:
            off._engine.close()
        if config.durable:
            _release(off._dir, fresh)
        else:
            shutil.rmtree(off._dir, ignore_errors=True)
        raise


def _release(directory: str, fresh: bool) -> None:
    """A durable state folder this process failed to open: a new one is removed, an existing
    one is given back as it was."""
    if fresh:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, "owner.json"))
