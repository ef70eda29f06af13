"""How many of tierlift's CPU threads the overlap's worker steps chunks on while training runs.

On a GPU the training thread launches backward's kernels (and runs the gradient hooks) while
the worker steps chunks on tierlift's thread pool. A pool as large as the machine leaves that
thread to compete with every pool thread for a core: it waits for a time slice while the GPU
drains its queue, and a pool thread it displaces holds up its whole chunk (each thread takes an
equal range). So while training runs, the worker leaves an eighth of the pool (at least one
thread) to the rest of the process, as DeepSpeed's SuperOffload keeps a share of the cores
from its CPU Adam process (`cpuadam_cores_perc`, 0.8 by default). Once step() waits for the
worker, nothing else runs and the worker takes the whole pool again. On a CPU the model's own
backward uses torch's threads; the worker takes the whole pool there, as before.
"""

from __future__ import annotations

import torch

from tierlift import _extension
from tierlift._shards import shard_owner


def trains_on_cuda(groups: list[dict]) -> bool:
    """Whether the parameters' forward and backward run on a CUDA device: a CUDA parameter,
    or a ZeRO shard (kept in host RAM or not) whose units compute on one."""
    for group in groups:
        for p in group["params"]:
            if p.is_cuda:
                return True
            owner = shard_owner(p)
            units = getattr(owner[0], "units", ()) if owner is not None else ()
            if any(torch.device(u.device).type == "cuda" for u in units):
                return True
    return False


def pool_size() -> int:
    """Threads in tierlift's CPU pool (TIERLIFT_NUM_THREADS, else one per CPU of the affinity
    mask)."""
    return _extension._C.num_threads()


def cap(requested: int | None, groups: list[dict]) -> int:
    """The threads the worker steps on while training runs: `requested`
    (OffloadConfig.overlap_threads) within the pool, or by default all but an eighth (at least
    one) where training runs on CUDA and the whole pool elsewhere."""
    pool = pool_size()
    if requested is not None:
        return min(requested, pool)
    if not trains_on_cuda(groups):
        return pool
    return max(1, pool - max(1, pool // 8))


def apply(threads: int) -> None:
    """Caps the calling thread's CPU kernels at `threads` (0: the whole pool)."""
    _extension._C.set_thread_limit(threads)
