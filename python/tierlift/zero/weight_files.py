"""WeightFiles: the tensors of a safetensors checkpoint, read by byte range.

A directory as Hugging Face's save_pretrained or `python -m tierlift.checkpoint export --format
hf` writes it (`model.safetensors`, or `model-0000i-of-0000N.safetensors` listed in
`model.safetensors.index.json`), or one `.safetensors` file. A safetensors file is an 8-byte
little-endian header length, a JSON header ({name: {"dtype", "shape", "data_offsets"}}) and the
raw row-major tensors; so `read(name, start, stop)` reads exactly the bytes of elements
[start, stop) of the flattened tensor (os.pread: nothing is mapped, RSS holds only what was
asked for).
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from tierlift._text import first_names

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightFiles:
    def __init__(self, path) -> None:
        path = os.fspath(path)
        self.path = path
        weight_map = None
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index) and os.path.exists(single):
                # transformers reads model.safetensors first, this reader the index: of two
                # exports into one folder, each would take another's weights without a word
                raise ValueError(
                    f"weights={path!r} holds both model.safetensors and "
                    "model.safetensors.index.json, which may be of different exports "
                    "(transformers' from_pretrained reads model.safetensors first); remove the "
                    "stale one")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"{index} has no weight_map")
                files = sorted(set(weight_map.values()))
                paths = [os.path.join(path, f) for f in files]
            elif os.path.exists(single):
                paths = [single]
            else:
                raise FileNotFoundError(f"weights={path!r} holds neither model.safetensors nor "
                                        "model.safetensors.index.json")
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            paths = [path]
        else:
            raise FileNotFoundError(f"weights={path!r} is not a directory of safetensors files "
                                    "nor a .safetensors file")
        self.entries: dict[str, tuple[str, int, torch.dtype, tuple]] = {}
        for p in paths:
            for name, (start, dtype, shape) in _header(p).items():
                if name in self.entries:
                    raise ValueError(f"weights={path!r}: tensor {name!r} is in both "
                                     f"{self.entries[name][0]} and {p} (shards of different "
                                     "exports?); nothing was read")
                self.entries[name] = (p, start, dtype, shape)
        if weight_map is not None:
            _check_index(path, weight_map, self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][3]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor, in the file's dtype (1-D)."""
        dtype, shape = self.entries[name][2:]
        numel = math.prod(shape)
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{name}: elements [{start}, {stop}) outside 0..{numel}")
        size = torch.empty((), dtype=dtype).element_size()
        out = torch.empty((stop - start) * size, dtype=torch.uint8)
        self._pread(name, start, stop, out)
        return out.view(dtype)

    def read_into(self, name: str, start: int, out: torch.Tensor, chunk: int = 1 << 22) -> None:
        """Elements [start, start + out.numel()) of the flattened tensor into `out` (contiguous,
        any dtype), converted; read in pieces of at most `chunk` elements, so nothing but `out`
        is held (straight into it when the dtypes match)."""
        dtype, shape = self.entries[name][2:]
        if not 0 <= start <= start + out.numel() <= math.prod(shape) or not out.is_contiguous():
            raise ValueError(f"{name}: cannot read {out.numel()} elements from {start} of "
                             f"{math.prod(shape)} into a {'' if out.is_contiguous() else 'non-'}"
                             "contiguous tensor")
        for lo in range(0, out.numel(), chunk):
            hi = min(lo + chunk, out.numel())
            if dtype == out.dtype:
                self._pread(name, start + lo, start + hi, out[lo:hi].view(torch.uint8))
            else:
                out[lo:hi].copy_(self.read(name, start + lo, start + hi))

    def _pread(self, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        path, base, dtype, _ = self.entries[name]
        size = torch.empty((), dtype=dtype).element_size()
        view, off, want = memoryview(dst.numpy()), base + start * size, (stop - start) * size
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < want:
                got = os.preadv(f.fileno(), [view[done:]], off + done)
                if got <= 0:
                    raise OSError(f"{path}: short read of {name!r} (file truncated?)")
                done += got


def _check_index(path: str, weight_map: dict, entries: dict) -> None:
    """The files of a sharded folder hold what its index says, each tensor where the index puts
    it: shards and an index of different exports (a folder written twice, with other shard
    sizes or another model) are refused, not mixed."""
    for name, (file, *_) in entries.items():
        named = weight_map.get(name)
        if named is None or os.path.normpath(os.path.join(path, named)) != os.path.normpath(file):
            where = "does not list it" if named is None else f"puts it in {named}"
            raise ValueError(f"weights={path!r}: {os.path.basename(file)} holds tensor "
                             f"{name!r} but model.safetensors.index.json {where}: the shards "
                             "and the index are of different exports; nothing was read")
    missing = [name for name in weight_map if name not in entries]
    if missing:
        raise ValueError(f"weights={path!r}: model.safetensors.index.json lists "
                         f"{first_names(missing)}, which the shards do not hold: the shards and "
                         "the index are of different exports; nothing was read")


def _header(path: str) -> dict[str, tuple[int, torch.dtype, tuple]]:
    """{name: (absolute byte offset, dtype, shape)} of one safetensors file, checked against
    the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, not supported")
        dtype = _DTYPES[meta["dtype"]]
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * torch.empty((), dtype=dtype).element_size() \
                or 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets (truncated or "
                             "corrupt file)")
        out[name] = (8 + n + begin, dtype, shape)
    return out
