"""One forward's saved tensors: where each went (left in place, RAM, NVMe), the NVMe file, the
write-behind and read-ahead windows, and what a failure does.

pack() runs as autograd saves a tensor during forward, unpack() as backward needs it. NVMe
writes are asynchronous (the io engine on the CPU; a D2H copy on a side stream, then the engine,
on a GPU) and finish by the end of the forward at the latest, so an I/O error surfaces there;
backward reads ahead in reverse forward order within the read-ahead window. A forward that
fails is abandoned: its file is closed (it never had a name on disk) and any later unpack
raises ActivationsDiscardedError, so no backward runs on half-saved activations. A backward that
raises (a user's hook, an op) abandons it too, at once: the graph, which the caller's `loss`
keeps alive, would otherwise hold the file and its descriptors until `loss` is dropped.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile
import time
import weakref
from collections import deque

import torch
from torch import nn
from torch.autograd import Variable

from tierlift.activations.config import ActivationsDiscardedError, BudgetError, OffloadConfig
from tierlift.activations.device import Layout, copier_for, flat_bytes, restore
from tierlift.activations.host_pool import HostPool
from tierlift.activations.kept import KeptBudget

_ALIGN = 4096


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def is_parameter(t: torch.Tensor, param_ptrs: frozenset[int]) -> bool:
    """Parameters, views of parameters and other leaves that require grad (user inputs) are
    never copied: they are alive anyway, so a copy would only add memory."""
    x = t if t._base is None else t._base  # a view is judged by what it views
    if isinstance(x, nn.Parameter) or (x.is_leaf and x.requires_grad):
        return True
    return bool(param_ptrs) and t.untyped_storage().data_ptr() in param_ptrs


def _wait_for_copies(releases: list) -> None:
    for event, _, _ in releases:
        event.synchronize()
    releases.clear()


class ActivationFile:
    """An anonymous file under nvme_path (O_TMPFILE, or a name unlinked at once where the file
    system lacks it): it disappears when closed or when the process dies, so no failure or crash
    leaves activation files behind. The engine reaches it through /proc/self/fd."""

    def __init__(self, directory: str, engine):
        self.engine = engine
        try:
            try:
                fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                fd, name = tempfile.mkstemp(prefix=".tierlift-activations-", dir=directory)
                os.unlink(name)
        except OSError as e:
            raise OSError(e.errno, f"cannot create an activation file under nvme_path "
                          f"{directory!r}: {e.strerror}") from None
        self.fd = fd
        self.path = f"/proc/self/fd/{fd}"
        self.size = 0
        self.kept = 1 << 62  # where the file was last cut back to (Session._trim_file)
        self.handles: list = []  # I/O that must finish before the descriptor closes

    def reserve(self, nbytes: int) -> int:
        offset = self.size
        self.size += _round_up(nbytes)
        return offset

    def done(self, handle) -> None:
        if handle in self.handles:  # not after close(), which waited for it
            self.handles.remove(handle)

    def close(self) -> None:
        for h in self.handles:
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - closing after a failure; the error was raised
                pass
        self.handles.clear()
        if self.fd >= 0:
            if not self.engine.closed:
                self.engine.forget(self.path)  # before the fd number can be reused
            os.close(self.fd)
            self.fd = -1


def _overlaps(t: torch.Tensor) -> bool:
    """Whether some elements share memory (an expand's stride 0): copied element by element,
    such a tensor could not be restored in its own strides, and it would take more bytes than
    it holds. Conservative: an unusual layout that may not overlap counts as overlapping."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def _check_version(t: torch.Tensor, version: int) -> None:
    """Autograd's own check, which it skips for tensors that saved_tensors_hooks packed: a
    saved tensor modified in place after it was saved would give a wrong gradient."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (tierlift.activations, like autograd, refuses "
            "a saved tensor changed after it was saved)")


class _Kept:
    """A saved tensor left in place, with its version at save time. Its storage's share of
    gpu_budget (`key`, when it is charged) goes back with it: by __del__, as autograd drops it,
    since a weakref.finalize per saved tensor made a forward's pack about 4 us slower per
    tensor (allocations the garbage collector then walks)."""

    __slots__ = ("tensor", "version", "budget", "key")

    def __init__(self, tensor, version, budget: KeptBudget, key):
        self.key = None  # set last: __del__ gives back only what hold() counted
        self.tensor, self.version, self.budget = tensor, version, budget
        self.key = key

    def __del__(self) -> None:
        if self.key is not None:
            self.budget.drop(self.key)


class Saved:
    """What autograd holds instead of a saved tensor."""

    __slots__ = ("session", "index", "group", "tier", "layout", "host", "offset", "reading",
                 "dev", "event", "uses", "source", "version", "lent", "copying", "stale",
                 "pooled", "__weakref__")

    def __init__(self, session, index, group, tier, layout):
        self.session, self.index, self.group, self.tier = session, index, group, tier
        self.layout = layout
        # The tensor while the caller keeps it (weak: holding it would defeat the offload), to
        # refuse it at unpack if it was modified in place since it was saved, as autograd does.
        self.source = self.version = None
        self.uses = 1  # packs that returned it: its bytes stay fetched until as many unpacks
        self.host = self.reading = self.dev = self.event = None
        self.pooled = None  # hands a RAM-tier CPU buffer back to the pool (HostPool.get)
        self.offset = -1
        # (weak buffer, its version) that the last unpack returned a view of: a backward that
        # edits the tensor it was given in place must not hand the edit to the next unpack.
        self.lent = None
        # A GPU tensor's copy to host runs on a side stream: `copying` until it is seen done,
        # `stale` if the tensor was modified in place before that (the copy may hold the edit).
        self.copying = self.stale = False


class _Write:
    __slots__ = ("item", "src", "event", "handle", "version", "nbytes", "source")

    def __init__(self, item, src, event, version, nbytes, source):
        self.item, self.src, self.event, self.version = item, src, event, version
        self.nbytes = nbytes
        self.source = source  # the saved tensor (or a view of it), held until it is copied
        self.handle = None


class _BackwardWatch:
    """A final callback of the backward that reads a session's tensors back. Autograd calls it
    when that backward succeeds and drops it uncalled when the backward raises, which is the
    only sign of a failed backward it gives: dropped uncalled, the watch abandons the session."""

    __slots__ = ("session", "armed", "ran")

    def __init__(self, session_ref):
        self.session, self.armed, self.ran = session_ref, False, False

    def __call__(self) -> None:
        self.ran = True
        session = self.session()
        if session is not None:
            session._watched = False  # the next backward (retain_graph=True) gets its own

    def __del__(self) -> None:
        session = self.session()
        if self.armed and not self.ran and session is not None:
            session._watched = False
            session.abandon(RuntimeError("a backward through this forward raised, so its "
                                         "saved activations were discarded"))


def _dropped(session_ref, index: int, _ref) -> None:
    """Autograd let go of saved tensor `index` (its backward ran, or the graph was freed)."""
    session = session_ref()
    if session is None:
        return
    fetched = session._fetched.pop(index, None)
    if fetched is not None:  # read ahead but never consumed: its bytes leave the window
        session._retire_read(*fetched)
    in_ram = session._in_ram.pop(index, None)
    if in_ram is not None:  # its host buffer is given back: micro-batches share cpu_budget,
        session.ram_bytes -= in_ram  # not each add to it
        session._host_pool.unreserve(in_ram)
    if session._spilled.pop(index, None) is not None:
        session._trim_file()


class _Failure:
    """Why a forward was abandoned: the exception's type and message, not the exception, whose
    traceback holds the forward's frames, whose tensors hold the graph, whose saved tensors hold
    this session: a cycle through autograd's C++ nodes that no collector breaks, which kept a
    failed offload_blocks forward's graph, buffers and share of cpu_budget for good."""

    __slots__ = ("name", "message")

    def __init__(self, exc: BaseException):
        self.name, self.message = type(exc).__name__, str(exc)

    def __str__(self) -> str:
        return self.message


def _unreserve_all(host_pool, in_ram: dict) -> None:
    host_pool.unreserve(sum(in_ram.values()))
    in_ram.clear()


class Session:
    def __init__(self, config: OffloadConfig, engines, param_ptrs: frozenset[int] = frozenset(),
                 host_pool=None, kept: KeptBudget | None = None):
        self.config = config
        self._kept = KeptBudget(config.gpu_budget) if kept is None else kept
        self._engines = engines
        self._host_pool = HostPool(config.cpu_budget) if host_pool is None else host_pool
        self._param_ptrs = param_ptrs
        self.items: list[weakref.ref] = []
        self.group_top: dict = {}  # group -> index of its last saved tensor
        self.group_bytes: dict = {}  # group -> bytes it offloaded or tried to
        self._copiers: dict = {}
        # GPU NVMe reads in flight, oldest first: (weak item, its read). The item weakly, as in
        # _copying: a backward that stops before reading it (backward(inputs=...), grad() of
        # part of the graph) must free the session and file with the graph, not at the next
        # full gc pass; the read (which holds its buffer) until it lands.
        self._reading: deque = deque()
        self._file: ActivationFile | None = None
        self._finalizer = None
        self._dedupe: dict = {}
        self._spilled: dict[int, tuple[int, int]] = {}  # index -> its bytes in the file
        # index -> [bytes in read_window, its NVMe read while not waited for] of every saved
        # tensor fetched and not yet consumed. One that dies unconsumed (backward stopped
        # early, backward(inputs=...), a partial grad(), a freed graph) leaves the window, and
        # its read (which holds its buffer) the file, when autograd lets go of it, not never.
        self._fetched: dict[int, list] = {}
        self._in_ram: dict[int, int] = {}  # index -> its bytes in the RAM tier
        # What this forward still holds of cpu_budget goes back also if the session dies with
        # its saved tensors in one gc pass (their callbacks then find no session).
        weakref.finalize(self, _unreserve_all, self._host_pool, self._in_ram)
        self._writes: deque[_Write] = deque()
        # RAM-tier D2H copies in flight, in stream order: (weak item, tensor, its version at
        # save, event). The tensor is held until its copy is seen done: modified in place before
        # that, the copy may hold the edit, and a dropped tensor could no longer tell. The item
        # weakly: it holds this session, and a graph dropped before backward must free both
        # (and the spill file) at once, not at the garbage collector's next full pass.
        self._copying: deque = deque()
        # (event, host buffer, device) of copies in flight between a pool buffer and the GPU.
        # A buffer goes back to the engine's pool only after its copy, also when the session
        # dies first.
        self._releases: list = []
        weakref.finalize(self, _wait_for_copies, self._releases)
        self.write_window = 0
        self.read_window = 0
        self._cursor = -1  # highest index that may still need a read-ahead
        # Lowest one: below it every saved tensor is consumed, dead or never read ahead, and
        # stays so (new ones come on top), so micro-batches backpropagated in one context do
        # not each scan all the earlier ones' indexes.
        self._floor = 0
        self.ram_bytes = 0
        self.ram_missing = 0  # bytes RAM could not take (counted, left in place)
        self.io_missing = 0  # largest tensor the NVMe window could not take
        self.failed: _Failure | None = None
        self.finished = False
        self._watched = False  # a _BackwardWatch waits on the running backward
        self.stats = {"tensors": 0, "kept_bytes": 0, "ram_bytes": 0, "nvme_bytes": 0,
                      "skipped_params": 0, "skipped_small": 0, "write_wait_s": 0.0,
                      "read_wait_s": 0.0, "reads_ahead": 0, "reads_on_demand": 0}

    # ---- forward ----
    # Autograd calls the hooks from C++; inside a torch.compile'd function's eager parts (a
    # graph break, a custom autograd.Function) dynamo would compile their frames, and their
    # host-side state (buffers, files, weak references) cannot be traced.
    @torch.compiler.disable
    def pack(self, t: torch.Tensor, group=None, tier: str = "auto"):
        if self.failed is not None:
            raise ActivationsDiscardedError(f"this forward was abandoned: {self.failed}")
        # A save after a backward inside the context (the next micro-batch's forward, or a
        # reentrant checkpoint's recomputation): its write must land before anything reads it.
        self.finished = False
        packed = self._pack(t, group, tier)
        if packed is t:
            # Detached (same memory and version counter): autograd hands the hook an op's
            # output with its grad_fn, which holds this; the tensor itself would close a cycle
            # no collector breaks (grad_fn is C++), and a graph dropped without a full backward
            # (retain_graph=True, backward(inputs=...)) would never be freed, nor its spill file.
            return _Kept(t.detach() if t.requires_grad else t, t._version, self._kept,
                         self._kept.hold(t))
        if packed.source is None:
            packed.source, packed.version = weakref.ref(t), t._version
        return packed

    def _pack(self, t: torch.Tensor, group, tier: str):
        if tier == "keep" or not self._offloadable(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype, t._version)
        seen = self._dedupe.get(key)
        if seen is not None and seen[0]() is t:  # the same tensor saved again (alive: no reuse)
            if seen[1] is None:
                return t  # left in place, and counted, the first time
            seen[1].uses += 1
            return seen[1]
        placed = self._place(t, group, tier)
        # Also a tensor left in place: saved again, it must not count twice towards the
        # bytes a BudgetError names.
        self._dedupe[key] = (weakref.ref(t), None if placed is t else placed)
        return placed

    def _place(self, t: torch.Tensor, group, tier: str):
        layout = Layout.of(t)
        n = layout.nbytes
        self.group_bytes[group] = self.group_bytes.get(group, 0) + n
        c = self.config
        if tier == "auto":
            # Keeping a view keeps its whole storage: q of a fused qkv output holds all three
            # (charged once, the other views then free).
            cost = self._kept.charge(t)
            if cost is not None:
                self.stats["kept_bytes"] += cost
                return t
        if tier in ("auto", "ram") and self._host_pool.reserve(n):
            item = self._new(group, "ram", layout)
            try:
                self._to_ram(item, t)
            except BaseException:
                self._host_pool.unreserve(n)
                raise
        elif tier in ("auto", "nvme") and c.nvme_path is not None:
            if n > c.io_bytes:
                self.io_missing = max(self.io_missing, n)
                return t  # measured, left in place; finish() raises BudgetError
            item = self._new(group, "nvme", layout)
            self._to_nvme(item, t)
        else:
            self.ram_missing += n
            return t
        self._pump(block=False)
        return item

    def _offloadable(self, t: torch.Tensor) -> bool:
        if is_parameter(t, self._param_ptrs):
            self.stats["skipped_params"] += 1
            return False
        # Nested tensors of the strided layout are plain Tensors with no sizes or strides.
        if (t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or t.is_nested
                or type(t) is not torch.Tensor or t.is_conj() or t.is_neg() or _overlaps(t)):
            return False  # sparse, nested, meta, subclasses (FP8, fakes), expands: left alone
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes < self.config.min_bytes:
            self.stats["skipped_small"] += 1
            return False
        return True

    def _copier(self, device: torch.device):
        c = self._copiers.get(device)
        if c is None:
            c = self._copiers[device] = copier_for(device)
        return c

    def _new(self, group, tier, layout) -> Saved:
        item = Saved(self, len(self.items), group, tier, layout)
        self.items.append(weakref.ref(item, functools.partial(_dropped, weakref.ref(self),
                                                               item.index)))
        self.group_top[group] = item.index
        self._cursor = item.index
        self.stats["tensors"] += 1
        return item

    def _to_ram(self, item: Saved, t: torch.Tensor) -> None:
        n = item.layout.nbytes
        copier = self._copier(t.device)
        if not copier.pin:
            item.host, item.pooled = self._host_pool.get(n, item)
        else:
            item.host = torch.empty(n, dtype=torch.uint8, pin_memory=copier.pin)
        item.event = copier.to_host(t, item.host)
        if item.event is not None:
            item.copying = True
            self._copying.append((weakref.ref(item), t, t._version, item.event))
        self.ram_bytes += n
        self._in_ram[item.index] = n
        self.stats["ram_bytes"] += n

    def _file_for_write(self) -> ActivationFile:
        if self._file is None:
            self._file = ActivationFile(self.config.nvme_path, self._engines.get())
            self._finalizer = weakref.finalize(self, self._file.close)
        return self._file

    def _to_nvme(self, item: Saved, t: torch.Tensor) -> None:
        n = item.layout.nbytes
        file = self._file_for_write()
        self._make_room(n)
        item.offset = file.reserve(n)
        self._spilled[item.index] = (item.offset, _round_up(n))
        if t.device.type == "cpu":
            # The engine writes from the tensor itself; it is held (write-behind) until written.
            src = flat_bytes(t)
            w = _Write(item, src, None, t._version, n, src)
            w.handle = self._start_write(src, item.offset, n)
        else:
            src = self._engines.get().pool_tensor(n, block=False)
            if src is None:
                src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            w = _Write(item, src[:n], self._copier(t.device).to_host(t, src), t._version, n, t)
            self._releases.append((w.event, src, t.device))  # waited for if the session dies
        self._writes.append(w)
        self.write_window += n
        self.stats["nvme_bytes"] += n

    def _start_write(self, src: torch.Tensor, offset: int, n: int):
        try:
            handle = self._file.engine.write(src, self._file.path, offset)
        except OSError as e:
            raise self._io_error(e, "writing", n) from e
        self._file.handles.append(handle)
        return handle

    def _io_error(self, e: OSError, doing: str, n: int) -> OSError:
        why = str(e.strerror or e).replace(f"'{self._file.path}'", "the activation file")
        return OSError(e.errno, f"activation offload to nvme_path {self.config.nvme_path!r} "
                       f"failed {doing} {n} bytes of a saved tensor: {why}; the forward was "
                       "abandoned (no gradients were computed from it, and its activation file "
                       "is gone)")

    def _make_room(self, n: int) -> None:
        """Waits for the oldest writes until `n` more bytes fit in the I/O window."""
        while self._writes and self.write_window + self.read_window + n > self.config.io_bytes:
            self._finish_write(self._writes.popleft(), block=True)

    def _finish_write(self, w: _Write, block: bool) -> bool:
        if w.handle is None:  # a GPU tensor: its D2H copy must be done before the write starts
            copier = self._copier(w.item.layout.device)
            if not block and not copier.done(w.event):
                return False
            copier.wait(w.event)
            self._check_written(w)
            w.source = None  # copied: the tensor may go
            w.handle = self._start_write(w.src, w.item.offset, w.nbytes)
        if not block and not w.handle.done():
            return False
        t0 = time.perf_counter()
        try:
            w.handle.wait()
        except OSError as e:
            raise self._io_error(e, "writing", w.nbytes) from e
        finally:
            self.stats["write_wait_s"] += time.perf_counter() - t0
            self._file.done(w.handle)
        self._check_written(w)
        w.source = None
        self.write_window -= w.nbytes
        return True

    @staticmethod
    def _check_written(w: _Write) -> None:
        if w.source is not None and w.source._version != w.version:
            raise RuntimeError("a saved tensor was modified in place while it was being written "
                               "to NVMe; its gradient would be wrong")

    def _check_copies(self, until: Saved | None = None) -> None:
        """Lets go of the tensors whose copies to host are done (waiting for those up to
        `until`), marking those modified in place since they were saved."""
        while self._copying:
            ref, t, version, event = self._copying[0]
            copier = self._copier(t.device)
            if until is not None and until.copying:
                copier.wait(event)
            elif not copier.done(event):
                return
            self._copying.popleft()
            item = ref()
            if item is not None:  # else its graph is gone: nothing will read the copy
                item.copying = False
                if t._version != version:
                    item.stale = True

    def _pump(self, block: bool) -> None:
        """Finishes the writes that are done (all of them with block=True), in any order."""
        for w in list(self._writes):
            if self._finish_write(w, block):
                self._writes.remove(w)
        self._check_copies()
        self._release(block=False)

    def finish(self) -> None:
        """End of forward: every write reached the file (or raised), and the budgets held."""
        try:
            self._pump(block=True)
            self._check_budgets()
        except BaseException as e:
            self.abandon(e)
            raise
        self.finished = True
        self._dedupe.clear()
        self._trim_file()

    def _trim_file(self) -> None:
        """Gives back the end of the activation file that no live saved tensor needs: backward
        consumes the last-saved tensors first, so each block's bytes go as its backward
        finishes (autograd drops the block's saved tensors), and the file is empty once
        backward is done, whether or not the graph (`loss`) is still referenced."""
        file = self._file
        if file is None or file.fd < 0 or not self.finished or self._writes:
            return  # writes in flight could land past a cut
        end = max((o + n for o, n in list(self._spilled.values())), default=0)
        if end < file.kept:
            try:
                os.ftruncate(file.fd, end)
                file.kept = end
            except OSError:  # the bytes stay until the file closes
                pass

    def _check_budgets(self) -> None:
        c = self.config
        groups = {g: b for g, b in self.group_bytes.items() if g is not None}
        per_block = ""
        if groups:
            g, b = max(groups.items(), key=lambda kv: kv[1])
            per_block = f"; the largest block ({g}) saves {b} bytes"
        if self.ram_missing:
            # Forwards of this offload not yet backpropagated hold their part of the budget.
            others = self._host_pool.held - self.ram_bytes
            need = self._host_pool.held + self.ram_missing
            held = (f" ({others} of them held by other forwards of this offload whose backward "
                    "has not run)" if others > 0 else "")
            raise BudgetError(
                f"cpu_budget={c.cpu_budget} bytes is too small for the activations this forward "
                f"keeps in RAM: they take {need} bytes{held}{per_block}. The smallest "
                f"cpu_budget that works is {need}" + ("" if c.nvme_path else
                                      " (or give nvme_path to spill the rest to NVMe)"),
                argument="cpu_budget", smallest=need)
        if self.io_missing:
            raise BudgetError(
                f"io_bytes={c.io_bytes} is too small to stage a saved tensor of "
                f"{self.io_missing} bytes through host memory on its way to and from NVMe"
                f"{per_block}. The smallest io_bytes that works is {self.io_missing} (twice "
                "the largest block's bytes reads one block ahead in backward)",
                argument="io_bytes", smallest=self.io_missing)

    def abandon(self, exc: BaseException) -> None:
        """After a failure: drop everything, close (and so delete) the file."""
        if self.failed is None:
            self.failed = _Failure(exc)
        for w in self._writes:  # a pool buffer a D2H copy still fills must not be reused
            if w.handle is None:
                self._copier(w.item.layout.device).wait(w.event)
        if self._finalizer is not None:
            self._finalizer()  # waits for I/O in flight (its buffers are still held), closes
        self._writes.clear()
        self._copying.clear()
        self._reading.clear()
        self._fetched.clear()
        self._dedupe.clear()
        self.write_window = self.read_window = 0
        for ref in self.items:
            item = ref()
            if item is not None:
                item.host = item.dev = item.reading = item.event = None
                if item.pooled is not None:
                    item.pooled()  # the buffer, not the graph: that waits for the caller
        # The RAM tier's bytes go back now, not when the graph dies: a caller that keeps the
        # exception (an `except ... as e` that retries inside it, a notebook's last traceback)
        # keeps the graph, and a retry would find cpu_budget still held by a dead forward.
        _unreserve_all(self._host_pool, self._in_ram)
        self.ram_bytes = 0

    # ---- backward ----
    def prefetch(self, top: int | None = None) -> None:
        """Reads ahead (NVMe -> host, and host -> GPU on a GPU) in reverse forward order from
        index `top` down, while the I/O window has room."""
        if self.failed is not None or not self.finished:
            return
        self._watch_backward()
        try:
            while self._floor <= self._cursor and not self._wants(self._floor):
                self._floor += 1
            while self._cursor >= self._floor and not self._wants(self._cursor):
                self._cursor -= 1  # everything above the cursor is fetched or consumed
            j = self._cursor if top is None else min(top, self._cursor)
            room = self.config.io_bytes - self.write_window
            while j >= self._floor:
                if self._wants(j):
                    item = self.items[j]()
                    if self.read_window + item.layout.nbytes > room:
                        break
                    self._fetch(item)
                    self.stats["reads_ahead"] += 1
                j -= 1
            self._advance()
            self._release(block=False)
        except BaseException as e:
            self.abandon(e)
            raise

    def _watch_backward(self) -> None:
        if self._watched:
            return
        watch = _BackwardWatch(weakref.ref(self))
        try:
            Variable._execution_engine.queue_callback(watch)
        except RuntimeError:
            return  # not inside a backward (a saved tensor read through grad_fn._saved_*)
        watch.armed = True
        self._watched = True

    def _advance(self) -> None:
        """On a GPU: starts the H2D copy of every NVMe read that has arrived, so the copy too
        runs ahead of the unpack that needs it."""
        while self._reading:
            ref, read = self._reading[0]
            item = ref()
            if item is None:  # its graph is gone: _dropped let its read go
                self._reading.popleft()
                continue
            if item.reading is not None and not item.reading.done():
                break
            self._reading.popleft()
            self._arrive(item)

    def _wants(self, j: int) -> bool:
        item = self.items[j]()
        return item is not None and item.uses > 0 and self._needs_fetch(item)

    def _needs_fetch(self, item: Saved) -> bool:
        if item.tier == "nvme":
            return item.reading is None and item.host is None and item.dev is None
        return item.layout.device.type == "cuda" and item.dev is None  # RAM tier: H2D ahead

    def _fetch(self, item: Saved) -> None:
        n = item.layout.nbytes
        self.read_window += n
        fetched = self._fetched[item.index] = [n, None]
        copier = self._copier(item.layout.device)
        if item.tier == "ram":
            if item.event is not None:
                copier.h2d.wait_event(item.event)  # its D2H is done before the H2D
            item.dev, item.event = copier.to_device(item.host, item.layout)
            return
        engine = self._file.engine
        if engine.closed:
            raise ActivationsDiscardedError(
                "backward reached activations on NVMe after their offload was closed (close() "
                "ends the io engine that reads them back); close it after backward, or run the "
                "forward again")
        buf = engine.pool_tensor(n, block=False)  # aligned: read in place with O_DIRECT
        if buf is None:
            buf = torch.empty(n, dtype=torch.uint8, pin_memory=copier.pin)
        try:
            item.reading = engine.read(buf[:n], self._file.path, item.offset)
        except OSError as e:
            raise self._io_error(e, "reading back", n) from e
        self._file.handles.append(item.reading)
        fetched[1] = item.reading
        item.host = buf
        if item.layout.device.type == "cuda":
            self._reading.append((weakref.ref(item), item.reading))

    def _consumed(self, item: Saved) -> None:
        if self._fetched.pop(item.index, None) is not None:
            self.read_window -= item.layout.nbytes

    def _retire_read(self, n: int, read) -> None:
        """A saved tensor read ahead died unconsumed: its read (a read-ahead, about to land) is
        waited for, so its buffer goes back to the pool, and its bytes leave the window."""
        if read is not None and self._file is not None and read in self._file.handles:
            with contextlib.suppress(Exception):  # nothing will use what it read
                read.wait()
            self._file.done(read)
        self.read_window -= n

    def _arrive(self, item: Saved) -> None:
        """Waits for an NVMe read; on a GPU, starts its H2D copy."""
        if item.reading is None:
            return
        t0 = time.perf_counter()
        try:
            item.reading.wait()
        except OSError as e:
            raise self._io_error(e, "reading back", item.layout.nbytes) from e
        finally:
            self.stats["read_wait_s"] += time.perf_counter() - t0
            self._file.done(item.reading)
            item.reading = None
            fetched = self._fetched.get(item.index)
            if fetched is not None:
                fetched[1] = None
        if item.layout.device.type == "cuda":
            item.dev, item.event = self._copier(item.layout.device).to_device(item.host,
                                                                               item.layout)
            self._releases.append((item.event, item.host, item.layout.device))
            item.host = None

    def _release(self, block: bool) -> None:
        """Host buffers go back to the pool once their H2D copies are done."""
        keep = []
        for event, buf, device in self._releases:
            if block:
                self._copier(device).wait(event)
            elif not self._copier(device).done(event):
                keep.append((event, buf, device))
        self._releases[:] = keep

    @torch.compiler.disable
    def unpack(self, item) -> torch.Tensor:
        if isinstance(item, _Kept):  # left in place at pack time
            _check_version(item.tensor, item.version)
            if self.failed is None and not self.finished:
                # A backward inside the context (the micro-batch's forward is over): its
                # budgets are checked now, even if what it reads first was left in place.
                self.finish()
            return item.tensor
        source = item.source()
        if source is not None:
            _check_version(source, item.version)
        if self.failed is not None:
            raise ActivationsDiscardedError(
                "backward reached activations of a forward that failed and was abandoned "
                f"({self.failed.name}: {self.failed}); run the forward again")
        if not self.finished:
            self.finish()  # backward inside the forward's context: writes must be done first
        self._check_copies(until=item)
        if item.stale:
            lay = item.layout
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{lay.dtype} {list(lay.shape)}] was modified after it was "
                "saved, while its copy to host memory was in flight (tierlift.activations, like "
                "autograd, refuses a saved tensor changed after it was saved)")
        self._watch_backward()
        if self._needs_fetch(item):
            self._fetch(item)
            self.stats["reads_on_demand"] += 1
        try:
            self._arrive(item)
        except BaseException as e:
            self.abandon(e)
            raise
        buf = item.dev if item.dev is not None else item.host
        if item.lent is not None and item.lent[0]() is buf and buf._version != item.lent[1]:
            lay = item.layout
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a backward modified the saved tensor [{lay.dtype} "
                f"{list(lay.shape)}] it was given, and this backward (retain_graph=True, or "
                "another op that saved the same tensor) needs it again (tierlift.activations, "
                "like autograd, refuses it; clone it in that backward before modifying it)")
        item.uses -= 1
        last = item.uses <= 0  # no other unpack of this forward's saves will need the bytes
        if item.tier == "ram" and item.dev is None:  # CPU: the bytes are where they are
            out = restore(item.host, item.layout)
        elif item.dev is not None:
            self._copier(item.layout.device).consume(item.dev, item.event)
            item.event = None
            out = restore(item.dev, item.layout)
            if last:
                item.dev = None  # the RAM copy stays, for a second backward
                self._consumed(item)
        else:
            out = restore(item.host, item.layout)  # CPU NVMe read: the buffer goes to autograd
            if last:
                item.host = None
                self._consumed(item)
        item.lent = (weakref.ref(buf), buf._version)
        self.prefetch()
        return out
