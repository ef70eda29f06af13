"""Agreeing across ranks before a checkpoint load commits: each rank checks and prepares its
part (params in place behind an undo journal, optimizer state in its uncommitted generation or
journaled), then ONE collective, a per-rank failure flag and digest of what it read, summed over
the ranks, decides: every rank commits, or every rank rolls back and raises (the failing rank
its own error, the others one naming it and quoting its error, sent by a second exchange on
that path only). A rank whose checks refuse the checkpoint takes part too, so none waits for it.
A rank that dies outright makes the collective fail on the survivors (the ZeRO heartbeat names
it, the process group timeout bounds a hang): they roll back too."""

from __future__ import annotations

import hashlib
import os

import torch

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import manifest

FINGERPRINT_BYTES = 16  # of the SHA-256 of what a rank read, compared across the ranks


def comm_device(comm) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if (
        comm.initialized and torch.distributed.get_backend(comm.group) == "nccl") else \
        torch.device("cpu")


def load_optimizer_state(optimizer, sd: dict, before_commit=None) -> None:
    """optimizer.load_state_dict(sd), all-or-nothing: `before_commit` is called before the new
    state becomes final; if it (or the load) raises, the old state is put back."""
    if hasattr(optimizer, "_load_state_dict"):  # tierlift's: all-or-nothing, offloaded too
        optimizer._load_state_dict(sd, before_commit)
        return
    # Any other torch optimizer replaces its state and param_groups objects: keep the old ones.
    old = {"state": optimizer.state, "param_groups": optimizer.param_groups}
    try:
        optimizer.load_state_dict(sd)
        if before_commit is not None:
            before_commit()
    except BaseException:
        optimizer.__dict__.update(old)
        raise


REASON_BYTES = 1024  # of each failing rank's error, sent to the others


def describe(error: BaseException | None) -> str:
    return "failed" if error is None else f"{type(error).__name__}: {error}"


def exchange_reasons(rank: int, world: int, reduce, reason: str | None) -> dict[int, str]:
    """Every rank's `reason` (None: it did not fail), through one sum of a [world, N] byte
    tensor in which each rank fills its own row. Called only once the ranks know some failed,
    so it costs nothing when all is well."""
    rows = torch.zeros(world, REASON_BYTES, dtype=torch.uint8)
    if reason is not None:
        data = (reason.encode(errors="replace") or b"failed")[:REASON_BYTES]
        rows[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = reduce(rows)
    return {r: bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
            for r, row in enumerate(rows) if bool(row.any())}


def explain(failed: list[int], reasons: dict[int, str]) -> str:
    """ "rank(s) [1]: rank 1 (ValueError: ...)": the failed ranks and their errors."""
    return f"rank(s) {failed}: " + "; ".join(
        f"rank {r} ({reasons[r]})" if r in reasons else f"rank {r}" for r in failed)


class Agreement:
    """One collective, reached by every rank exactly once per load, that decides whether every
    rank prepared its part: commit everywhere, or roll back everywhere. A rank that died
    outright makes the collective fail (the ZeRO heartbeat names it): the survivors roll back.

    It is entered before the load's first check, so a rank whose own checks refuse the
    checkpoint (its folder or a file missing or corrupt there, its model or optimizer not
    matching) still reaches it: the others raise too, naming that rank and its error, instead
    of waiting in the collective. It also compares what each rank read (`fingerprint`: the
    digest of the checkpoint's manifest): ranks that loaded different checkpoints all roll
    back."""

    def __init__(self, comm, path: str):
        """`comm`: a tierlift.zero Comm over the ranks that load together (None: this one)."""
        self.comm, self.path = comm, path
        self.rank = comm.rank if comm is not None else 0
        self.decided = False  # the collective ran (or was tried): never twice
        self.failed: list[int] = []
        self.reasons: dict[int, str] = {}
        self.fingerprint = bytes(FINGERPRINT_BYTES)  # set by the load once it read the files

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(comm_device(self.comm))
        self.comm.wait(self.comm.all_reduce(t))
        return t.cpu()

    def _decide(self, error: BaseException | None) -> list[int]:
        if not self.decided:
            self.decided = True
            self.failed = [] if error is None else [self.rank]
            if self.comm is not None and self.comm.world > 1:
                # per rank: failed (0/1), then the digest of what it read
                t = torch.zeros(self.comm.world, 1 + FINGERPRINT_BYTES, dtype=torch.uint8)
                t[self.rank, 0] = 0 if error is None else 1
                t[self.rank, 1:] = torch.frombuffer(bytearray(self.fingerprint),
                                                    dtype=torch.uint8)
                t = self._reduce(t)
                self.failed = [r for r in range(self.comm.world) if int(t[r, 0])]
                if self.failed:
                    self.reasons = exchange_reasons(
                        self.rank, self.comm.world, self._reduce,
                        describe(error) if error is not None else None)
                else:
                    self._refuse_other_checkpoints(t[:, 1:])
        return self.failed

    def _refuse_other_checkpoints(self, prints: torch.Tensor) -> None:
        """Every rank read its files fine, but not the same checkpoint (a folder of its own
        per rank, a copy that differs): no rank may commit a mix."""
        groups: dict[bytes, list[int]] = {}
        for r, row in enumerate(prints):
            groups.setdefault(bytes(row.tolist()), []).append(r)
        if len(groups) > 1:
            self.failed = list(range(len(prints)))
            self.reasons = {}
            raise RuntimeError(
                f"loading checkpoint {self.path}: the ranks read different checkpoints "
                f"(manifest digests differ; ranks grouped by what they read: "
                f"{sorted(groups.values())}), so none loaded anything; rank {self.rank} "
                "kept the state it had. Give every rank the same checkpoint folder (on a "
                "file system every rank sees, or identical copies)")

    def check(self) -> None:
        """This rank is ready: raises if any rank was not (then this rank rolls back too)."""
        failed = self._decide(None)
        if failed:
            raise RuntimeError(f"loading checkpoint {self.path} failed on "
                               f"{explain(failed, self.reasons)}; rank {self.rank} rolled "
                               "back too, so every rank keeps the state it had before the load")

    def fail(self, error: BaseException) -> None:
        """This rank failed with `error`: tells the others (if not decided yet)."""
        if not self.decided:
            try:
                self._decide(error)
            except Exception as e:  # a peer died too: roll back, raise the first error
                error.add_note(f"(and the ranks could not agree on the failure: {e})")
            else:
                others = [r for r in self.failed if r != self.rank]
                if others:
                    error.add_note(f"(it failed on {explain(others, self.reasons)} too)")


def fingerprint(path: str) -> bytes:
    """What identifies the checkpoint a rank read: the digest of its manifest.json (the
    SHA-256 of every file), or of metadata.json where it has none."""
    h = hashlib.sha256()
    for name in (manifest.MANIFEST, fmt.METADATA):
        try:
            with open(os.path.join(path, name), "rb") as f:
                h.update(f.read())
            break
        except FileNotFoundError:
            continue
    return h.digest()[:FINGERPRINT_BYTES]
