"""How the offloader's host memory is cut up: the pipeline slots and the chunk size under a
cpu_budget, and the host tier (two generations, or one plus spare chunk blocks) with its
staging slots."""

from __future__ import annotations

import warnings

import torch

from tierlift.offload import host_budget
from tierlift.offload.layout import ALIGN_ELEMS, chunk_bytes, even_chunk_elems
from tierlift.offload.tiers import MemoryTier

MIN_SLOTS = 3  # read ahead, step, write back
MIN_SLOT_CHUNK_BYTES = 1 << 20  # the smallest chunk per kind worth an extra pipeline slot


def slots_and_chunk(config, slot_dtypes: dict, largest: int) -> tuple[int, int]:
    """(pipeline slots, chunk elements). `largest`: the elements of the largest param group.
    On disk under a cpu_budget the slots (each one chunk of every kind in `slot_dtypes`) must
    fit the budget, a hybrid's in a quarter of it."""

    def slot_bytes(n: int) -> int:
        return chunk_bytes(slot_dtypes, n)

    per_elem = chunk_bytes(slot_dtypes, ALIGN_ELEMS) / ALIGN_ELEMS
    chunk_elems = max(ALIGN_ELEMS, min(config.chunk_bytes // 4, largest))
    slots = config.pipeline_slots
    if config.offload in ("nvme", "hybrid") and config.cpu_budget is not None:
        # More slots only while each still holds MIN_SLOT_CHUNK_BYTES per kind: a deeper
        # read-ahead is not worth cutting the device's requests smaller than that.
        afford = config.cpu_budget // slot_bytes(MIN_SLOT_CHUNK_BYTES // 4)
        slots = max(MIN_SLOTS, min(slots, afford))
        fit = int(config.cpu_budget // (slots * per_elem)) // ALIGN_ELEMS * ALIGN_ELEMS
        while fit >= ALIGN_ELEMS and slots * slot_bytes(fit) > config.cpu_budget:
            fit -= ALIGN_ELEMS  # 4 KiB rounding of the small kinds
        if fit < ALIGN_ELEMS:
            raise ValueError(
                f"cpu_budget={config.cpu_budget} bytes is smaller than one chunk of "
                f"{slots} pipeline slots; the smallest budget that works is "
                f"{slots * slot_bytes(ALIGN_ELEMS)} bytes")
        if config.offload == "nvme":
            chunk_elems = min(chunk_elems, fit)
        else:  # the pool takes at most a quarter of a hybrid's budget: RAM holds the rest
            chunk_elems = min(chunk_elems, max(ALIGN_ELEMS, fit // 4 // ALIGN_ELEMS
                                               * ALIGN_ELEMS))
    # As few chunks as this size gives, made equal: no nearly empty last chunk.
    return slots, even_chunk_elems(largest, chunk_elems)


def build_memory_tiers(off, slots: int) -> None:
    """offload="cpu": sets off.tiers, off._slots (staging) and off.pool_bytes; refuses a
    cpu_budget smaller than the state and its staging."""
    config, slot_dtypes, chunk_elems = off.config, off._slot_dtypes, off.chunk_elems
    slot_kinds = off._slot_kinds if off.streamed else ["grad", "copy"]
    if not off.streamed and not off._cuda:
        slot_kinds = []
    spare = spare_chunks(off, slots, slot_kinds)
    if spare is not None:  # the slots only stage device gradients and weights
        slot_kinds = [k for k in ("grad", "copy") if k in slot_dtypes]
    off.tiers = []
    for gi, (k, lay, dt) in enumerate(zip(off._tier_kinds, off.layouts, off._dtypes)):
        if spare is None:  # two generations when overlapped
            tier = MemoryTier(k, len(lay.chunks), chunk_elems, off._pin,
                              2 if off.streamed else 1, dtypes=dt)
        else:
            tier = MemoryTier(k, len(lay.chunks), chunk_elems, off._pin, 1, dtypes=dt,
                              spare=spare[gi])
        off.tiers.append(tier)
    off._slots = [{k: torch.empty(chunk_bytes({k: slot_dtypes[k]}, chunk_elems)
                                  // slot_dtypes[k].itemsize, dtype=slot_dtypes[k],
                                  pin_memory=off._pin) for k in slot_kinds}
                  for _ in range(slots)]
    resident = sum(t.resident_bytes for t in off.tiers)
    staging = host_budget.staging_bytes(slots, slot_kinds, slot_dtypes, chunk_elems)
    off.pool_bytes = staging
    if config.cpu_budget is not None and resident + staging > config.cpu_budget:
        raise ValueError(
            f"cpu_budget={config.cpu_budget} bytes is smaller than the optimizer state "
            f"({resident + staging} bytes with staging); raise it or use "
            "offload='hybrid' or 'nvme'")


def spare_chunks(off, slots: int, slot_kinds: list) -> list[int] | None:
    """offload="cpu" with overlap keeps two generations of the state, unless `cpu_budget` is
    smaller than that (and the full staging): then one generation plus, per group, as many
    spare chunk blocks as the rest of the budget holds (tiers.MemoryTier), in group order; the
    overlap steps ahead as many chunks as there are spare blocks and step() the rest. None:
    two generations (or no overlap)."""
    budget = off.config.cpu_budget
    if not off.streamed or budget is None:
        return None
    dts = off._slot_dtypes

    def staging(kinds) -> int:
        return host_budget.staging_bytes(slots, kinds, dts, off.chunk_elems)

    per_chunk = [chunk_bytes({kd: dt[kd] for kd in k}, off.chunk_elems, aligned=False)
                 for k, dt in zip(off._tier_kinds, off._dtypes)]
    counts = [len(lay.chunks) for lay in off.layouts]
    staging_one = staging([k for k in ("grad", "copy") if k in dts])
    spare = host_budget.spare_chunks(per_chunk, counts, budget, staging(slot_kinds),
                                     staging_one)
    fits = budget >= host_budget.one_generation_bytes(per_chunk, counts) + staging_one
    if spare is not None and fits and sum(counts) and not any(spare):
        warnings.warn(
            f"tierlift offload: cpu_budget={budget} holds the optimizer state but no spare "
            f"chunk beside it ({min(c for c in per_chunk if c)} bytes each), so "
            "overlap=True steps nothing during backward; every chunk is stepped in step()",
            RuntimeWarning, stacklevel=5)
    return spare
