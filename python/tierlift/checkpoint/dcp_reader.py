"""Reading the tensors of a torch.distributed.checkpoint directory (FileSystemWriter's layout)
for import_dcp (handoff.py), checking what DCP records before anything is accepted. DCP keeps
no checksum: its .metadata holds each tensor's size, dtype and chunks, and for each chunk the
data file and byte range of its item (storage_data), an item being a torch.save archive (a zip
whose records carry CRC-32s unless torch.save was told not to compute them). So:

- every item's byte range must lie inside its data file: a truncated or missing file is an
  error naming it, before any item is read (DCP's own reader gives a bare EOFError);
- every item's records must match their CRC-32 (a record whose CRC is 0 was written without);
- every item must hold one tensor of the chunk's shape and the tensor's dtype (DCP's reader
  copies into the target, which casts a float64 into a float32 silently);
- a tensor's chunks must cover it exactly once (else torch.empty's bytes would be imported).

A changed byte that keeps the CRC-32 is not caught: CRC-32 guards against accidents, not edits.

.metadata is a pickle. It is read by a restricted unpickler (_MetadataUnpickler) that resolves
only the classes and values DCP's metadata holds, so a crafted .metadata cannot run code: one
that names anything else (os.system, builtins.eval) is refused, naming it, before it is called.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import zipfile

import torch

# What a DCP .metadata may name: DCP's own record classes, torch's dtypes, layouts, memory formats
# and Size, paths and plain containers. Anything else (os.system, builtins.eval, a class whose
# construction runs code) is refused before it is looked up: .metadata is a pickle, and
# unpickling an untrusted one with pickle.load (as DCP's reader does) runs whatever it names.
_DCP_MODULES = {"torch.distributed.checkpoint.metadata",
                "torch.distributed._shard.sharded_tensor.metadata"}  # older DCP's TensorProperties
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a name lookup
    ("collections", "OrderedDict"),
    *((m, n) for m in ("pathlib", "pathlib._local")
      for n in ("Path", "PosixPath", "PurePath", "PurePosixPath")),
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float",
                                "frozenset", "int", "list", "set", "slice", "str", "tuple")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only what DCP's metadata holds (_ALLOWED, the classes
    defined in DCP's metadata module, torch's dtype/layout/memory_format values)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _DCP_MODULES and "." not in name:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ in _DCP_MODULES:
                return found
        if module == "torch" and "." not in name and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self.where} names {module}.{name}, which a torch.distributed.checkpoint's "
            "metadata does not hold; refusing to load it (unpickling it could run code)")


def read_metadata(dcp_dir: str):
    """The Metadata in `dcp_dir`/.metadata, unpickled by _MetadataUnpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(dcp_dir, ".metadata")
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def open_metadata(dcp_dir: str):
    """(FileSystemReader, Metadata) of `dcp_dir`; an unreadable .metadata, or one that names
    anything DCP's metadata does not hold (_MetadataUnpickler), is a ValueError."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(dcp_dir)
    try:
        metadata = read_metadata(dcp_dir)
    except pickle.UnpicklingError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - any unreadable .metadata
        raise ValueError(f"{dcp_dir} is not a torch.distributed.checkpoint directory: "
                         f"{type(e).__name__}: {e}") from e
    return reader, metadata


def _items(dcp_dir: str, metadata, entries: dict) -> dict[str, list]:
    """{name: [(chunk, data file, storage info)]}, every byte range checked against its file."""
    where = {(i.fqn, None if i.offset is None else tuple(i.offset)): info
             for i, info in metadata.storage_data.items()}
    sizes: dict[str, int] = {}
    out = {}
    for name, m in entries.items():
        out[name] = []
        for chunk in m.chunks:
            info = where.get((name, tuple(chunk.offsets)))
            if info is None:
                raise ValueError(f"{dcp_dir}/.metadata is corrupt: it lists a chunk of {name!r} "
                                 f"at {list(chunk.offsets)} but no item holding it")
            file = os.path.join(dcp_dir, info.relative_path)
            if file not in sizes:
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"{file} is missing: {dcp_dir}/.metadata places "
                                            f"{name!r} in it")
                sizes[file] = os.path.getsize(file)
            end = info.offset + info.length
            if info.offset < 0 or info.length <= 0 or end > sizes[file]:
                raise ValueError(f"{file} is truncated or corrupt: {sizes[file]} bytes, but "
                                 f"{dcp_dir}/.metadata places {name!r} at bytes "
                                 f"{info.offset}..{end}")
            out[name].append((chunk, file, info))
    return out


def _check_crc(blob: bytes, file: str, name: str, span: str) -> None:
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        for record in archive.infolist():
            if record.CRC == 0:
                continue  # written without a CRC-32 (torch's save.compute_crc32=False)
            with archive.open(record) as f:  # zipfile checks the CRC-32 at the end
                while f.read(1 << 22):
                    pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
        raise ValueError(f"{file} is corrupt: the item of {name!r} (bytes {span}) fails its "
                         f"check ({e}); DCP keeps no other checksum to tell more") from None


def _covers(name: str, m, chunks: list) -> None:
    """The chunks of tensor `name` lie inside it and cover each element once."""
    size = tuple(m.size)
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or any(
                o < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size)):
            raise ValueError(f"DCP .metadata is corrupt: a chunk of {name!r} at "
                             f"{list(chunk.offsets)} size {list(chunk.sizes)} lies outside "
                             f"its size {list(size)}")
    if len(chunks) == 1 and tuple(chunks[0].sizes) == size:
        return
    seen = torch.zeros(size, dtype=torch.uint8)
    for chunk in chunks:
        seen[_index(chunk)] += 1
    if not bool((seen == 1).all()):
        raise ValueError(f"DCP .metadata is corrupt: the chunks of {name!r} do not cover it "
                         "exactly once")


def _index(chunk) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


def read_tensors(dcp_dir: str, reader, metadata, entries: dict) -> dict[str, torch.Tensor]:
    """The tensors `entries` ({name: TensorStorageMetadata}) of `dcp_dir`, each item checked
    (the module docstring); every byte range is checked before the first item is read."""
    items = _items(dcp_dir, metadata, entries)
    for name, m in entries.items():
        _covers(name, m, [c for c, _, _ in items[name]])
    out = {}
    for name, m in entries.items():
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for chunk, file, info in items[name]:
            span = f"{info.offset}..{info.offset + info.length}"
            with open(file, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            if len(blob) != info.length:
                raise ValueError(f"{file} is truncated: it became shorter while being read "
                                 f"(the item of {name!r}, bytes {span})")
            if info.transform_descriptors:  # e.g. compressed by a DCP extension
                blob = reader.transforms.transform_load_stream(
                    None, info.transform_descriptors, io.BytesIO(blob)).read()
            _check_crc(blob, file, name, span)
            try:
                value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable item
                raise ValueError(f"{file} is corrupt: the item of {name!r} (bytes {span}) "
                                 f"does not load: {type(e).__name__}: {e}") from None
            if not isinstance(value, torch.Tensor) or value.dtype != t.dtype or \
                    tuple(value.shape) != tuple(chunk.sizes):
                got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"{file}: the item of {name!r} (bytes {span}) holds {got}, "
                                 f"but .metadata says {t.dtype} {list(chunk.sizes)}")
            t[_index(chunk)].copy_(value)
        out[name] = t
    return out
