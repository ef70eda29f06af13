"""deferred_init(): build a model on the meta device while recording how its tensors were made,
so that shard() can replay the recording later and keep only this rank's slices.

    with tierlift.zero.deferred_init():
        torch.manual_seed(0)
        model = Llama(cfg)              # no memory: parameters and buffers are on meta
    model = tierlift.zero.shard(model, stage=3, device="cuda")   # each rank: its shards only

Recording: a dispatch mode sees every aten op run while the model is built (factories, the
modules' reset_parameters, the model's own init passes, buffer math such as rotary tables) and
stores it with its arguments; tensors are named by their storage and a version that starts anew
whenever an op overwrites a whole storage without reading it (uniform_, normal_, zero_, fill_,
copy_ into it), so a parameter initialised three times holds only its last value at replay.
Factories without a device go to meta; torch.tensor(data) and friends stay on the CPU (they
hold data, and libraries probe `torch.tensor([]).device` to tell a meta build from a real one:
Hugging Face models skip their own weight init on meta, which would change the values).

Replay: every recorded op runs again, in order, on the CPU, from the default CPU generator's
state when the recording began; the same random ops of the same sizes in the same order give
the same bits as building the model on the CPU after the same torch.manual_seed. A storage is
freed after its last use; the final value of a parameter or buffer is handed to a callback at
that point, which keeps what this rank needs (its slice of each flat shard) and drops the rest.
So a rank holds its shards plus the tensors that are alive at once during construction (one
parameter, for models that initialise parameter by parameter), never the whole model.

Real tensors the recorded ops use (torch.tensor's data, tensors from before the block) are
copied when first used, so in-place edits that already ran on them are not applied twice.
torch.manual_seed before or inside the block is honoured: the CPU generator's state is kept where
the block starts and before every random op that finds it set anew. Not recorded (the guarantee
does not cover it): changes to the model's tensors after the `with` block (an in-place op on a
parameter or buffer is refused by shard(); one through `.data` is not seen), random numbers
drawn outside aten ops (Python's `random`, numpy), explicit generator= objects and the CUDA
generator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_ATTR = "_tierlift_deferred"  # the Recording, set on every module built inside the block
_META = torch.device("meta")
# Ops that overwrite every element of `self` without reading it: a new version of the storage.
_OVERWRITE = {"uniform_", "normal_", "zero_", "fill_", "exponential_", "random_", "cauchy_",
              "log_normal_", "geometric_", "bernoulli_", "copy_"}
# Constructors that take data: they stay on the CPU (their values are what gets recorded).
_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


@dataclass(frozen=True)
class Ref:
    """A tensor argument: a view (offset, size, stride, dtype) of storage `key` at `version`."""

    key: int
    version: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class Op:
    func: object
    args: object  # args/kwargs with tensors replaced by Ref (recorded) or kept (constants)
    kwargs: object
    new: list  # (Ref, flat output index) of outputs with fresh storage
    reads: list  # Refs read
    writes: list  # Refs written (in-place targets and fresh outputs)
    reseed: torch.Tensor | None = None  # the CPU generator's state, if set anew before this op


class Recording:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.rng_state = torch.get_rng_state()
        self.rng_after = self.rng_state  # after the last recorded random op
        self.rng_end = None  # when the block ended
        self.exit_versions: dict[int, int] = {}  # per key: the highest _version at the end
        self.keys: dict[StorageWeakRef, int] = {}
        self.version: list[int] = []  # current version per key
        self.nbytes: list[int] = []
        self.alive: list = []  # recorded tensors: their storages' weak refs stay unique
        # Real tensors made outside the recorded ops (torch.tensor's data, tensors from before
        # the block), copied when first used: later in-place ops on them, which already ran
        # for real, must not be applied twice by the replay. {id: (tensor, version, copy)}
        self.constants: dict[int, tuple] = {}

    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(StorageWeakRef(t.untyped_storage()))

    def ref(self, t: torch.Tensor, key: int) -> Ref:
        return Ref(key, self.version[key], t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t.dtype)

    def constant(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of real tensor t as it is now (meta tensors have no values to copy)."""
        if t.is_meta:
            return t
        seen = self.constants.get(id(t))
        if seen is None or seen[1] != t._version:
            seen = (t, t._version, t.detach().clone())
            self.constants[id(t)] = seen
        return seen[2]

    def record(self, func, args, kwargs, out, rng=None) -> None:
        schema = func._schema.arguments
        written = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        overwrite = func.overloadpacket.__name__ in _OVERWRITE
        reads, writes = [], []

        # A whole-storage overwrite of `self` starts a new version, after the other arguments
        # (which may read the old one) are named.
        bump = (overwrite and args and isinstance(args[0], torch.Tensor)
                and self.key_of(args[0]) is not None and _covers(args[0]))

        def conv(t, name=None):
            if not isinstance(t, torch.Tensor):
                return t
            key = self.key_of(t)
            if key is None:
                return self.constant(t)
            r = self.ref(t, key)
            reads.append(r)
            if name in written:
                writes.append(r)
            return r

        names = [a.name for a in schema]
        rargs = [a if bump and i == 0 else
                 conv(a, names[i] if i < len(names) else None) if isinstance(a, torch.Tensor)
                 else tree_map(conv, a) for i, a in enumerate(args)]
        rkwargs = {k: conv(v, k) if isinstance(v, torch.Tensor) else tree_map(conv, v)
                   for k, v in kwargs.items()}
        if bump:
            key = self.key_of(args[0])
            self.version[key] += 1  # the old value is dead from here on
            rargs[0] = self.ref(args[0], key)
            writes.append(rargs[0])
        rargs = tuple(rargs)
        new = []
        flat, _ = tree_flatten(out)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor) or self.key_of(t) is not None:
                continue
            if t.layout != torch.strided:
                raise NotImplementedError(f"deferred_init records dense tensors only; {func} "
                                          f"made a {t.layout} tensor")
            key = len(self.version)
            self.keys[StorageWeakRef(t.untyped_storage())] = key
            self.version.append(0)
            self.nbytes.append(t.untyped_storage().nbytes())
            r = self.ref(t, key)
            new.append((r, i))
            writes.append(r)
        self.alive.append(out)
        op = Op(func, rargs, rkwargs, new, reads, writes)
        if rng is not None:  # (state before, state after) of a random op
            if not torch.equal(rng[0], self.rng_after):
                op.reseed = rng[0]  # torch.manual_seed (or the like) ran inside the block
            self.rng_after = rng[1]
        self.ops.append(op)


def _covers(t: torch.Tensor) -> bool:
    """Whether t's elements are exactly its whole storage."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


class _RecordMode(TorchDispatchMode):
    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default and args[0].is_meta \
                and self.rec.key_of(args[0]) is None:
            raise RuntimeError("deferred_init: a tensor made from data on the meta device has "
                               "no values to record; make it on the CPU")
        if torch.Tag.nondeterministic_seeded not in func.tags:
            out = func(*args, **kwargs)
            self.rec.record(func, args, kwargs, out)
            return out
        before = torch.get_rng_state()
        out = func(*args, **kwargs)
        self.rec.record(func, args, kwargs, out, rng=(before, torch.get_rng_state()))
        return out


class _MetaFactories(TorchFunctionMode):
    """Factories without a device go to meta; data constructors (torch.tensor(data), ...) stay
    on the CPU, as in eager construction: they hold data, and the recording replays them."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA and kwargs.get("device") is None:
            return func(*args, **kwargs)  # on the CPU: small, and its data is recorded
        if func in self.factories and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": _META}
        return func(*args, **kwargs)


_active: list[Recording] = []


@contextlib.contextmanager
def deferred_init():
    """Build modules inside this block on the meta device, recording how their parameters and
    buffers are made; tierlift.zero.shard(model, ..., device=...) replays the recording and
    keeps only this rank's shards (see this module's docstring for the exact guarantee)."""
    if _active:
        raise RuntimeError("deferred_init() blocks do not nest")
    rec = Recording()
    _active.append(rec)
    before = torch.nn.Module.__init__

    def init(self, *args, **kwargs):
        before(self, *args, **kwargs)
        object.__setattr__(self, _ATTR, rec)

    torch.nn.Module.__init__ = init
    try:
        with _MetaFactories(), _RecordMode(rec):
            yield rec
    finally:
        torch.nn.Module.__init__ = before
        _active.pop()
        rec.rng_end = torch.get_rng_state()
        for out in rec.alive:
            for t in tree_flatten(out)[0]:
                key = rec.key_of(t) if isinstance(t, torch.Tensor) else None
                if key is not None:
                    rec.exit_versions[key] = max(rec.exit_versions.get(key, 0), t._version)


def recording_of(model: torch.nn.Module) -> Recording | None:
    """The Recording of a model built inside deferred_init(), or None."""
    return getattr(model, _ATTR, None)


def changed_after(rec: Recording, t: torch.Tensor) -> bool:
    """Whether an in-place op outside the block changed recorded tensor t (not recorded, so the
    replay would miss it). Seen through the version counter t shares with the recorded ones."""
    key = rec.key_of(t)
    return key is not None and t._version > rec.exit_versions.get(key, t._version)


def forget(model: torch.nn.Module) -> None:
    """Drops the recording from the model's modules (once replayed it is only memory)."""
    for m in model.modules():
        m.__dict__.pop(_ATTR, None)


# ---- replay ------------------------------------------------------------------------------------


def _to_cpu(x):
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x


def replay(rec: Recording, wanted: dict[int, object], *, full: bool) -> None:
    """Runs the recording on the CPU. `wanted` maps storage keys to a callback `fn(storage)`
    called with the final value (an UntypedStorage) of that storage right before it is freed.

    full=False runs only the ops the wanted storages depend on, unless one of them is random
    (then everything runs, so the random stream stays that of the full construction)."""
    final = {k: rec.version[k] for k in wanted}
    ops = rec.ops if full else _needed(rec, final)
    last: dict[tuple, int] = {}
    for i, op in enumerate(ops):
        for r in op.reads + op.writes:
            last[(r.key, r.version)] = i
    for k, v in final.items():
        if (k, v) not in last:
            raise RuntimeError(f"deferred_init: storage {k} has no recorded value")
    live: dict[tuple, torch.UntypedStorage] = {}

    def resolve(x):
        if not isinstance(x, Ref):
            if isinstance(x, torch.Tensor) and x.is_meta:
                raise RuntimeError("deferred_init: the model uses a meta tensor made outside the "
                                   "deferred_init() block; its values were never recorded")
            return _to_cpu(x)
        s = live.get((x.key, x.version))
        if s is None:  # a fresh version: the op that writes it reads nothing of it
            s = torch.UntypedStorage(rec.nbytes[x.key])
            live[(x.key, x.version)] = s
        return torch.empty(0, dtype=x.dtype).set_(s, x.offset, x.size, x.stride)

    state = torch.get_rng_state()
    torch.set_rng_state(rec.rng_state)
    try:
        with torch.no_grad():
            for i, op in enumerate(ops):
                if op.reseed is not None:
                    torch.set_rng_state(op.reseed)
                args = tree_map(resolve, op.args)
                kwargs = tree_map(resolve, op.kwargs)
                out = op.func(*args, **kwargs)
                flat, _ = tree_flatten(out)
                consts = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, torch.Tensor)}
                for r, j in op.new:
                    t = flat[j]
                    if t.untyped_storage().data_ptr() in consts:  # lift_fresh: the constant
                        t = t.clone()  # itself, which must stay as recorded
                    if (t.storage_offset(), tuple(t.stride())) == (r.offset, r.stride) and \
                            t.untyped_storage().nbytes() == rec.nbytes[r.key]:
                        live[(r.key, r.version)] = t.untyped_storage()
                    else:  # the CPU kernel laid it out differently: copy into the recorded one
                        resolve(r).copy_(t)
                del out, flat, args, kwargs
                for r in {(r.key, r.version) for r in op.reads + op.writes}:
                    if last.get(r) == i:
                        s = live.pop(r, None)
                        if r[0] in wanted and final[r[0]] == r[1] and s is not None:
                            wanted[r[0]](s)
    finally:
        # Nothing drew from the generator since the block: leave it where eager construction
        # would have; otherwise put back what the caller had.
        if ops is not rec.ops or not full or rec.rng_end is None \
                or not torch.equal(state, rec.rng_end):
            torch.set_rng_state(state)


def _needed(rec: Recording, final: dict[int, int]) -> list[Op]:
    need = {(k, v) for k, v in final.items()}
    keep = []
    for op in reversed(rec.ops):
        if any((r.key, r.version) in need for r in op.writes):
            keep.append(op)
            need.update((r.key, r.version) for r in op.reads)
    keep.reverse()
    if any(torch.Tag.nondeterministic_seeded in op.func.tags for op in keep):
        return rec.ops
    return keep
