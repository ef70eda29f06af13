"""Naming the rank that died or hung, instead of failing with an anonymous socket error or
hanging forever.

Each rank bumps a counter in the c10d store (the one torchrun / init_process_group already
runs) once per forward. When a collective fails (a peer closed its socket, or the process
group's timeout expired), the survivor records its own failure in the store, waits a moment for
the other survivors to do the same, and names the ranks that neither failed nor are ahead of it:
those stopped answering. The process group timeout (init_process_group(timeout=...)) bounds how
long a hung rank can stall the others.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_PREFIX = "tierlift_zero/"


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


class Heartbeat:
    def __init__(self, comm, also=(), settle_s: float = 2.0):
        """`comm`: every rank of the model; `also`: the other Comms whose failures it explains
        (the shard group and replicate legs of hierarchical sharding)."""
        self.comm = comm
        self.settle_s = settle_s
        self.count = 0
        self.ranks = (list(range(comm.world)) if comm.group is None
                      else dist.get_process_group_ranks(comm.group))
        self.me = self.ranks[comm.rank]
        for c in (comm, *also):
            c.on_error = self.explain

    @property
    def store(self):
        # Looked up on every use, never kept: a store object that outlives
        # destroy_process_group() aborts the process when it is finally destroyed.
        try:
            return dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            return None

    def beat(self) -> None:
        self.count += 1
        store = self.store
        if store is None:
            return
        try:
            store.set(f"{_PREFIX}beat/{self.me}", str(self.count))
        except RuntimeError:
            pass  # a dead store host surfaces, named, at the next collective

    @staticmethod
    def _read(store, key: str) -> int | None:
        if not store.check([key]):
            return None
        return int(store.get(key))

    def explain(self, exc: Exception) -> Exception:
        head = f"tierlift.zero: a collective failed on rank {self.me} in forward step {self.count}"
        store = self.store
        if store is None:
            return RankFailureError(f"{head} ({exc}); no c10d store to find the culprit")
        try:
            store.set(f"{_PREFIX}failed/{self.me}", str(self.count))
            deadline = time.monotonic() + self.settle_s
            silent: list[int] = []
            while True:
                silent = []
                for r in self.ranks:
                    if r == self.me or self._read(store, f"{_PREFIX}failed/{r}") is not None:
                        continue
                    beat = self._read(store, f"{_PREFIX}beat/{r}") or 0
                    if beat <= self.count:
                        silent.append(r)
                if not silent or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception as store_exc:  # noqa: BLE001 - the store's host may be the dead rank
            return RankFailureError(f"{head} ({exc}); the c10d store is unreachable too "
                                    f"({store_exc}): the rank hosting it (rank 0 unless "
                                    "torchrun hosts it) probably died")
        if silent:
            who = ", ".join(str(r) for r in silent)
            return RankFailureError(f"{head}: rank {who} stopped answering (died or hung; "
                                    f"the others timed out or lost the connection). Cause: {exc}")
        return RankFailureError(f"{head} and on every other rank too ({exc})")
