"""FlatUnit: the parameters of one ZeRO unit (a module gathered and freed as a whole) kept in
one flat buffer.

Layout: the unit's trainable parameters, back to back, padded to a multiple of the world size.
  shard  fp32 nn.Parameter [padded / world]: this rank's slice, the master weights; it is what
         model.parameters() yields and what the optimizer steps.
  full   leaf tensor [padded] in the compute dtype (requires grad, never a Parameter): the
         gathered weights. Before each forward the module's parameter attributes are set to
         views of `full`, so autograd sums every use of every parameter (tied weights, several
         forward calls) into one full.grad, which is reduce-scattered as a single collective.
Stage 3 frees full's storage after use (the views and tensors saved for backward keep pointing
at the same storage, which the pre-backward all-gather refills). With parameter offload
(`offload`, a ParamOffload) the shard lives in host memory and gathers stage it to the device
first (see param_offload.py). With shard(param_group_fn=...) a module's parameters are split
over several FlatUnits, one per group key (see groups.py).

Frozen parameters (requires_grad=False; stage 3 only) go to FlatUnits of their own, one per
module and dtype, with `frozen` set: a separate unit rather than a flag per entry, so a
unit's `full` either requires grad as a whole or not at all, and a frozen unit has no grad
hook, no gradient buffer, no reduction and no optimizer state with no test inside the
gradient path. Its shard keeps the parameters' own dtype (a bf16 base costs 2 bytes per
element per world, not 4) and is an nn.Parameter with requires_grad=False; it is gathered in
that dtype (or MixedPrecision.param_dtype) and freed after its module's backward (hooks.py).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._C._autograd import CreationMeta, _get_creation_meta, _set_creation_meta

from tierlift import ops
from tierlift.zero.freed import freed_weights


@dataclass(kw_only=True)
class ParamEntry:
    """One unique parameter of a unit and every (module, attribute) that refers to it."""

    names: list[str]
    owners: list[tuple[weakref.ref, str]] = field(repr=False)  # (module, attribute)
    shape: torch.Size
    offset: int
    numel: int


class ShardParameter(nn.Parameter):
    """A unit's shard (the fp32 master slice the optimizer steps). Writes through `.data`
    (`p.data.copy_(ema)`, `p.data = ema`, torch.nn.utils.vector_to_parameters) bump no version
    counter, so stages 1/2 would keep forwarding the weights gathered before them: `.data` hands
    out a tensor whose version the unit checks at the next forward, step or full_state_dict, and
    a new tensor set through it is recorded, so the next forward gathers again."""

    @property
    def data(self) -> torch.Tensor:
        d = nn.Parameter.data.__get__(self)
        unit = _UNITS.get(id(self))
        if unit is not None and unit() is not None:
            unit().data_handles.append((d, d._version))
        return d

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        ref = _UNITS.get(id(self))
        unit = ref() if ref is not None else None
        if unit is not None:
            unit.check_new_data(self, value)
            # The same storage again (module.to() to where it is already): nothing moved.
            moved = value.data_ptr() != self.data_ptr() or value.stride() != self.stride()
        nn.Parameter.data.__set__(self, value)
        if unit is not None and moved:
            unit.data_replaced()


_UNITS: dict[int, weakref.ref] = {}  # id(shard) -> its FlatUnit


class WatchedView(torch.Tensor):
    """A module attribute of a stage 1/2 unit gathered in another dtype than its masters: a
    plain view (every operation returns plain tensors) whose `.data` is handed out as with
    ShardParameter, so an edit through it (`module.weight.data.copy_(x)`, which bumps no
    version counter of `full`) is refused like any other edit of the compute copy."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        d = torch.Tensor.data.__get__(self)
        ref = _VIEWS.get(id(self))
        unit = ref() if ref is not None else None
        if unit is not None:
            unit.attr_handles.append((d, d._version))
        return d

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, value)  # refused at the next check (moved_attrs)


_VIEWS: dict[int, weakref.ref] = {}  # id(WatchedView) -> its FlatUnit, while installed


def _as_single_view(view: torch.Tensor) -> None:
    """Lets autograd treat a piece of one split as it treats a slice. After an in-place change
    of `full` or of any piece under no_grad (nn.Embedding(max_norm=...) renormalizes its weight
    in its forward; a weight edited between steps), torch refuses to use the output of a
    multi-output view in grad mode; a view of the default kind instead rebuilds its backward
    as an as_strided of `full` (the sliced view's cost for that view, the same values). In-place
    changes in grad mode stay refused as for any view of a leaf that requires grad."""
    if _get_creation_meta(view) == CreationMeta.MULTI_OUTPUT_NODE:
        _set_creation_meta(view, CreationMeta.DEFAULT)


def source_key(names: list[str], state_dict, prefix: str = "") -> str | None:
    """The key of `state_dict` a parameter known by `names` (its tied aliases, in model order)
    loads from, or None: torch's load_state_dict copies each alias in turn into the one tensor,
    so the last one present wins. Every full-weight load of a sharded model picks by this."""
    return next((prefix + n for n in reversed(names) if prefix + n in state_dict), None)


class FlatUnit:
    def __init__(self, *, name: str, module: nn.Module,
                 params: list[tuple[nn.Parameter, list[str], list[tuple[nn.Module, str]]]],
                 comm, compute_dtype: torch.dtype, keep_full: bool, offload=None, group=None,
                 source=None, device=None, frozen: bool = False,
                 shard_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None):
        # source(lo, n) -> this rank's slice [lo, lo + n) of the padded flat buffer (on
        # the CPU): the unit is built from its shard alone, never whole, on `device` (stage 3
        # only; params may then be on meta; see materialize.py).
        self.name = name or "<root>"
        self.group = group  # the param_group_fn key of these parameters (zero/groups.py)
        self.frozen = frozen  # requires_grad=False parameters: gathered, never reduced
        # The dtype full weights are handed out in (state dicts): the parameters' own for a
        # frozen unit (its shard may be fp32 when a file holds it), fp32 masters otherwise.
        self.out_dtype = out_dtype or shard_dtype
        self.pending_backward = 0  # frozen: module calls whose backward has not ended yet
        self.pinned = False        # frozen: kept gathered until the end of this backward
        self.expects_backward = False  # an output of this forward's call requires grad
        # Weak references to modules: the model owns its ZeRO state, never the reverse, so a
        # dropped model is freed at once (not by the garbage collector, which may run after
        # destroy_process_group(), when freeing in-flight collective buffers aborts the process).
        self._module = weakref.ref(module)
        self.comm = comm
        self.compute_dtype = compute_dtype
        self.offload = offload  # ParamOffload: the shard lives in host memory
        self.gather_event = None  # with offload and CUDA: the gather issued on the copy stream
        self.entries: list[ParamEntry] = []
        offset = 0
        for p, names, owners in params:
            self.entries.append(ParamEntry(names=names,
                                           owners=[(weakref.ref(m), a) for m, a in owners],
                                           shape=p.shape,
                                           offset=offset, numel=p.numel()))
            offset += p.numel()
        self.numel = offset
        world = comm.world
        self.padded = -(-offset // world) * world
        # The pieces install_views' one split cuts: the entries (back to back), then the padding.
        self.split_sizes = [e.numel for e in self.entries] + (
            [self.padded - offset] if self.padded > offset else [])
        self.shard_numel = self.padded // world
        device = params[0][0].device if device is None else torch.device(device)
        self.device = device
        lo = comm.rank * self.shard_numel
        # With fp32 compute and replicated weights (stages 1/2) the shard is this rank's slice
        # of the gathered buffer itself: no second copy of it.
        self.aliased = keep_full and compute_dtype == shard_dtype
        full32 = None  # the whole unit in the shard dtype, while it is built
        if source is not None:
            if keep_full:
                raise ValueError("a FlatUnit built from its shard alone needs stage 3")
            piece = source(lo, self.shard_numel)
            piece = piece.to(shard_dtype)
            self.shard = ShardParameter(piece.to(device) if offload is None
                                        else offload.host_shard(piece), requires_grad=not frozen)
            del piece
            # Not gathered: shard() frees it at once (stage 3) and the first forward gathers.
            self.full = torch.empty(self.padded, dtype=compute_dtype, device=device)
        else:
            full32 = torch.empty(self.padded, dtype=shard_dtype, device=device)
            ops.flatten_pack_(full32, [p.detach().to(shard_dtype) for p, _, _ in params])
        if source is None and self.aliased:
            self.full = full32
            self.shard = ShardParameter(full32[lo:lo + self.shard_numel],
                                        requires_grad=not frozen)
        elif source is None:
            piece = full32[lo:lo + self.shard_numel]
            self.shard = ShardParameter(piece.clone() if offload is None
                                        else offload.host_shard(piece), requires_grad=not frozen)
            self.full = torch.empty(self.padded, dtype=compute_dtype, device=device)
            self.full.copy_(full32)
        self.full.requires_grad_(not frozen)
        del full32
        for _, _, owners in params:
            for mod, attr in owners:
                del mod._parameters[attr]
        self.gathered = source is None   # full holds the current weights
        self.stale = False     # the optimizer changed the shard since the last gather
        self.pending = None    # (work, src) of an async all-gather in flight
        self.full_grad = None  # stage 1: the averaged full gradient of the last backward
        self.fp8_gather = None  # an Fp8Gather (zero/fp8_gather.py) with fp8_all_gather=True
        self.shard_version = self.shard._version
        # Stages 1/2 in another compute dtype: `full` is a copy, not the masters; an in-place
        # edit through a module attribute shows in its version (gathers write through .data).
        self.copied = keep_full and not self.aliased
        self.full_version = self.full._version
        # Stage 3: the gathered weights were changed in place before being freed (see free()).
        self.edited_gathered = False
        self.keep_full = keep_full
        self.data_handles: list = []  # (tensor, version): the shard's `.data` handed out
        self.attr_ptrs: list = []     # per entry: the data_ptr its module attributes have
        self.attr_handles: list = []  # (tensor, version): `.data` of the attributes handed out
        self._watched: list[int] = []  # ids of the WatchedViews installed
        _UNITS[id(self.shard)] = weakref.ref(self)
        weakref.finalize(self.shard, _UNITS.pop, id(self.shard), None)
        self._freed = None     # the FreedWeight stand-ins, made at the first free()
        self.install_views()

    @property
    def module(self) -> nn.Module:
        return self._module()

    # ---- storage ----
    @property
    def full_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    @property
    def gather_bytes(self) -> int:
        """Bytes `full` holds while gathered."""
        return self.padded * self.full.element_size()

    def free(self) -> None:
        """Drop the gathered weights (stage 3); the shard stays."""
        self.wait_gather()
        if self.full.untyped_storage().nbytes() > 0:
            # Changed in place since the gather (nn.Embedding(max_norm=...) renormalizes the
            # rows it reads inside its forward): the change goes with this storage and never
            # reaches the masters, while torch's parameter keeps it; the next step refuses.
            if not self.frozen and self.full._version != self.full_version:
                self.edited_gathered = True
            self.full.untyped_storage().resize_(0)
        if self.fp8_gather is not None:
            self.fp8_gather.release()  # its FP8 codes go with the weights
        self.gathered = False
        self.install_freed()

    def needs_gather(self) -> bool:
        return not self.gathered or self.stale or self.shard._version != self.shard_version

    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into `full` (compute dtype); async when async_op."""
        if self.pending is not None or not self.needs_gather():
            return
        storage = self.full.untyped_storage()
        want = self.padded * self.full.element_size()
        if storage.nbytes() != want:
            storage.resize_(want)
        # .data: writing the gathered weights must not bump the version counter autograd
        # checks on the tensors saved for backward (they are views of this very storage).
        if self.fp8_gather is not None:  # Float8Linear weights travel as FP8 bytes
            work, src = self.fp8_gather.all_gather(self, async_op)
        else:
            src = self._gather_source()
            with self._gather_stream():
                work = self.comm.all_gather(self.full.data, src, async_op=async_op)
                if self.offload is not None:
                    self.gather_event = self.offload.after()
        self.pending = (work, src)
        self.gathered, self.stale, self.shard_version = True, False, self.shard._version
        # What was written through the shard's .data so far is gathered now; later writes
        # through the same tensors still show.
        self.data_handles = [(d, d._version) for d, _ in self.data_handles]
        self.full_version = self.full._version
        self.install_views()  # in place of the freed stand-ins
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self.pending is not None:
            work, src = self.pending
            self.pending = None
            self.comm.wait(work)
            if self.fp8_gather is not None:
                self.fp8_gather.unpack(self, src)
        if self.gather_event is not None:
            self.offload.wait(self.gather_event)
            self.gather_event = None

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the device, ready to all-gather."""
        if self.offload is not None:
            return self.offload.stage_in(self.shard, self.compute_dtype)
        # The source must not alias the destination (aliased shards live inside `full`).
        return self.shard.detach().to(self.compute_dtype, copy=self.aliased)

    def _gather_stream(self):
        """Where the all-gather is issued: the copy stream of a parameter offload with CUDA."""
        return contextlib.nullcontext() if self.offload is None else self.offload.stream_context()

    def edited_copy(self) -> bool:
        """Whether a module attribute of a stage 1/2 unit gathered in another dtype than its
        masters was changed in place since the gather: the change is in the copy only."""
        if not self.copied:
            return False
        edited = self.full._version != self.full_version or any(
            d._version != v for d, v in self.attr_handles)
        if not edited:
            self.attr_handles.clear()
        return edited

    # ---- the shard's .data ----
    def check_new_data(self, shard: torch.Tensor, value) -> None:
        """Refuses (before it is set) new data the unit's layout cannot take."""
        if not isinstance(value, torch.Tensor) or value.shape != shard.shape or \
                value.dtype != shard.dtype or value.device != shard.device:
            got = (f"{tuple(value.shape)} {value.dtype} on {value.device}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise ValueError(f"the shard of unit {self.name!r} is {tuple(shard.shape)} "
                             f"{shard.dtype} on {shard.device}; `.data =` got {got}. Copy into "
                             "it instead (p.data.copy_(x)), or load full weights with "
                             "load_full_state_dict")
        if self.offload is not None:
            raise ValueError(f"the shard of unit {self.name!r} lives in offloaded memory "
                             "(offload_params): `.data =` would move it out; copy into it "
                             "instead (p.data.copy_(x))")

    def data_replaced(self) -> None:
        """The shard now has storage of its own: no longer the slice of `full` it was. `full`
        moves to new storage too: the old one may be held as a backup (`saved = p.data` before
        an EMA swap-in), which the next gather must not overwrite."""
        if self.aliased:
            self.full.data = torch.empty_like(self.full)
            self.aliased, self.copied = False, self.keep_full
            self.full_version = self.full._version
        self.stale = True

    def take_data_edits(self) -> bool:
        """Whether a tensor handed out by shard.data was changed in place since the last call."""
        edited = any(d._version != v for d, v in self.data_handles)
        self.data_handles.clear()
        return edited

    def moved_attrs(self) -> list[str]:
        """Names of weights whose module attribute was given other data (`.data = ...`) or set
        to another tensor since the views (or stand-ins) were installed."""
        out = []
        for e, ptr in zip(self.entries, self.attr_ptrs, strict=True):
            for mod, attr in e.owners:
                now = getattr(mod(), attr, None)
                if not isinstance(now, torch.Tensor) or now.data_ptr() != ptr:
                    out.append(e.names[0])
                    break
        return out

    def _unwatch(self) -> None:
        for i in self._watched:
            _VIEWS.pop(i, None)
        self._watched.clear()

    # ---- module attributes ----
    def install_views(self) -> None:
        """Point every owner attribute at its piece of `full` (fresh views: new autograd
        edges). One split makes them all: its backward is one concatenation of the parameters'
        gradients into a buffer of the unit (zeros where a parameter got none, and for the
        padding). A view sliced per parameter had each backward zero a buffer of the whole unit
        and scatter into it, and autograd summed those out of place: k memsets, copies and adds
        of the unit for k parameters, three unit-size buffers at once at the peak."""
        self.attr_ptrs = []
        self._unwatch()
        # One parameter filling the unit: a plain view, whose backward copies nothing.
        pieces = ([self.full] if len(self.split_sizes) == 1
                  else torch.split(self.full, self.split_sizes))
        for e, piece in zip(self.entries, pieces):  # the padding's piece is left over
            view = piece.view(e.shape)
            if self.copied:
                view = view.as_subclass(WatchedView)
                _VIEWS[id(view)] = weakref.ref(self)
                self._watched.append(id(view))
            _as_single_view(view)
            self.attr_ptrs.append(view.data_ptr())
            for mod, attr in e.owners:
                setattr(mod(), attr, view)

    def install_freed(self) -> None:
        """Point every owner attribute at a storage-less stand-in that raises a clear error
        when used (a view of the freed buffer would read freed memory: freed.py)."""
        if self._freed is None:
            self._freed = freed_weights(self.entries, self.compute_dtype, self.device)
        self.attr_ptrs = []
        self._unwatch()
        for e, stand_in in zip(self.entries, self._freed, strict=True):
            self.attr_ptrs.append(stand_in.data_ptr())
            for mod, attr in e.owners:
                setattr(mod(), attr, stand_in)

    # ---- full weights (state dicts, checkpoints) ----
    def check_files(self) -> None:
        """With offload_params="nvme", an OSError if the shard's file was cut short under the
        running job: reading it through the mapping would be a SIGBUS that kills the process."""
        store = getattr(self.offload, "store", None)
        if store is not None:
            store.check_files()

    def gather_fp32(self) -> torch.Tensor:
        """The unpadded master weights of the whole unit, in the shard dtype: fp32 (a frozen
        unit: its parameters' dtype, or fp32 in a file). A collective: every rank calls."""
        self.check_files()
        out = torch.empty(self.padded, dtype=self.shard.dtype, device=self.device)
        self.comm.wait(self.comm.all_gather(out, self.shard.detach().to(self.device)))
        return out[:self.numel]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter tensors (cloned, in out_dtype) of an unpadded flat buffer, under every
        alias name."""
        out = {}
        for e in self.entries:
            t = flat[e.offset:e.offset + e.numel].view(e.shape).to(self.out_dtype, copy=True)
            for name in e.names:
                out[name] = t
        return out

    def load_fp32(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the master shard from full per-parameter tensors (keyed by any alias name; of
        tied names given together, the last in model order, as torch loads them)."""
        self.check_files()
        dtype = self.shard.dtype
        full = torch.empty(self.padded, dtype=dtype, device=self.device)
        srcs = []
        for e in self.entries:
            t = tensors[source_key(e.names, tensors)]
            srcs.append(t.detach().to(device=self.device, dtype=dtype).reshape(e.shape))
        ops.flatten_pack_(full, srcs)
        lo = self.comm.rank * self.shard_numel
        with torch.no_grad():
            self.shard.copy_(full[lo:lo + self.shard_numel])
        self.stale = True
