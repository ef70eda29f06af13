"""tierlift.zero.gathered(): the full weights of a sharded model in a `with` block, as DeepSpeed's
GatheredParameters.

    with tierlift.zero.gathered(model.embed, modifier_rank=0):   # every rank
        if dist.get_rank() == 0:
            model.embed.weight[pad_id].zero_()

On entry every unit holding the given weights all-gathers its fp32 master shards into a buffer
of its own, and the module attributes become views of it (fp32, no grad; frozen weights, sharded
at stage 3, in their own dtype): the same on every rank, at stages 1, 2 and 3 and with parameter
offload. On exit the attributes go back to what they were (views of the gathered compute
weights, or stage 3's freed stand-ins). With modifier_rank=r, rank r's buffers are broadcast and
every rank copies its slice into its shard (edits on other ranks are discarded); the next
forward gathers the new weights. Without it the block is read-only: an edit of a gathered
weight, on any one rank, raises at exit on every rank and nothing is written back anywhere.
Edits through the tensor itself show in its version counter; writes through `.data` (or numpy
views) do not, so a read-only block also takes a content fingerprint of each gathered buffer on
entry and compares it on exit (one pass over the bytes each way).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from tierlift import _extension
from tierlift._shards import shard_owner
from tierlift.offload.watch import fingerprints
from tierlift.zero.freed import FreedWeight
from tierlift.zero.members import live_states, states_in


def _resolve(obj) -> list[tuple]:
    """[(state, [unit indices])] for the weights `obj` names, states and units in a fixed order
    (so that every rank issues the same collectives)."""
    items = [obj] if isinstance(obj, (nn.Module, torch.Tensor)) else list(obj)
    picked: list[list] = []

    def add(state, index: int) -> None:
        for entry in picked:
            if entry[0] is state:
                entry[1].add(index)
                return
        picked.append([state, {index}])

    for item in items:
        if isinstance(item, nn.Module):
            inside = {id(m) for m in item.modules()}
            for state in states_in(item):
                for i, u in enumerate(state.units):
                    if any(id(mod()) in inside for e in u.entries for mod, _ in e.owners):
                        add(state, i)
        elif isinstance(item, torch.Tensor):
            owner = shard_owner(item)
            if owner is not None:
                add(*owner)
                continue
            for state in live_states():
                for i, u in enumerate(state.units):
                    if any(getattr(mod(), attr, None) is item
                           for e in u.entries for mod, attr in e.owners):
                        add(state, i)
        else:
            raise TypeError(f"gathered() takes modules, tensors or an iterable of them, got "
                            f"{type(item).__name__}")
    return [(state, sorted(idx)) for state, idx in picked]


def _check_modifier(state, modifier_rank) -> None:
    if modifier_rank is None:
        return
    world = state.world_comm.world
    if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int) \
            or not 0 <= modifier_rank < world:
        raise ValueError(f"modifier_rank must be None or a rank of the model's process group "
                         f"(0..{world - 1}), got {modifier_rank!r}")


class _Held:
    """One unit gathered for the block: its fp32 buffer and the views put on the module."""

    def __init__(self, unit, read_only: bool):
        self.unit = unit
        unit.wait_gather()
        buf = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.device)
        unit.comm.wait(unit.comm.all_gather(buf, unit.shard.detach().to(unit.device)))
        self.buf = buf
        self.views = [buf[e.offset:e.offset + e.numel].view(e.shape) for e in unit.entries]
        for e, v in zip(unit.entries, self.views, strict=True):
            for mod, attr in e.owners:
                setattr(mod(), attr, v)
        self.version = buf._version
        self.print = _fingerprint(buf) if read_only else None

    def _moved(self, v: torch.Tensor) -> bool:
        """Whether `v` was given other data (`v.data = ...`) inside the block."""
        return v.untyped_storage().data_ptr() != self.buf.untyped_storage().data_ptr()

    def edited(self) -> bool:
        return self.buf._version != self.version or any(
            self._moved(v) or any(getattr(mod(), attr, None) is not v for mod, attr in e.owners)
            for e, v in zip(self.unit.entries, self.views, strict=True)) or (
            self.print is not None and not _same(_fingerprint(self.buf), self.print))

    def replaced(self) -> str | None:
        """Takes a weight given new data of its own shape (an attribute set to another tensor,
        or `.data` assigned) as an edit; a weight given another shape, as a message."""
        for e, v in zip(self.unit.entries, self.views, strict=True):
            for now in [getattr(mod(), attr, None) for mod, attr in e.owners]:
                if (now is v and not self._moved(v)) or isinstance(now, FreedWeight):
                    continue
                if isinstance(now, torch.Tensor) and tuple(now.shape) == tuple(e.shape):
                    with torch.no_grad():
                        self.buf[e.offset:e.offset + e.numel].copy_(now.detach().reshape(-1))
                    continue
                shape = tuple(now.shape) if isinstance(now, torch.Tensor) else type(now).__name__
                return (f"{e.names[0]!r} was given shape {shape} inside gathered(); a sharded "
                        f"weight keeps its shape {tuple(e.shape)} (resize it, e.g. "
                        "resize_token_embeddings, before tierlift.zero.shard); nothing was "
                        "written back")
        return None

    def restore(self, state, collective: bool) -> None:
        unit = self.unit
        if unit.gathered or unit.pending is not None:
            if collective:
                # Gathered again on every rank (the held units are the same everywhere): whether
                # a unit needs it can differ by rank (the put-back of parameters without a
                # gradient after a step writes only the ranks whose slice holds them, through
                # .data), and a gather on some ranks only would pair with another collective.
                unit.stale = True
                state._gather(unit)
            else:
                unit.wait_gather()
            unit.install_views()
        else:
            unit.install_freed()

    @torch.no_grad()
    def write_back(self) -> None:
        unit = self.unit
        lo = unit.comm.rank * unit.shard_numel
        unit.shard.copy_(self.buf[lo:lo + unit.shard_numel])
        unit.stale = True


@contextlib.contextmanager
def gathered(params_or_module, modifier_rank: int | None = None):
    """Full weights inside the block on every rank; with modifier_rank=r, rank r's edits are
    written back into every rank's shards on exit. A collective: every rank enters it with the
    same weights, outside forward and backward. Weights that are not sharded (frozen ones at
    stages 1/2, an unsharded model) are left alone. See the module doc."""
    targets = _resolve(params_or_module)
    for state, _ in targets:
        _check_modifier(state, modifier_rank)
    for state, _ in targets:
        state.named_call("tierlift.zero.gathered")
    held: list[tuple] = []
    for state, _ in targets:
        state.gathered_blocks += 1
    try:
        for state, idx in targets:
            for i in idx:
                held.append((state, _Held(state.units[i], read_only=modifier_rank is None)))
    except BaseException:
        _close(targets, held, collective=False)
        raise
    try:
        yield
    except BaseException:
        try:
            with contextlib.suppress(Exception):  # the others' exit check gets its answer
                _finish(targets, held, modifier_rank, raised=True)
        finally:
            _close(targets, held, collective=False)  # failed, maybe on this rank only
        raise
    try:
        _finish(targets, held, modifier_rank)
    except BaseException:
        # Refused on every rank (the exit's flags are agreed), and a rank that raised inside
        # the block closes without collectives: none here either, or they would pair with
        # that rank's next ones. Nothing was written back; stale units gather at the next
        # forward, on every rank.
        _close(targets, held, collective=False)
        raise
    _close(targets, held, collective=True)


def _close(targets, held, collective: bool) -> None:
    try:
        for state, h in held:
            h.restore(state, collective)
    finally:
        for state, _ in targets:
            state.gathered_blocks -= 1


def _finish(targets, held, modifier_rank, raised: bool = False) -> None:
    """The exit of a block, the same collectives on every rank: first one all-reduce per model
    of a flag per rank (whether it raised inside the block, `raised` here; read-only: which unit
    it edited; writable: whether modifier_rank's edit is refused). Any of those raises on every
    rank before anything is written back; else modifier_rank's buffers are broadcast and every
    rank writes its slice back."""
    problems: dict[int, str | None] = {}

    def mark(state, mine) -> int:
        if raised:
            return -1
        if modifier_rank is None:
            first = next((i for i, h in enumerate(mine) if h.edited()), None)
            return 0 if first is None else first + 1
        if state.world_comm.rank != modifier_rank:
            return 0
        problems[id(state)] = next((m for m in (h.replaced() for h in mine) if m is not None),
                                   None)
        return int(problems[id(state)] is not None)

    seen = []
    for state, _ in targets:
        comm = state.world_comm
        mine = [h for s, h in held if s is state]
        # Slot r is rank r's mark; each rank fills only its own slot, so a sum gathers them.
        flags = torch.zeros(comm.world, dtype=torch.int64, device=mine[0].unit.device)
        flags[comm.rank] = mark(state, mine)
        if comm.world > 1:
            comm.wait(comm.all_reduce(flags))
        seen.append((state, comm, mine, flags.tolist()))
    if raised:
        return  # this rank's own exception goes on
    for _, _, _, flags in seen:
        failed = [r for r, f in enumerate(flags) if f < 0]
        if failed:
            raise RuntimeError(
                f"rank {failed[0]} raised inside a tierlift.zero.gathered() block; the block was "
                "left on every rank and nothing was written back")
    if modifier_rank is None:
        for _, comm, mine, flags in seen:
            _raise_if_edited(comm, mine, flags)
        return
    for state, _, _, flags in seen:
        if flags[modifier_rank]:
            raise RuntimeError(problems.get(id(state)) or
                               f"rank {modifier_rank} (modifier_rank) gave a gathered weight "
                               "another shape inside gathered() (resize weights before "
                               "tierlift.zero.shard); nothing was written back")
    for _, comm, mine, _ in seen:
        for h in mine:
            _broadcast(comm, h.buf, modifier_rank)
        for h in mine:
            h.write_back()


def _raise_if_edited(comm, mine: list, flags: list[int]) -> None:
    """A read-only block: flags[r] is 1 + the index in `mine` (the same order on every rank)
    of the first unit rank r edited, 0 if none."""
    ranks = [r for r, f in enumerate(flags) if f > 0]
    if not ranks:
        return
    unit = mine[flags[ranks[0]] - 1].unit
    where = "this rank" if ranks == [comm.rank] else (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
    raise RuntimeError(
        f"a weight of unit {unit.name!r} ({unit.entries[0].names[0]!r}...) was edited on "
        f"{where} inside tierlift.zero.gathered() without modifier_rank (in place, through "
        ".data or by assignment); the edit is discarded on every rank and nothing was written "
        "back. Use the writable form, gathered(..., modifier_rank=<the rank whose edits to "
        "keep>), to write it back")


_CHUNK = 1 << 26  # bytes of a device buffer copied to the host at a time to fingerprint it


def _fingerprint(buf: torch.Tensor) -> tuple[int, ...] | torch.Tensor:
    """The content fingerprint of a gathered buffer: host buffers in one call, device ones
    chunk by chunk through one host scratch buffer; without the compiled extension, a copy of
    its bytes."""
    flat = buf.detach().reshape(-1).view(torch.uint8)
    if not _extension.available():
        return flat.clone()
    if flat.device.type == "cpu":
        return tuple(fingerprints([flat]))
    scratch = torch.empty(min(_CHUNK, flat.numel()), dtype=torch.uint8)
    return tuple(fingerprints([flat[i:i + _CHUNK]], scratch)[0]
                 for i in range(0, flat.numel(), _CHUNK))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _broadcast(comm, t: torch.Tensor, src: int) -> None:
    if comm.world == 1:
        return
    if comm.rank == src:
        comm._count(t.numel() * t.element_size())
    comm.wait(comm._run(dist.broadcast, t, group_src=src, async_op=True))
