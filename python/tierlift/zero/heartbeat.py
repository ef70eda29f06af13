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

The ranks' own c10d calls are agreed on too while a stage-3 model lives: see user_calls.py.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from tierlift.zero.comm import RankFailureError
from tierlift.zero.user_calls import GATHERING, UserCallAgreement, model_name

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


class Heartbeat(UserCallAgreement):
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
        self._init_user_calls(comm, also)
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
                    GATHERING.setdefault(group, weakref.WeakSet()).add(self)
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
        if self.gathers and sum(h.live() for h in GATHERING.get(self.group_ns, ())) > 1:
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
        models = sorted((h for h in GATHERING.get(self.group_ns, ())
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
               f"model {model_name(self.ns)}, but rank {r} started forward {count} of model "
               f"{model_name(other.ns)} instead (this rank ran {other.count} of those): a "
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
