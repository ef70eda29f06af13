"""offload_blocks: activation offload applied per block of a model, with a Policy per block and
backward reading one block ahead.

Each block's forward is wrapped (the module's own forward is kept, and put back by remove()):
under torch.no_grad it runs unchanged; otherwise its saved tensors go where the policy says,
tagged with the block, and a gradient hook on its output tells the forward's session when
backward reaches the block, which then reads that block and the one before it ahead
(double-buffered: one block computes while the next one's activations arrive). Block 0 starts
a new forward's session, the last block ends it (its writes are waited for there, so an I/O
error surfaces in forward). An exception anywhere in the model's forward (a block, a hook, the
loss after the last block) abandons the sessions that forward opened at once, through a forward
hook on the model that runs also when its forward raises: the exception's traceback keeps the
graph, and with it the spill file, alive for as long as the caller keeps the exception.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from tierlift.activations.context import offload
from tierlift.activations.policy import Policy


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the model's longest nn.ModuleList (the transformer blocks)."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks; pass "
                         "blocks=[...] (the modules whose activations are offloaded, in order)")
    prefix = best[0] + "." if best[0] else ""
    return [(f"{prefix}{i}", m) for i, m in enumerate(best[1])]


def _prefetch_hook(session_ref, top: int):
    def reached(grad):
        session = session_ref()
        if session is not None:
            session.prefetch(top)

    return reached


def _first_grad_tensor(out):
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        for x in out:
            found = _first_grad_tensor(x)
            if found is not None:
                return found
    return None


def _compared(buffer: torch.Tensor) -> bool:
    """Whether a buffer's values are compared after the forward to keep only those it changed.
    On the CPU a cheap read; on a GPU torch.equal waits for the device, once per buffer of
    every recompute block at every forward, so its copy (already made) is kept instead: exact
    too, for the memory of the block's buffers until its backward."""
    return buffer.device.type == "cpu"


class _Replay:
    """A recompute-tier block's forward for torch's checkpoint, which calls it twice: in forward,
    and again in backward to recompute what it saves. The second call must compute what the
    first did and change nothing: the modules' training flags (an evaluation between forward
    and backward leaves the model in eval mode) and the buffers the forward updated
    (BatchNorm's running statistics, spectral norm's power-iteration vectors) are set back to
    what they were at the forward while it runs, and to their current values after it. A buffer
    the forward left alone but something else changed before the recomputation is refused: its
    forward value is gone (on the CPU; a GPU block keeps every buffer's, see _compared)."""

    def __init__(self, name: str, block: nn.Module, forward):
        self.name, self.block, self.forward = name, block, forward
        self.buffers = list(dict.fromkeys(block.buffers()))  # a shared buffer once
        self.first: list[torch.Tensor | None] | None = None  # None until the forward ran
        self.versions: list[int] = []  # after the forward
        self.modes = [(m, m.training) for m in block.modules()]

    def __call__(self, *args, **kwargs):
        if self.first is None:
            return self._forward(args, kwargs)
        return self._recompute(args, kwargs)

    def _forward(self, args, kwargs):
        bufs = self.buffers
        before = [b._version for b in bufs]
        values = [b.detach().clone() for b in bufs]
        out = self.forward(*args, **kwargs)
        self.versions = [b._version for b in bufs]
        # Some kernels update a buffer without its version counter (BatchNorm's running
        # statistics: native_batch_norm and cudnn_batch_norm): the values tell. Constant
        # buffers are not kept.
        changed = [v != w or not _compared(b) or not torch.equal(x, b)
                   for v, w, x, b in zip(before, self.versions, values, bufs, strict=True)]
        self.first = [x if c else None for x, c in zip(values, changed, strict=True)]
        return out

    def _recompute(self, args, kwargs):
        kept = [(b, x) for b, x in zip(self.buffers, self.first, strict=True) if x is not None]
        for b, x, version in zip(self.buffers, self.first, self.versions, strict=True):
            if x is None and b._version != version:
                name = next((n for n, y in self.block.named_buffers() if y is b), "?")
                raise RuntimeError(
                    f"buffer {name!r} of block {self.name!r} (policy 'recompute') was modified "
                    "in place after the block's forward and before backward recomputed it, so "
                    "the recomputation would not compute what the forward did; modify it after "
                    "backward, or give the block another tier")
        now = [(b, b.detach().clone()) for b, _ in kept]
        modes = [(m, m.training) for m, _ in self.modes]
        self._load(kept)
        for m, training in self.modes:
            m.training = training
        try:
            return self.forward(*args, **kwargs)
        finally:
            self._load(now)
            for m, training in modes:
                m.training = training

    @staticmethod
    def _load(pairs) -> None:
        with torch.no_grad():
            for b, value in pairs:
                with torch.autograd._unsafe_preserve_version_counter(b):
                    b.copy_(value)


class _WrappedForward:
    """A block's wrapped forward, set in its __dict__. It refers to the block weakly: a bound
    method there refers back to the block, a cycle that keeps the block (its weights) and the
    handle (its RAM buffers, io engine) alive after the caller drops the model and the handle,
    until a gc pass. A deepcopy of the model (an EMA copy) binds the copy to its own block."""

    __slots__ = ("run", "block")

    def __init__(self, run, block: nn.Module):
        self.run = run
        self.block = weakref.ref(block)

    def __call__(self, *args, **kwargs):
        block = self.block()
        if block is None:
            raise RuntimeError("this wrapped forward's block no longer exists")
        return self.run(block, *args, **kwargs)

    def __deepcopy__(self, memo):
        block = self.block()
        # Copying the block copies its __dict__, so the block's copy is in memo already.
        twin = memo.get(id(block))
        return _WrappedForward(self.run, twin if twin is not None else copy.deepcopy(block, memo))


class BlockOffload:
    """Returned by offload_blocks: last_stats, remove() (puts the blocks' forwards back),
    trim() (frees idle RAM-tier buffers), close() (remove, then close the io engine)."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], policy: Policy, tiers: offload,
                 model: nn.Module | None = None):
        # Weakly: each block's wrapped forward holds this handle, and a handle holding the
        # blocks back would make a cycle that keeps the weights, the RAM tier's buffers and the
        # io engine alive after the caller drops the model and the handle, until a gc pass.
        self._blocks = [(name, weakref.ref(block)) for name, block in blocks]
        self.policy = policy
        self._offload = tiers
        # The forward in progress is per thread: a second thread's forward of the same model
        # (a background worker) opens sessions of its own instead of saving into this one's.
        self._local = threading.local()
        self._originals = []
        self._hooks = [] if model is None else self._watch_forward(model)
        for i, (name, block) in enumerate(blocks):
            if "forward" in block.__dict__:
                raise ValueError(f"block {name!r} already has a wrapped forward (is "
                                 "offload_blocks applied twice?)")
            self._originals.append(weakref.ref(block))
            block.forward = _WrappedForward(self._wrap(i, name), block)

    @property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        """(name, block) of the offloaded blocks still alive, in forward order."""
        return [(name, block) for name, ref in self._blocks if (block := ref()) is not None]

    @property
    def _session(self):
        return getattr(self._local, "session", None)

    @_session.setter
    def _session(self, session) -> None:
        self._local.session = session

    @property
    def _calls(self) -> list[tuple[BaseException | None, list]]:
        """Per model call in progress in this thread: (the exception being handled when it
        started, weak references to the sessions it opened)."""
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    @property
    def last_stats(self) -> dict:
        return self._offload.last_stats

    def _watch_forward(self, model: nn.Module) -> list:
        # Closures, not bound methods: a deepcopy of the model must not copy this handle.
        def started(module, args):
            self._calls.append((sys.exc_info()[1], []))

        def ended(module, args, output):
            calls = self._calls
            if not calls:
                return
            outer, opened = calls.pop()
            exc = sys.exc_info()[1]  # with always_call, set only while the forward's error is
            if exc is None or exc is outer:  # handled (or an outer one, for a normal return)
                # The forward is over even if its last block did not run (skipped, as layer
                # drop does, or blocks called in another order): its writes are waited for
                # here, an error surfaces here, and backward (or none) can free the file.
                for ref in opened:
                    session = ref()
                    if session is not None and not session.finished and session.failed is None:
                        if self._session is session:
                            self._session = None
                        session.finish()
                return
            for ref in opened:
                session = ref()
                if session is not None and session.failed is None:
                    session.abandon(exc)
            if self._session is not None and self._session.failed is not None:
                self._session = None

        return [model.register_forward_pre_hook(started),
                model.register_forward_hook(ended, always_call=True)]

    def _wrap(self, i: int, name: str):
        tier = self.policy[i]
        last = len(self._blocks) - 1

        # Not traced when the block (or the model) is compiled: dynamo rebuilt `forward`
        # after the hooks' graph break as `block.forward`, this wrapper, and recursed until
        # RecursionError. The block's own forward below is still compiled.
        @torch.compiler.disable(recursive=False)
        def run(block, *args, **kwargs):
            forward = type(block).forward.__get__(block)
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            session = self._session
            if i == 0 or session is None or session.finished or session.failed is not None:
                session = self._session = self._offload.session()
                if self._calls:
                    self._calls[-1][1].append(weakref.ref(session))
            hook_tier = "keep" if tier == "recompute" else tier
            hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: session.pack(t, name, hook_tier), session.unpack)
            try:
                with hooks:
                    if tier == "recompute":
                        out = torch.utils.checkpoint.checkpoint(_Replay(name, block, forward),
                                                                *args, use_reentrant=False,
                                                                **kwargs)
                    else:
                        out = forward(*args, **kwargs)
                if i == last:
                    self._session = None
                    session.finish()
            except BaseException as e:
                self._session = None
                session.abandon(e)
                raise
            anchor = _first_grad_tensor(out)
            top = session.group_top.get(name)
            if anchor is not None and top is not None:
                # Backward reached this block: read it (if not yet) and the one before ahead.
                # Weakly: the graph (alive while the user keeps `loss`) must not keep the
                # session, whose spill file goes once backward has consumed it.
                anchor.register_hook(_prefetch_hook(weakref.ref(session), top))
            return out

        return run

    def remove(self) -> None:
        for ref in self._originals:
            block = ref()
            if block is not None:
                block.__dict__.pop("forward", None)
        self._originals = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def trim(self) -> None:
        self._offload.trim()

    def close(self) -> None:
        self.remove()
        self._offload.close()


def offload_blocks(model: nn.Module, policy: str | Sequence[str] | Policy = "auto", *,
                   cpu_budget: int, nvme_path=None, blocks: Sequence[nn.Module] | None = None,
                   io_bytes: int = 64 << 20, gpu_budget: int = 0,
                   min_bytes: int = 1 << 20) -> BlockOffload:
    """Offloads each block's saved activations as `policy` says (one of keep, ram, nvme,
    recompute, auto for all blocks, or one per block). `blocks`: the modules, in forward order
    (default: the model's longest nn.ModuleList). The other arguments: see OffloadConfig."""
    if blocks is None:
        named = find_blocks(model)
    else:
        names = {id(m): n for n, m in model.named_modules()}
        missing = [i for i, b in enumerate(blocks) if id(b) not in names]
        if missing:
            raise ValueError(f"blocks {missing} are not submodules of the model")
        named = [(names[id(b)], b) for b in blocks]
    pol = Policy.of(policy, len(named))
    tiers = offload(cpu_budget, nvme_path, io_bytes=io_bytes, gpu_budget=gpu_budget,
                    min_bytes=min_bytes, params=model)
    if "nvme" in pol.tiers and tiers.config.nvme_path is None:
        raise ValueError("the policy sends blocks to NVMe but no nvme_path was given")
    return BlockOffload(named, pol, tiers, model)
