"""Agreeing on the ranks' own c10d calls while a stage-3 model lives.

The ranks' own c10d calls (`dist.all_reduce(loss)` after an eval loop, a metric gather, a
barrier) are agreed on while a stage-3 model lives: at stage 3 every forward gathers
weights with collectives matched across ranks in call order, so an eval batch only rank 0 has
would pair its gathers with rank 1's all_reduce, and rank 1 would wait until the process
group's timeout (minutes). Each such call on the thread that made the model, outside a
forward or backward, records on entry how many collectives the model has issued on this rank
(Comm.issued) and reads its ring neighbours' records; the model's first collective after each
forward start or such call records the same and reads theirs. A rank that issues more of the
model's collectives before the call than its neighbour did is seen by one side or the other
before anything is sent (each records before it reads): it raises RankFailureError naming the
call and the forwards (a forward refused at its first gather is not counted, and a refused
call is never taken for entered: where both raised, the model goes on). The first such call
after the model's collectives also waits (up to _AGREE_S, polling the store) for the
neighbours to enter it, so that both raise; a rank not there by then is left to the
collective, as before, and where the rank that saw it first had already issued its gather,
that gather fails naming the call once the other rank leaves.
Cost: per such call a store write (~1 us) and one read of the neighbours' records (~0.1 ms
on a loaded 2-core host), plus the polling while a neighbour has not entered it yet; per
forward the same write and read. Not checked: calls from other threads (a background save's
votes), point-to-point calls, and a torch without process-group pre-hooks.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch
import torch.distributed as dist

from tierlift.zero import collectives, members
from tierlift.zero import comm as comm_mod
from tierlift.zero.comm import RankFailureError

# Per rank set (a group's key prefix): the heartbeats of the stage-3 models over those ranks
# that live in this process (check_same_model).
GATHERING: dict[str, weakref.WeakSet] = {}


def model_name(ns: str) -> str:
    """'#2' for the second model made over its ranks (its key prefix ends in m2/)."""
    return "#" + ns.rstrip("/").rpartition("/m")[2]


# The ranks' own collectives on each process group this process hooked (by group name): how
# many were issued, counted alike on every rank (c10d issues a group's calls in one order), so
# the k-th call on a group is the same call on every rank.
_USER_SEQ: dict[str, int] = {}
# Calls entered on each group, refused ones too (never taken back): names one attempt.
_ATTEMPTS: dict[str, int] = {}
_HOOKED: set[str] = set()
_USER_HOOK_ID = 0x74697573  # not collectives.py's id: both hooks run
_AGREE_S = 5.0  # how long a call waits for the other ranks to enter it
# After this long without the other ranks, a model this rank no longer reaches may be what they
# wait for no more (they collected theirs): collect once, and wait only for the models left.
# Longer than ranks' usual skew, so a collection is rare: once per dropped model, not per call.
_COLLECT_AFTER_S = 0.5
# Calls between two ranks only (and group splits): not matched over the whole group.
_UNMATCHED = {"SEND", "RECV", "SPLIT", "NEW_WINDOW", "UNKNOWN"}


def _counts(text: str) -> list[int]:
    return [int(v) for v in text.split(".")] if text else []


def _parse_user(value: str) -> dict[str, tuple[int, int, int, str, list[int], bool]]:
    """A rank's record of its own calls: {group: (call index, attempt, forward count, op,
    counts, refused)}."""
    out = {}
    for part in filter(None, value.split(";")):
        group, _, rest = part.partition("=")
        k, attempt, c, op, counts, refused = rest.split(",")
        out[group] = (int(k), int(attempt), int(c), op, _counts(counts), refused == "x")
    return out


def _parse_pre(value: str) -> tuple[int, list[int], dict[str, int]] | None:
    """A rank's record before its model's next collective: (the Comm it goes to, counts,
    {group: calls issued})."""
    if not value or value.startswith("R|"):
        return None
    issuing, counts, seqs = value.split("|")
    return int(issuing), _counts(counts), {
        g: int(k) for g, _, k in (p.partition("=") for p in filter(None, seqs.split(";")))}


def _user_pre_hook(group_name: str):
    ranks: list = []

    def group_ranks() -> list:
        if not ranks:
            group = dist.distributed_c10d._resolve_process_group(group_name)
            ranks[:] = dist.get_process_group_ranks(group)
        return ranks

    def pre_hook(issued) -> None:
        if comm_mod.OWN.issuing:
            return
        op = issued.name.name
        if op in _UNMATCHED:
            return
        k = _USER_SEQ[group_name] = _USER_SEQ.get(group_name, 0) + 1
        _ATTEMPTS[group_name] = _ATTEMPTS.get(group_name, 0) + 1
        if not any(s.data for s in GATHERING.values()):
            return
        try:
            _agree_on_call(group_name, k, group_ranks, op.lower(), bool(issued.async_op))
        except RankFailureError:
            _USER_SEQ[group_name] = k - 1  # refused: never issued, on no rank
            raise

    return pre_hook


def _agree_on_call(group: str, k: int, group_ranks, op: str, async_op: bool) -> None:
    """Every stage-3 model records the call first, then all read the other ranks' records
    until each has entered it (up to _AGREE_S; an async call reads once)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return
    entered = []
    try:
        entered = [(h, e) for hbs in list(GATHERING.values()) for h in list(hbs)
                   if h.live() and
                   (e := h.enter_call(store, group, k, group_ranks, op)) is not None]
        # A call right after another agreed one, with no collective of the model between
        # (metrics all-reduced one by one) reads once: a rank that goes on to a forward
        # instead still sees it and refuses
        wait = not async_op and any(h.agreed.get(group) != e[4] for h, e in entered)
        start = time.monotonic()
        pause, deadline = 0.0001, start + (_AGREE_S if wait else 0.0)
        left, collected = entered, False
        while left:
            still = [(h, e) for h, e in left if h.check_call(store, e)]
            for h, e in left:
                if all(h is not o for o, _ in still):
                    h.agreed[group] = e[4]  # every rank entered it after the same counts
            left = still
            if not left or time.monotonic() > deadline:
                return
            if not collected and time.monotonic() - start > _COLLECT_AFTER_S:
                refs = [(weakref.ref(h), e) for h, e in left]
                entered = left = still = h = None  # no strong reference across the collection
                collected, left = True, _collected(refs)
                entered = left  # the models collected took part in nothing: nothing to undo
                continue
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    except RankFailureError:
        for h, _ in entered:  # never issued: no other rank may take it for entered
            h.refuse_call(store, group)
        raise
    except (RuntimeError, AttributeError, ValueError):
        return  # a store without these calls, or gone: only makes errors clearer


def _collected(refs: list) -> list:
    """The heartbeats of `refs` (weak) that a garbage collection leaves: a model the script
    dropped (a new one built in its place) lives on here until Python's next full collection,
    while the other ranks, which collected theirs, never enter the call for it; each call
    would wait _AGREE_S for it."""
    gc.collect()
    return [(h, e) for r, e in refs if (h := r()) is not None and h.live()
            and any(h in hbs for hbs in list(GATHERING.values()))]


def _neighbours(me: int, ranks) -> list[int]:
    """The ranks before and after `me` in `ranks` (a ring): the ones whose records this rank
    reads, so that the store serves two reads per rank, not one per pair of ranks. A rank
    that goes another way is seen by its neighbours; the others then wait in the call, as
    before, until those fail."""
    ring = sorted(set(ranks) | {me})
    if len(ring) <= 3:
        return [r for r in ring if r != me]
    i = ring.index(me)
    return sorted({ring[i - 1], ring[(i + 1) % len(ring)]})


def _hook_user_calls(group) -> None:
    group.register_pre_hook(_USER_HOOK_ID, _user_pre_hook(group.group_name))
    _HOOKED.add(group.group_name)


def _hooking_new_groups(original):
    def register(pg, *args, **kwargs):
        original(pg, *args, **kwargs)
        _hook_user_calls(pg)

    return register


def install_user_calls() -> None:
    """Hooks every process group (made so far and later) for the agreement on the ranks' own
    calls (see the module doc). Idempotent. Not on a torch without process-group pre-hooks."""
    from tierlift._torch_patch import wrap_method

    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    if not hasattr(c10d.ProcessGroup, "register_pre_hook") or \
            not hasattr(torch._C._distributed_c10d, "HookOpName"):
        return
    params = ["pg", "backend_name", "store", "group_name", "backend_config", "rank_mapping",
              "pg_tag", "user_tag", "add_to_default_tag"]
    wrap_method(c10d, "_register_pg_in_world", params, _hooking_new_groups)
    collectives.unhook_at_exit(_USER_HOOK_ID)
    for group in list(c10d._world.pg_map):
        if group.group_name not in _HOOKED:
            _hook_user_calls(group)


class UserCallAgreement:
    """The part of a stage-3 model's Heartbeat that agrees on the ranks' own calls (see the
    module doc). Uses the Heartbeat's me, count, nograd, nograd_first, ns and store."""

    def _init_user_calls(self, comm, also) -> None:
        # The agreement on the ranks' own calls (stage 3): the model's Comms and their ranks,
        # the thread that runs its forwards, this rank's records of its own calls by group
        self.comms = [c for i, c in enumerate((comm, *also))
                      if c.world > 1 and all(c is not o for o in (comm, *also)[:i])]
        self.comm_ranks = [set(range(c.world)) if c.group is None
                           else set(dist.get_process_group_ranks(c.group)) for c in self.comms]
        self.thread = threading.get_ident()
        self.user_records: dict[str, tuple[int, int, int, str, list[int], bool]] = {}
        self.precheck_due = False
        self.refused_for: set[tuple] = set()  # (rank, group, attempt) refused here once
        self.unbeat: tuple | None = None  # (nograd, nograd_first) before the latest beat
        self.agreed: dict[str, list[int]] = {}  # group -> counts at its last agreed call

    def _issued(self) -> list[int]:
        return [c.issued for c in self.comms]

    def _busy(self) -> bool:
        """Inside a forward or backward of a sharded model (an MoE layer's all_to_all): not
        a call between forwards; checked at the forward's boundaries instead."""
        if torch._C._current_graph_task_id() != -1:
            return True
        return any(getattr(st, "forwarding", 0) for st in members.live_states())

    def _ahead(self, r: int, theirs: list[int], mine: list[int], issuing: int) -> bool:
        """Whether `theirs` (counts of the model's collectives, one side about to issue one
        more on Comm `issuing`) passes `mine` on a Comm both this rank and rank r are in."""
        return any(r in ranks and (t > m or (i == issuing and t >= m))
                   for i, (ranks, t, m) in enumerate(zip(self.comm_ranks, theirs, mine,
                                                         strict=False)))

    def enter_call(self, store, group: str, k: int, group_ranks, op: str) -> tuple | None:
        """This rank enters its own call `op`, the k-th on process group `group` (the
        pre-hook): records it. Returns what check_call needs, or None where nothing is to be
        agreed on (another thread, inside a forward or backward, no other rank of the model
        in the call's group)."""
        if threading.get_ident() != self.thread or self._busy():
            return None
        try:
            in_group = set(group_ranks())
        except (RuntimeError, ValueError):
            return None
        peers = _neighbours(self.me, set().union(*self.comm_ranks) & in_group)
        if not peers:
            return None
        mine = self._issued()
        # Kept when refused: a rank about to gather still sees it (and refuses once per
        # attempt); this rank's next call on the group takes index k again.
        self.user_records[group] = (k, _ATTEMPTS[group], self.count, op, mine, False)
        self.precheck_due = True
        self.unbeat = None
        store.set(f"{self.ns}user/{self.me}", self._user_value())
        return group, k, op, peers, mine

    def refuse_call(self, store, group: str) -> None:
        """Marks this rank's latest call on `group` refused. Still read by a rank about to
        gather (which refuses once for it: it went another way), never as a call entered."""
        k, attempt, count, op, mine, _ = self.user_records[group]
        self.user_records[group] = (k, attempt, count, op, mine, True)
        try:
            store.set(f"{self.ns}user/{self.me}", self._user_value())
        except RuntimeError:
            pass

    def check_call(self, store, entered: tuple) -> bool:
        """Reads the other ranks' records once: raises where one went another way; returns
        whether some rank has not entered the call yet."""
        group, k, op, peers, mine = entered
        read = [v.decode() for v in store.multi_get(
            [f"{self.ns}{kind}/{r}" for r in peers for kind in ("user", "pre")])]
        pending = False
        for i, r in enumerate(peers):
            theirs = _parse_user(read[2 * i]).get(group)
            if theirs is not None and theirs[0] >= k and not theirs[5]:
                if theirs[0] == k and any(
                        r in ranks and t != m for ranks, t, m in
                        zip(self.comm_ranks, theirs[4], mine, strict=False)):
                    self._user_call_differs(store, r, op, theirs[2])
                continue
            if read[2 * i + 1] == f"R|{self.me}|{group}|{_ATTEMPTS[group]}":
                self._user_call_skipped(store, r, op)  # it refused on seeing this call
            pre = _parse_pre(read[2 * i + 1])
            if pre is not None and pre[2].get(group, 0) < k and \
                    self._ahead(r, pre[1], mine, pre[0]):
                self._user_call_skipped(store, r, op)
            pending = True
        return pending

    def _user_value(self) -> str:
        return ";".join(f"{g}={k},{a},{c},{op},{'.'.join(map(str, n))},{'x' if x else ''}"
                        for g, (k, a, c, op, n, x) in self.user_records.items())

    def before_own_call(self, comm) -> None:
        """Before the first of the model's collectives after a forward started or the rank
        made a call of its own (Comm.before_issue): refuses it, before it is sent, when
        another rank entered a call of its own that this rank has not, after fewer of the
        model's collectives than this rank has issued already."""
        if not self.precheck_due or threading.get_ident() != self.thread:
            return
        self.precheck_due = False
        unbeat, self.unbeat = self.unbeat, None
        store = self.store
        peers = _neighbours(self.me, set().union(*self.comm_ranks))
        if store is None or not peers:
            return
        mine = self._issued()
        issuing = next((i for i, c in enumerate(self.comms) if c is comm), -1)
        seqs = ";".join(f"{g}={k}" for g, k in _USER_SEQ.items())
        try:
            store.set(f"{self.ns}pre/{self.me}",
                      f"{issuing}|{'.'.join(map(str, mine))}|{seqs}")
            read = [v.decode() for v in store.multi_get([f"{self.ns}user/{r}" for r in peers])]
        except (RuntimeError, AttributeError, ValueError):
            return  # only makes errors clearer; a dead store surfaces at the collective
        for r, value in zip(peers, read, strict=True):
            for group, (k, attempt, count, op, theirs, _) in _parse_user(value).items():
                if group in _HOOKED and _USER_SEQ.get(group, 0) < k and \
                        (r, group, attempt) not in self.refused_for and \
                        self._ahead(r, mine, theirs, issuing):
                    self.refused_for.add((r, group, attempt))
                    try:  # nothing issued: that rank's call refuses too, later ones not
                        store.set(f"{self.ns}pre/{self.me}", f"R|{r}|{group}|{attempt}")
                    except RuntimeError:
                        pass
                    self.precheck_due = True
                    starting = self.count
                    if unbeat is not None:  # the forward starting never ran
                        self.nograd, self.nograd_first = unbeat
                        self.count -= 1
                        self._publish_count(store)
                    self._went_on_without(store, r, op, count, starting)

    def _publish_count(self, store) -> None:
        try:
            store.set(f"{self.ns}beat/{self.me}", str(self.count))
            store.set(f"{self.ns}nograd/{self.me}", f"{self.nograd_first}:{self.nograd}")
        except RuntimeError:
            pass

    def _uneven(self, store, msg: str) -> None:
        msg += (": a forward (an extra eval batch, say) ran on some ranks only before it. At "
                "stage 3 every forward gathers the weights with collectives matched across "
                "ranks in call order, so the call would pair with another rank's weight "
                "gathers and wait until the process group's timeout: run the same forwards on "
                "every rank before it (pad the last eval batch, or give every rank the same "
                "number of batches). Nothing was sent")
        try:  # a rank already inside a gather names it when that fails
            store.set(f"{self.ns}diverged", msg)
        except RuntimeError:
            pass
        raise RankFailureError(msg)

    def _user_call_skipped(self, store, r: int, op: str) -> None:
        self._uneven(store, f"tierlift.zero: rank {self.me} called {op} (a collective of its "
                     f"own) after forward {self.count} of sharded model "
                     f"{model_name(self.ns)}, but rank {r} went on to the model's collectives "
                     "(the next forward's weight gathers) without calling it")

    def _user_call_differs(self, store, r: int, op: str, count: int) -> None:
        self._uneven(store, f"tierlift.zero: rank {self.me} called {op} (a collective of its "
                     f"own) after forward {self.count} of sharded model "
                     f"{model_name(self.ns)}, and rank {r} after forward {count}, with "
                     "another number of the model's collectives before it")

    def _went_on_without(self, store, r: int, op: str, count: int, starting: int) -> None:
        self._uneven(store, f"tierlift.zero: rank {r} called {op} (a collective of its own) "
                     f"after forward {count} of sharded model {model_name(self.ns)}, but "
                     f"rank {self.me} went on to the model's collectives (forward "
                     f"{starting}'s weight gathers) without calling it")
