"""Hand-off between a tierlift checkpoint and other tools' formats.

export_hf(): a checkpoint's model weights as Hugging Face sharded safetensors, the layout
transformers' from_pretrained(dir) reads: `model.safetensors`, or `model-00001-of-0000N.safetensors`
... plus `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map":
{name: file}}). Tensors are read from the checkpoint one at a time (format.iter_state_dict) and
a shard is written as soon as it is full, so about one shard is in memory, not the model. Every
state dict name is written as its own tensor: a tied alias (lm_head.weight of a model with
tie_word_embeddings) is stored once more rather than dropped as save_pretrained does, so the
files load into a model whether or not it ties them; from_pretrained re-ties them either way.
Names are the module's own: torch.compile's `_orig_mod.` and DDP's leading `module.` are left
out (two names that would then meet are refused).

import_dcp(): the model weights of a torch.distributed.checkpoint directory as a tierlift
checkpoint (replicated.save_state_dict: the same format, SHA-256 and atomic publish as save()).
DCP records no checksum of its own, so what it does record is checked before anything is
written (dcp_reader.py): every item's byte range against its data file (a truncated file is an
error naming it), each tensor's shape and dtype against .metadata, and the CRC-32 that
torch.save puts into each item (which catches most changed bytes, not all: it is no SHA-256).
"""

from __future__ import annotations

import os
import re
import shutil

import torch

from tierlift.checkpoint import dcp_reader, in_flight, outputs, replicated, targets
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint.order import strip_wrappers
from tierlift.io.fsync import fsync_path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" (powers of 10) / "2GiB" (powers of 2), as
    transformers' max_shard_size reads it."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ValueError(f"bad shard size {size!r}: expected bytes or a number with one of "
                             "KB MB GB TB KiB MiB GiB TiB (e.g. 5GB)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"bad shard size {size!r}: must be more than 0 bytes")
    return value


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def export_hf(checkpoint: str, out_dir: str, *, max_shard_size: str | int = "5GB",
              config: str | None = None, verify: bool = True) -> tuple[int, int, int]:
    """Write the model weights of `checkpoint` to the new or empty directory `out_dir` as
    Hugging Face safetensors shards of at most `max_shard_size` each (a larger tensor gets a
    shard of its own), with `config` (a config.json) copied in when given. Returns (files,
    tensors, total bytes). Written to a temporary directory beside it and renamed: nothing
    half-written is left, and a failed write is an OSError naming `out_dir` and the cause
    (outputs.write_new). Missing parent directories are created. A checkpoint without
    manifest.json is refused unless `verify` is False (format.read_metadata)."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError("--format hf needs the safetensors package (pip install "
                          "safetensors)") from e
    limit = parse_size(max_shard_size)
    in_flight.before_load(checkpoint)  # this process's background save of it lands first
    checkpoint = fmt.resolve_dir(os.fspath(checkpoint))
    fmt.read_metadata(checkpoint, verify)  # a clear error before anything is written
    out_dir = os.fspath(out_dir).rstrip(os.sep) or os.sep
    targets.check_new_output(out_dir, directory=True)
    if config is not None and not os.path.isfile(config):
        raise FileNotFoundError(f"config {config} does not exist")
    parts: list[list[str]] = []
    total = 0

    def write(tmp: str) -> None:
        nonlocal total
        shard: dict[str, torch.Tensor] = {}
        storages: set[int] = set()  # of the tensors in `shard`
        size = 0

        def flush() -> None:
            file = os.path.join(tmp, f"part{len(parts)}")
            save_file(shard, file, metadata={"format": "pt"})
            fsync_path(file)
            parts.append(list(shard))
            shard.clear()
            storages.clear()

        given: dict[str, str] = {}  # name in the files -> name saved
        for saved, t in fmt.iter_state_dict(checkpoint, verify):
            # a model saved through torch.compile or DDP: from_pretrained looks for the
            # module's own names, so its wrappers' segments are left out
            name = strip_wrappers(saved)
            if name in given:
                raise ValueError(f"checkpoint {checkpoint}: '{saved}' and '{given[name]}' both "
                                 f"name '{name}' without their torch.compile/DDP wrapper "
                                 "segments; export --format file keeps the saved names")
            given[name] = saved
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > limit:
                flush()
                size = 0
            t = t.contiguous()
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()  # a tied alias: safetensors refuses shared storage
            storages.add(t.untyped_storage().data_ptr())
            shard[name] = t
            size += nbytes
            total += nbytes
        if shard or not parts:
            flush()
        if len(parts) == 1:
            os.rename(os.path.join(tmp, "part0"), os.path.join(tmp, SINGLE))
        else:
            weight_map = {}
            for i, names in enumerate(parts):
                file = shard_name(i + 1, len(parts))
                os.rename(os.path.join(tmp, f"part{i}"), os.path.join(tmp, file))
                weight_map.update(dict.fromkeys(names, file))
            fmt.write_json(os.path.join(tmp, INDEX),
                           {"metadata": {"total_size": total}, "weight_map": weight_map})
        if config is not None:
            shutil.copyfile(config, os.path.join(tmp, "config.json"))

    # A directory of its own beside out_dir (one rename away): nothing of the user's is reused.
    outputs.write_new(out_dir, write, directory=True)
    return len(parts), sum(len(p) for p in parts), total


DCP_NOTE = ("note: torch.distributed.checkpoint keeps no checksum of its own; each item was "
            "checked against what its .metadata records (byte range, shape, dtype) and against "
            "the CRC-32 torch.save writes into it, which catches most changed bytes but not "
            "all; the new checkpoint carries SHA-256 checksums from here on")


def import_dcp(dcp_dir: str, out: str, *, prefix: str = "") -> int:
    """Write the tensors of the torch.distributed.checkpoint directory `dcp_dir` whose names
    start with `prefix` ("model." for a dcp.save({"model": ..., "optim": ...})), without it,
    as a tierlift checkpoint at `out` (a new path or an empty directory: an existing checkpoint
    is refused, not replaced) that tierlift.checkpoint.load() puts into a model that is not
    sharded. No process group needed. Returns the number of tensors. The tensors are all
    read into memory, each item checked against what DCP's .metadata records (dcp_reader.py):
    DCP has no checksum, so a changed byte that keeps torch.save's CRC-32 goes unnoticed."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_dir, out = os.fspath(dcp_dir), os.fspath(out)
    if not os.path.isdir(dcp_dir):
        what = "is not a directory" if os.path.lexists(dcp_dir) else "does not exist"
        raise FileNotFoundError(f"DCP checkpoint directory {dcp_dir} {what}")
    targets.check_save_target(out, replace=False)  # before the (long) read
    reader, metadata = dcp_reader.open_metadata(dcp_dir)
    entries = {k: m for k, m in metadata.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata) and k.startswith(prefix)}
    if not entries:
        some = sorted(metadata.state_dict_metadata)[:5]
        raise ValueError(f"{dcp_dir} has no tensors whose names start with {prefix!r} "
                         f"(its first names: {some})")
    sd = dcp_reader.read_tensors(dcp_dir, reader, metadata, entries)
    replicated.save_state_dict(out, {k[len(prefix):]: v for k, v in sd.items()},
                               extra={"imported_from": os.path.abspath(dcp_dir)})
    return len(sd)
