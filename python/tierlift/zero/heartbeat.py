"""Naming the rank that died or hung, instead of failing with an anonymous socket error or
hanging forever.

Each rank bumps a counter in the c10d store (the one torchrun / init_process_group already
runs) once per forward. When a collective fails (a peer closed its socket, or the process
group's timeout expired), the survivor records its own failure in the store, waits a moment for
the other survivors to do the same, and names the ranks that neither failed nor are ahead of it:
those stopped answering. The process group timeout (init_process_group(timeout=...)) bounds how
long a hung rank can stall the others.

Collectives the user calls between steps (Trainer.save_model, tierlift.zero.full_state_dict,
gathered(), checkpoints) are named: on entry a rank records the call (its index, its name and
the forward it came after) and waits until every rank has recorded the same call. A rank that
skipped it (`if rank == 0: trainer.save_model(...)`) shows in the store at once: its next
forward starts, and its forward counter passes the caller's. Both sides then raise within
moments, naming the call, instead of hanging until the process group's timeout (or matching
unrelated collectives): the caller while it waits, the other rank when its forward starts (or,
if it was already inside a collective, when that fails because the caller gave up).

The ranks' own c10d calls (`dist.all_reduce(loss)` after an eval loop, a metric gather, a
barrier) are agreed on too, while a stage-3 model lives: at stage 3 every forward gathers
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

import hashlib
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from tierlift.zero import comm as comm_mod
from tierlift.zero import members

_PREFIX = "tierlift_zero/"


def _group_key(ranks: list[int]) -> str:
    """The same short name on every rank of a group, for its ranks: runs of consecutive ranks
    ("0-3", "0,2"), or a digest where that runs long (a strided group of thousands)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    name = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    if len(name) <= 48:
        return name
    digest = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:24]
    return f"{len(ranks)}r{digest}"


def _every_rank(name: str) -> str:
    return f"call {name} on every rank (not under `if rank == 0:`)"


# Per rank set (a group's key prefix): the heartbeats of the stage-3 models over those ranks
# that live in this process (check_same_model).
_GATHERING: dict[str, weakref.WeakSet] = {}


def _model_name(ns: str) -> str:
    """'#2' for the second model made over its ranks (its key prefix ends in m2/)."""
    return "#" + ns.rstrip("/").rpartition("/m")[2]


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


# The ranks' own collectives on each process group this process hooked (by group name): how
# many were issued, counted alike on every rank (c10d issues a group's calls in one order), so
# the k-th call on a group is the same call on every rank.
_USER_SEQ: dict[str, int] = {}
# Calls entered on each group, refused ones too (never taken back): names one attempt.
_ATTEMPTS: dict[str, int] = {}
_HOOKED: set[str] = set()
_USER_HOOK_ID = 0x74697573  # not collectives.py's id: both hooks run
_AGREE_S = 5.0  # how long a call waits for the other ranks to enter it
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
        if not any(s.data for s in _GATHERING.values()):
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
        entered = [(h, e) for hbs in list(_GATHERING.values()) for h in list(hbs)
                   if h.live() and
                   (e := h.enter_call(store, group, k, group_ranks, op)) is not None]
        # A call right after another agreed one, with no collective of the model between
        # (metrics all-reduced one by one) reads once: a rank that goes on to a forward
        # instead still sees it and refuses
        wait = not async_op and any(h.agreed.get(group) != e[4] for h, e in entered)
        pause, deadline = 0.0001, time.monotonic() + (_AGREE_S if wait else 0.0)
        left = entered
        while left:
            still = [(h, e) for h, e in left if h.check_call(store, e)]
            for h, e in left:
                if all(h is not o for o, _ in still):
                    h.agreed[group] = e[4]  # every rank entered it after the same counts
            left = still
            if not left or time.monotonic() > deadline:
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    except RankFailureError:
        for h, _ in entered:  # never issued: no other rank may take it for entered
            h.refuse_call(store, group)
        raise
    except (RuntimeError, AttributeError, ValueError):
        return  # a store without these calls, or gone: only makes errors clearer


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
    for group in list(c10d._world.pg_map):
        if group.group_name not in _HOOKED:
            _hook_user_calls(group)


def _default_group_ref():
    """A weak reference to the default process group (a dead one when there is none), or
    None where the group takes no weak reference. Never a strong one: a group kept past
    destroy_process_group() holds its store, which aborts the process when destroyed late."""
    try:
        group = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError, AttributeError):
        return _dead_ref
    try:
        return weakref.ref(group)
    except TypeError:
        return None


def _dead_ref():
    return None


class Heartbeat:
    def __init__(self, comm, also=(), settle_s: float = 2.0, gathers: bool = False):
        """`comm`: every rank of the model; `also`: the other Comms whose failures it explains
        (the shard group and replicate legs of hierarchical sharding); `gathers`: every forward
        gathers weights (stage 3), see check_same_model."""
        self.comm = comm
        self.gathers = gathers
        self.group_ns = None  # the keys every model over these ranks shares
        self.settle_s = settle_s
        self.count = 0
        self.nograd = 0  # the last forward without grad (stage 3), by count
        self.nograd_first = 0  # the first of the run of no-grad forwards it ends
        self.ranks = (list(range(comm.world)) if comm.group is None
                      else dist.get_process_group_ranks(comm.group))
        self.me = self.ranks[comm.rank]
        self.calls = 0  # named collective calls this rank has entered
        self.backs = 0  # synced backwards checked by check_same_units (stages 1/2)
        self.unit_names: list[str] = []  # for check_same_units' message
        # callable() -> True when the forward starting runs no collective (a stage-1/2 eval
        # with current weights): not counted, so an eval on rank 0 only is no skipped call
        self.quiet = None
        self.ns = _PREFIX
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
        self._group_ref = _default_group_ref()
        store = self.store
        if store is not None:
            # Keys of their own per sharded model, under its ranks (every rank of the model;
            # hierarchy=/mesh=: the world, its shard groups' peers among them): another
            # group's models (two data-parallel groups, each sharding its copy) never read
            # them. Within the ranks, the n-th model each rank makes over them (shard() is
            # collective over them, so every rank makes those in the same order) counts on
            # its own.
            group = f"{_PREFIX}g{_group_key(self.ranks)}/"
            try:
                self.ns = f"{group}m{store.add(f'{group}models/{self.me}', 1)}/"
                self.group_ns = group
                if gathers:
                    _GATHERING.setdefault(group, weakref.WeakSet()).add(self)
                # Present from the start, so check_same_forward reads them in one round trip.
                store.set(f"{self.ns}beat/{self.me}", "0")
                store.set(f"{self.ns}nograd/{self.me}", "0:0")
                store.set(f"{self.ns}user/{self.me}", "")
                store.set(f"{self.ns}pre/{self.me}", "")
            except RuntimeError:
                pass
        for c in (comm, *also):
            c.on_error = self.explain
            if gathers:
                c.before_issue = self.before_own_call

    def live(self) -> bool:
        """Whether the process group this model was made in is still the default one. A
        model kept past destroy_process_group() has its keys in the destroyed group's store
        only: read from the next group's store they would block until its timeout."""
        ref = self._group_ref
        if ref is None:
            return True  # a torch whose groups take no weakref: checked as before
        try:
            current = dist.distributed_c10d._get_default_group()
        except (RuntimeError, ValueError, AttributeError):
            return False
        return ref() is current

    @property
    def store(self):
        # Looked up on every use, never kept: a store object that outlives
        # destroy_process_group() aborts the process when it is finally destroyed.
        try:
            return dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            return None

    def beat(self, no_grad: bool = False) -> None:
        """A forward starts; `no_grad`: a stage-3 forward without grad (an eval), recorded so
        that check_same_forward can tell a forward some ranks ran and others did not."""
        if self.quiet is not None and self.quiet():
            return
        # What the forward starting changes, kept until its first collective: a forward
        # refused there never ran, and is taken back (before_own_call)
        self.unbeat = (self.nograd, self.nograd_first)
        self.count += 1
        self.precheck_due = True
        if no_grad:
            # The run of consecutive no-grad forwards this one belongs to, first:last.
            if self.nograd != self.count - 1:
                self.nograd_first = self.count
            self.nograd = self.count
        store = self.store
        if store is None:
            return
        try:
            store.set(f"{self.ns}beat/{self.me}", str(self.count))
            if no_grad:
                store.set(f"{self.ns}nograd/{self.me}", f"{self.nograd_first}:{self.nograd}")
            skipped = store.check([f"{self.ns}call/{self.calls}"])
        except RuntimeError:
            return  # a dead store host surfaces, named, at the next collective
        if skipped:
            self._raise_skipped_call(store)
        if self.gathers and sum(h.live() for h in _GATHERING.get(self.group_ns, ())) > 1:
            self.check_same_model(store)

    def _raise_skipped_call(self, store) -> None:
        # Another rank entered a named call this rank has not: skipped if it came after an
        # earlier forward than the one starting here.
        for r, (name, at) in self._callers(store, self.calls).items():
            if at < self.count:
                self.calls += 1  # not waited for again if the caller recovers
                raise RankFailureError(
                    f"tierlift.zero: rank {r} called {name}, a collective that every rank "
                    f"must call, but rank {self.me} went on to forward step {self.count} "
                    f"without it: {_every_rank(name)}")

    def check_same_model(self, store) -> None:
        """At the start of a forward that gathers (stage 3) while another such model over these
        ranks lives in this process (a policy and its reference model, a teacher, an EMA
        copy): no rank started a forward of another model where this rank starts this one.
        Their gathers share the ranks' collectives, matched in call order, so a forward run on
        some ranks only (rank 0's extra eval batch) would gather one model's weights with
        another's of the same sizes: wrong outputs on every rank, no error. A rank r that has
        not started this model's forward yet but has started more forwards of another model X
        than this rank did took X where this rank takes this one (its X forward's gathers could
        not have completed without this rank). Each rank records its count before reading the
        others', so of two ranks taking different models the later one sees it; it raises
        RankFailureError before any gather, and the other's gathers, left unanswered, fail
        naming it. One store round trip, without waiting."""
        models = sorted((h for h in _GATHERING.get(self.group_ns, ())
                         if h.ns != self.ns and h.live()),
                        key=lambda h: h.ns)
        others = [r for r in self.ranks if r != self.me]
        keys = [f"{h.ns}beat/{r}" for r in others for h in (self, *models)]
        try:
            if not store.check(keys):  # a model some rank is still making: nothing to compare
                return
            read = [int(v) for v in store.multi_get(keys)]
        except (RuntimeError, AttributeError, ValueError):
            return  # only makes errors clearer; a dead store surfaces at a collective
        width = 1 + len(models)
        for i, r in enumerate(others):
            theirs = read[i * width:(i + 1) * width]
            if theirs[0] >= self.count:
                continue  # r started this forward too
            for h, count in zip(models, theirs[1:]):
                if count > h.count:
                    self._took_another_model(store, r, h, count)

    def _took_another_model(self, store, r: int, other: Heartbeat, count: int) -> None:
        msg = (f"tierlift.zero: rank {self.me} is starting forward {self.count} of sharded "
               f"model {_model_name(self.ns)}, but rank {r} started forward {count} of model "
               f"{_model_name(other.ns)} instead (this rank ran {other.count} of those): a "
               "forward (an extra eval batch, say) ran on some ranks only. At stage 3 every "
               "forward gathers the weights with collectives matched across ranks in call "
               "order, so one model's weights would be gathered with another's: run the same "
               "forwards on every rank, in the same order (pad the last eval batch, or give "
               "every rank the same number of batches)")
        try:  # the other rank's gathers, left unanswered, fail naming it
            for h in (self, other):
                store.set(f"{h.ns}diverged", msg)
        except RuntimeError:
            pass
        raise RankFailureError(msg)

    # ---- the ranks' own calls (stage 3), see the module doc ----
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
                     f"{_model_name(self.ns)}, but rank {r} went on to the model's collectives "
                     "(the next forward's weight gathers) without calling it")

    def _user_call_differs(self, store, r: int, op: str, count: int) -> None:
        self._uneven(store, f"tierlift.zero: rank {self.me} called {op} (a collective of its "
                     f"own) after forward {self.count} of sharded model "
                     f"{_model_name(self.ns)}, and rank {r} after forward {count}, with "
                     "another number of the model's collectives before it")

    def _went_on_without(self, store, r: int, op: str, count: int, starting: int) -> None:
        self._uneven(store, f"tierlift.zero: rank {r} called {op} (a collective of its own) "
                     f"after forward {count} of sharded model {_model_name(self.ns)}, but "
                     f"rank {self.me} went on to the model's collectives (forward "
                     f"{starting}'s weight gathers) without calling it")

    def check_same_forward(self, peers) -> None:
        """At the start of a stage-3 backward: every rank of `peers` (the comm whose gathers
        couple the ranks' forwards: the shard group) ran its forward of this rank's latest count
        with grad or without as this rank did. A forward run on some ranks only (an eval under
        torch.no_grad() on rank 0) would pair its weight gathers with another rank's backward
        gathers: gloo aborts the process on the size mismatch, or worse, the sizes match.
        Raises RankFailureError, naming the ranks, before this rank's first backward
        collective. Only the kind of that one forward is compared: a peer may legitimately be a
        forward ahead (after a backward without collectives: no_sync() with
        reshard_after_forward=False) or behind (a forward without gathers)."""
        store = self.store
        if store is None:
            return
        ranks = (list(range(peers.world)) if peers.group is None
                 else dist.get_process_group_ranks(peers.group))
        others = [r for r in ranks if r != self.me]
        if not others:
            return
        keys = [f"{self.ns}{k}/{r}" for r in others for k in ("beat", "nograd")]
        try:
            read = [v.decode() for v in store.multi_get(keys)]
        except (RuntimeError, AttributeError, ValueError):
            return  # only makes errors clearer; a dead store surfaces at a collective
        mine = self.nograd_first <= self.count <= self.nograd
        for i, r in enumerate(others):
            beat = int(read[2 * i])
            first, _, last = read[2 * i + 1].partition(":")
            theirs = int(first) <= self.count <= int(last or first)
            # A peer behind (a forward without gathers: units still gathered) tells nothing.
            if beat >= self.count and theirs != mine:
                self._diverged(store, r, theirs)

    def check_same_units(self, used: list[int]) -> None:
        """At the start of a synced backward at stages 1/2, before its first reduction: every
        rank ran the same units (indices, in first-call order) in the forwards since its last
        backward began. Each unit's gradient is reduced with a collective that pairs with the
        other ranks' reductions in call order, so a unit some ranks skipped (an MoE expert no
        token was routed to, a branch taken on one rank) would pair one unit's gradient with
        another's: gloo aborts the process on a size mismatch, units of the same size mix
        silently. Raises RankFailureError naming the units and ranks on every rank, before any
        of them communicates (training can go on). Each rank writes its units under this
        backward's key and reads the others' (the read waits for ranks still in their forward,
        as their first reduction would), then drops its key of the backward before: three
        store round trips per synced backward."""
        self.backs += 1
        store = self.store
        others = [r for r in self.ranks if r != self.me]
        if store is None or not others:
            return
        mine = ",".join(map(str, used))
        key = f"{self.ns}units/{self.backs}/"
        try:
            store.set(f"{key}{self.me}", mine)
            read = [v.decode() for v in store.multi_get([f"{key}{r}" for r in others])]
            if self.backs > 1:  # every rank read it before the reductions of that backward
                store.delete_key(f"{self.ns}units/{self.backs - 1}/{self.me}")
        except (AttributeError, ValueError):
            return  # a store without these calls: only makes errors clearer
        except RuntimeError as exc:  # a rank that never came (or the store's host died)
            raise self.explain(exc) from exc
        for r, theirs in zip(others, read):
            if theirs != mine:
                self._units_differ(store, r, used, [int(i) for i in theirs.split(",") if i])

    def _units_differ(self, store, r: int, mine: list[int], theirs: list[int]) -> None:
        def name(i):
            return repr(self.unit_names[i]) if i < len(self.unit_names) else f"#{i}"

        def listed(units):
            return "[" + ", ".join(name(i) for i in units) + "]"

        only = {self.me: [i for i in mine if i not in theirs],
                r: [i for i in theirs if i not in mine]}
        which = "; ".join(f"{', '.join(name(i) for i in units)} ran on rank {rank} only"
                          for rank, units in only.items() if units) or "the same units in " \
            "another order"
        msg = (f"tierlift.zero: before synced backward {self.backs}, rank {self.me} ran units "
               f"{listed(mine)} and rank {r} ran {listed(theirs)} ({which}). "
               "At stages 1/2 each unit's gradient is reduced with a collective matched across "
               "ranks in call order, so every rank must run the same units in the same order "
               "before every synced backward: call every MoE expert on every rank (one that no "
               "token was routed to on an empty batch: its gradient is zeros, which DDP would "
               "sum in too), and take a branch on every rank or on none")
        raise RankFailureError(msg)

    def _diverged(self, store, r: int, no_grad: bool) -> None:
        msg = (f"tierlift.zero: rank {self.me} is starting a backward after its forward "
               f"{self.count} ({'with' if no_grad else 'without'} grad), but rank {r} ran its "
               f"forward {self.count} {'without' if no_grad else 'with'} grad: a forward (an "
               "eval under torch.no_grad(), say) ran on some ranks only. At stage 3 every "
               "forward gathers the weights with collectives, so every rank must run the same "
               "forwards in the same order: run the eval on every rank (each on its own part "
               "of the data), or use tierlift.zero.full_state_dict for a rank-0-only model")
        try:  # the other ranks' checks and failed collectives name it too
            store.set(f"{self.ns}diverged", msg)
        except RuntimeError:
            pass
        raise RankFailureError(msg)

    def _callers(self, store, index: int) -> dict[int, tuple[str, int]]:
        """{rank: (name, forward count)} of the ranks that entered named call `index`."""
        out = {}
        for r in self.ranks:
            key = f"{self.ns}call/{index}/{r}"
            if store.check([key]):
                name, _, at = store.get(key).decode().rpartition("@")
                out[r] = (name, int(at))
        return out

    def collective(self, name: str, timeout: timedelta | None = None) -> None:
        """Entering named collective `name`: returns once every rank has entered the same
        call; raises RankFailureError, naming it, when another rank skipped it or entered
        another one."""
        store = self.store
        if store is None:
            return
        index, self.calls = self.calls, self.calls + 1
        limit = (timeout or dist.default_pg_timeout).total_seconds()
        deadline = time.monotonic() + limit
        head = (f"tierlift.zero: rank {self.me} called {name}, a collective that every rank "
                "must call")
        try:
            store.set(f"{self.ns}call/{index}/{self.me}", f"{name}@{self.count}")
            store.set(f"{self.ns}call/{index}", "1")
            keys = [f"{self.ns}call/{index}/{r}" for r in self.ranks]
            pause = 0.001
            while not store.check(keys):
                for r, key in zip(self.ranks, keys):
                    if r == self.me or store.check([key]):
                        continue
                    beat = self._read(store, f"{self.ns}beat/{r}") or 0
                    if beat > self.count:  # it started a forward after this call's place
                        raise RankFailureError(f"{head}, but rank {r} went on to forward step "
                                               f"{beat} without it: {_every_rank(name)}")
                if time.monotonic() > deadline:
                    missing = [r for r, k in zip(self.ranks, keys) if not store.check([k])]
                    raise RankFailureError(f"{head}; rank {missing} did not call it within "
                                           f"{limit:.0f} s")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            others = {r: v for r, v in self._callers(store, index).items() if v[0] != name}
        except RankFailureError:
            raise
        except RuntimeError as exc:
            raise self.explain(exc) from exc
        if others:
            r, (other, _) = next(iter(others.items()))
            raise RankFailureError(f"{head}, but rank {r} called {other} at that point: every "
                                   "rank must make the same collective calls in the same order")

    @staticmethod
    def _read(store, key: str) -> int | None:
        if not store.check([key]):
            return None
        return int(store.get(key))

    def explain(self, exc: Exception) -> Exception:
        head = f"tierlift.zero: a collective failed on rank {self.me} in forward step {self.count}"
        store = self.store
        if store is None:
            return RankFailureError(f"{head} ({exc}); no c10d store to find the culprit")
        try:
            store.set(f"{self.ns}failed/{self.me}", str(self.count))
            deadline = time.monotonic() + self.settle_s
            silent: list[int] = []
            while True:
                silent = []
                for r in self.ranks:
                    if r == self.me or self._read(store, f"{self.ns}failed/{r}") is not None:
                        continue
                    beat = self._read(store, f"{self.ns}beat/{r}") or 0
                    if beat <= self.count:
                        silent.append(r)
                if not silent or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception as store_exc:  # noqa: BLE001 - the store's host may be the dead rank
            return RankFailureError(f"{head} ({exc}); the c10d store is unreachable too "
                                    f"({store_exc}): the rank hosting it (rank 0 unless "
                                    "torchrun hosts it) probably died")
        try:
            calls = self._callers(store, self.calls)
            diverged = store.get(f"{self.ns}diverged").decode() \
                if store.check([f"{self.ns}diverged"]) else None
        except Exception:  # noqa: BLE001 - only makes the message better
            calls, diverged = {}, None
        if diverged:
            return RankFailureError(f"{head}: {diverged}. Cause: {exc}")
        calls.pop(self.me, None)
        if calls:
            r, (name, _) = next(iter(calls.items()))
            return RankFailureError(f"{head}: rank {r} called {name}, a collective that every "
                                    f"rank must call, and rank {self.me} did not: "
                                    f"{_every_rank(name)}. Cause: {exc}")
        if silent:
            who = ", ".join(str(r) for r in silent)
            return RankFailureError(f"{head}: rank {who} stopped answering (died or hung; "
                                    f"the others timed out or lost the connection). Cause: {exc}")
        return RankFailureError(f"{head} and on every other rank too ({exc})")
