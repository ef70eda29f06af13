"""The NVMe tier of stage-3 parameter offload (shard(..., offload_params="nvme", nvme_path=...)):
the fp32 master shards of every unit, and their fp32 gradient shards, live in one file per
rank, mapped MAP_SHARED, so a model whose shards or gradients do not fit in RAM still trains.

Layout   two files, `params.rank<R>.f32` (every unit's shard) and `grads.rank<R>.f32` (every
         unit's gradient shard, same layout), in a private `tierlift-offload-*` folder under
         nvme_path (owner.json + the stale-folder cleanup of offload/tiers.py: a killed run's
         folder is removed by the next run); each unit's range starts on a page boundary (2 MiB
         for units of 2 MiB or more). Two files, not two regions of one: a fault maps
         neighbouring page-cache pages of the same mapping (fault-around) and read-around
         reads past a range, which across a region boundary kept gradient pages mapped after
         a parameter range was dropped (measured). Both are fallocate'd up front, so a drive
         too small for parameters + gradients is refused at shard() with the bytes needed.
Views    every unit.shard Parameter is a view of the mapping (torch.frombuffer): any optimizer
         steps it in place and the kernel writes the dirty pages back to the file.
Grads    when a unit's reduce-scatter lands and its shard has no gradient, zero/hooks.py hands
         the piece over through grad_home(): it is written to the unit's range of the
         gradients' file with a buffered pwrite (a write through the mapping would first read
         every page no longer cached from the disk) and unit.shard.grad becomes a tensor over
         that range (its own tensor, not a view of a larger one: its version counter counts
         only its writes, which the overlapped optimizer checks). Later backwards accumulate
         into it, as into any .grad. Optimizers, clipping and the overlapped offload optimizer
         read p.grad as before, faulting it in. The range is dropped (unmapped, write-back
         started, evicted) _GRAD_DROP_LAG hand-overs later, once the overlapped optimizer's
         worker has read it (with the parameter's range, which that worker reads too: only
         unmapped, it stays in the page cache for the step), and again after the optimizer
         step, so no more than the units in flight stay resident. zero_grad(set_to_none=True)
         drops the tensors: the next backward assigns a fresh one over the same range,
         overwriting it; set_to_none=False zeroes them
         in place (which faults every gradient page in, from the disk: RSS holds them until
         the next hand-over drops them).
Residency explicit, per unit range. After a gather has read a shard into the staging slot and
         after an optimizer step has written it, the range is dropped: madvise(MADV_DONTNEED)
         unmaps it from this process (safe for MAP_SHARED file pages: the data stays in the page
         cache and the file) and posix_fadvise(POSIX_FADV_DONTNEED) starts the write-back of
         dirty pages and evicts the clean ones, so neither the process's RSS nor the page cache
         keeps the tier. (MADV_PAGEOUT would unmap too, but it does not write dirty file pages
         back from the caller's context.)
Gathers  read with O_DIRECT into two aligned buffers (param_nvme_reader.py): gathers follow
         the same order every step, so the store learns which range followed the last two
         staged ones and reads it ahead while this unit computes. Without O_DIRECT (warned)
         gathers copy from the mapping and the range due next gets POSIX_FADV_WILLNEED.
Steps    a write fault on a page not in the page cache reads it from the disk first, so the
         last gather before a step (learned per range) writes the bytes it read back with a
         buffered pwrite and keeps the range in the page cache, at most _WARM_CAP_UNITS
         ranges at a time.
Changes  a file cut short, replaced under its name, or written by another process (truncated
         and regrown, rewritten, overwritten in part) under the running job is refused before
         the next gather, gradient hand-over or step touches it: an OSError (EIO) naming the
         file (io/file_watch.py). A removed file is not: the mapping keeps it.
msync    not needed: the file is scratch, deleted when the model goes away; checkpoints are
         written separately (tierlift.checkpoint), and within the run every access goes through
         the same page cache.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
import warnings
import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from tierlift._paths import absolute
from tierlift.io.file_watch import FileWatch
from tierlift.offload import tiers
from tierlift.zero.param_nvme_reader import ShardReader, direct_io_error

_PAGE = mmap.PAGESIZE
# Units of 2 MiB or more start on a 2 MiB boundary: a page-cache folio (at most 2 MiB,
# naturally aligned) then never spans two units, so a fault in one unit maps no page of its
# neighbour (measured: without it, dropping a unit left up to 1 MiB of the next one mapped).
_HUGE = 2 << 20
_ELEM = 4  # fp32
_WARM_CAP_UNITS = 4
# A gradient handed over is read at once by the overlapped optimizer's worker, so it is
# dropped this many hand-overs later, not at once. Measured on bench_zero_offload's `nvme True
# nvme` row (2-core VM, interleaved, x of offload "none"): gradients in RAM 1.48-1.52, lag 0
# 1.56-1.61, lag 1 1.54-1.57, lag 2/3 1.53-1.59, only after the step 1.52-1.56: all within the
# noise but lag 0; lag 1 keeps the page cache to about one unit of gradients.
_GRAD_DROP_LAG = 1


def _check_dir(nvme_path) -> str:
    if not isinstance(nvme_path, (str, os.PathLike)):
        raise TypeError(f"nvme_path must be a directory path (str or os.PathLike), got "
                        f"{type(nvme_path).__name__}")
    path = absolute(nvme_path)  # the shard files are read, watched and removed by path later
    if not os.path.isdir(path):
        raise ValueError(f"nvme_path={path!r} is not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path={path!r} is not writable by this process")
    return path


def _fill_holes(fd: int, nbytes: int) -> None:
    """Writes zeros over a file that fallocate left sparse (a file system without it): a
    write fault through the mapping on a hole of a full drive is a SIGBUS that kills the
    process mid-step, a pwrite here is an OSError at shard()."""
    if os.fstat(fd).st_blocks * 512 >= nbytes:
        return
    zeros = bytes(min(nbytes, 8 << 20))
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, zeros[:nbytes - done], done)


def _cleanup(fds: list[int], directory: str, hooks, reader, watch) -> None:
    for hook in hooks:
        hook.remove()
    if reader is not None:
        reader.close()
    watch.close()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    # Views of the mapping that outlive the model stay valid: an unlinked file keeps its pages
    # until the last mapping goes.
    shutil.rmtree(directory, ignore_errors=True)


class NvmeParamStore:
    """One preallocated, mapped file holding the fp32 shards of all units of one rank.

    alloc() hands out the units' shards in order; fetch(t) is the data a gather copies;
    staged(t) / stepped(t) drop a shard's range after it was read for a gather / written by an
    optimizer step; grad_home(shard, piece) is the gradient a backward hands over, kept in the
    file. Stats (the model's ZeroState stats): nvme_read_bytes (shard bytes read for
    gathers), nvme_write_bytes (shard bytes stepped), nvme_grad_bytes (gradient bytes handed
    over into the file), nvme_file_bytes (both files' size),
    nvme_direct, the training thread's seconds in the tier (nvme_read_wait_s, nvme_warm_s,
    nvme_drop_s), nvme_warm_bytes, nvme_prefetch_hits/misses, nvme_cached_reads."""

    def __init__(self, *, nvme_path, shard_numels: list[int], rank: int = 0,
                 stats: dict | None = None):
        parent = _check_dir(nvme_path)
        tiers.remove_stale_dirs(parent)
        self.offsets, nbytes = self.layout(shard_numels)
        self.numels = list(shard_numels)
        self.nbytes = nbytes  # of each file (the gradients' file has the same layout)
        # Each unit's slot: from its offset up to the next unit's (padding included).
        self._slot_end = dict(zip(self.offsets, [*self.offsets[1:], nbytes], strict=True))
        self._data_bytes = {o: n * _ELEM for o, n in zip(self.offsets, self.numels, strict=True)}
        self.stats = stats if stats is not None else {}  # the model's ZeroState stats
        self.stats.update(nvme_read_bytes=0, nvme_write_bytes=0, nvme_grad_bytes=0,
                          nvme_file_bytes=2 * nbytes)
        try:
            self.directory = tiers.make_state_dir(parent)
        except OSError as e:
            raise PermissionError(e.errno, f"nvme_path={parent!r}: cannot create the parameter "
                                  f"folder there: {os.strerror(e.errno or 0)}") from e
        self.path = os.path.join(self.directory, f"params.rank{rank}.f32")
        self.grad_path = os.path.join(self.directory, f"grads.rank{rank}.f32")
        fds: list[int] = []
        try:
            maps = []
            for path in (self.path, self.grad_path):
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                try:
                    tiers._reserve(fds[-1], nbytes, path, 2 * nbytes)
                    _fill_holes(fds[-1], nbytes)
                except OSError as e:
                    raise OSError(e.errno, f"nvme_path={parent!r} has no room for the "
                                  f"parameter and gradient shards: {2 * nbytes} bytes are "
                                  f"needed ({nbytes} for the fp32 shards and {nbytes} for the "
                                  f"fp32 gradient shards of every unit of rank {rank}); "
                                  f"allocating {path!r} failed: "
                                  f"{os.strerror(e.errno or 0)}") from e
                maps.append(mmap.mmap(fds[-1], nbytes, flags=mmap.MAP_SHARED,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE))
            err = direct_io_error(self.path)  # None, or EINVAL: no O_DIRECT here
            # Truncated and regrown, overwritten or replaced by another process: refused at
            # the next gather or step (io/file_watch.py), not read back as the shards.
            # A removed file is harmless: the mapping keeps it.
            self._watch = FileWatch()
            self._watch.add(self.path, "the fp32 shards of offload_params='nvme'", nbytes,
                            fds[0])
            self._watch.add(self.grad_path, "the fp32 gradient shards of offload_params='nvme'",
                            nbytes, fds[1])
        except BaseException:
            if hasattr(self, "_watch"):
                self._watch.close()
            for fd in fds:
                os.close(fd)
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        fd, self._gfd = fds
        self._map, self._gmap = maps
        self._fd = fd
        self._flat = torch.frombuffer(self._map, dtype=torch.float32)
        self._gbase = torch.frombuffer(self._gmap, dtype=torch.uint8, count=1)  # (its address)
        self._reader = None
        if err is not None:
            warnings.warn(f"nvme_path={parent!r}: the file system does not support O_DIRECT "
                          f"({os.strerror(err.errno or 0) or err}); parameter gathers read the "
                          f"shards through the mapping instead (page faults on the training "
                          f"thread, slower)", RuntimeWarning, stacklevel=3)
        else:
            slot = max((self._slot_end[o] - o for o in self.offsets), default=_PAGE)
            self._reader = ShardReader(path=self.path, fd=fd, base=self._flat.data_ptr(),
                                       slot_bytes=slot, stats=self.stats)
        self.stats["nvme_direct"] = self._reader is not None
        self.stats.update(nvme_drop_s=0.0, nvme_warm_s=0.0, nvme_warm_bytes=0,
                          nvme_read_wait_s=0.0, nvme_prefetch_hits=0, nvme_prefetch_misses=0,
                          nvme_cached_reads=0)
        # Write faults of a range that is not in the page cache read it from the disk first.
        # The gather right before a step (learned: how many gathers a range had between its
        # last two steps) therefore writes the bytes it read back through the page cache
        # (a buffered pwrite of whole pages reads nothing) and leaves them there for the step,
        # at most _WARM_CAP_UNITS ranges at a time (oldest evicted first).
        self._since_step: dict[int, int] = {}  # offset -> gathers since its last step
        self._per_step: dict[int, int] = {}  # offset -> gathers between its last two steps
        self._warm: list[int] = []  # offsets kept in the page cache for the step, oldest first
        self._ranges: dict[int, tuple[int, int]] = {}  # data_ptr -> (byte offset, bytes)
        self._grad_at: dict[int, int] = {}  # shard data_ptr -> its offset in both files
        self._grads: dict[int, tuple[int, int]] = {}  # gradient data_ptr -> (offset, bytes)
        # A handed-over gradient is dropped (unmapped, write-back started, evicted)
        # grad_drop_lag hand-overs later, when the overlapped optimizer has read it (0: at
        # once; None: only after the step). See _GRAD_DROP_LAG.
        self.grad_drop_lag: int | None = _GRAD_DROP_LAG
        self._handed: list[tuple[int, int]] = []  # handed over, not dropped yet, oldest first
        self._next_unit = 0
        self._history: tuple = (None, None)  # the last two staged ranges
        self._follows: dict[tuple, int] = {}  # (range before, range) -> the range staged next
        ref = weakref.ref(self)

        def after_step(optimizer, args, kwargs):
            store = ref()
            if store is not None:
                store._after_step(optimizer)

        def before_step(optimizer, args, kwargs):
            store = ref()
            if store is not None:
                store._before_step(optimizer)

        hooks = (register_optimizer_step_pre_hook(before_step),
                 register_optimizer_step_post_hook(after_step))
        self._finalizer = weakref.finalize(self, _cleanup, fds, self.directory, hooks,
                                           self._reader, self._watch)

    @staticmethod
    def layout(shard_numels: list[int]) -> tuple[list[int], int]:
        """(byte offset of every unit's shard in the file, the file's size)."""
        offsets, nbytes = [], 0
        for n in shard_numels:
            align = _HUGE if n * _ELEM >= _HUGE else _PAGE
            nbytes = -(-nbytes // align) * align
            offsets.append(nbytes)
            nbytes += -(-n * _ELEM // _PAGE) * _PAGE
        return offsets, nbytes

    def close(self) -> None:
        """Removes the folder now (the shards' and gradients' views stay readable until they
        are freed; the page cache is no longer advised, and later backwards keep gradients in
        RAM, so call it when training is over)."""
        self._finalizer()
        self._fd = -1

    def check_files(self, reading_at: int | None = None) -> None:
        """Raises OSError (EIO) if either file was changed under the running job (FileWatch):
        cut short (its pages past the end are gone, and touching them through the mapping
        would be a SIGBUS that kills the process), replaced under its name, or written by
        another process (truncated and regrown, rewritten, overwritten in part: zeros or
        someone else's bytes where the shards were). A removed file is not refused: the
        mapping keeps it, and training goes on exactly. Called before every gather and step
        reads or writes them (a stat per file and one read of the event queue). `reading_at`:
        the offset a gather is about to read."""
        if self._fd < 0:
            return

        def doing(path: str) -> str:
            if reading_at is None or path != self.path:
                return ""
            return f"reading parameter shards from {path!r} at offset {reading_at} failed: "

        self._watch.check(doing)

    def _before_step(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and self._range(p) is not None:
                    self.check_files()  # before the step writes anything through the mapping
                    return

    # ---- shards ----
    def alloc(self, shard: torch.Tensor) -> torch.Tensor:
        """The next unit's shard: a view of the mapping holding a copy of `shard` (fp32)."""
        i = self._next_unit
        if i >= len(self.numels) or shard.numel() != self.numels[i]:
            raise RuntimeError(f"NvmeParamStore.alloc: unit {i} has {shard.numel()} elements, "
                               f"the store was sized for {self.numels[i:i + 1]}")
        self._next_unit += 1
        lo = self.offsets[i] // _ELEM
        view = self._flat[lo:lo + shard.numel()]
        view.copy_(shard.detach())
        self._ranges[view.data_ptr()] = (self.offsets[i], shard.numel() * _ELEM)
        self._grad_at[view.data_ptr()] = self.offsets[i]
        self._drop(self.offsets[i], shard.numel() * _ELEM)
        return view

    def grad_home(self, shard: torch.Tensor, piece: torch.Tensor) -> torch.Tensor | None:
        """The gradient to assign to `shard` (which has none): a view of its range in the
        gradients' file holding a copy of `piece`; None if `shard` is not one of this store's."""
        if self._fd < 0 or shard.device.type != "cpu" or shard.numel() == 0:
            return None
        off = self._grad_at.get(shard.data_ptr())
        if off is None:
            return None
        self.check_files()
        # A tensor of its own over the range, not a view of self._flat: its version counter
        # then counts writes to this gradient only (the overlapped optimizer checks it).
        view = torch.frombuffer(self._gmap, dtype=torch.float32, count=shard.numel(),
                                offset=off)  # (shards are flat)
        # Through the page cache, not the mapping: a write fault on a page no longer cached
        # reads it from the disk first; a buffered pwrite of whole pages reads nothing, and
        # maps nothing into this process.
        data = piece.detach().to(torch.float32).contiguous().view(-1).view(torch.uint8)
        buf, done = memoryview(data.numpy()), 0
        while done < len(buf):
            done += os.pwrite(self._gfd, buf[done:], off + done)
        self._grads[view.data_ptr()] = (off, shard.numel() * _ELEM)
        self.stats["nvme_grad_bytes"] += shard.numel() * _ELEM
        return view

    def landed(self, grad: torch.Tensor) -> None:
        """A backward handed `grad` over (assigned or accumulated): drop it from RAM
        grad_drop_lag hand-overs later."""
        lag = self.grad_drop_lag
        r = self._grads.get(grad.data_ptr()) if self._fd >= 0 else None
        if r is None or lag is None:
            return
        if r not in self._handed:  # (a second backward accumulating into it)
            self._handed.append(r)
        while len(self._handed) > lag:
            offset, nbytes = self._handed.pop(0)
            self._drop(offset, nbytes, grads=True)
            # The overlapped optimizer's worker read the parameter too (it checks what it steps
            # from by content): unmapped, but kept in the page cache for the step.
            if nbytes:
                self._map.madvise(mmap.MADV_DONTNEED, offset, self._slot_end[offset] - offset)

    def _drop_grad(self, grad: torch.Tensor) -> None:
        r = self._grads.get(grad.data_ptr()) if self._fd >= 0 else None
        if r is not None:
            self._drop(*r, grads=True)

    def _range(self, t: torch.Tensor):
        if self._fd < 0:  # closed: residency is no longer managed (the fd number may be reused)
            return None
        return self._ranges.get(t.data_ptr()) if t.device.type == "cpu" else None

    def fetch(self, shard: torch.Tensor) -> torch.Tensor:
        """The data of `shard` to copy into a gather's staging buffer: a RAM copy read with
        O_DIRECT (read ahead while the previous unit computed, if it was predicted), or the
        view itself where O_DIRECT is not available. Valid until the next fetch()."""
        r = self._range(shard)
        if r is not None:
            self.check_files(reading_at=r[0])
        if r is None or self._reader is None:
            return shard
        return self._reader.fetch(*r).view(torch.float32).view(shard.shape)

    def staged(self, shard: torch.Tensor) -> None:
        """`shard` was just read into a staging slot: drop it, read ahead the one due next."""
        r = self._range(shard)
        if r is None:
            return
        self.stats["nvme_read_bytes"] += r[1]
        key = r[0]
        since = self._since_step.get(key, 0) + 1
        self._since_step[key] = since
        if self._reader is not None and since == self._per_step.get(key):
            self._keep_warm(key, r[1])
        else:
            self._drop(*r)
        if self._history[1] is not None:
            self._follows[self._history] = key
        self._history = (self._history[1], key)
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Starts reading the range that followed the last two staged ones last time."""
        nxt = self._follows.get(self._history)
        if nxt is None:
            return
        if self._reader is not None:
            if nxt != self._history[1]:
                # Evict what is clean of it now (pages under write-back stay until the next
                # drop), then read it with O_DIRECT into the free buffer.
                os.posix_fadvise(self._fd, nxt, self._slot_end[nxt] - nxt,
                                 os.POSIX_FADV_DONTNEED)
            self._reader.prefetch(nxt, self._data_bytes[nxt])
        elif nxt != self._history[1]:  # into the page cache (not into this process)
            os.posix_fadvise(self._fd, nxt, self._data_bytes[nxt], os.POSIX_FADV_WILLNEED)

    def stepped(self, shard: torch.Tensor, wrote: bool = True) -> None:
        """An optimizer stepped `shard`: drop its range (dirty if it `wrote`, which starts the
        write-back)."""
        r = self._range(shard)
        if r is not None:
            self.stats["nvme_write_bytes"] += r[1] if wrote else 0
            key = r[0]
            if self._reader is not None:
                self._reader.stale(key)
            if self._since_step.get(key):
                self._per_step[key] = self._since_step[key]
            self._since_step[key] = 0
            if key in self._warm:
                self._warm.remove(key)
            self._drop(*r)

    def _after_step(self, optimizer) -> None:
        # An offloaded optimizer skips a step with non-finite gradients: nothing was written.
        wrote = not getattr(optimizer, "last_step_stats", {}).get("skipped", False)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # (an optimizer skips a parameter without gradient)
                    self.stepped(p, wrote)
                    self._drop_grad(p.grad)  # read by the step: nothing needs it in RAM now
        self._handed.clear()
        if self._reader is not None and self._fd >= 0:
            self._read_ahead()  # the first gather of the next forward, now that it is written

    # ---- residency ----
    def _keep_warm(self, offset: int, nbytes: int) -> None:
        """Unmaps the range from this process but leaves it in the page cache, filled from the
        gather's O_DIRECT buffer, for the optimizer step that follows."""
        t0 = time.perf_counter()
        if offset not in self._warm:
            self._warm.append(offset)
            os.pwrite(self._fd, self._reader.last(nbytes).numpy(), offset)
            self.stats["nvme_warm_bytes"] += nbytes
        self._map.madvise(mmap.MADV_DONTNEED, offset, self._slot_end[offset] - offset)
        self.stats["nvme_warm_s"] += time.perf_counter() - t0
        while len(self._warm) > _WARM_CAP_UNITS:
            old = self._warm.pop(0)
            self._drop(old, self._data_bytes[old])

    def _drop(self, offset: int, nbytes: int, grads: bool = False) -> None:
        """Drops the unit's whole slot (of the gradients' file if `grads`), up to the next
        unit: a fault near the end of the data may have mapped padding pages of the same folio
        too."""
        if nbytes == 0:
            return  # (a zero length would advise the whole rest of the file)
        t0 = time.perf_counter()
        end = self._slot_end[offset]
        (self._gmap if grads else self._map).madvise(mmap.MADV_DONTNEED, offset, end - offset)
        os.posix_fadvise(self._gfd if grads else self._fd, offset, end - offset,
                         os.POSIX_FADV_DONTNEED)
        self.stats["nvme_drop_s"] += time.perf_counter() - t0

    def resident_bytes(self, grads: bool = False) -> int:
        """Bytes of the parameters' (gradients' if `grads`) file that this process has mapped
        in right now (from /proc/self/smaps of that mapping), for tests and diagnostics."""
        start = (self._gbase if grads else self._flat).data_ptr()
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo = int(head.split("-")[0], 16)
                    inside = lo == start
                elif inside and head == "Rss:":
                    return int(line.split()[1]) * 1024
        return 0
