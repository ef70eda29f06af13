"""FeatureStore: node features that stay in host memory and are gathered row by row.

On a GPU the table is page-locked and mapped (in place with cudaHostRegister, or as a pinned
copy) and `gather` runs tierlift's CUDA kernel, which reads the rows over PCIe straight into the
output; the hottest rows (by degree, or by observed access frequency) can be kept in a GPU cache
table that the same kernel serves. Without a GPU (or with device="cpu") the same API gathers on
the CPU with the multithreaded C++ gather.

Forked workers: a CPU store works in forked DataLoader workers (the C++ gather runs on the
worker's own thread there). A CUDA store cannot: CUDA does not survive fork(), so gathering in a
forked child raises RuntimeError; gather in the main process (for PyG loaders:
filter_per_worker=False) or use multiprocessing start method "spawn".
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierlift import _extension, ops
from tierlift.gnn.file_table import (
    FileBackedPickling,
    WatchedFile,
    file_identity,
    file_region,
    mapped_again,
)

_PIN_MODES = ("inplace", "copy")
_CACHE_POLICIES = ("degree", "frequency")
_CHECKS = ("sync", "async")
_LOCALITIES = ("index", "sorted")
_FREQUENCY_WARMUP = 8  # gathers counted before a frequency-policy cache is filled
_FILE_NAMES = {"what": "feature file", "holder": "store"}


@dataclass(kw_only=True)
class FeatureStoreOptions:
    """Validated FeatureStore settings (every field is a FeatureStore keyword)."""

    pin: str = "inplace"
    cache: float = 0.0
    cache_policy: str = "degree"
    device: str | torch.device = "cuda"
    locality: str = "index"
    sort: bool = False  # deprecated: locality="sorted"
    check: str = "sync"

    def __post_init__(self):
        if self.pin not in _PIN_MODES:
            raise ValueError(f"pin must be one of {_PIN_MODES}, got {self.pin!r}")
        if self.cache_policy not in _CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {_CACHE_POLICIES}, "
                             f"got {self.cache_policy!r}")
        if isinstance(self.cache, bool) or not isinstance(self.cache, (int, float)) \
                or not 0.0 <= float(self.cache) <= 1.0:
            raise ValueError(f"cache must be a fraction of rows in [0, 1], got {self.cache!r}")
        self.device = torch.device(self.device)
        if not isinstance(self.sort, bool):
            raise TypeError(f"sort must be a bool, got {type(self.sort).__name__}")
        if self.locality not in _LOCALITIES:
            raise ValueError(f"locality must be one of {_LOCALITIES}, got {self.locality!r}")
        if self.sort:
            warnings.warn("FeatureStore(sort=True) is deprecated; use locality='sorted'",
                          DeprecationWarning, stacklevel=3)
            self.locality = "sorted"
        if self.check not in _CHECKS:
            raise ValueError(f"check must be one of {_CHECKS}, got {self.check!r}")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device}")


def _load_features(features, dtype, shape) -> tuple[torch.Tensor, WatchedFile | None]:
    """Returns (tensor, file): file is the watch of a file it maps, else None. Files are
    memory-mapped copy-on-write, never read whole."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"features: dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(features, torch.Tensor):
        # Ignored, they would leave the user believing rows come back as dtype= or shape= says.
        _check_given(features.dtype, tuple(features.shape), dtype, shape, "a tensor",
                     "use features.view(dtype) or features.view(shape)")
        return features, None
    if not isinstance(features, (str, os.PathLike)):
        raise TypeError("features must be a torch.Tensor or a path to an .npy or raw file, got "
                        f"{type(features).__name__}")
    path = Path(features)
    if not path.is_file():
        raise FileNotFoundError(f"features: no such file {str(path)!r}")
    # Watched before mapping: a rewrite from here on is refused at gather (_check_file).
    file = WatchedFile(str(path.resolve()), file_identity(path.stat()), **_FILE_NAMES)
    if path.suffix == ".npy":
        with open(path, "rb") as f:  # the header says what the mapping will need
            fmt = np.lib.format
            read = (fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0)
                    else fmt.read_array_header_2_0)
            shape_, fortran_order, np_dtype = read(f)
            start = f.tell()
        _check_size(path, start, shape_, np_dtype)
        array = np.load(path, mmap_mode="c")
        table = torch.from_numpy(array)
        if fortran_order and not table.is_contiguous():
            raise ValueError(f"features: {str(path)!r} is stored in Fortran (column-major) order, "
                             "so its rows are not contiguous in the file; save it in C order "
                             "(np.save(path, np.ascontiguousarray(a)))")
        if dtype is not None and dtype != table.dtype and np_dtype.kind == "u" \
                and _numpy_twin(dtype) is None \
                and torch.empty(0, dtype=dtype).element_size() == np_dtype.itemsize:
            table = table.view(dtype)  # bfloat16/float8 bits saved as unsigned, as raw files
        _check_given(table.dtype, tuple(shape_), dtype, shape, "an .npy file (its header says)",
                     "a dtype numpy lacks (bfloat16, float8) can be read from an .npy of "
                     "unsigned ints of its width")
        return table, file
    if dtype is None or shape is None:
        raise ValueError("features: a raw file needs dtype= and shape= (an .npy file does not)")
    np_dtype = _numpy_twin(dtype)
    if np_dtype is None:  # no numpy twin (bfloat16, float8): mapped as unsigned of its width
        np_dtype = np.dtype(f"u{torch.empty(0, dtype=dtype).element_size()}")
    _check_size(path, 0, shape, np_dtype, exact=str(dtype).removeprefix("torch."))
    array = np.memmap(path, dtype=np_dtype, mode="c", shape=tuple(shape))
    return torch.from_numpy(array).view(dtype), file


def _numpy_twin(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


def _check_given(actual_dtype, actual_shape, dtype, shape, source: str, hint: str) -> None:
    """dtype= and shape= describe a raw file; elsewhere they may only repeat what the features
    say, as a check."""
    if dtype is not None and dtype != actual_dtype:
        raise ValueError(f"features: dtype={dtype} but {source} holds {actual_dtype}; dtype= "
                         f"and shape= describe a raw file and are not a conversion ({hint})")
    if shape is not None and tuple(shape) != actual_shape:
        raise ValueError(f"features: shape={tuple(shape)} but {source} has shape "
                         f"{actual_shape}; dtype= and shape= describe a raw file and are not a "
                         f"reshape")


def _watch(held, tensor: torch.Tensor) -> tuple:
    """(held, then what gather compares to tell whether the features changed since the store
    was built): their version counter (in-place edits), and the storage, offset, shape and
    dtype they view, which features.data = ... replaces without counting a version. The storage
    by identity, held weakly: share_memory_() (a spawned worker's pickling) moves its bytes
    but keeps it, and a storage freed since can never compare equal."""
    return (held, tensor._version, weakref.ref(tensor.untyped_storage()), *_layout(tensor))


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.storage_offset(), tuple(tensor.shape), tensor.dtype


def _moved(tensor: torch.Tensor, watched: tuple) -> bool:
    storage = tensor.untyped_storage()
    # A storage resized smaller in place (storage.resize_()) keeps its identity, but the
    # gather kernels would read past its end (garbage rows; a segmentation fault at size 0).
    short = storage.nbytes() < (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return storage is not watched[2]() or _layout(tensor) != watched[3:] or short


def _check_size(path: Path, start: int, shape, np_dtype, exact: str | None = None) -> None:
    """A file shorter than its shape: named with both sizes (mmap would only say "mmap length
    is greater than file size"). With `exact` (a raw file's dtype, as the user named it) a
    longer file is refused too: a raw file holds the table and nothing else, so spare bytes
    mean the shape or dtype given is not the file's (the rows would be silently misread)."""
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0 for n in shape):
        raise ValueError(f"features: shape must hold ints >= 0, got {tuple(shape)}")
    need = start + int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    size = path.stat().st_size
    if size < need:
        raise ValueError(f"features: {str(path)!r} has {size} bytes but shape {tuple(shape)} of "
                         f"{exact or np.dtype(np_dtype).name} needs {need}"
                         + (f" ({start} of them the .npy header)" if start else "")
                         + " (a truncated file, or the wrong shape or dtype?)")
    if exact is not None and size > need:
        raise ValueError(f"features: {str(path)!r} has {size} bytes but shape {tuple(shape)} of "
                         f"{exact} needs {need}: a raw file must hold exactly the table (the wrong "
                         "shape or dtype?)")


class FeatureStore(FileBackedPickling):
    """Host-resident feature rows gathered into GPU (or CPU) tensors.

    The features must not change once the store is built: rows are read from their memory at
    each gather, except a CUDA store's cached rows and pin="copy" copy, taken at build. Changes
    torch can see (in-place ops, which count a version; new memory under the tensor, as
    `features.data = ...` or a module's `.half()` give) make gather raise, on every device.
    Changes it cannot see (through numpy, `features.data.mul_()`, inference tensors, torch's
    fused=True optimizers) would mix old and new rows on such a CUDA store: build a new store
    after editing the features. Features that are a file's mapping (a path, np.memmap,
    np.load(mmap_mode=...), torch.from_file) are watched: a rewrite of the file in place is
    refused at the next gather (this process's own writes through a writable shared mapping are
    edits of the features, as above).

    Args:
        features: CPU tensor (contiguous, at least 1-D, rows along dim 0) or path to an .npy
            file or a raw file (then give dtype= and shape=); files are memory-mapped.
        pin: "inplace" registers the existing memory with CUDA (no second copy); "copy" makes a
            pinned copy (for memory CUDA cannot register).
        cache: fraction of rows to keep in a GPU cache table (CUDA stores only).
        cache_policy: "degree" caches the rows of the highest `degrees`; "frequency" counts the
            rows the first gathers ask for and then caches the most requested ones.
        degrees: per-row degree (or any hotness score), needed by cache_policy="degree".
        device: where gather results live; "cuda" falls back to "cpu" with a warning when this
            machine or build has no CUDA.
        locality: "index" reads rows in the order of the index; "sorted" has the CUDA kernel
            read them in ascending row order (the index is sorted on the GPU, each row still
            lands at its own position), so neighbouring requests share host pages. The CPU
            gather is the same either way. `sort=True` is the deprecated spelling of "sorted".
        check: bounds checking of a GPU index on a CUDA store. "sync" reads the kernel's flag
            back (one stream synchronisation per gather); "async" does not: a bad index is still
            never read (nor its output row written), and IndexError is raised by a later
            `gather` that finds the flag set, or by `synchronize()`. A CPU index is checked on
            the host and then gathered without any synchronisation, whatever `check` says.
        dtype, shape: element type and shape of a raw (non-.npy) feature file. For an .npy file
            or a tensor they may only repeat what it holds (a ValueError otherwise), except that
            an .npy of unsigned ints reads as a dtype of their width numpy lacks (bfloat16).
    """

    # Sent to a spawned worker, a table that is a mapped file goes as a reference to its file
    # (the features watched for edits are that table: one mapping for both).
    _file_state_keys = ("_table", "_watched")
    _file_names = {"owner": "FeatureStore", **_FILE_NAMES}

    def __init__(self, features, *, pin="inplace", cache=0.0, cache_policy="degree",
                 degrees=None, device="cuda", locality="index", sort=False, check="sync",
                 dtype=None, shape=None):
        _extension.require("extension")
        self.options = FeatureStoreOptions(pin=pin, cache=cache, cache_policy=cache_policy,
                                           device=device, locality=locality, sort=sort,
                                           check=check)
        table, self._file = _load_features(features, dtype, shape)
        file_backed = self._file is not None
        self._check_table(table)
        self.device = self.options.device
        if self.device.type == "cuda" and not (torch.cuda.is_available()
                                               and _extension.has_cuda_kernels()):
            warnings.warn("FeatureStore: no CUDA GPU or CUDA kernels here; gathering on the CPU",
                          RuntimeWarning, stacklevel=2)
            self.device = torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._pid = os.getpid()
        self._registration = self._registered_ptr = None
        self._cache_table = self._cache_slots = self._counts = self._bad = self._bad_host = None
        self._gathers = 0
        self._closed = False
        self._pickled_cuda = False  # a copy of a CUDA store in another process: cannot gather
        if self.device.type == "cuda":
            table = self._pin(table, file_backed)
            self._new_bad_index_flags()
        self._table = table
        if self._file is None:
            # The user's mapping of a file (np.memmap, np.load(mmap_mode=...), torch.from_file)
            # shows a rewrite of the file as a path's does: watched the same way, where the store
            # reads it (not under a pin="copy" copy). Found once, from the process's mappings: a
            # table in memory of its own has no watch, and its gathers make no system call more.
            region = file_region(table, watch=True)
            self._file = None if region is None else region.watch(**_FILE_NAMES)
        # The caller's tensor, its version and its memory: an in-place edit of it after this
        # point, or new memory put under it (features.data = ...), would reach a CUDA store's
        # table but not its cached copies (nor a pin="copy" copy), so gathers would mix old and
        # new rows. gather refuses both, on every device. Held weakly only when the store keeps
        # a copy (a CPU store, which holds the tensor, stays picklable).
        self._watched = None
        if isinstance(features, torch.Tensor) and not features.is_inference():
            held = features if features is table else weakref.ref(features)
            self._watched = _watch(held, features)
        self.num_rows = table.shape[0]
        self.row_shape = tuple(table.shape[1:])
        self.dtype = table.dtype
        if self.device.type == "cuda" and self.options.cache > 0:
            self._setup_cache(degrees)
        elif degrees is not None:
            self._check_degrees(degrees)

    # ---- construction helpers ----

    @staticmethod
    def _check_table(table: torch.Tensor) -> None:
        if table.device.type != "cpu":
            raise ValueError(f"features must be a CPU tensor (host memory), got {table.device}")
        if table.layout != torch.strided:
            raise ValueError(f"features must be a dense tensor, got {table.layout}")
        if table.is_quantized:  # its scale and zero point would not reach the gathered rows
            raise ValueError("features: quantized tensors (torch.quantize_per_*) are not "
                             "supported; store q.int_repr() and apply q's scale and zero point "
                             "to the gathered rows")
        if table.dim() < 1:
            raise ValueError("features must have at least one dimension (rows along dim 0)")
        if not table.is_contiguous():
            raise ValueError("features must be contiguous (call .contiguous(), which copies)")
        if table.requires_grad:  # the gathered rows would carry no gradient back to it
            raise ValueError("features require grad, but FeatureStore.gather is not "
                             "differentiable; pass features.detach() for a constant table")

    def _new_bad_index_flags(self) -> None:
        # Deferred bounds check: the kernel stores (position, value) of a bad index in _bad
        # (device memory); async gathers then copy it, non-blocking, into the pinned _bad_host,
        # which the host can read without any CUDA call.
        self._bad = torch.full((2,), -1, dtype=torch.long, device=self.device)
        self._bad_host = torch.full((2,), -1, dtype=torch.long).pin_memory()

    def _pin(self, table: torch.Tensor, file_backed: bool) -> torch.Tensor:
        if table.numel() == 0 or table.is_pinned():
            return table
        if self.options.pin == "copy":
            return table.pin_memory()
        self._registration = _extension._C.HostRegistration(
            table, read_only=file_backed, owner="features", remedy="use pin='copy'")
        # The kernels read the registered address: share_memory_() keeps the storage (the
        # watch's identity check passes) but moves its bytes, unregistered, elsewhere.
        self._registered_ptr = table.data_ptr()
        return table

    def _check_degrees(self, degrees) -> torch.Tensor:
        degrees = torch.as_tensor(degrees)
        if degrees.shape != (self.num_rows,):
            raise ValueError(f"degrees must have shape ({self.num_rows},), one per row, "
                             f"got {tuple(degrees.shape)}")
        return degrees

    def _setup_cache(self, degrees) -> None:
        self.cache_rows = int(self.options.cache * self.num_rows)
        self._cache_slots = torch.full((self.num_rows,), -1, dtype=torch.int32,
                                       device=self.device)
        if self.options.cache_policy == "degree":
            if degrees is None:
                raise ValueError("cache_policy='degree' needs degrees= (one per row)")
            self._fill_cache(self._check_degrees(degrees).to(torch.float64))
        else:
            self._counts = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)

    def _fill_cache(self, score: torch.Tensor) -> None:
        hot = torch.topk(score.cpu(), self.cache_rows, sorted=False).indices
        self._cache_table = self._table.index_select(0, hot).to(self.device)
        slots = torch.full((self.num_rows,), -1, dtype=torch.int32)
        slots[hot] = torch.arange(self.cache_rows, dtype=torch.int32)
        self._cache_slots = slots.to(self.device)

    # ---- public API ----

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_rows, *self.row_shape)

    def cached_rows(self) -> torch.Tensor:
        """Row ids currently served from the GPU cache (empty without a cache)."""
        if self._cache_slots is None or self._cache_table is None:
            return torch.empty(0, dtype=torch.long)
        return (self._cache_slots >= 0).nonzero().flatten().cpu()

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None,
               stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Rows `index` (int32/int64, 1-D, on the CPU or the store's device) as a tensor on the
        store's device, written into `out` when given. With `stream`, the gather is queued on it
        (then make the consumer wait on that stream). An empty index gives an empty result; an
        out-of-range or negative index raises IndexError naming it, and is never read."""
        self._check_usable()
        index = self._check_index(index)
        out = self._check_out(out, index.numel())
        self._raise_deferred(wait=False)
        if index.numel() == 0:
            return out
        if self.device.type == "cpu":
            self._gather_into(index, out, deferred=False)
            return out
        host_checked = index.device.type == "cpu"
        if host_checked:
            # A private pinned copy, so the copy to the GPU need not synchronise: the caller's
            # index (a pinned one too) may be refilled as soon as gather returns, before the
            # non-blocking copy has run. Checked here; then the GPU need not report back.
            index = torch.empty(index.shape, dtype=index.dtype, pin_memory=True).copy_(index)
            self._validate_host_index(index)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if host_checked:
                index = index.to(self.device, non_blocking=True)
            if self._counts is not None:
                self._count(index)
            deferred = host_checked or self.options.check == "async"
            self._gather_into(index, out, deferred=deferred)
            if not host_checked and deferred:  # only a GPU index can set the flag
                self._bad_host.copy_(self._bad, non_blocking=True)
        return out

    def synchronize(self) -> None:
        """Waits for this store's gathers (all work on its device) and raises the IndexError of
        a bad index that a check="async" gather found. A no-op for CPU stores."""
        self._raise_deferred(wait=True)

    def _raise_deferred(self, wait: bool) -> None:
        if self._bad is None:
            return
        if not wait and int(self._bad_host[0]) == -1:  # a plain host read: no CUDA call
            return
        torch.cuda.synchronize(self.device)
        pos, value = self._bad.tolist()
        if pos == -1:
            return
        self._bad.fill_(-1)
        self._bad_host.fill_(-1)
        raise IndexError(f"gather_rows: index[{pos}] = {value} is out of range for a table of "
                         f"{self.num_rows} rows (found by an earlier gather with check='async'; "
                         "that row was not read and its output row was not written)")

    def _gather_into(self, index: torch.Tensor, out: torch.Tensor, deferred: bool) -> None:
        kwargs = {"bad_index": self._bad} if deferred else {}
        if self._cache_table is not None:
            kwargs.update(cache_table=self._cache_table, cache_slots=self._cache_slots)
        ops.gather_rows(self._table, index, out, locality=self.options.locality, **kwargs)

    def close(self) -> None:
        """Unregisters the host memory and frees the cache; later gathers raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._registration is not None and os.getpid() == self._pid:
            self._registration.close()
        self._registration = None
        self._table = self._cache_table = self._cache_slots = self._counts = None
        self._bad = self._bad_host = self._watched = None
        self._file = None  # (its watch's mark goes with the last store that shares it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    def __copy__(self):
        """A shallow copy shares the table. A CUDA store's would also share its registered
        memory and GPU cache, which close() on either would take from the other: refused."""
        if self.device.type == "cuda" and not self._closed and not self._pickled_cuda:
            raise TypeError("copy.copy of a FeatureStore(device='cuda') is not supported: the "
                            "copy would share the original's page-locked rows and GPU cache, "
                            "and closing either would take them from the other; use the store "
                            "itself, or copy.deepcopy for an independent store")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        """An independent store with the same rows, as deepcopy of a model or a PyG Data that
        holds it expects: the table copied (with the features when they are in the same
        deepcopy, as for any tensor; a CPU store's file, mapped copy-on-write, mapped again as
        pickling does), a CUDA
        store's copy pinned as pin= says, its GPU cache and access counts copied as they are.
        A store that would refuse to gather (its features edited in place since it was built, in
        a forked child) is refused before anything is copied. Closed, or carrying no rows
        (pickled into this process): copied as it is."""
        if self._closed or self._pickled_cuda:
            new = object.__new__(type(self))
            memo[id(self)] = new
            new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
            return new
        self._check_usable()
        cuda = self.device.type == "cuda"
        if cuda:  # gathers on other streams count rows and fill the cache: let them finish
            torch.cuda.synchronize(self.device)
        new = object.__new__(type(self))
        memo[id(self)] = new
        held = {"_table", "_watched", "_registration", "_cache_table", "_cache_slots",
                "_counts", "_bad", "_bad_host", "_file"}
        new.__dict__.update(copy.deepcopy(
            {k: v for k, v in self.__dict__.items() if k not in held}, memo))
        new._pid = os.getpid()
        new._registration = new._bad = new._bad_host = None
        table = memo.get(id(self._table))  # the features, copied already with their holder
        # A private mapping is mapped again, not read whole into memory; a shared one is
        # copied: edits of the original's features would reach the file, and so the copy.
        mapped = None if table is not None or cuda else mapped_again(self._table,
                                                                     **self._file_names)
        if mapped is not None:
            table = memo[id(self._table)] = mapped
        elif table is None:
            if cuda and self._table.is_pinned():  # a pinned copy, not a second one to pin it
                table = torch.empty_like(self._table, pin_memory=True).copy_(self._table)
                memo[id(self._table)] = table
            else:
                table = copy.deepcopy(self._table, memo)
        new._table = new._pin(table, file_backed=False) if cuda else table
        # Mapped again: watched again, from when the original mapped it.
        new._file = self._file.again() if mapped is not None and self._file is not None \
            else None
        new._watched = self._watched
        if self._watched is not None and isinstance(self._watched[0], torch.Tensor):
            # It held its table, the features themselves: the copy holds its own (as built).
            new._watched = _watch(table if table is new._table else weakref.ref(table), table)
        for key in ("_cache_table", "_cache_slots", "_counts"):
            value = getattr(self, key)
            setattr(new, key, None if value is None else value.clone())
        if cuda:
            new._new_bad_index_flags()  # a bad index the original saw is the original's to raise
            torch.cuda.synchronize(self.device)  # copied before a gather on any stream reads it
        return new

    def __getstate__(self):
        """A CPU store pickles whole (torch.save too): an archived store keeps its rows, even
        one built from a file. Sent to a spawned process (a DataLoader worker) through
        multiprocessing's pickler, a table that is a mapped file goes as a reference to that
        file instead (FileBackedPickling), not as a copy in /dev/shm.

        A CUDA store's copy (for a spawned DataLoader worker, say) carries no rows: its
        registered memory and GPU cache cannot cross processes, and pickling the table for a
        worker would move it into shared, unpinned memory under this process's store. The copy
        keeps shape and dtype, and refuses to gather."""
        state = self.__dict__.copy()
        if not self._closed and not self._pickled_cuda:
            self._check_file()  # the rows, by value or as the file, would not be the store's
        # Rows by value are the copy's own. Sent as its file, the table is watched again where
        # it is mapped (_mapped_again).
        state["_file"] = None
        if self.device.type == "cuda" and not self._closed:
            for key in ("_registration", "_table", "_cache_table", "_cache_slots", "_counts",
                        "_bad", "_bad_host", "_watched"):
                state[key] = None
            state["_pickled_cuda"] = True
            return state
        if self._watched is not None:  # the held tensor; the rest is remade on unpickling
            state["_watched"] = self._watched[:1]
        return state

    def __setstate__(self, state):
        """Unpickled (a spawned worker's copy): its tensor is new, with a version of its own."""
        self.__dict__.setdefault("_file", None)  # pickled before stores watched their file
        self.__dict__.update(state)
        if self._watched is not None and isinstance(self._watched[0], torch.Tensor):
            self._watched = _watch(self._watched[0], self._watched[0])

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_rows} rows x {self.row_shape}"
        return f"FeatureStore({state}, dtype={self.dtype}, device={self.device})"

    # ---- gather helpers ----

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("FeatureStore is closed; create a new one")
        if self._pickled_cuda:
            raise RuntimeError("FeatureStore(device='cuda') was pickled into another process "
                               "(a spawned DataLoader worker?), which gets no rows: gather in "
                               "the process that built it (PyG loaders: "
                               "filter_per_worker=False), or give workers a device='cpu' store")
        watched = self._watched[0] if self._watched is not None else None
        if isinstance(watched, weakref.ref):
            watched = watched()
        if watched is not None and watched.requires_grad:  # learnable rows that would not learn
            raise RuntimeError(
                "FeatureStore: its features tensor requires grad now (requires_grad_() after the "
                "store was built), but gather is not differentiable: the gathered rows would "
                "carry no gradient back and the features would never train. Gather with plain "
                "indexing (features[index]) to train them, or build the store from "
                "features.detach() for a constant table")
        if watched is not None and _moved(watched, self._watched):
            raise RuntimeError(
                "FeatureStore: its features tensor holds other memory (or another shape or "
                "dtype, or a storage resized smaller) than when the store was built "
                "(features.data = ..., or a module's .to()/.half() converting it), which the "
                "store does not read (a CUDA store's "
                "cache and a pin='copy' copy keep the old rows). Refused on every device: build "
                "a new FeatureStore from the tensor as it is now (close() this one first)")
        if self._registration is not None and self._table.data_ptr() != self._registered_ptr:
            raise RuntimeError(
                "FeatureStore(pin='inplace'): the features' bytes moved since the store "
                "registered them with CUDA (x.share_memory_(), which pickling for a spawned "
                "worker does, moves them to new shared memory), so the zero-copy gather would "
                "read memory that is no longer the tensor's. Build a new FeatureStore after "
                "share_memory_() (close() this one first), or use pin='copy'")
        if watched is not None and watched._version != self._watched[1]:
            raise RuntimeError(
                "FeatureStore: its features tensor (or a view of it) was modified in place after "
                "the store was built; a CUDA store's cached rows (and a pin='copy' copy) still "
                "hold the old values, so gathers would mix old and new rows. Refused on every "
                "device: build a new FeatureStore from the edited tensor (close() this one "
                "first), or edit a clone")
        self._check_file()
        if self.device.type == "cuda" and os.getpid() != self._pid:
            raise RuntimeError("FeatureStore(device='cuda') cannot gather in a forked process "
                               "(CUDA does not survive fork()); gather in the main process "
                               "(PyG loaders: filter_per_worker=False), use the 'spawn' start "
                               "method, or a device='cpu' store in workers")

    def _check_file(self) -> None:
        """A store built from a path maps its file (one built from a tensor may be the user's
        mapping of one): a rewrite in place (np.save to the same path,
        or another process writing some bytes of it) puts other bytes under the rows not yet
        read (a shorter file: zeros, or SIGBUS past its end; another shape: rows of another
        table), while rows already copied (a CUDA store's cache, pages written copy-on-write)
        keep the old ones. The file's WatchedFile tells: a stat and a read of the process's
        fanotify queue per gather. A file replaced at its path (os.replace, a new inode) or
        removed is not seen by the mapping, which keeps the old file's bytes: not refused."""
        problem = None if self._file is None else self._file.problem()
        if problem is not None:
            raise RuntimeError(
                f"FeatureStore: {problem}. Refused on every device: build a new FeatureStore "
                "from the file (close() this one first); to change the features under a "
                "running store, write a new file and os.replace() it onto the path")

    def _mapped_again(self, regions: dict) -> None:
        """Unpickled in another process (a spawned worker) with its table mapped from its file
        again: watch that file there too, from when the original was pickled (the mapping
        checked that the file was unchanged then); a table that came by value has no file to
        watch."""
        region = regions.get("_table")
        self._file = None if region is None else WatchedFile(region.path, region.identity,
                                                             **_FILE_NAMES)

    def _check_index(self, index) -> torch.Tensor:
        if not isinstance(index, torch.Tensor):
            raise TypeError(f"index must be a torch.Tensor, got {type(index).__name__}")
        if index.dtype not in (torch.int32, torch.int64):
            hint = ""
            if index.dtype in (torch.bool, torch.uint8):  # x[index] reads these as a mask
                hint = (" (a mask? gather takes row ids: pass mask.nonzero().flatten(); "
                        "PyGFeatureStore takes a boolean mask as is)")
            raise TypeError(f"index must be int32 or int64, got {index.dtype}{hint}")
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        if index.device.type != "cpu" and index.device != self.device:
            where = "the CPU" + ("" if self.device.type == "cpu" else f" or {self.device}")
            raise ValueError(f"index must be on {where} (this store's device is "
                             f"{self.device}), got {index.device}")
        return index

    def _validate_host_index(self, index: torch.Tensor) -> None:
        lo, hi = torch.aminmax(index)
        if lo < 0 or hi >= self.num_rows:
            pos = int(((index < 0) | (index >= self.num_rows)).nonzero()[0, 0])
            raise IndexError(f"gather_rows: index[{pos}] = {int(index[pos])} is out of range "
                             f"for a table of {self.num_rows} rows")

    def _check_out(self, out, count) -> torch.Tensor:
        shape = (count, *self.row_shape)
        if out is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.device != self.device or out.dtype != self.dtype or tuple(out.shape) != shape:
            raise ValueError(f"out must be a {self.dtype} tensor of shape {shape} on "
                             f"{self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if out.is_conj() or out.is_neg():  # torch's fallback for such views aborts the process
            raise ValueError("out is a conjugate or negative view (.conj(), ._neg_view()); pass "
                             "a plain tensor (out.resolve_conj().resolve_neg() copies)")
        if out.requires_grad:  # autograd would keep out's old history over the new rows
            raise ValueError("out requires grad, but gather writes it in place without autograd: "
                             "its gradient would flow to whatever out was computed from. Pass an "
                             "out that does not require grad, or none (gather allocates one)")
        return out

    def _count(self, index: torch.Tensor) -> None:
        """Frequency policy: count requests; after the warm-up, cache the most requested rows."""
        valid = ((index >= 0) & (index < self.num_rows)).long()  # no boolean mask: no sync
        self._counts.index_put_((index.long().clamp(0, self.num_rows - 1),), valid,
                                accumulate=True)
        self._gathers += 1
        if self._gathers == _FREQUENCY_WARMUP:
            self._fill_cache(self._counts.float())
            self._counts = None
