"""Sharding a model whose parameters are on the meta device: shard(model, device=...,
weights=...) makes each rank build only what it keeps.

Sources of the values, checked in prepare() before anything changes:
  weights=DIR   safetensors files (zero/weight_files.py): each rank reads the byte ranges of its
                own slice of every flat shard (stage 3), or whole tensors (stages 1/2, frozen
                parameters, persistent buffers).
  a recording   the model was built inside tierlift.zero.deferred_init() (zero/deferred.py):
                the recorded construction is replayed on the CPU, and each parameter's final
                value is cut down to this rank's slices as soon as it is final. Bit-identical
                to building the model eagerly after the same torch.manual_seed.
Buffers not in the files (non-persistent ones such as rotary tables) come from the recording
(only the ops they depend on run, unless one of those is random), or are already real (e.g.
accelerate's init_empty_weights(), which leaves buffers on the CPU); otherwise shard() refuses.

Memory per rank at stage 3: this rank's shards plus, with a recording, whatever the model's own
construction keeps alive at once (one parameter for models that initialise parameter by
parameter; see deferred.py), and with files, one read at a time. Stages 1/2 keep the whole model
on every rank anyway, so they materialize it whole.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tierlift.lowp import delayed
from tierlift.zero.deferred import changed_after, forget, recording_of, replay
from tierlift.zero.unit import source_key
from tierlift.zero.weight_files import WeightFiles


def _owners(model: nn.Module, kind: str) -> dict[int, list]:
    """{id(tensor): [tensor, [names], [(module, attr)], persistent]} for parameters or buffers."""
    out: dict[int, list] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        table = mod._parameters if kind == "param" else mod._buffers
        for attr, t in table.items():
            if t is None:
                continue
            rec = out.setdefault(id(t), [t, [], [], False])
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if fqn not in rec[1]:
                rec[1].append(fqn)
            if not any(m is mod and a == attr for m, a in rec[2]):
                rec[2].append((mod, attr))
            if kind == "buffer" and attr not in mod._non_persistent_buffers_set:
                rec[3] = True
    return out


def first_meta(model: nn.Module) -> str | None:
    """The name of the first parameter or buffer on the meta device, or None."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            return name
    return None


def check_no_meta(model: nn.Module) -> None:
    """Raises if a parameter or buffer of `model` is still on the meta device."""
    for kind, items in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t.is_meta:
                raise RuntimeError(f"{kind} {name!r} is still on the meta device after shard(); "
                                   "it would compute nothing: see tierlift.zero.deferred_init "
                                   "and shard(weights=...)")


def prepare(model: nn.Module, *, device, weights, sharded=None) -> Materializer | None:
    """A Materializer for a model with meta tensors (None for an ordinary model). Checks that
    every meta tensor has a source; changes nothing. sharded(param) says which parameters go
    into units (default: the trainable ones; stage 3 shards frozen ones too)."""
    meta = first_meta(model)
    if meta is None:
        if device is not None or weights is not None:
            real = next(iter(model.parameters()), None)
            raise ValueError("shard(device=..., weights=...) builds a model whose parameters are "
                             "on the meta device; this model's are on "
                             f"{None if real is None else real.device}: move it with .to() and "
                             "load weights with tierlift.zero.load_full_state_dict")
        return None
    if device is None:
        raise ValueError(f"{meta!r} is on the meta device: pass device= (where the shards "
                         "go, e.g. 'cuda' or 'cpu') and weights=DIR or a model built inside "
                         "tierlift.zero.deferred_init()")
    return Materializer(model, torch.device(device), weights, sharded)


class Materializer:
    def __init__(self, model: nn.Module, device: torch.device, weights, sharded=None) -> None:
        self.model = model
        self.sharded = sharded or (lambda t: t.requires_grad)
        self.device = device
        self.files = None if weights is None else WeightFiles(weights)
        self.rec = recording_of(model)
        self.params = _owners(model, "param")
        self.buffers = _owners(model, "buffer")
        real = [names[0] for t, names, _, _ in self.params.values()
                if self.sharded(t) and not t.is_meta]
        if real:
            raise ValueError(f"parameter {real[0]!r} is on {self.params_device(real[0])} while "
                             f"{first_meta(model)!r} is on the meta device: build all trainable "
                             "parameters on meta, or none (at stage 3, which shards frozen "
                             "ones too, all floating-point parameters)")
        if self.files is None and self.rec is None:
            raise ValueError("the model's parameters are on the meta device and nothing says "
                             "what they hold: pass weights=DIR (safetensors, as save_pretrained "
                             "writes) or build the model inside tierlift.zero.deferred_init()")
        # Where each meta tensor that is not a trainable parameter comes from.
        self.rest: list[tuple[list, str]] = []  # ([tensor, names, owners, persistent], source)
        for kind, table in (("param", self.params), ("buffer", self.buffers)):
            for entry in table.values():
                t, names = entry[0], entry[1]
                if kind == "param" and self.sharded(t):
                    continue
                self.rest.append((entry, self._source(kind, entry)))
        if self.files is not None:
            for entry in self.params.values():
                if self.sharded(entry[0]):
                    self._file_name(entry[1], entry[0].shape, required=True)
            known = set(model.state_dict().keys())
            # Hugging Face models list file tensors their loader skips (GPT-2's old attn.bias
            # masks, still in the hub's files): from_pretrained ignores them, so do we.
            ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
            extra = [n for n in self.files.names() if n not in known
                     and not any(re.search(pat, n) for pat in ignored)]
            if extra:
                raise ValueError(f"weights={self.files.path!r} holds tensors the model does not "
                                 f"have: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if self.rec is not None:
            for t, names, _, _ in [*self.params.values(), *self.buffers.values()]:
                if t.is_meta and self.rec.key_of(t) is None and \
                        not delayed.is_history_name(names[0]):  # made never filled
                    raise ValueError(f"{names[0]!r} is on the meta device but was not made "
                                     "inside the deferred_init() block")
                if t.is_meta and changed_after(self.rec, t):
                    raise ValueError(f"{names[0]!r} was changed in place after the "
                                     "deferred_init() block, on meta, where nothing is "
                                     "recorded: make the change inside the block")

    def params_device(self, name: str) -> torch.device:
        return next(t.device for t, names, _, _ in self.params.values() if name in names)

    def _file_name(self, names: list[str], shape, *, required: bool) -> str | None:
        # Of tied names the files hold, the last in model order, as torch's load_state_dict
        # (and load_full_state_dict: unit.source_key) leaves it.
        found = None if self.files is None else source_key(names, self.files)
        if found is None:
            if required:
                raise KeyError(f"weights={self.files.path!r} has no tensor {names[0]!r} (a "
                               "weight the files store once for two names must be tied in the "
                               "model before shard(): after accelerate.init_empty_weights(), "
                               "call model.tie_weights())")
            return None
        for name in names:  # every tied name the files hold must fit, not only the one read
            if name in self.files and tuple(self.files.shape(name)) != tuple(shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(self.files.shape(name))}, "
                                 f"the model expects {tuple(shape)}")
        return found

    def _source(self, kind: str, entry: list) -> str:
        """Where a frozen parameter or a buffer comes from: "file", "move" (already real),
        "replay" or "history" (a delayed FP8 layer's amax history, never filled). A frozen
        parameter must be in the files when there are files."""
        t, names, _, persistent = entry
        if self.files is not None and kind == "param":
            self._file_name(names, t.shape, required=True)
            return "file"
        if self.files is not None and persistent:
            if self._file_name(names, t.shape, required=False) is not None:
                return "file"
            if delayed.is_history_name(names[0]):
                # weights saved before the model was converted: a delayed FP8 layer's amax
                # history starts never filled, as load_state_dict leaves it
                return "history"
            # torch's strict load_state_dict refuses a missing key: keeping the constructed
            # value (BatchNorm's running_mean of zeros) would be a silently different model.
            raise KeyError(f"weights={self.files.path!r} has no tensor {names[0]!r}, a "
                           "persistent buffer of the model (in its state_dict()); its "
                           "constructed value would be kept in place of the saved one. Save "
                           "the files from model.state_dict(), or, if the constructed value is "
                           "meant, register the buffer with persistent=False")
        if not t.is_meta:
            return "move"
        if delayed.is_history_name(names[0]):  # converted after deferred_init(): not recorded
            return "history"
        if self.rec is not None:
            return "replay"
        raise ValueError(f"buffer {names[0]!r} is on the meta device and not in the weights: "
                         "build the model inside tierlift.zero.deferred_init() (which records "
                         "how it is computed) or with accelerate.init_empty_weights() (which "
                         "keeps buffers on the CPU)")

    # ---- shard() calls this once the units are known ------------------------------------------
    def run(self, split: list, comm, stage: int) -> list[dict]:
        """Makes every non-trainable tensor real on the device (in the modules) and returns,
        per unit of `split`, the FlatUnit keyword arguments that build it without meta tensors:
        {"source": fn, "device": d} at stage 3, {"params": real tensors} at stages 1/2."""
        replayed: dict[int, torch.Tensor] = {}  # id(meta tensor) -> value (not trainable)
        wanted: dict[int, list] = {}
        for entry, src in self.rest:
            if src == "replay":
                t = entry[0]
                wanted.setdefault(self.rec.key_of(t), []).append(
                    lambda s, t=t: replayed.__setitem__(id(t), _view(s, t).clone()))
        layouts = _layouts(split, comm)
        unit_values = None
        if self.files is None:  # trainable parameters come from the recording too
            unit_values = [None] * len(split)
            for u, (_, _, params) in enumerate(split):
                unit_values[u] = self._harvest(params, layouts[u], stage, wanted, _dtype(split[u]))
        if wanted:
            replay(self.rec, {k: _calls(fns) for k, fns in wanted.items()},
                   full=self.files is None)
        values = {}
        for entry, src in self.rest:
            t, names = entry[0], entry[1]
            if src == "file":
                v = self.files.read(self._file_name(names, t.shape, required=True))
                v = v.view(t.shape)
            elif src == "move":
                v = t.detach()
            elif src == "history":
                v = torch.full(t.shape, delayed.NEVER_WRITTEN, dtype=torch.float32)
            else:
                v = replayed[id(t)]
            values[id(t)] = v.to(device=self.device, dtype=t.dtype)
        for entry, _ in self.rest:  # from here on the model changes
            t, _, owners, _ = entry
            new = values[id(t)]
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            for mod, attr in owners:
                (mod._parameters if isinstance(t, nn.Parameter) else mod._buffers)[attr] = new
        if self.rec is not None:
            forget(self.model)
        out = []
        for u, (_, _, params) in enumerate(split):
            if stage < 3:
                vals = unit_values[u] if unit_values is not None else [
                    self.files.read(self._file_name(names, p.shape, required=True)).view(p.shape)
                    for p, names, _ in params]
                out.append({"params": [(v.to(self.device), names, owners) for v, (_, names, owners)
                                       in zip(vals, params, strict=True)]})
            elif unit_values is not None:
                out.append({"source": _ready(unit_values[u], layouts[u]),
                            "device": self.device})
                unit_values[u] = None
            else:
                out.append({"source": self._file_source(params, layouts[u], _dtype(split[u])),
                            "device": self.device})
        return out

    def _harvest(self, params: list, layout: tuple, stage: int, wanted: dict,
                 dtype: torch.dtype):
        """Registers replay callbacks keeping a unit's values: whole tensors (stages 1/2) or
        this rank's slice of the flat shard (stage 3)."""
        lo, n, offsets = layout
        if stage < 3:
            vals = [None] * len(params)
            for i, (p, _, _) in enumerate(params):
                wanted.setdefault(self.rec.key_of(p), []).append(
                    lambda s, p=p, i=i: vals.__setitem__(i, _view(s, p).clone()))
            return vals
        buf = torch.zeros(n, dtype=dtype)
        for (p, _, _), off in zip(params, offsets, strict=True):
            a, b = max(off, lo), min(off + p.numel(), lo + n)
            if a < b:
                wanted.setdefault(self.rec.key_of(p), []).append(
                    lambda s, p=p, a=a - off, b=b - off, at=a - lo:
                    buf[at:at + b - a].copy_(_view(s, p).reshape(-1)[a:b]))
        return buf

    def _file_source(self, params: list, layout: tuple, dtype: torch.dtype):
        lo, n, offsets = layout
        names = [self._file_name(nm, p.shape, required=True) for p, nm, _ in params]

        def source(lo_: int, n_: int) -> torch.Tensor:
            assert (lo_, n_) == (lo, n), "FlatUnit layout differs from materialize's"
            buf = torch.zeros(n, dtype=dtype)
            for (p, _, _), off, name in zip(params, offsets, names, strict=True):
                a, b = max(off, lo), min(off + p.numel(), lo + n)
                if a < b:
                    self.files.read_into(name, a - off, buf[a - lo:b - lo])
            return buf  # on the CPU: FlatUnit puts it on the device or in the offload tier
        return source


def _dtype(unit: tuple) -> torch.dtype:
    """The dtype of a unit's slices: its frozen parameters' own, fp32 for trainable ones."""
    return getattr(unit[1], "dtype", torch.float32)  # a frozen.Frozen key has one


def _layouts(split: list, comm) -> list[tuple[int, int, list[int]]]:
    """Per unit: (lo, shard numel, parameter offsets) as FlatUnit lays it out."""
    out = []
    for _, _, params in split:
        offsets, off = [], 0
        for p, _, _ in params:
            offsets.append(off)
            off += p.numel()
        shard = -(-off // comm.world)
        out.append((comm.rank * shard, shard, offsets))
    return out


def _ready(buf: torch.Tensor, layout: tuple):
    held = [buf]  # handed over once: the FlatUnit then holds the only reference

    def source(lo: int, n: int) -> torch.Tensor:
        assert (lo, n) == layout[:2], "FlatUnit layout differs from materialize's"
        return held.pop()
    return source


def _view(storage: torch.UntypedStorage, t: torch.Tensor) -> torch.Tensor:
    """The recorded tensor t (meta) as a view of its replayed storage."""
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def _calls(fns: list):
    def call(storage):
        for fn in fns:
            fn(storage)
    return call
