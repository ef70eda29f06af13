"""One save in flight: its snapshot (staging.py), its writer thread (writer.py), and the commit
that every rank agrees on. save(blocking=True) is the same job waited for at once.

A job claims `path`.tmp (atomically: of two saves of one path, one is refused before it writes
anything; claim()), snapshots on the training thread (copies into staging; two-generation
optimizer tiers are held, not copied), then the writer puts every byte on the drive. The
commit: one vote over the ranks (every rank wrote its files), rank 0 writes metadata.json and
renames `path`.tmp to `path` (format.replace_dir), a second vote says whether that worked. In
the background the votes run on a gloo group of their own, never on the training process
group. A failed save leaves the previous checkpoint at `path` as it was and raises at wait(),
at the next save, or at close(); a process killed at any point leaves it loadable too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid

import torch

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import in_flight, manifest, stream, targets, write_errors
from tierlift.checkpoint.agree import comm_device, describe, exchange_reasons, explain
from tierlift.checkpoint.staging import MIN_PIECE, Packer, Staging, free_cached, piece_bytes
from tierlift.checkpoint.writer import TensorFile, Writer, close_engine
from tierlift.offload.tiers import _owner_alive, _pid_namespace, _start_time

BLOCKING_BUDGET = 256 << 20  # a blocking save's staging, when no budget is given
OWNER = targets.OWNER

_side_groups: dict[tuple, object] = {}


class SaveHandle:
    """A save running in the background: wait() blocks until it is committed (or raises what
    failed); done() says whether it finished. `stall_s`: how long save() held the caller;
    `total_s`: from save() to the commit; `bytes`: the bytes written by this rank."""

    def __init__(self, path: str):
        self.path = path
        self.stall_s = 0.0
        self.total_s: float | None = None
        self.bytes = 0
        self.staging_peak = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the save is committed; re-raises its error (once)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"saving {self.path} did not finish within {timeout} s")
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error else "done"
        return f"SaveHandle({self.path!r}, {state})"


def close() -> None:
    """Waits for the save in flight (raising its error) and frees the staging memory kept
    between saves and the writer's engine."""
    try:
        in_flight.before_save()
    finally:
        free_cached()
        close_engine()


def estimate_bytes(model, optimizer, off) -> int:
    """About the bytes one process's save of `model` and `optimizer` writes (for the error of
    a full drive): its state dict's tensors and the optimizer's state."""
    seen, total = set(), 0
    tensors = list(model.state_dict().values())
    if off is not None:
        total += stream.state_bytes(off)
    elif optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def side_group(group) -> object:
    """A gloo group over the ranks of `group` for a background save's votes, with its timeout
    (a lost rank fails the vote as soon as it would fail training). Created on the training
    thread, inside save(), where every rank of the group calls it."""
    ranks = tuple(torch.distributed.get_process_group_ranks(group))
    if ranks in _side_groups and not _live(_side_groups[ranks]):
        del _side_groups[ranks]  # destroyed with its default group: the ranks may be others now
    if ranks not in _side_groups:
        kw = {}
        try:  # not public API: the default timeout where it is not there
            kw["timeout"] = group._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):
            pass
        _side_groups[ranks] = torch.distributed.new_group(
            list(ranks), backend="gloo", use_local_synchronization=True, **kw)
    return _side_groups[ranks]


def _live(group) -> bool:
    """Whether `group` is still registered with c10d (destroy_process_group() drops it)."""
    try:
        return group in torch.distributed.distributed_c10d._world.pg_map
    except (AttributeError, TypeError):  # not public API: where it is not there, trust it
        return True


def claim(tmp: str, path: str | None = None, replace: bool = True) -> str:
    """Claims `tmp` for a new save of `path`: refuses a `path` the save may not replace
    (targets.check_save_target), then takes `tmp` atomically, so that of two saves started
    at the same moment one is refused before it writes anything. The claim is the owner file
    in `tmp`, created with O_EXCL (one process wins) and naming the owner (pid, host, start
    time, a token), so a dead owner's `tmp` is told from a live one's and cleared
    (_clear_stale); a live owner's is an error. Missing parent directories are created.
    Returns the token, which must still be in `tmp` when the save publishes (Job.publish)."""
    if path is not None:
        targets.check_save_target(path, replace=replace)
    targets.make_parent(tmp)
    owner_file = os.path.join(tmp, OWNER)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(),
          "start_time": _start_time(os.getpid()), "token": uuid.uuid4().hex}
    for _ in range(8):  # each turn clears one dead owner's claim, or takes `tmp`
        made = False
        try:
            os.mkdir(tmp)
            made = True
        except FileExistsError:
            pass  # an empty one is taken as it is (check_save_target refused anything else)
        try:
            f = open(owner_file, "x")  # O_CREAT | O_EXCL: one process wins
        except FileNotFoundError:
            continue  # `tmp` was cleared meanwhile by another save
        except FileExistsError:
            owner = _read_owner(owner_file)
            if owner is not None and _alive(owner):
                who = "its owner file is being written" if owner.get("unreadable") else \
                    f"process {owner['pid']}" + (f" on {owner['host']}" if owner.get("host")
                                                 not in (None, me["host"]) else "")
                raise RuntimeError(f"{tmp[:-len('.tmp')]!r} is being written by another save "
                                   f"({who}); nothing was written (wait for it, or save "
                                   "elsewhere)") from None
            _clear_stale(tmp, owner)
            continue
        except BaseException:
            if made:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            with f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _ACTIVE.add(me["token"])
        return me["token"]
    raise RuntimeError(f"could not claim {tmp!r}: other saves of the same path keep taking it")


_ACTIVE: set[str] = set()  # the tokens of this process's saves in flight (its threads')
_FRESH_S = 30.0  # an unreadable owner file younger than this may be one being written


def _read_owner(file: str) -> dict | None:
    """The owner record in `file`; None where it is unreadable and old enough that its writer
    must have died (a claim is written right after its O_EXCL create). A young unreadable one
    is given a moment, then taken as a live claim."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            with open(file) as f:
                owner = json.load(f)
            if isinstance(owner, dict) and isinstance(owner.get("pid"), int):
                return owner
        except FileNotFoundError:
            return {}  # removed meanwhile: its claim is being cleared; try again
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            try:
                young = time.time() - os.path.getmtime(file) < _FRESH_S
            except OSError:
                young = False
            return {"pid": -1, "unreadable": True} if young else None
        time.sleep(0.01)


def _alive(owner: dict) -> bool:
    """Whether the save that wrote `owner` may still be running. One on another host or in
    another pid namespace cannot be checked here: taken as alive (the error says so)."""
    if not owner:
        return False
    if owner.get("unreadable"):
        return True
    if owner.get("host", socket.gethostname()) != socket.gethostname() or \
            owner.get("pidns", _pid_namespace()) != _pid_namespace():
        return True
    if owner["pid"] == os.getpid():
        return owner.get("token") in _ACTIVE
    return _owner_alive(owner["pid"], owner.get("start_time"))


def _clear_stale(tmp: str, owner: dict | None) -> None:
    """Removes `tmp`, which a dead save left, unless another save claimed it since its owner
    file was read: it is renamed aside first (only one clearing process can), then its owner
    read again; a live claim found there is put back."""
    if owner == {}:
        return  # being cleared by another save
    aside = f"{tmp}.stale-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(tmp, aside)
    except FileNotFoundError:
        return
    now = _read_owner(os.path.join(aside, OWNER))
    if now and now != owner and _alive(now):
        try:
            os.rename(aside, tmp)  # onto an absent or empty `tmp` only
            return
        except OSError:
            pass  # a third save took `tmp`: the one moved aside fails at its publish
    shutil.rmtree(aside, ignore_errors=True)


def owns(tmp: str, token: str) -> bool:
    """Whether `tmp` still holds the claim with `token`."""
    try:
        with open(os.path.join(tmp, OWNER)) as f:
            return json.load(f).get("token") == token
    except (OSError, ValueError, AttributeError):
        return False


def publish(tmp: str, path: str, meta: dict, token: str | None = None,
            replace: bool = True) -> None:
    """Rank 0, every rank's files written: metadata.json, then manifest.json (the checksums of
    every file) last, then `tmp` becomes `path`. With `token`: only while `tmp` holds that
    claim, and `path` holds only tierlift's files (checked again: a background save may have
    run for minutes since its claim)."""
    if token is not None and not owns(tmp, token):
        raise RuntimeError(f"saving {path}: its temporary directory {tmp!r} was taken over "
                           "by another save (which judged this one dead); nothing was "
                           "published")
    targets.check_save_target(path, replace=replace)
    # the name it is published as: a checkpoint a user names `x.old` is told from the copy of
    # `x` a save moves aside there (format.saved_as_itself)
    meta = {**meta, fmt.SAVED_AS: os.path.basename(path)}
    fmt.write_json(os.path.join(tmp, fmt.METADATA), meta)
    manifest.write(tmp)
    fmt.replace_dir(tmp, path)
    if token is None or owns(path, token):
        try:
            os.unlink(os.path.join(path, OWNER))
        except FileNotFoundError:
            pass


class Vote:
    """`ok` from every rank, summed: the ranks that failed (the same list on every rank); where
    some did, `reasons` holds their errors ({rank: "Type: message"}), for the others' error."""

    def __init__(self, rank: int, world: int, reduce):
        self.rank, self.world, self.reduce = rank, world, reduce
        self.reasons: dict[int, str] = {}
        self.groups: list[list[int]] = [list(range(world))]  # ranks by `same` (see __call__)
        self.held: list[bytes] = []  # each rank's `same`, by rank (see __call__)

    def __call__(self, ok: bool, error: BaseException | None = None,
                 same: bytes = b"") -> list[int]:
        """`same`: bytes every rank should hold alike (every rank passes as many), sent in the
        same collective; where they differ, `groups` lists the ranks that hold each."""
        if self.world == 1:
            return [] if ok else [0]
        t = torch.zeros(self.world, 1 + len(same), dtype=torch.uint8)
        t[self.rank, 0] = 0 if ok else 1
        if same:
            t[self.rank, 1:] = torch.frombuffer(bytearray(same), dtype=torch.uint8)
        t = self.reduce(t)
        failed = [r for r in range(self.world) if int(t[r, 0])]
        if failed:  # every rank knows: all take part in the second exchange
            self.reasons = exchange_reasons(self.rank, self.world, self.reduce,
                                            None if ok else describe(error))
        elif same:
            self.held = [bytes(t[r, 1:].tolist()) for r in range(self.world)]
            held: dict[bytes, list[int]] = {}
            for r, b in enumerate(self.held):
                held.setdefault(b, []).append(r)
            self.groups = sorted(held.values())
        return failed

    def others(self, failed: list[int]) -> str:
        """The failed ranks other than this one, with their errors."""
        rest = [r for r in failed if r != self.rank]
        return explain(rest, self.reasons) if rest else ""


def training_vote(comm) -> Vote:
    """Votes on the training process group (the training thread, inside save())."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(comm_device(comm))
        comm.wait(comm.all_reduce(t))
        return t.cpu()

    return Vote(comm.rank, comm.world, reduce)


def side_vote(comm) -> Vote:
    """Votes of a background save: on a gloo group of its own, not the training one."""
    if comm.world == 1:
        return Vote(0, 1, None)
    side = side_group(comm.group if comm.group is not None else torch.distributed.group.WORLD)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, group=side)
        return t

    return Vote(comm.rank, comm.world, reduce)


_WRITES_NOTHING = b"\xff" * 16  # a rank that writes no file of the save: any folder will do
_SEES_NO_CLAIM = b"\x00" * 16


def claim_seen(tmp: str, writes: bool) -> bytes:
    """What this rank sees of rank 0's claim: the token in `tmp`'s owner file. The ranks that
    write files must all see rank 0's: the same folder, however each one's path names it (a
    symbolic link, a relative path, a bind mount, a shared file system mounted elsewhere on
    another node); a folder of its own (even under the same name, on a node's local drive)
    holds no such claim."""
    if not writes:
        return _WRITES_NOTHING
    try:
        with open(os.path.join(tmp, OWNER)) as f:
            seen = bytes.fromhex(json.load(f)["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return _SEES_NO_CLAIM
    # every rank must send as many bytes (one collective): an owner file not of a claim (left
    # in a folder of a rank's own) may hold a token of another length
    return seen if len(seen) == len(_SEES_NO_CLAIM) else _SEES_NO_CLAIM


def refuse(vote: Vote, error: BaseException, path: str) -> None:
    """This rank's own checks refused the save of `path` before its Job could claim
    `path`.tmp: it votes with the others' claim (Job.claim), so that they raise too instead
    of waiting, then raises `error`."""
    try:
        failed = vote(False, error)
    except Exception as e:  # noqa: BLE001 - a peer is gone too; this rank's error goes on
        error.add_note(f"(and the ranks could not agree on the failure: {e})")
    else:
        if vote.others(failed):
            error.add_note(f"(it was refused on {vote.others(failed)} too)")
    raise error


class Job:
    """The files of one rank's part of a save, staged, written and committed."""

    def __init__(self, path: str, *, blocking: bool, staging_budget: int | None, off=None,
                 replace: bool = True, estimate=None):
        """`off`: the optimizer's Offloader, if any: a blocking save stays within its
        cpu_budget, and the staging must hold one chunk of its held generation. `replace`:
        whether `path` may be an existing checkpoint (else it must be new, or an empty
        directory). `estimate()`: the bytes this rank writes, for a full drive's error before
        the files are known."""
        self.path, self.blocking = path, blocking
        # Files go where `path` named at the save, even if the process changes its working
        # directory while a background save writes (`path` stays for the messages).
        self.where = fmt.absolute(path)
        self.tmp = self.where + ".tmp"
        self.replace, self.estimate = replace, estimate
        need = stream.held_chunk_bytes(off) if off is not None else 0
        cap = getattr(getattr(off, "config", None), "cpu_budget", None) or BLOCKING_BUDGET
        smallest = max(MIN_PIECE, need)
        budget = staging_budget if staging_budget is not None else (
            max(min(BLOCKING_BUDGET, cap), smallest) if blocking else 1 << 62)
        if budget < smallest:
            raise ValueError(f"staging_budget={budget} bytes is smaller than one piece of this "
                             f"save; the smallest budget that works is {smallest} bytes")
        self.staging = Staging(budget, pin=torch.cuda.is_available())
        self.files: list = []
        self.helds: list = []
        self.snapshot_error: BaseException | None = None
        self.finishers: list = []
        self.writer = Writer(self.staging, self.files)
        self.packer = Packer(self.staging, self.writer.put, piece_bytes(self.staging.budget))
        self.handle = SaveHandle(path)
        self.token: str | None = None  # rank 0's claim on `tmp` (claim())
        self._t0 = time.perf_counter()
        self.writer.start()
        if blocking or staging_budget is not None:
            self.writer.go.set()  # writes while the training thread fills the next piece

    def claim(self, rank: int, vote: Vote, writes: bool = True) -> None:
        """Rank 0 claims `path`.tmp (claim()); every rank learns whether it could, and all
        raise if not (on the training thread, inside save(), where every rank is). Then every
        rank that `writes` files must see that claim in its own `path`.tmp (claim_seen): else
        rank 0 would publish a checkpoint without its files, over the last good one."""
        error = None
        try:
            if rank == 0:
                self.token = claim(self.tmp, self.where, self.replace)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            error = self._explain(e) or e
        failed = vote(error is None, error)
        if not failed and vote.world > 1:
            vote(True, None, claim_seen(self.tmp, writes or rank == 0))
            elsewhere = [r for r, seen in enumerate(vote.held)
                         if seen not in (vote.held[0], _WRITES_NOTHING)]
            if elsewhere:
                error = RuntimeError(
                    f"saving {self.path}: the ranks were given different paths: rank(s) "
                    f"{elsewhere} do not see the save rank 0 started in its temporary folder "
                    f"(rank {rank} has {self.tmp!r}); nothing was saved. "
                    "Give every rank the same checkpoint folder")
        if failed or error is not None:
            error = error or RuntimeError(f"saving {self.path} was refused on "
                                          f"{vote.others(failed)}; nothing was saved")
            self.abandon(error)
            raise error

    def publish(self, meta: dict) -> None:
        """Rank 0 (the claimer): metadata.json, manifest.json, `tmp` becomes `path`."""
        publish(self.tmp, self.where, meta, token=self.token, replace=self.replace)

    def _explain(self, error: BaseException) -> OSError | None:
        """A failed write's error naming the path and the cause (else None): a full drive's
        with the bytes needed (targets.no_space), others by write_errors.explain."""
        if targets.no_space(error, self.path, None) is None:
            out = write_errors.explain(
                error, self.path, self.tmp, "nothing was saved and the temporary directory "
                f"{self.tmp!r} was removed")
            if out is not None:
                out.__cause__ = error
            return out
        needed = sum(f.size for f in self.files) if self.files and all(
            getattr(f, "records", True) is not None for f in self.files) else None
        if needed is None and self.estimate is not None:
            try:
                needed = self.estimate()
            except Exception:  # noqa: BLE001 - the message goes without it
                needed = None
        out = targets.no_space(error, self.path, needed)
        out.__cause__ = error
        return out

    def tensor_file(self, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        """rank's tensor file (format.py): torch.save(tensors), its SHA-256 beside it."""
        f = TensorFile(os.path.join(self.tmp, fmt.rank_file(rank)), tensors)
        self.files.append(f)
        for i, t in enumerate(tensors.values()):
            self.packer.add(f, t, 0, record=i)  # records are 4 KiB-aligned in the file
        self.finishers.append(lambda d: fmt.write_checksum(self.tmp, rank, d[f.path]))

    def offloaded(self, off, directory: str, names: dict) -> None:
        """An offloading optimizer's committed state, streamed to `directory` (stream.py)."""
        self.finishers.append(stream.stage_offloaded(off, os.path.join(self.tmp, directory),
                                                     names, self.packer, self.helds,
                                                     self.files))

    def snapshot_failed(self, error: BaseException) -> None:
        """Snapshotting failed on the training thread: nothing more is staged, holds are let
        go; the ranks still vote (start()), so none waits for this one."""
        if self.snapshot_error is None:
            self.snapshot_error = error
            error.add_note(f"nothing was saved; the checkpoint at {self.path!r} (if any) is as "
                           "it was before this save")
        self.staging.fail(error)
        try:  # no copy may still land in a buffer that goes back to the cache
            self.packer.settle()
        except BaseException:  # noqa: BLE001 - the snapshot's error is the one raised
            pass
        for h in self.helds:
            h.hold.release()

    def abandon(self, error: BaseException) -> None:
        """Stops the job before anything was staged (its directory could not be claimed, or
        the ranks could not agree on it)."""
        if self.token is not None and owns(self.tmp, self.token):
            shutil.rmtree(self.tmp, ignore_errors=True)
        _ACTIVE.discard(self.token)
        self.snapshot_failed(error)
        self.writer.finish()
        self.writer.go.set()
        self.writer.join()

    def start(self, vote: Vote, publish) -> SaveHandle:
        """The snapshot is complete: the writer goes on alone; then every rank votes and
        `publish()` (rank 0's metadata and rename) runs. Blocking: waits, votes here."""
        if self.snapshot_error is None:
            try:
                self.packer.flush()
                self.packer.settle()  # GPU copies done: training may change the tensors now
                for h in self.helds:
                    self.writer.put(h)
            except BaseException as e:  # noqa: BLE001 - voted on, then raised
                self.snapshot_failed(e)
        self.writer.finish()
        self.writer.go.set()
        handle = self.handle
        handle.stall_s = time.perf_counter() - self._t0
        if self.blocking:
            self._finish(vote, publish)
            if handle._error is not None:
                handle._reported = True
                raise handle._error
            return handle
        handle._thread = threading.Thread(target=self._finish, args=(vote, publish),
                                          name="tierlift-checkpoint-commit", daemon=True)
        handle._thread.start()
        in_flight.started(handle)
        if self.snapshot_error is not None:  # raised here; the vote goes on in the thread
            handle._reported = True
            raise self.snapshot_error
        return handle

    def _finish(self, vote: Vote, publish) -> None:
        handle = self.handle
        try:
            self.writer.join()
            error = self.snapshot_error or self.writer.error
            if error is None:
                try:
                    for finish in self.finishers:
                        finish(self.writer.digests)
                except BaseException as e:  # noqa: BLE001 - voted on below
                    error = e
            if error is not None:  # explained before the vote: the others' error quotes it
                error = self._explain(error) or error
            failed = vote(error is None, error)
            if not failed:
                error = None
                try:
                    publish()
                except BaseException as e:  # noqa: BLE001 - voted on below
                    error = self._explain(e) or e
                failed = vote(error is None, error)
            if failed:
                if vote.rank == 0 and self.token is not None and owns(self.tmp, self.token):
                    shutil.rmtree(self.tmp, ignore_errors=True)  # never another save's
                if error is None:
                    error = RuntimeError(f"saving {self.path} failed on "
                                         f"{vote.others(failed)}; nothing was saved")
                elif vote.others(failed):
                    error.add_note(f"(it failed on {vote.others(failed)} too)")
                if error is not self.snapshot_error:
                    error.add_note(f"the checkpoint at {self.path!r} (if any) is as it was "
                                   "before this save")
                handle._error = error
        except BaseException as e:  # noqa: BLE001 - a vote failed: a rank is gone
            e.add_note(f"saving {self.path} was abandoned; the checkpoint there (if any) is "
                       "as it was before this save")
            handle._error = e
        finally:
            _ACTIVE.discard(self.token)
            handle.bytes = self.writer.written
            handle.staging_peak = self.staging.peak
            handle.total_s = time.perf_counter() - self._t0
