"""SwapStore: named CPU tensors <-> files in one directory, checksummed and crash-safe.

File layout (one file per tensor, `<quoted name>.tlswap`, mode 0600):
    bytes 0..15     magic b"TLSWAP01", header length (u32 LE), CRC-32C of the header (u32 LE)
    bytes 16..      JSON header: name, dtype, shape, nbytes, block_bytes, crc (one per block)
    offset H        the tensor's bytes (H = header rounded up to 4 KiB, so data is O_DIRECT-able)
A put writes a temporary file and renames it over the old one only once the data is on the
device, so a failure, close() or interpreter exit never leaves a half-written tensor: either the
old version or the new one is there. Every get verifies every block's CRC-32C.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import struct
import weakref
from urllib.parse import quote

import torch

from tierlift import _extension
from tierlift.io.engine import EngineConfig, IoEngine, _check_tensor
from tierlift.io.fsync import fsync_path

_MAGIC = b"TLSWAP01"
_PREFIX = struct.Struct("<8sII")
_SUFFIX = ".tlswap"
_ALIGN = 4096


class ChecksumError(OSError):
    """A swap file is truncated, corrupt or not a swap file; the message names the tensor."""


def _crcs(tensor: torch.Tensor, block_bytes: int) -> list[int]:
    if tensor.numel() == 0:
        return []
    return list(_extension._C.io.block_crc32c(tensor, block_bytes))


class _State:
    """What the exit hook needs (not the store itself, so the store can be collected)."""

    def __init__(self, engine: IoEngine, owns_engine: bool):
        self.engine = engine
        self.owns_engine = owns_engine
        self.pending: dict[str, _PendingPut] = {}
        self.closed = False

    def commit_all(self) -> None:
        first_error = None
        for name in list(self.pending):
            try:
                self.pending.pop(name).commit()
            except Exception as exc:  # keep committing the others; report the first failure
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.commit_all()
        finally:
            if self.owns_engine:
                self.engine.close()


class _PendingPut:
    def __init__(self, state: _State, name: str, handle, tmp: str, final: str):
        self._state, self.name, self._handle, self.tmp, self.final = state, name, handle, tmp, final
        self.committed = False

    def done(self) -> bool:
        return self._handle.done()

    def commit(self) -> None:
        """Waits for the data, makes it durable, then atomically replaces the old file."""
        if self.committed:
            return
        self.committed = True
        engine = self._state.engine
        try:
            self._handle.wait()
            fsync_path(self.tmp)
            os.replace(self.tmp, self.final)
        except BaseException:
            _unlink_quietly(self.tmp)
            raise
        finally:
            if not engine.closed:
                engine.forget(self.tmp)
        fsync_path(os.path.dirname(self.final))  # the rename itself is durable


class PutHandle:
    """Returned by SwapStore.put: wait() finishes the write and publishes the file."""

    def __init__(self, store: SwapStore, pending: _PendingPut):
        self._store, self._pending = store, pending

    def done(self) -> bool:
        return self._pending.committed or self._pending.done()

    def wait(self) -> None:
        self._store._commit(self._pending.name)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SwapStore:
    """Named tensors to files in `directory` and back.

    put(name, tensor) starts an asynchronous write (do not modify `tensor` until its handle's
    wait(), flush() or close()); get(name, out=None) reads, verifies and returns the tensor.
    """

    _tmp_counter = itertools.count()

    def __init__(self, directory: str | os.PathLike, *, engine: IoEngine | None = None,
                 config: EngineConfig | None = None, block_bytes: int = 1 << 20):
        directory = os.fspath(directory)
        try:
            is_dir = stat.S_ISDIR(os.stat(directory).st_mode)
        except FileNotFoundError:
            raise FileNotFoundError(f"directory {directory!r} does not exist") from None
        except PermissionError:
            raise PermissionError(f"directory {directory!r} cannot be reached (permission "
                                  "denied on a parent directory)") from None
        if not is_dir:
            raise NotADirectoryError(f"directory {directory!r} is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"directory {directory!r} is not writable")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if engine is not None and config is not None:
            raise ValueError("pass engine or config, not both")
        self.directory = directory
        self.block_bytes = int(block_bytes)
        owns = engine is None
        self._state = _State(engine if engine is not None else IoEngine(config), owns)
        self._finalizer = weakref.finalize(self, _State.shutdown, self._state)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Deletes temporary files of puts whose process died (e.g. SIGKILL) before commit."""
        for f in os.listdir(self.directory):
            parts = f.split(".")
            if not (f.startswith(".") and f.endswith(".tmp") and len(parts) >= 5):
                continue
            try:
                pid = int(parts[-3])
                os.kill(pid, 0)
            except ValueError:
                continue
            except ProcessLookupError:
                _unlink_quietly(os.path.join(self.directory, f))
            except PermissionError:
                pass  # alive, owned by another user

    # ---- paths and headers ----
    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        return os.path.join(self.directory, quote(name, safe="") + _SUFFIX)

    def _check_open(self, op: str) -> None:
        if self._state.closed:
            raise RuntimeError(f"SwapStore.{op}() called after close()")

    def _header(self, name: str, tensor: torch.Tensor) -> bytes:
        meta = {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape), "nbytes": tensor.numel() * tensor.element_size(),
                "block_bytes": self.block_bytes, "crc": _crcs(tensor, self.block_bytes)}
        body = json.dumps(meta, separators=(",", ":")).encode()
        crc = _extension._C.io.block_crc32c(torch.frombuffer(bytearray(body), dtype=torch.uint8),
                                            len(body))[0]
        raw = _PREFIX.pack(_MAGIC, len(body), crc) + body
        return raw + b"\0" * (-len(raw) % _ALIGN)

    def _read_header(self, name: str, path: str) -> tuple[dict, int]:
        def corrupt(why: str) -> ChecksumError:
            return ChecksumError(f"swap file of tensor {name!r} ({path}) {why}")

        try:
            with open(path, "rb") as f:
                prefix = f.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    raise corrupt("is truncated (no header)")
                magic, length, crc = _PREFIX.unpack(prefix)
                if magic != _MAGIC:
                    raise corrupt("is not a tierlift swap file (bad magic)")
                body = f.read(length)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise KeyError(f"no tensor named {name!r} in {self.directory}") from None
        if len(body) < length:
            raise corrupt("is truncated (header cut short)")
        got = _extension._C.io.block_crc32c(torch.frombuffer(bytearray(body), dtype=torch.uint8),
                                            length)[0] if length else 0
        if got != crc:
            raise corrupt("has a corrupt header (checksum mismatch)")
        meta = json.loads(body)
        data_offset = -(-(_PREFIX.size + length) // _ALIGN) * _ALIGN
        if size < data_offset + meta["nbytes"]:
            raise corrupt(f"is truncated: {size} bytes, expected {data_offset + meta['nbytes']}")
        return meta, data_offset

    # ---- API ----
    def put(self, name: str, tensor: torch.Tensor) -> PutHandle:
        """Starts writing `tensor` under `name`; the previous version stays until it commits."""
        self._check_open("put")
        _check_tensor(tensor)
        final = self._path(name)
        if name in self._state.pending:
            self._commit(name)
        header = self._header(name, tensor)
        tmp = os.path.join(self.directory,
                           f".{os.path.basename(final)}.{os.getpid()}.{next(self._tmp_counter)}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, header)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        try:
            handle = self._state.engine.write(tensor, tmp, len(header))
        except BaseException:
            _unlink_quietly(tmp)
            raise
        pending = _PendingPut(self._state, name, handle, tmp, final)
        self._state.pending[name] = pending
        return PutHandle(self, pending)

    def _commit(self, name: str) -> None:
        pending = self._state.pending.pop(name, None)
        if pending is not None:
            pending.commit()

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reads tensor `name` (into `out` if given: same dtype and numel, CPU, contiguous) and
        verifies every block's checksum. Raises KeyError, ChecksumError, TypeError, ValueError."""
        self._check_open("get")
        path = self._path(name)
        self._commit(name)
        meta, data_offset = self._read_header(name, path)
        dtype = getattr(torch, meta["dtype"])
        shape = tuple(meta["shape"])
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        else:
            _check_tensor(out, "out")
            if out.dtype != dtype:
                raise TypeError(
                    f"out has dtype {out.dtype} but tensor {name!r} is stored as {dtype}")
            if out.numel() != torch.Size(shape).numel():
                raise ValueError(f"out has {out.numel()} elements (shape {tuple(out.shape)}) but "
                                 f"tensor {name!r} has shape {shape}")
        try:
            self._state.engine.read(out, path, data_offset).wait()
        finally:
            self._state.engine.forget(path)
        if _crcs(out, meta["block_bytes"]) != meta["crc"]:
            bad = [i for i, (a, b) in enumerate(zip(_crcs(out, meta["block_bytes"]), meta["crc"],
                                                    strict=True)) if a != b]
            raise ChecksumError(f"swap file of tensor {name!r} ({path}) is corrupt: checksum "
                                f"mismatch in block(s) {bad[:8]} of {meta['block_bytes']} bytes")
        return out

    def __contains__(self, name: str) -> bool:
        return name in self._state.pending or os.path.exists(self._path(name))

    def remove(self, name: str) -> None:
        self._check_open("remove")
        self._commit(name)
        os.unlink(self._path(name))

    def flush(self) -> None:
        """Finishes and publishes every pending put."""
        self._check_open("flush")
        self._state.commit_all()

    def close(self) -> None:
        """Publishes pending puts and closes the engine (if the store created it). Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
