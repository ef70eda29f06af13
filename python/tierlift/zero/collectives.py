"""Hand-written c10d calls on the parameters or gradients of a sharded model: refused before
anything is sent.

After tierlift.zero.shard() model.parameters() yields one flat shard per unit, and each rank of
the model's process group holds a different slice of the same size. Scripts written for an
unsharded model (PyTorch's "Writing Distributed Applications" tutorial, Horovod-style code,
research repos) move parameters and gradients with c10d calls themselves; on shards every such
line mixes slices, silently:

- `dist.broadcast(p.data, 0)` "so every rank starts from rank 0's weights" copies rank 0's
  slice over every other rank's slice (as torch.distributed._broadcast_coalesced, under DDP's
  _sync_module_states, would);
- `dist.all_reduce(p.data); p.data /= world` (model averaging, local SGD) averages different
  slices;
- the tutorial's average_gradients, `dist.all_reduce(p.grad.data); p.grad.data /= world`
  after backward, sums different slices (gradients tierlift has already averaged).

Every process group gets a pre-hook (ProcessGroup.register_pre_hook, at the first shard() and
on each group made after it), which torch calls before it issues any collective through the
group, whatever the call's Python path: `dist.all_reduce`, a name imported before tierlift
(`from torch.distributed import all_reduce`), torch.distributed.distributed_c10d's names, the
group's own methods (`group.allreduce([t])`) and the in-place functional ops
(torch.ops._c10d_functional.all_reduce_). A tensor that is a shard, its gradient, or a view of
their storage, given in a role where the call reduces it or writes into it, is refused when the
call's group holds another rank of the shard's own group. Ranks of other groups hold the same
slice of their own copy (a model sharded over a subgroup, one copy per group), so a call over
one rank of each group (local SGD across the groups) is what it says and goes through. Every
rank makes the same call with its own shard and refuses on its own, before the collective is
issued: no rank is left waiting, nothing changed. Roles that only hand out this rank's slice
(all_gather's and gather's input, send, all_to_all's inputs, scatter's source list) go through:
they send what they say (the slices, not the weights).

The out-of-place functional collectives (torch.distributed._functional_collectives.all_reduce,
torch.distributed.nn.functional.all_reduce, ...) reduce a copy of their input, which the
pre-hook cannot tell from any other tensor: their module functions are wrapped and check the
input (covered when looked up on the module at the call; a name imported from them before the
first shard() is not). batch_isend_irecv is wrapped too, so that a receive into a shard
anywhere in the batch is refused before any of its sends goes, and
torch.distributed._broadcast_coalesced (DDP's _sync_module_states), which broadcasts a
flattened copy. tierlift's own collectives run with comm.OWN set and are not checked. Not
seen: copies (parameters_to_vector(model.parameters()), a flattened bucket of gradients,
all-reduced, hold no storage of a shard), objects (broadcast_object_list: the pickled state dict
a load then refuses, guards.py), and a backend called directly (group._get_backend(device)).

Where torch has no process-group pre-hooks (an older torch), torch.distributed's functions are
wrapped instead (calls looked up as `dist.<name>` after the first shard()). Under torch.compile
the wrappers' check is skipped (dynamo traces torch's own collective, rewritten into a
functional one on a copy, which the pre-hook does not see either): a hand-written call inside
a compiled function is not checked.

A receive into a shard (recv, irecv, an irecv P2POp) is refused when the sender is another rank
of the shard's group; the send itself goes through (this rank's slice, into whatever the peer
gives), so where only the receiving side refuses, the sender's send waits for it (gloo's
timeout): a weight sync by hand with send/recv is refused on the receivers.

Cost (measured on this CPU, a 1-element all_reduce over a gloo group of one rank, ~11 us
without the hook): before the first shard() nothing; after it, with no sharded model alive,
~0.2 us per call (torch hands the hook its arguments); with a model of 64 units alive, ~1.4 us
(a storage-address lookup per tensor given, in a table of the shards' and their gradients'
storages rebuilt when a model is sharded and after zero_grad; the operation's name is read only
for a shard). A 1-D tensor of a shard's size, or a view of one, not in the table (a gradient
newer than it, or set by hand) is compared with that size's units directly (~0.7 us per unit).
"""

from __future__ import annotations

import atexit
import itertools
import weakref

import torch

from tierlift._torch_patch import wrap_method
from tierlift.zero import comm, members

# name: (torch's parameter names, the arguments to check and how: "one" tensor, a "list", a
# "lists" of lists, "ops" of batch_isend_irecv; the process group argument; the peer
# arguments of a point-to-point receive). torch.distributed's functions, wrapped only where
# torch has no process-group pre-hooks (_ISSUED covers them).
_CHECKED = {
    "broadcast": (["tensor", "src", "group", "async_op", "group_src"],
                  {"tensor": "one"}, "group", None),
    "all_reduce": (["tensor", "op", "group", "async_op"], {"tensor": "one"}, "group", None),
    "reduce": (["tensor", "dst", "op", "group", "async_op", "group_dst"],
               {"tensor": "one"}, "group", None),
    "all_gather": (["tensor_list", "tensor", "group", "async_op"],
                   {"tensor_list": "list"}, "group", None),
    "all_gather_into_tensor": (["output_tensor", "input_tensor", "group", "async_op"],
                               {"output_tensor": "one"}, "group", None),
    "_all_gather_base": (["output_tensor", "input_tensor", "group", "async_op"],
                         {"output_tensor": "one"}, "group", None),
    "reduce_scatter": (["output", "input_list", "op", "group", "async_op"],
                       {"output": "one", "input_list": "list"}, "group", None),
    "reduce_scatter_tensor": (["output", "input", "op", "group", "async_op"],
                              {"output": "one", "input": "one"}, "group", None),
    "_reduce_scatter_base": (["output", "input", "op", "group", "async_op"],
                             {"output": "one", "input": "one"}, "group", None),
    "scatter": (["tensor", "scatter_list", "src", "group", "async_op", "group_src"],
                {"tensor": "one"}, "group", None),
    "gather": (["tensor", "gather_list", "dst", "group", "async_op", "group_dst"],
               {"gather_list": "list"}, "group", None),
    "all_to_all": (["output_tensor_list", "input_tensor_list", "group", "async_op"],
                   {"output_tensor_list": "list"}, "group", None),
    "all_to_all_single": (["output", "input", "output_split_sizes", "input_split_sizes",
                           "group", "async_op"], {"output": "one"}, "group", None),
    "all_reduce_coalesced": (["tensors", "op", "group", "async_op"],
                             {"tensors": "list"}, "group", None),
    "all_gather_coalesced": (["output_tensor_lists", "input_tensor_list", "group", "async_op"],
                             {"output_tensor_lists": "lists"}, "group", None),
    "recv": (["tensor", "src", "group", "tag", "group_src"], {"tensor": "one"}, "group",
             ("src", "group_src")),
    "irecv": (["tensor", "src", "group", "tag", "group_src"], {"tensor": "one"}, "group",
              ("src", "group_src")),
}
# Wrapped in any case: the pre-hook sees a batch's operations one by one, its sends first.
_BATCH = {"batch_isend_irecv": (["p2p_op_list"], {"p2p_op_list": "ops"}, None, None)}
# The out-of-place functional collectives reduce or broadcast a copy of their input, which the
# pre-hook cannot tell from any other tensor: the input is checked here. The others (gathers,
# all-to-alls) hand out this rank's slice; their in-place forms reach the pre-hook.
_FUNCOL = {
    "all_reduce": (["self", "reduceOp", "group", "tag"], {"self": "one"}, "group", None),
    "all_reduce_coalesced": (["self", "reduceOp", "group", "tag"], {"self": "list"}, "group",
                             None),
    "reduce_scatter_tensor": (["self", "reduceOp", "scatter_dim", "group", "tag"],
                              {"self": "one"}, "group", None),
    "reduce_scatter_tensor_autograd": (["self", "reduceOp", "scatter_dim", "group", "tag"],
                                       {"self": "one"}, "group", None),
    "reduce_scatter_tensor_coalesced": (["inputs", "reduceOp", "scatter_dim", "group", "tag"],
                                        {"inputs": "list"}, "group", None),
    "reduce_scatter_single": (["self", "reduceOp", "scatter_dim", "group", "tag"],
                              {"self": "one"}, "group", None),
    "reduce_scatter_single_autograd": (["self", "reduceOp", "scatter_dim", "group", "tag"],
                                       {"self": "one"}, "group", None),
    "reduce_scatter_single_coalesced": (["inputs", "reduceOp", "scatter_dim", "group", "tag"],
                                        {"inputs": "list"}, "group", None),
    "broadcast": (["self", "src", "group", "tag"], {"self": "one"}, "group", None),
    # torch.distributed's calls as dynamo rewrites them: a copy_ into the output
    "all_gather_tensor_inplace": (["output_tensor", "input_tensor", "group", "async_op", "tag",
                                   "gather_dim"], {"output_tensor": "one"}, "group", None),
    "all_gather_inplace": (["tensor_list", "tensor", "group", "async_op", "tag"],
                           {"tensor_list": "list"}, "group", None),
    "reduce_scatter_tensor_inplace": (["output", "input", "op", "group", "async_op",
                                       "scatter_dim", "tag"], {"output": "one", "input": "one"},
                                      "group", None),
    "reduce_scatter_inplace": (["output", "input_list", "op", "group", "async_op", "tag"],
                               {"output": "one", "input_list": "list"}, "group", None),
    "all_to_all_inplace": (["output", "input", "output_split_sizes", "input_split_sizes",
                            "group", "async_op", "tag"], {"output": "one"}, "group", None),
}
_NN_FUNCTIONAL = {  # torch.distributed.nn.functional: these clone the input first
    "all_reduce": (["tensor", "op", "group"], {"tensor": "one"}, "group", None),
    "reduce": (["tensor", "dst", "op", "group"], {"tensor": "one"}, "group", None),
    "broadcast": (["tensor", "src", "group"], {"tensor": "one"}, "group", None),
}
# HookOpName: (torch.distributed's name, the role of the input tensors when the call reduces
# them or writes into them, that of the output tensors). The other roles (send's, the inputs of
# gathers, scatters and all-to-alls) hand out this rank's slice.
_ISSUED = {
    "ALLREDUCE": ("all_reduce", "tensor", None),
    "ALLREDUCE_COALESCED": ("all_reduce_coalesced", "tensors", None),
    "BROADCAST": ("broadcast", "tensor", None),
    "REDUCE": ("reduce", "tensor", None),
    "ALLGATHER": ("all_gather", None, "tensor_list"),
    "ALLGATHER_BASE": ("all_gather_into_tensor", None, "output_tensor"),
    "ALLGATHER_COALESCED": ("all_gather_coalesced", None, "output_tensor_lists"),
    "ALLGATHER_INTO_TENSOR_COALESCED": ("all_gather_into_tensor", None, "output_tensor"),
    "REDUCE_SCATTER": ("reduce_scatter", "input_list", "output"),
    "REDUCE_SCATTER_BASE": ("reduce_scatter_tensor", "input", "output"),
    "REDUCE_SCATTER_TENSOR_COALESCED": ("reduce_scatter_tensor", "input", "output"),
    "SCATTER": ("scatter", None, "tensor"),
    "GATHER": ("gather", None, "gather_list"),
    "ALLTOALL": ("all_to_all", None, "output_tensor_list"),
    "ALLTOALL_BASE": ("all_to_all_single", None, "output"),
    "RECV": ("recv", None, "tensor"),
}
# Calls that put another rank's data over the tensor (the others sum or gather into it).
_OVERWRITES = {"broadcast", "scatter", "recv", "irecv", "batch_isend_irecv",
               "_broadcast_coalesced", "_functional_collectives.broadcast",
               "nn.functional.broadcast"}
_HOOK_ID = 0x74696572  # one id: registering again replaces the hook


def _address(t: torch.Tensor) -> int | None:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes from the first element of `a` to its numel-th overlap those of `b`."""
    sa, sb = a.data_ptr(), b.data_ptr()
    return sa < sb + max(b.numel(), 1) * b.element_size() and \
        sb < sa + max(a.numel(), 1) * a.element_size()


class _Table:
    """Which shard or shard gradient a tensor shares its storage with: a table of their storage
    addresses (the shards' are stable; gradients are new tensors every step, so an entry is
    checked against the shard before it counts), rebuilt when a model is sharded and after a
    zero_grad, and the units of each size: a tensor of a shard's size, or a view of one (or of
    a unit's whole flat buffer, which a stage-1 gradient is a slice of), not in the table (a
    gradient newer than the table, or set by hand) is compared with those units' shards and
    gradients directly. Several shards may share one storage (an offloaded model's host arena):
    the one the tensor overlaps is named."""

    def __init__(self):
        # (key, storage address -> [(weak state, unit index)], shard or padded numel -> the
        # same): one tuple, replaced whole, so that a thread checking a call while another
        # rebuilds it (a background save's vote) reads a finished table, never a half-filled one
        self.snapshot: tuple = (None, {}, {})
        self.forgets = 0  # bumped by forget(): the key's second half

    def rebuild(self) -> tuple:
        # the key read first: a shard() or zero_grad during the rebuild makes it stale again
        key = (members.GENERATION[0], self.forgets)
        where: dict[int, list] = {}
        by_numel: dict[int, list] = {}
        for state in members.live_states():
            ref = weakref.ref(state)
            for i, u in enumerate(state.units):
                for n in {u.shard_numel, u.padded}:
                    by_numel.setdefault(n, []).append((ref, i))
                for t in (u.shard, u.shard.grad):
                    ptr = None if t is None else _address(t)
                    if ptr is not None and (ref, i) not in where.get(ptr, ()):
                        where.setdefault(ptr, []).append((ref, i))
        self.snapshot = (key, where, by_numel)
        return self.snapshot

    def find(self, t: torch.Tensor):
        """(state, unit index, "weights" or "gradient") when `t` shares the storage of a
        shard or its gradient, else None."""
        snapshot = self.snapshot
        if snapshot[0] != (members.GENERATION[0], self.forgets):
            snapshot = self.rebuild()
        ptr = _address(t)
        if ptr is None:
            return None
        hit = self._lookup(snapshot[1], ptr, t)
        whole = t if t._base is None else t._base
        by_numel = snapshot[2]
        if hit is None and whole.dim() == 1 and whole.numel() in by_numel:
            hit = _among(by_numel[whole.numel()], ptr, t)
        return hit

    def _lookup(self, where: dict, ptr: int, t: torch.Tensor):
        entries = where.get(ptr)
        if entries is None:
            return None
        hit = _among(entries, ptr, t)
        if hit is None:  # a dropped model or gradient: its storage may be another tensor's now
            hit = _among(self.rebuild()[1].get(ptr, []), ptr, t)
        return hit


def _among(units: list, ptr: int, t: torch.Tensor):
    """The first of `units` whose shard or gradient `t` overlaps, else the first whose shard or
    gradient has storage `ptr` (as a stage 1/2 module attribute has its shard's), else None."""
    first = None
    for ref, i in units:
        state = ref()
        if state is None:
            continue
        shard = state.units[i].shard
        for kind, x in (("weights", shard), ("gradient", shard.grad)):
            if x is None or _address(x) != ptr:
                continue
            if _overlap(x, t):
                return state, i, kind
            first = first or (state, i, kind)
    return first


_TABLE = _Table()
_FORGETS = itertools.count(1)


def forget() -> None:
    """The gradients may be other tensors from here on (zero_grad): the table is rebuilt at the
    next check."""
    _TABLE.forgets = next(_FORGETS)  # atomic, unlike +=, where two threads forget at once


def _ranks(group) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _funcol_ranks(group, tag) -> list[int]:
    """The ranks of a functional collective's group (a group, a list of ranks, a mesh...)."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    if group is None:  # the in-place forms' default
        return _ranks(None)
    name = funcol._resolve_group_name(group, tag or "")
    return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))


def _peer(group, src, group_src) -> int | None:
    import torch.distributed as dist

    if src is not None:
        return src
    if group_src is not None:
        return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_src)
    return None


def _mixes(state, ranks, peer, p2p: bool) -> bool:
    """Whether the call's ranks (`ranks()`) include another rank of the shard's own group (a
    different slice); `peer` for a receive (None: any source)."""
    import torch.distributed as dist

    own = set(_ranks(state.comm.group)) if state.comm.initialized else set()
    me = dist.get_rank()
    own.discard(me)
    if not own:
        return False
    if p2p:
        return peer is None or peer in own
    return bool(own & set(ranks()))


def _tensors(kind: str, value):
    if value is None:
        return []
    if kind == "one":
        return [value]
    if kind == "list":
        return list(value)
    if kind == "lists":
        return [t for inner in value for t in inner]
    return []


def _refuse(name: str, arg: str, state, index: int, what: str) -> None:
    unit = state.units[index]
    root = state.root
    shard_name = next((n for n, p in root.named_parameters() if p is unit.shard), None) \
        if root is not None else None
    shown = f"{shard_name!r}, " if shard_name else ""
    head = (f"torch.distributed.{name} was given ({arg}) the {what} of {shown}unit "
            f"{unit.name!r} of a model sharded by tierlift.zero.shard: each rank of the model's "
            f"process group holds a different slice of it ({unit.shard_numel} of the unit's "
            f"{unit.numel} elements), so this call would ")
    if what == "gradient":
        raise RuntimeError(
            head + "sum or copy different slices. The gradients are already averaged over the "
            "model's ranks by tierlift.zero during backward (each rank's shard gradient is the "
            "average of its slice, as DDP's): drop the hand-written averaging (an "
            "average_gradients(model) after backward) and step. Nothing was sent or changed")
    if name in _OVERWRITES:
        raise RuntimeError(
            head + "copy another rank's slice over this rank's. Every rank already starts from "
            "the same weights: shard() compares a fingerprint of every parameter over the ranks "
            "and refuses weights that differ; to start from rank 0's, broadcast before "
            "tierlift.zero.shard(model) (or load the same state dict on every rank). Nothing "
            "was sent or changed")
    raise RuntimeError(
        head + "write other slices (or their sum) into this rank's. The ranks of the model's "
        "process group train one model together: there is nothing to average between them. "
        "For the full weights use tierlift.zero.full_state_dict(model) (every rank) or `with "
        "tierlift.zero.gathered(model): ...`; to average the copies of several groups (each "
        "sharding its own copy), run the call over a group holding one rank of each: those hold "
        "the same slice. Nothing was sent or changed")


def _check(name: str, spec, group_ranks, args, kwargs) -> None:
    """Refuses a call of `name` (spec: an entry of the tables above) on a shard;
    group_ranks(arg) gives the ranks of its group from its arguments (`arg(name)`)."""
    params, checked, group_arg, peers = spec

    def arg(n):
        i = params.index(n)
        return args[i] if i < len(args) else kwargs.get(n)

    for n, kind in checked.items():
        if kind == "ops":
            import torch.distributed as dist

            irecv = getattr(dist.irecv, "__wrapped__", dist.irecv)
            for op in arg(n) or []:
                fn = getattr(op.op, "__wrapped__", op.op)
                if fn is not irecv:
                    continue
                hit = _TABLE.find(op.tensor)
                if hit is not None and _mixes(hit[0], None, op.peer, p2p=True):
                    _refuse(name, "P2POp(irecv, tensor)", *hit)
            continue
        for t in _tensors(kind, arg(n)):
            if not isinstance(t, torch.Tensor):
                continue
            hit = _TABLE.find(t)
            if hit is None:
                continue
            peer = _peer(arg(group_arg), arg(peers[0]), arg(peers[1])) if peers else None
            if _mixes(hit[0], lambda: group_ranks(arg), peer, p2p=peers is not None):
                _refuse(name, n, *hit)


def _checking(name: str, spec, group_ranks):
    def wrap(original):
        def collective(*args, **kwargs):
            # .data: a WeakSet's own truth test is a Python-level __len__
            if members.STATES.data and not torch.compiler.is_compiling():
                _check(name, spec, group_ranks, args, kwargs)
            return original(*args, **kwargs)

        return collective

    return wrap


def _pre_hook(group_name: str):
    """The check torch runs before it issues a collective through the group named
    `group_name`: it holds the name, not the group, so the group can still be freed."""
    ranks: list = []  # the group's global ranks, looked up at the first shard given

    def group_ranks() -> list:
        if not ranks:
            import torch.distributed as dist

            group = dist.distributed_c10d._resolve_process_group(group_name)
            ranks[:] = dist.get_process_group_ranks(group)  # whole: two threads may ask
        return ranks

    def pre_hook(issued) -> None:
        if not members.STATES.data or comm.OWN.issuing:
            return
        # the tensors first, the operation only for a shard: its name costs more than a lookup
        for t in issued.output_tensors:
            hit = _TABLE.find(t)
            if hit is not None:
                _check_issued(issued, "output", hit, group_ranks)
        for t in issued.input_tensors:
            hit = _TABLE.find(t)
            if hit is not None:
                _check_issued(issued, "input", hit, group_ranks)

    return pre_hook


_ISSUED_BY_OP: dict = {}  # HookOpName -> _ISSUED's entry, filled by install()


def _check_issued(issued, side: str, hit, group_ranks) -> None:
    """Refuses the collective `issued` when it reduces or writes into the shard (or gradient)
    `hit` it was given on `side` ("input" or "output") and its group mixes slices."""
    roles = _ISSUED_BY_OP.get(issued.name)
    if roles is None:
        return
    name, input_role, output_role = roles
    role = input_role if side == "input" else output_role
    if role is None:  # this rank's slice handed out
        return
    p2p = name == "recv"
    peer = group_ranks()[issued.root] if p2p and issued.root >= 0 else None
    if _mixes(hit[0], group_ranks, peer, p2p):
        _refuse(name, role, *hit)


def _hook(group) -> None:
    group.register_pre_hook(_HOOK_ID, _pre_hook(group.group_name))


_EXIT_UNHOOK_IDS: set[int] = set()


def unhook_at_exit(hook_id: int) -> None:
    """A group the script never destroyed is freed by torch's C++ group registry after Python
    has gone, and freeing a Python pre-hook then crashes the process (SIGSEGV at exit, after
    the work succeeded: torchrun reports the run failed): the hooks of `hook_id` are dropped
    from every live group at exit first."""
    if not _EXIT_UNHOOK_IDS:
        atexit.register(_unhook_all)
    _EXIT_UNHOOK_IDS.add(hook_id)


def _unhook_all() -> None:
    import torch.distributed as dist

    for group in list(dist.distributed_c10d._world.pg_map):
        for hook_id in _EXIT_UNHOOK_IDS:
            group.unregister_pre_hook(hook_id)


def _hooking_new_groups(original):
    # every group torch makes (new_group, split_group, a device mesh's) is registered here
    def register(pg, *args, **kwargs):
        original(pg, *args, **kwargs)
        _hook(pg)

    return register


def _broadcast_coalesced(original):
    # A builtin (no signature): (process_group, tensors, buffer_size, src), positional.
    def _broadcast_coalesced(*args, **kwargs):
        if members.STATES.data and not torch.compiler.is_compiling():
            group = args[0] if args else kwargs.get("process_group")
            tensors = args[1] if len(args) > 1 else kwargs.get("tensors", ())
            for t in tensors:
                hit = _TABLE.find(t) if isinstance(t, torch.Tensor) else None
                if hit is not None and _mixes(hit[0], lambda: _ranks(group), None, p2p=False):
                    _refuse("_broadcast_coalesced", "tensors", *hit)
        return original(*args, **kwargs)

    return _broadcast_coalesced


def _p2p_op_check(original):
    # P2POp(dist.irecv, ...) checks that op is torch's isend or irecv: the wrapped irecv is.
    def _check_op(op):
        return original(op.__wrapped__ if getattr(op, "_tierlift_wrapped", False) else op)

    return _check_op


def _dist_ranks(spec):
    group_arg = spec[2]
    return lambda arg: _ranks(arg(group_arg) if group_arg else None)


def _wrap_all(module, prefix: str, table: dict, group_ranks) -> None:
    for name, spec in table.items():
        wrap_method(module, name, spec[0], _checking(prefix + name, spec, group_ranks(spec)))


def _wrap_torch_names(dist) -> None:
    wrap_method(dist.distributed_c10d, "_check_op", ["op"], _p2p_op_check)
    _wrap_all(dist, "", _CHECKED, _dist_ranks)


_REGISTER_PARAMS = ["pg", "backend_name", "store", "group_name", "backend_config",
                    "rank_mapping", "pg_tag", "user_tag", "add_to_default_tag"]


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py); hooks the process groups made so far."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.nn import functional as nn_functional

    c10d = dist.distributed_c10d
    _wrap_all(dist, "", _BATCH, _dist_ranks)
    _wrap_all(funcol, "_functional_collectives.", _FUNCOL,
              lambda spec: lambda arg: _funcol_ranks(arg("group"), arg("tag")))
    _wrap_all(nn_functional, "nn.functional.", _NN_FUNCTIONAL, _dist_ranks)
    wrap_method(dist, "_broadcast_coalesced", None, _broadcast_coalesced)  # a builtin
    hook_op = getattr(torch._C._distributed_c10d, "HookOpName", None)
    if hook_op is None or not hasattr(c10d.ProcessGroup, "register_pre_hook"):
        _wrap_torch_names(dist)
        return
    _ISSUED_BY_OP.update({getattr(hook_op, k): v for k, v in _ISSUED.items()
                          if hasattr(hook_op, k)})
    wrap_method(c10d, "_register_pg_in_world", _REGISTER_PARAMS, _hooking_new_groups)
    unhook_at_exit(_HOOK_ID)
    if not getattr(c10d._register_pg_in_world, "_tierlift_wrapped", False):
        # groups made from here on would go unhooked: torch.distributed's names checked too
        _wrap_torch_names(dist)
    for group in list(c10d._world.pg_map):
        _hook(group)
