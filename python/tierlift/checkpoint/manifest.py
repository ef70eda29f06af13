"""manifest.json: the SHA-256 and size of every file of a checkpoint, written last, right before
the directory is published (background.publish), and checked before a load reads anything.

    {"format": "tierlift-checkpoint-manifest", "version": 1,
     "files": {"metadata.json": {"bytes": 2041, "sha256": "..."},
               "rank00000.pt": {"bytes": 9437184, "sha256": "...",
                                "checked_by": "rank00000.sha256"},
               "optim/state.json": {...},
               "optim/g0.exp_avg.f32": {..., "checked_by": "optim/state.json"}},
     "sha256": "..."}     # of "files" itself (json.dumps with sorted keys)

The small files (JSON, checksum files) are hashed here, at save and again at load, so one
changed digit in metadata.json or state.json is an error naming the file. The large tensor
files already carry their own SHA-256 (rankNNNNN.sha256, state.json's "sha256"), which the
loader checks as it reads them; the manifest records who checks them ("checked_by") and their
size, which is checked here at once, so a large file is never hashed twice.

A checkpoint without one is refused: deleting manifest.json must not switch the checks off. A
checkpoint written before manifests existed loads only when the caller says so (load(...,
verify=False), the CLI's --allow-unverified-json), with a warning: its tensor files are still
checked, its JSON files are not (their values still are, validate.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

MANIFEST = "manifest.json"
FORMAT = "tierlift-checkpoint-manifest"
VERSION = 1
_SKIP = {MANIFEST, ".owner.json"}  # the owner file is the save's lock, removed at publish


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: str) -> list[str]:
    out = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if rel not in _SKIP:
                out.append(rel)
    return out


def _delegated(directory: str, files: list[str]) -> dict[str, tuple[str, str]]:
    """{file: (its digest, the file that holds it)} for the tensor files whose SHA-256 is
    recorded in a checksum file or a state.json of the checkpoint."""
    out = {}
    for rel in files:
        if rel.endswith(".sha256"):
            target = rel[:-len(".sha256")] + ".pt"
            with open(os.path.join(directory, rel)) as f:
                out[target] = (f.read().strip(), rel)
        elif rel == "state.json" or rel.endswith("/state.json"):
            sub = rel[:-len("state.json")]
            with open(os.path.join(directory, rel)) as f:
                digests = json.load(f).get("sha256", {})
            for name, digest in digests.items():
                out[sub + name] = (digest, rel)
    return out


def write_json(file: str, obj) -> None:
    """A JSON file, flushed to the drive before it is published."""
    with open(file, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write(directory: str) -> None:
    """Writes `directory`/manifest.json over every other file in it, flushed to the drive."""
    files = _files(directory)
    delegated = _delegated(directory, files)
    entries = {}
    for rel in files:
        file = os.path.join(directory, rel)
        entry = {"bytes": os.path.getsize(file)}
        if rel in delegated:
            entry["sha256"], entry["checked_by"] = delegated[rel]
        else:
            entry["sha256"] = _sha256(file)
        entries[rel] = entry
    write_json(os.path.join(directory, MANIFEST),
               {"format": FORMAT, "version": VERSION, "files": entries,
                "sha256": _digest_of(entries)})


def _digest_of(entries: dict) -> str:
    """The manifest's own checksum: a changed byte in it is an error naming it."""
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def verify(path: str, required: bool = True) -> None:
    """Raises a ValueError naming the first file of checkpoint `path` that is missing, of
    another size or (a file not checked elsewhere) another SHA-256 than manifest.json says.
    Without a manifest: a ValueError, or (not `required`: a checkpoint from before manifests)
    a warning. Reads, changes nothing."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        if required:
            raise ValueError(
                f"checkpoint {path} has no {MANIFEST}, so its JSON files (hyperparameters, step "
                "counts, shapes) cannot be checked; refusing it. If it was written by a "
                "tierlift from before manifests and you trust it, load it with "
                "tierlift.checkpoint.load(..., verify=False) (on the command line: "
                "--allow-unverified-json) and save it again to add one")
        warnings.warn(f"checkpoint {path} has no {MANIFEST} (written by an older tierlift): its "
                      "tensor files are checked by their SHA-256, its JSON files are not "
                      "(verify=False); save it again to add one", UserWarning, stacklevel=3)
        return
    try:
        with open(file) as f:
            manifest = json.load(f)
        entries = manifest["files"]
        ok = (manifest.get("format") == FORMAT and manifest.get("version") == VERSION
              and isinstance(entries, dict) and manifest.get("sha256") == _digest_of(entries))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file} is corrupt: {type(e).__name__}: {e}") from None
    if not ok:
        raise ValueError(f"{file} is corrupt (its own SHA-256 does not match) or of another "
                         f"version (expected format {FORMAT!r} version {VERSION})")
    for rel, entry in entries.items():
        target = os.path.join(path, rel)
        try:
            size, digest = entry["bytes"], entry["sha256"]
        except (KeyError, TypeError):
            raise ValueError(f"{file} is corrupt: its entry for {rel!r} is malformed") from None
        if not os.path.isfile(target):
            raise ValueError(f"checkpoint {path} is incomplete: {rel} is missing (listed in "
                             f"{MANIFEST})")
        got = os.path.getsize(target)
        if got != size:
            raise ValueError(f"{target} is corrupt or truncated: {got} bytes, {MANIFEST} says "
                             f"{size}")
        if "checked_by" not in entry and _sha256(target) != digest:
            raise ValueError(f"{target} is corrupt: its SHA-256 does not match the one in "
                             f"{MANIFEST}")
