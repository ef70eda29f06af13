"""On-disk layout of a tierlift ZeRO checkpoint (a directory; an unsharded model's is described
in replicated.py, an offloading optimizer's streamed state in stream.py):

    metadata.json       format version, world size, per unit: name, numel, padded size, whether
                        it is frozen (stage 3) and the parameters it holds (names, shape,
                        offset); optimizer param groups
    rank00000.pt ...    one file per rank, written by that rank in parallel: a flat dict of
                        tensors only ("unit3.param", "unit3.exp_avg", "unit3.step", and on rank
                        0 "extra.<state_dict key>" for buffers and, at stages 1/2, frozen
                        parameters)
    rank00000.sha256    the SHA-256 of that file: a truncated or corrupted file is an error
                        naming it, never silently wrong weights
    manifest.json       written last: the size and SHA-256 of every other file (manifest.py),
                        so the JSON files are checked too
    .moved_aside.json   only in `path`.old while a save replaces `path` (replace_dir): the
                        name and inode it was moved aside as, which tell it from a user's copy

Tensor files are read with torch.load(weights_only=True, mmap=True): no arbitrary unpickling,
and a rank reads only the byte ranges its new shard overlaps.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator

import torch

from tierlift._paths import absolute
from tierlift.checkpoint import in_flight, manifest, validate
from tierlift.io.fsync import fsync_path

FORMAT = "tierlift-zero-checkpoint"
VERSION = 1
METADATA = "metadata.json"
SAVED_AS = "saved_as"  # in metadata.json: the folder name a save published the checkpoint as
# Written into `path` right before a save renames it to `path`.old: that name and the folder's
# inode, which a rename keeps and a copy does not (moved_aside).
MOVED_ASIDE = ".moved_aside.json"
# How long after its marker a save's rename of `path` aside may come (the marker's flush to
# the drive, then the rename): a whole folder renamed later than that was renamed by its user
# (`mv run run.old` after a save was killed between marking run and renaming it), and a save
# of run must not delete it as its own moved-aside copy.
RENAMED_WITHIN_NS = 60 * 10**9


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def read_metadata(path: str, verify: bool = True) -> dict:
    """metadata.json of checkpoint `path`, once every file's size and every small file's
    SHA-256 matched manifest.json (manifest.py): a changed or truncated file is an error
    naming it, raised before anything is loaded. A checkpoint without manifest.json is refused
    unless `verify` is False (then: a warning). Its values are checked as the optimizer's
    constructor checks them (validate.py), with a manifest or without."""
    file = os.path.join(path, METADATA)
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.lexists(path) else "is a file"
        raise FileNotFoundError(f"{path} is not a tierlift checkpoint (it {what})")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} is not a tierlift checkpoint (no {METADATA})")
    manifest.verify(path, required=verify)
    try:
        with open(file) as f:
            meta = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file} is corrupt: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file} is corrupt: not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{file}: unsupported checkpoint format {meta.get('format')!r} "
                         f"version {meta.get('version')!r} (expected {FORMAT!r} {VERSION})")
    validate.metadata(meta, file)
    return meta


def jsonable(value):
    """`value` (a param group's hyperparameter: a number, a 0-d tensor, a tuple) as JSON has it."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def param_groups_json(optimizer) -> list[dict]:
    """The optimizer's param groups without their parameters, as metadata.json stores them."""
    return [{k: jsonable(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


# A JSON file flushed to the drive before replace_dir() publishes it; manifest.py writes its own
# manifest.json the same way.
write_json = manifest.write_json


def replace_dir(tmp: str, path: str) -> None:
    """Makes the complete directory `tmp` the new `path` by two renames. A process killed in
    between leaves either `path` or `path`.old complete, and resolve_dir() finds it. The new
    folders' entries and the renames are flushed to the drive before the old checkpoint is
    removed: after a power loss too, one of the two is there whole."""
    old = path + ".old"
    sync_tree(tmp)  # its files' data are flushed already (writer, write_json, checksums)
    if _empty(path) and os.path.isdir(old):
        os.rmdir(path)  # `path`.old is the checkpoint (resolve_dir): kept, as below
    moved = os.path.exists(path)
    if moved:
        remove_dir(old)  # a stale one: `path` is complete (targets.check_save_target)
        move_aside(path, old)
    # With only `path`.old there (a replace killed between its renames), it goes only once the
    # new `path` is in place: some complete checkpoint is there at every moment.
    try:
        os.rename(tmp, path)
    except OSError as e:
        if moved:  # the previous checkpoint goes back to its name
            try:
                os.rename(old, path)
                _quietly(os.unlink, os.path.join(path, MOVED_ASIDE))
            except OSError:
                pass  # left at `path`.old, which a load of `path` reads (resolve_dir)
        raise _not_renamable(e, path, tmp) from e
    fsync_path(os.path.dirname(absolute(path)))
    remove_dir(old)


def move_aside(path: str, old: str) -> None:
    """Renames checkpoint folder `path` to `old`, marked first as a save's moved-aside copy
    (moved_aside): a folder its user renamed or copied to `old` is told from it."""
    marker = os.path.join(path, MOVED_ASIDE)
    try:
        write_json(marker, {"as": os.path.basename(old), "inode": os.stat(path).st_ino})
    except BaseException:
        _quietly(os.unlink, marker)  # a full drive, say: `path` stays as it was
        raise
    try:
        os.rename(path, old)
    except OSError as e:
        _quietly(os.unlink, marker)  # `path` stays as it was
        raise _not_renamable(e, path, old) from e


def _not_renamable(error: OSError, path: str, to: str) -> OSError:
    """A failed rename of a save's replace, said plainly: a folder that is a mount point (or
    on another drive than its sibling) cannot be renamed, and a save replaces by renames."""
    if error.errno not in (errno.EBUSY, errno.EXDEV):
        return error
    return OSError(error.errno, f"cannot replace checkpoint {path!r}: renaming "
                   f"{error.filename!r} to {error.filename2 or to!r} failed ({error.strerror}: "
                   f"{path!r} is a mount point, or on another drive than its parent folder?); "
                   "a save replaces the checkpoint folder by renames beside it, so save into a "
                   f"folder inside it, e.g. {os.path.join(path, 'ckpt')!r}")


def sync_tree(directory: str) -> None:
    """Flushes the entries of `directory` and of every folder in it (which files it holds,
    under which names) to the drive."""
    for root, _, _ in os.walk(directory, topdown=False):
        fsync_path(root)


def remove_dir(directory: str) -> None:
    """Removes a checkpoint directory, its manifest.json and metadata.json last: until it is
    gone it still reads as a checkpoint (targets.is_checkpoint), never as a foreign folder
    another save would refuse."""
    # the marker last: a removal killed before it leaves a folder still known as moved aside
    last = [os.path.join(directory, n) for n in (manifest.MANIFEST, METADATA, MOVED_ASIDE)]
    for root, dirs, names in os.walk(directory, topdown=False):
        for name in names:
            file = os.path.join(root, name)
            if file not in last:
                _quietly(os.unlink, file)
        for name in dirs:
            sub = os.path.join(root, name)
            _quietly(os.unlink if os.path.islink(sub) else os.rmdir, sub)
    for file in last:
        _quietly(os.unlink, file)
    shutil.rmtree(directory, ignore_errors=True)  # whatever is left


def _quietly(remove, path: str) -> None:
    try:
        remove(path)
    except OSError:
        pass  # gone already (another removal of it), or left for the rmtree at the end


def _empty(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def dir_path(path) -> str:
    """`path` as a string without trailing separators: "ckpt/" names ckpt, and its siblings
    ckpt.tmp and ckpt.old, not ckpt/.tmp inside it."""
    path = os.fspath(path)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    out = path.rstrip(os.sep) or path
    if out in ("", ".", "..") or os.path.basename(out) in (".", ".."):
        # A checkpoint is a directory with siblings (`path`.tmp, `path`.old) beside it.
        raise ValueError(f"checkpoint path {path!r} names no directory: give the checkpoint's "
                         "own directory, e.g. 'ckpt/' or 'runs/step100'")
    return out


def resolve_dir(path: str) -> str:
    """`path`, or `path`.old when a replace_dir() was killed between its two renames (`path`
    is then absent, or an empty directory) and `path`.old is the copy it moved aside."""
    path = dir_path(path)
    if (not os.path.exists(path) or _empty(path)) and os.path.isdir(path + ".old") and \
            moved_aside(path + ".old"):
        return path + ".old"
    return path


def moved_aside(old: str) -> bool:
    """Whether folder `old` (a `path`.old) is the copy of `path` a save moved aside (which a
    save of `path` deletes, and a load of `path` reads when `path` is gone): it holds the
    marker move_aside() wrote, naming `old` and its own inode. A checkpoint saved as `old`,
    or one its user renamed (`mv run run.old`) or copied (`cp -r run run.old`) there, is not.
    Checkpoints from before SAVED_AS count as moved aside, as they always did."""
    marker = os.path.join(old, MOVED_ASIDE)
    try:
        with open(marker) as f:
            mark = json.load(f)
        st = os.stat(old)
        if not (isinstance(mark, dict) and mark.get("as") == os.path.basename(old)
                and mark.get("inode") == st.st_ino):
            return False
        # A rename sets the folder's ctime: one long after the marker is its user's
        # (RENAMED_WITHIN_NS). A removal of the copy (remove_dir) sets it too, but then the
        # folder is no longer whole.
        return st.st_ctime_ns - os.stat(marker).st_mtime_ns <= RENAMED_WITHIN_NS or \
            not _whole(old)
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return False
    try:
        with open(os.path.join(old, METADATA)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and SAVED_AS not in meta


def _whole(folder: str) -> bool:
    """Whether checkpoint `folder` still holds manifest.json and every file it lists."""
    try:
        with open(os.path.join(folder, manifest.MANIFEST)) as f:
            files = json.load(f)["files"]
        return all(os.path.isfile(os.path.join(folder, rel)) for rel in files)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_fits(own: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], *,
               complete: bool) -> None:
    """Raises a ValueError naming the first saved tensor the model lacks or holds in another
    shape, and (when `complete`) the first model tensor the checkpoint lacks."""
    for name, value in saved.items():
        if name not in own:
            raise ValueError(f"checkpoint does not match the model: {name!r} exists only in "
                             "the checkpoint")
        if own[name].shape != value.shape:
            raise ValueError(f"checkpoint does not match the model: {name!r} has shape "
                             f"{tuple(value.shape)} in the checkpoint but "
                             f"{tuple(own[name].shape)} in the model")
    missing = [name for name in own if name not in saved] if complete else []
    if missing:
        raise ValueError(f"checkpoint does not match the model: {missing[0]!r} exists only in "
                         "the model")


def checksum_file(rank: int) -> str:
    return f"rank{rank:05d}.sha256"


def sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_checksum(path: str, rank: int, digest: str) -> None:
    with open(os.path.join(path, checksum_file(rank)), "w") as f:
        f.write(digest + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_tensors(path: str, rank: int) -> dict[str, torch.Tensor]:
    file = os.path.join(path, rank_file(rank))
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint {path} lacks {rank_file(rank)} (rank {rank}'s "
                                "shard)")
    digest = os.path.join(path, checksum_file(rank))
    if not os.path.isfile(digest):
        raise FileNotFoundError(f"checkpoint {path} lacks {checksum_file(rank)} (the SHA-256 "
                                f"of {rank_file(rank)}), so that file cannot be checked")
    with open(digest) as f:
        expected = f.read().strip()
    if sha256(file) != expected:
        raise ValueError(f"{file} is corrupt or truncated: its SHA-256 does not match "
                         f"{checksum_file(rank)}")
    data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"{file}: expected a dict of tensors")
    validate.step_tensors(data, file)
    return data


def unit_slice(shards: list[dict], key: str, shard_numel: int, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the unit's flat tensor `key`, saved as consecutive shards of
    `shard_numel` elements across `shards` (one dict per saved rank)."""
    pieces = []
    pos = lo
    while pos < hi:
        r, off = divmod(pos, shard_numel)
        take = min(hi - pos, shard_numel - off)
        pieces.append(shards[r][key][off:off + take])
        pos += take
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=shards[0][key].dtype)


def iter_state_dict(path: str, verify: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain (unsharded) model state dict stored in a checkpoint, one (name, tensor) at a
    time in the model's key order, without torch.distributed. The files are mapped; each
    tensor is read out of them only when it is reached, so a consumer that writes the tensors
    out as they come holds about what it keeps, not the whole model. Names tied to one
    parameter in a sharded checkpoint get the same tensor. `verify`: as in read_metadata."""
    meta = read_metadata(path, verify)
    if meta.get("layout") == "replicated":  # tierlift.checkpoint.replicated: "model.<key>"
        for k, v in load_tensors(path, 0).items():
            if k.startswith("model."):
                yield k[len("model."):], v.clone()
        return
    shards = [load_tensors(path, r) for r in range(meta["world_size"])]
    where: dict[str, tuple] = {}  # name -> (unit index, entry), or (None, "extra.<name>")
    for i, unit in enumerate(meta["units"]):
        for e in unit["entries"]:
            for name in e["names"]:
                where[name] = (i, e)
    for key in shards[0]:
        if key.startswith("extra."):
            where[key[len("extra."):]] = (None, key)
    order = {k: i for i, k in enumerate(meta["key_order"])}
    tied: dict[int, tuple[torch.Tensor, int]] = {}  # id(entry) -> (tensor, names still to go)
    for name in sorted(where, key=lambda k: order.get(k, len(order))):
        i, e = where[name]
        if i is None:
            yield name, shards[0][e].clone()
            continue
        t, left = tied.get(id(e), (None, len(e["names"])))
        if t is None:
            unit = meta["units"][i]
            t = unit_slice(shards, f"unit{i}.param", unit["shard_numel"], e["offset"],
                           e["offset"] + e["numel"]).view(e["shape"])
        if left > 1:
            tied[id(e)] = (t, left - 1)
        else:
            tied.pop(id(e), None)
        yield name, t


def full_state_dict(path: str, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The plain (unsharded) model state dict stored in a checkpoint, without torch.distributed
    (all of it in memory: iter_state_dict() gives it one tensor at a time). A checkpoint
    without manifest.json is refused unless `verify` is False (read_metadata)."""
    in_flight.before_load(path)
    return dict(iter_state_dict(resolve_dir(path), verify))


def offloader(optimizer):
    """The offloaded state of `optimizer` (tierlift.optim with offload=...), or None; a device
    part (device_fraction) is saved and loaded with it (stream.py, restore.py). Its layout
    is found by position in the param groups' lists, so lists changed since the optimizer was
    built are refused here, before a save reads or a load writes anything; so is a moment or
    master written into optimizer.state[p] (check_state), which a save would leave out and a
    load would leave behind over the loaded state."""
    off = getattr(optimizer, "_offload", None) if optimizer is not None else None
    if off is not None:
        off.check_lists()
        off.check_state()
    return off
