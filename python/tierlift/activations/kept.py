"""gpu_budget's account: the bytes of saved tensors left in place, shared by every forward of one
offload (micro-batches in one context, forwards of separate contexts or of offload_blocks alive
together), so what the graphs hold on the device never exceeds the budget.

A kept view keeps its whole storage, so a storage is charged once, at its full size; other
views of it are then free. It is given back when autograd has dropped the last saved tensor
that holds it (its backward ran, or its graph was freed), so the next micro-batch gets the
budget the previous one used, not what is left of it.
"""

from __future__ import annotations

import threading

import torch


def storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()  # not str(device): 0.3 us more per tensor


class KeptBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        # storage key -> [bytes charged, saved tensors holding it]. A charged storage is alive
        # while it has holders, so its address cannot be reused by another storage meanwhile.
        self._storages: dict[tuple[torch.device, int], list[int]] = {}
        # Saved tensors are dropped from any thread, also by a collection inside charge().
        self._lock = threading.RLock()

    def charge(self, t: torch.Tensor) -> int | None:
        """The bytes charged for keeping `t` in place (0 if its storage is kept already), or
        None if the budget cannot hold its storage."""
        key = storage_key(t)
        with self._lock:
            if key in self._storages:
                return 0
            cost = t.untyped_storage().nbytes()
            if self.used + cost > self.limit:
                return None
            self._storages[key] = [cost, 0]
            self.used += cost
            return cost

    def hold(self, t: torch.Tensor):
        """Counts one more holder (what autograd keeps for `t`) of `t`'s storage, if it is
        charged: returns the key to drop() when that holder goes, or None. Only a plain strided
        tensor can hold a charged storage: a sparse tensor or a subclass (FP8, a wrapper) has
        none to ask for, and asking raises."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested:
            return None
        key = storage_key(t)
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return None
            entry[1] += 1
        return key

    def drop(self, key) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._storages[key]
                self.used -= entry[0]
