"""How the overlapped host tier (offload="cpu", overlap=True) sizes itself under a cpu_budget,
as pure arithmetic on chunk counts and bytes: the runtime (runner.Offloader) and the planner
(tierlift.plan) follow the same rule, so a plan counts what the optimizer allocates.

Two generations of the state when there is no budget, or one that holds them and the full
staging (slots x one chunk of every slot kind: the state kinds, plus fp32 grad and copy for
device parameters); else one generation plus, per param group in order, as many spare chunk
blocks as the rest of the budget holds once the staging of device gradients and weights is
taken (slots x one chunk of grad and copy; none for host parameters). A block is one chunk of
every state kind of the group's tier, unaligned: tiers.MemoryTier keeps each kind in one flat
tensor. The overlap steps ahead, during backward, as many chunks as there are spare blocks;
step() steps the others in place after backward.

Without overlap the state is one generation stepped in place, and the slots stage only the
gradients and new weights of device parameters (slots x one chunk of fp32 grad and copy; none
for host parameters): staging_bytes counts every pool of slots, here and in the runtime.
"""

from __future__ import annotations

from tierlift.offload.layout import ALIGN_ELEMS, chunk_bytes, even_chunk_elems


def host_chunk_elems(chunk_bytes: int, largest: int) -> int:
    """The chunk size of offload="cpu": `chunk_bytes` of fp32 per kind, at most the largest
    group's reserved elements (layout.reserved_elems), cut evenly (layout.even_chunk_elems)."""
    elems = max(ALIGN_ELEMS, min(chunk_bytes // 4, largest))
    return even_chunk_elems(largest, elems)


def staging_bytes(slots: int, kinds, dtypes: dict, chunk_elems: int) -> int:
    """The pinned staging slots of offload="cpu": `slots` x one chunk of `chunk_elems` of each
    of `kinds` (in `dtypes`, {kind: dtype}), each kind 4 KiB aligned as the slots allocate it."""
    return slots * chunk_bytes({k: dtypes[k] for k in kinds}, chunk_elems)


def spare_chunks(per_chunk: list[int], counts: list[int], budget: int | None,
                 staging_two: int, staging_one: int) -> list[int] | None:
    """Per group, the spare chunk blocks beside one generation; None: two generations.
    `per_chunk[g]`: bytes of one chunk of group g's state kinds (unaligned), `counts[g]`: its
    chunks; `staging_two`: the slots' bytes with two generations, `staging_one`: with one.
    A budget below one generation and `staging_one` gives no spare block here; the caller
    refuses it (one_generation_bytes says how much that takes)."""
    if budget is None:
        return None
    one = one_generation_bytes(per_chunk, counts)
    if 2 * one + staging_two <= budget:
        return None
    room = budget - one - staging_one
    spare = []
    for c, n in zip(per_chunk, counts):
        got = max(0, min(n, room // c)) if c else 0
        spare.append(got)
        room -= got * c
    return spare


def one_generation_bytes(per_chunk: list[int], counts: list[int]) -> int:
    return sum(c * n for c, n in zip(per_chunk, counts))


__all__ = ["host_chunk_elems", "one_generation_bytes", "spare_chunks", "staging_bytes"]
