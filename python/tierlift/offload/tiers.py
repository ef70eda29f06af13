"""Where one param group's flat state kinds (master, exp_avg, exp_avg_sq, max_exp_avg_sq) live.

MemoryTier: resident flat tensors, one per kind in the kind's dtype (pinned at their size when
CUDA is available); a chunk "read" is a view. With two generations (overlap) a step reads
generation g of a chunk and writes g + 1 where they lie (`direct`: the kernel steps out of
place, no slot copy).
NvmeTier: files per kind; with two generations a step reads chunk k from generation g[k] and
writes the updated chunk to 1 - g[k]; g[k] flips only after every write of the step reached the
device, so a failed step leaves the committed generation untouched. With one generation (half
the disk) a chunk is rewritten in place. Each committed chunk carries a CRC-32C per kind,
verified on every read. Every read and write first checks that no file was cut short, removed,
replaced or written by another process (io/file_watch.py), so a step refuses to start, with an
OSError (EIO) naming the file, on state that is no longer the job's.
HybridTier: the first chunks in host memory (one generation, stepped in place), the rest on
NVMe, so one optimizer's state can use all of both.

Every tier answers per chunk: `two_gen(ci)` (does a step write a second copy, so it can be
undone?), `next_gen(ci)` (the generation a step writes) and `flip(ci)` (commit that write).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from tierlift import _extension
from tierlift._pinned import pinned_zeros, release
from tierlift.io import ChecksumError, IoEngine
from tierlift.io.file_watch import FileWatch
from tierlift.offload.layout import kind_bytes, kind_elems


def crc32c(buf: torch.Tensor) -> int:
    """CRC-32C of all of the tensor's bytes (block_crc32c's block is in bytes: a block of
    numel() bytes covered only the first quarter of an fp32 chunk)."""
    if buf.nbytes == 0:
        return 0
    return int(_extension._C.io.block_crc32c(buf, buf.nbytes)[0])


_CRC_POOL = None


def crc_pool() -> ThreadPoolExecutor:
    """The threads that run the offload runner's gradient sums (numpy releases the GIL). A
    forked child gets new ones: the parent's threads do not exist there, and the executor
    copied from it would wait for them forever."""
    global _CRC_POOL
    if _CRC_POOL is None:
        _CRC_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                       thread_name_prefix="tierlift-crc")
    return _CRC_POOL


def _forget_pool_in_child() -> None:
    global _CRC_POOL
    _CRC_POOL = None


os.register_at_fork(after_in_child=_forget_pool_in_child)


class _Checked:
    """The I/O of one chunk (every kind) as one handle: wait() waits for every request, then
    hands the chunk's CRC-32Cs to `then` (verify or record). A read's CRCs are computed by the
    thread that waits, right before it steps the chunk (which then finds it in cache); a write's
    are passed in, computed by the stepping thread as it issued the writes (Adam had just
    written the data). `crc_s`: the CRC time, for the step's "checksum_s".

    Measured on the 16M-parameter NVMe step (2 cores, rounds interleaved in one process):
    step / roofline 1.24x-1.29x this way, 1.33x with a Python pool task per chunk waiting and
    checksumming off the stepping thread (two thread hops and GIL hand-overs between "data
    arrived" and "data usable"), 1.42x-1.47x with the CRC on the io_uring thread at completion
    (it stops submitting and reaping meanwhile).

    `issued_at` and `done_at` (set once wait() has seen the requests done, before the CRC):
    the engine's busy time in the step's legs (offload.legs.IoTrack)."""

    def __init__(self, handles, then, *, parts=(), crcs=None, crc_s=0.0, issued_at=None):
        self.handles = handles
        self.then = then
        self.parts = parts
        self.crcs = crcs
        self.crc_s = crc_s
        self.issued_at = time.perf_counter() if issued_at is None else issued_at
        self.done_at = None

    def wait(self):
        error = None
        for h in self.handles:  # every one, even after a failure: none may stay in flight
            try:
                h.wait()
            except Exception as e:  # noqa: BLE001 - the first error is re-raised below
                error = error or e
        self.done_at = time.perf_counter()
        if error is not None:
            raise error
        if self.crcs is None:
            t = time.perf_counter()
            self.crcs = [crc32c(b) for b in self.parts]
            self.crc_s = time.perf_counter() - t
        self.then(self.crcs)


def drain(handles: dict) -> None:
    """Waits for every I/O handle left in {i: [handles]} and empties it (after an error or a
    skipped step: no I/O may stay in flight into the slots); their own errors are dropped."""
    for hs in handles.values():
        for h in hs:
            try:
                getattr(h, "abandon", h.wait)()
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
    handles.clear()


DIR_PREFIX = "tierlift-offload-"
OWNER_FILE = "owner.json"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), which
    tells a live owner from an unrelated process that reused its pid; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _owner_alive(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    now = _start_time(pid)
    return started is None or now is None or now == started


def _pid_namespace() -> str | None:
    """Which pid namespace this process sees (containers sharing a host name and a volume
    each have their own, where the same pid means another process)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def make_state_dir(parent: str) -> str:
    """A private directory for one optimizer's state files under `parent`, with the owner's
    pid, host and start time in owner.json, so a later process can tell it is stale."""
    path = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(),
             "start_time": _start_time(os.getpid())}
    try:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            json.dump(owner, f)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # ownerless folders are never cleaned up later
        raise
    return path


def remove_stale_dirs(parent: str) -> list[str]:
    """Removes the state directories under `parent` whose owner process is dead on this host
    (e.g. killed by SIGKILL before it could clean up). Directories of live processes, of other
    hosts or pid namespaces (a shared file system, containers) and without a readable
    owner.json are left alone."""
    host, ns, removed = socket.gethostname(), _pid_namespace(), []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith(DIR_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
            pid, owner_host = int(owner["pid"]), owner["host"]
            started, owner_ns = owner.get("start_time"), owner.get("pidns")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner_host != host or owner_ns != ns or _owner_alive(pid, started):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        warnings.warn(f"tierlift offload: removed {len(removed)} state folder(s) of dead "
                      f"processes under {parent!r}: {[os.path.basename(p) for p in removed]}",
                      RuntimeWarning, stacklevel=3)
    return removed


class _Done:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class GenerationHold:
    """A checkpoint save reading a tier's committed generation in the background, without
    copying it first: until the save has read chunk ci, a write into (ci, the generation held)
    waits, so training may step on meanwhile and the save still sees the state as it was when
    it started. The CRC-32Cs are taken with it (a step replaces the tier's entries)."""

    def __init__(self, tier, chunks):
        self.tier = tier
        self.gen = list(tier.gen)
        self.crc = dict(getattr(tier, "crc", {}))
        self.pending = set(chunks)

    def blocks(self, ci: int, gen: int) -> bool:
        return ci in self.pending and self.gen[ci] == gen

    def release(self, ci: int | None = None) -> None:
        """Chunk `ci` was read (None: every chunk, the save finished or failed)."""
        with self.tier.held:
            if ci is None:
                self.pending.clear()
            else:
                self.pending.discard(ci)
            if not self.pending and self in self.tier.holds:
                self.tier.holds.remove(self)
            self.tier.held.notify_all()


class _Holdable:
    """What MemoryTier and NvmeTier share: GenerationHold, and the generation of each chunk
    (`generations`, 1 or 2, for every chunk of the tier)."""

    def two_gen(self, ci: int) -> bool:
        return self.generations == 2

    def next_gen(self, ci: int) -> int:
        return 1 - self.gen[ci] if self.generations == 2 else self.gen[ci]

    def flip(self, ci: int) -> None:
        if self.generations == 2:
            self.gen[ci] = 1 - self.gen[ci]

    def direct(self, ci: int) -> bool:
        """Whether a step of chunk ci reads and writes the tier's own memory, with no slot in
        between (MemoryTier with two generations)."""
        return False

    def check_files(self) -> None:
        """OSError (EIO) if a file of the tier was changed under the job (none in RAM)."""

    def speculates(self, ci: int) -> bool:
        """Whether the overlap may step chunk ci ahead (it needs somewhere to write the new
        state other than the committed one; reserve() takes it)."""
        return self.two_gen(ci)

    def reserve(self, ci: int) -> bool:
        return self.two_gen(ci)

    def release_spare(self) -> None:
        pass

    def _init_holds(self) -> None:
        self.held = threading.Condition()
        self.holds: list[GenerationHold] = []
        self.held_wait_s = 0.0  # time writes waited for a save to read a held chunk

    def hold(self, chunks) -> GenerationHold:
        h = GenerationHold(self, chunks)
        with self.held:
            if h.pending:
                self.holds.append(h)
        return h

    def _wait_unheld(self, ci: int, gen: int) -> None:
        if not self.holds:  # no save in flight: no lock on the step's path
            return
        t = time.perf_counter()
        with self.held:
            while any(h.blocks(ci, gen) for h in self.holds):
                self.held.wait()
        self.held_wait_s += time.perf_counter() - t

    def wait_unheld_all(self) -> None:
        """Waits until no save reads this tier (before its files are removed)."""
        with self.held:
            while self.holds:
                self.held.wait()


class MemoryTier(_Holdable):
    """generations=1: chunks are views, updated in place. generations=2: a step reads a chunk's
    generation g and writes g + 1 (both where they lie: `direct`), so it can be undone.

    generations=1 with `spare` blocks: one generation plus `spare` chunk-sized blocks that a
    step may write a chunk's new state into instead of rewriting it in place (`reserve`): such
    a chunk is two-generation until its step commits (`flip` adopts the block and frees the old
    one) or gives it up (`release_spare`). The overlap's worker steps chunks ahead this way as
    long as blocks are free; the others wait for step() and are rewritten in place there.
    `block[ci]`: where chunk ci's committed state lies; `pending[ci]`: its uncommitted block."""

    def __init__(self, kinds: list[str], n_chunks: int, chunk_elems: int, pin: bool,
                 generations: int = 1, dtypes: dict | None = None, spare: int = 0):
        if spare and generations != 1:
            raise ValueError("spare blocks are for a one-generation MemoryTier")
        self.kinds = kinds
        self.dtypes = {k: (dtypes or {}).get(k, torch.float32) for k in kinds}
        self.chunk_elems = chunk_elems
        self.generations = generations
        self.gen = [0] * n_chunks
        self.spare = spare
        self.block = list(range(n_chunks))
        self.free = list(range(n_chunks, n_chunks + spare))
        self.pending: dict[int, int] = {}
        self._spare_lock = threading.Lock()
        self._init_holds()
        self._registrations: list = []  # page-locked at their size (_pinned.py), not rounded up

        def flat(k: str) -> torch.Tensor:
            n = (n_chunks + spare) * kind_elems(k, chunk_elems)
            if pin:
                return pinned_zeros(n, self.dtypes[k], self._registrations)
            return torch.zeros(n, dtype=self.dtypes[k])

        self.flat = {(k, g): flat(k) for k in kinds for g in range(generations)}

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.flat.values())

    def unpin(self) -> None:
        """Unpins the state's memory now (the optimizer's close()); it stays readable."""
        release(self._registrations)

    def viewable(self, ci: int) -> bool:
        """Whether view(ci) gives the committed chunk itself (host memory)."""
        return True

    def two_gen(self, ci: int) -> bool:
        return self.generations == 2 or ci in self.pending

    def next_gen(self, ci: int) -> int:
        if self.generations == 2:
            return 1 - self.gen[ci]
        return 1 if ci in self.pending else 0

    def flip(self, ci: int) -> None:
        if self.generations == 2:
            self.gen[ci] = 1 - self.gen[ci]
            return
        with self._spare_lock:
            if ci in self.pending:
                self.free.append(self.block[ci])
                self.block[ci] = self.pending.pop(ci)

    def direct(self, ci: int) -> bool:
        """Whether a step of chunk ci reads its committed state and writes the new one where
        they lie (the kernel steps out of place): two generations, or a reserved spare block."""
        return self.two_gen(ci)

    def speculates(self, ci: int) -> bool:
        return self.generations == 2 or self.spare > 0

    def reserve(self, ci: int) -> bool:
        """A block for chunk ci's next state: True with two generations, or once a spare block
        is held for it (until flip or release_spare); False when none is free."""
        if self.generations == 2:
            return True
        with self._spare_lock:
            if ci not in self.pending:
                if not self.free:
                    return False
                self.pending[ci] = self.free.pop()
            return True

    def release_spare(self) -> None:
        """Gives every block that no step committed back (the step ended, or its speculative
        chunks were dropped)."""
        with self._spare_lock:
            self.free.extend(self.pending.values())
            self.pending.clear()

    def _at(self, kind: str, ci: int, gen: int) -> torch.Tensor:
        n = kind_elems(kind, self.chunk_elems)
        if self.generations == 2:
            return self.flat[(kind, gen)][ci * n:(ci + 1) * n]
        b = self.pending[ci] if gen else self.block[ci]
        return self.flat[(kind, 0)][b * n:(b + 1) * n]

    def view(self, kind: str, ci: int, chunk_elems: int) -> torch.Tensor:
        return self._at(kind, ci, self.gen[ci])

    def peek(self, kind: str, ci: int, gen: int) -> torch.Tensor:
        """Chunk ci of generation `gen` itself, to read without a copy (publishing a step)."""
        return self._at(kind, ci, gen)

    def part(self, kind: str, ci: int, buf: torch.Tensor) -> torch.Tensor:
        """The part of a chunk buffer (a slot may be longer: padded for O_DIRECT) it holds."""
        return buf[:kind_elems(kind, self.chunk_elems)]

    def read(self, kind: str, ci: int, buf: torch.Tensor, gen: int | None = None):
        """Copies chunk ci (its first buf.numel() values) into `buf`."""
        src = self._at(kind, ci, self.gen[ci] if gen is None else gen)
        m = min(buf.numel(), src.numel())
        buf[:m].copy_(src[:m])
        return _Done(buf)

    def verify(self, kind, ci, buf, what, gen=None) -> None:
        pass  # host memory: no checksum

    def read_all(self, ci: int, bufs: dict, what) -> list:
        return [self.read(k, ci, bufs[k]) for k in self.kinds]

    def write_all(self, ci: int, bufs: dict, gen: int) -> list:
        return [self.write(k, ci, bufs[k], gen) for k in self.kinds]

    def write(self, kind: str, ci: int, buf: torch.Tensor, gen: int):
        self._wait_unheld(ci, gen)
        dst = self._at(kind, ci, gen)
        dst.copy_(buf[:dst.numel()])
        return _Done(buf)


_LIBC = None
_GENS = {1: "one generation", 2: "two generations"}
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _reserve(fd: int, nbytes: int, path: str, total: int, generations: int = 2) -> None:
    """Sizes the (empty) file to `nbytes` of zeros, allocating its blocks up front with
    fallocate(2), so a drive too small for the state is refused at construction and steps never
    allocate. File systems without fallocate get a sparse file (glibc's posix_fallocate would
    emulate it by writing every block)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    err = 0
    if nbytes and _LIBC.fallocate(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
    if err not in _NO_ROOM:
        try:
            os.ftruncate(fd, nbytes)  # also the size when fallocate is unsupported
            return
        except OSError as e:
            if e.errno not in _NO_ROOM:
                raise
            err = e.errno
    raise OSError(err, f"nvme_path has no room for the optimizer state: {total} bytes are "
                  f"needed under {os.path.dirname(os.path.dirname(path))!r} ({_GENS[generations]} "
                  f"of every state kind); allocating {path!r} failed: {os.strerror(err)}")


class NvmeTier(_Holdable):
    """`used[ci]`: the elements of chunk ci in use (a multiple of 1024, default all): only
    those are read, written and checksummed (rounded up to 4 KiB per kind); the rest of a slot
    is never looked at. `first`: the first chunk this tier holds (a HybridTier keeps those
    before it in RAM); chunk ci sits at (ci - first) * the kind's chunk bytes (4 KiB aligned)
    of each kind's file. `generations`: 2 (a step writes the other copy) or 1 (in place: half
    the disk, and a step cannot be undone). `dtypes`: {kind: dtype}, fp32 where not given."""

    def __init__(self, engine: IoEngine, directory: str, gi: int, kinds: list[str],
                 n_chunks: int, chunk_elems: int, used: list[int] | None = None,
                 first: int = 0, generations: int = 2, dtypes: dict | None = None,
                 reopen: bool = False):
        if generations not in (1, 2):
            raise ValueError(f"generations must be 1 or 2, got {generations}")
        self.engine = engine
        self.kinds = kinds
        self.dtypes = {k: (dtypes or {}).get(k, torch.float32) for k in kinds}
        self.first = first
        self.generations = generations
        self.chunk_elems = chunk_elems
        self.kind_chunk_bytes = {k: kind_bytes(k, d, chunk_elems) for k, d in self.dtypes.items()}
        self.used = list(used) if used is not None else [chunk_elems] * n_chunks
        if len(self.used) != n_chunks or any(u % 1024 or not 0 <= u <= chunk_elems
                                             for u in self.used):
            raise ValueError("used must give a multiple of 1024 elements <= chunk_elems for "
                             "every chunk")
        self.gen = [0] * n_chunks
        self._init_holds()
        self.crc: dict[tuple[str, int, int], int] = {}  # (kind, ci, gen) -> crc
        self.paths = {(k, g): os.path.join(directory, f"g{gi}.{k}.{g}") for k in kinds
                      for g in range(generations)}
        # Every read and write first checks that no other process changed a file
        # (io/file_watch.py): a step refuses to start on state that is no longer its own.
        self.watch = FileWatch()
        total = self.disk_bytes
        for (k, g), path in self.paths.items():
            want = (n_chunks - first) * self.kind_chunk_bytes[k]
            if reopen:  # a durable state's files, kept as they are
                if not os.path.exists(path) or os.path.getsize(path) < want:
                    raise ValueError(f"optimizer state file {path!r} is missing or shorter "
                                     "than its layout; the state cannot be reopened")
            else:
                with open(path, "wb") as f:
                    _reserve(f.fileno(), want, path, total, generations)
            self.watch.add(path, f"the {k} of param group {gi}, generation {g}, of the "
                           f"offloaded optimizer's state", want)

    @property
    def disk_bytes(self) -> int:
        return (len(self.gen) - self.first) * self.generations * sum(
            self.kind_chunk_bytes.values())

    def unpin(self) -> None:
        pass  # nothing of its own is pinned: its slots are the engine's pool

    def viewable(self, ci: int) -> bool:
        return False

    def _pos(self, kind: str, ci: int) -> int:
        return (ci - self.first) * self.kind_chunk_bytes[kind]

    def part(self, kind: str, ci: int, buf: torch.Tensor) -> torch.Tensor:
        """The part of a chunk buffer that is stored: the bytes of the chunk's used elements,
        rounded up to 4 KiB (the buffer is a slot of the kind's full aligned chunk bytes)."""
        n = kind_bytes(kind, self.dtypes[kind], self.used[ci]) // buf.element_size()
        return buf if n >= buf.numel() else buf[:n]

    def check_files(self) -> None:
        self.watch.check()

    def read(self, kind: str, ci: int, buf: torch.Tensor, gen: int | None = None):
        g = self.gen[ci] if gen is None else gen
        # Only this file: a failed step puts parameters back from the committed masters,
        # unless the masters' file is the one changed.
        self.watch.check(paths=[self.paths[(kind, g)]])
        return self.engine.read(self.part(kind, ci, buf), self.paths[(kind, g)],
                                self._pos(kind, ci))

    def verify(self, kind: str, ci: int, buf: torch.Tensor, what, gen: int | None = None):
        g = self.gen[ci] if gen is None else gen
        want = self.crc.get((kind, ci, g))
        if want is not None and crc32c(self.part(kind, ci, buf)) != want:
            raise ChecksumError(
                f"optimizer state file {self.paths[(kind, g)]!r} is corrupt: the {kind} of "
                f"{what()} (chunk {ci}) does not match its CRC-32C")

    def write(self, kind: str, ci: int, buf: torch.Tensor, gen: int, crc: int | None = None):
        self._wait_unheld(ci, gen)
        self.watch.check()  # every file: a step refuses to start on a changed one
        buf = self.part(kind, ci, buf)
        self.crc[(kind, ci, gen)] = crc32c(buf) if crc is None else crc
        return self.engine.write(buf, self.paths[(kind, gen)], self._pos(kind, ci))

    def read_all(self, ci: int, bufs: dict, what) -> list:
        """Starts reading every kind of chunk `ci` of the committed generation into `bufs`.
        Waiting on the returned handle waits for the reads and verifies their CRC-32C."""
        g = self.gen[ci]
        self.watch.check()  # every file: a step refuses to start on a changed one
        handles = [self.engine.read(self.part(k, ci, bufs[k]), self.paths[(k, g)],
                                    self._pos(k, ci)) for k in self.kinds]
        want = [self.crc.get((k, ci, g)) for k in self.kinds]

        def verify(got: list[int]) -> None:
            for k, c, exp in zip(self.kinds, got, want):
                if exp is not None and c != exp:
                    raise ChecksumError(
                        f"optimizer state file {self.paths[(k, g)]!r} is corrupt: the {k} of "
                        f"{what()} (chunk {ci}) does not match its CRC-32C")

        return [_Checked(handles, verify, parts=[self.part(k, ci, bufs[k]) for k in self.kinds])]

    def write_all(self, ci: int, bufs: dict, gen: int, crcs: list[int] | None = None) -> list:
        """Starts writing every kind of chunk `ci` to generation `gen` and checksums it while
        the writes run (unless `crcs` gives them); the CRCs are recorded once the writes are
        done (run() waits for every returned handle before the step commits)."""
        self._wait_unheld(ci, gen)
        self.watch.check()  # every file: a step refuses to start on a changed one
        # No stale CRC may describe this generation until the new one is known.
        for k in self.kinds:
            self.crc.pop((k, ci, gen), None)
        parts = [self.part(k, ci, bufs[k]) for k in self.kinds]
        handles = [self.engine.write(b, self.paths[(k, gen)], self._pos(k, ci))
                   for k, b in zip(self.kinds, parts)]
        t = time.perf_counter()
        if crcs is None:
            crcs = [crc32c(b) for b in parts]

        def record(got: list[int]) -> None:
            for k, c in zip(self.kinds, got):
                self.crc[(k, ci, gen)] = c

        return [_Checked(handles, record, crcs=crcs, crc_s=time.perf_counter() - t, issued_at=t)]

    def remove_files(self) -> None:
        self.wait_unheld_all()
        self.watch.close()
        for path in self.paths.values():
            try:
                self.engine.forget(path)
            except RuntimeError:
                pass
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class HybridTier(_Holdable):
    """Chunks [0, n_ram) in a one-generation MemoryTier, stepped in place without I/O;
    chunks [n_ram, n) in an NvmeTier. Both share this tier's generation list, holds and CRCs, so
    a GenerationHold of the hybrid covers every chunk. The RAM chunks come first: the runner
    steps one-generation chunks after the two-generation ones are durable, and the first
    chunks' gradients are the last that backward produces."""

    def __init__(self, ram: MemoryTier, nvme: NvmeTier):
        if ram.generations != 1 or nvme.first != len(ram.gen):
            raise ValueError("a HybridTier takes a one-generation MemoryTier of the first "
                             "chunks and an NvmeTier of the rest")
        self.ram, self.nvme = ram, nvme
        self.n_ram = len(ram.gen)
        self.kinds = nvme.kinds
        self.dtypes = nvme.dtypes
        self.engine = nvme.engine
        self.used = nvme.used
        self.crc = nvme.crc
        self.paths = nvme.paths
        self.gen = nvme.gen
        self.held, self.holds = threading.Condition(), []  # the parts count their own waits
        for t in (ram, nvme):
            t.gen, t.held, t.holds = self.gen, self.held, self.holds

    def _of(self, ci: int):
        return self.ram if ci < self.n_ram else self.nvme

    def check_files(self) -> None:
        self.nvme.check_files()

    @property
    def held_wait_s(self) -> float:
        return self.ram.held_wait_s + self.nvme.held_wait_s

    def _wait_unheld(self, ci: int, gen: int) -> None:
        self._of(ci)._wait_unheld(ci, gen)

    @property
    def resident_bytes(self) -> int:
        return self.ram.resident_bytes

    def unpin(self) -> None:
        self.ram.unpin()

    @property
    def disk_bytes(self) -> int:
        return self.nvme.disk_bytes

    def viewable(self, ci: int) -> bool:
        return ci < self.n_ram

    def two_gen(self, ci: int) -> bool:
        return self._of(ci).two_gen(ci)

    def next_gen(self, ci: int) -> int:
        return self._of(ci).next_gen(ci)

    def flip(self, ci: int) -> None:
        self._of(ci).flip(ci)

    def view(self, kind: str, ci: int, chunk_elems: int) -> torch.Tensor:
        return self.ram.view(kind, ci, chunk_elems)

    def part(self, kind, ci, buf):
        return self._of(ci).part(kind, ci, buf)

    def read(self, kind, ci, buf, gen=None):
        return self._of(ci).read(kind, ci, buf, gen)

    def verify(self, kind, ci, buf, what, gen=None) -> None:
        self._of(ci).verify(kind, ci, buf, what, gen)

    def write(self, kind, ci, buf, gen, *args):
        return self._of(ci).write(kind, ci, buf, gen, *args)

    def read_all(self, ci: int, bufs: dict, what) -> list:
        return self._of(ci).read_all(ci, bufs, what)

    def write_all(self, ci: int, bufs: dict, gen: int) -> list:
        return self._of(ci).write_all(ci, bufs, gen)

    def remove_files(self) -> None:
        self.nvme.remove_files()
