"""Agreeing across ranks before a checkpoint load commits: each rank prepares its part (params
in place behind an undo journal, optimizer state in its uncommitted generation or journaled),
then ONE collective, a per-rank failure vector summed over the ranks, decides: every rank
commits, or every rank rolls back and raises (the failing rank its own error, the others one
naming it). A rank that dies outright makes the collective fail on the survivors (the ZeRO
heartbeat names it, the process group timeout bounds a hang): they roll back too."""

from __future__ import annotations

import torch


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


class Agreement:
    """One collective, reached by every rank exactly once per load, that decides whether every
    rank prepared its part: commit everywhere, or roll back everywhere. A rank that died
    outright makes the collective fail (the ZeRO heartbeat names it): the survivors roll back."""

    def __init__(self, comm, path: str):
        """`comm`: a tierlift.zero Comm over the ranks that load together (None: this one)."""
        self.comm, self.path = comm, path
        self.rank = comm.rank if comm is not None else 0
        self.decided = False  # the collective ran (or was tried): never twice
        self.failed: list[int] = []

    def _decide(self, ok: bool) -> list[int]:
        if not self.decided:
            self.decided = True
            self.failed = [] if ok else [self.rank]
            if self.comm is not None and self.comm.world > 1:
                t = torch.zeros(self.comm.world, device=comm_device(self.comm))
                t[self.rank] = 0.0 if ok else 1.0
                self.comm.wait(self.comm.all_reduce(t))
                self.failed = [r for r, v in enumerate(t.tolist()) if v]
        return self.failed

    def check(self) -> None:
        """This rank is ready: raises if any rank was not (then this rank rolls back too)."""
        failed = self._decide(True)
        if failed:
            raise RuntimeError(f"loading checkpoint {self.path} failed on rank(s) {failed}; "
                               f"rank {self.rank} rolled back too, so every rank keeps "
                               "the state it had before the load")

    def fail(self, error: BaseException) -> None:
        """This rank failed with `error`: tells the others (if not decided yet)."""
        if not self.decided:
            try:
                self._decide(False)
            except Exception as e:  # a peer died too: roll back, raise the first error
                error.add_note(f"(and the ranks could not agree on the failure: {e})")
