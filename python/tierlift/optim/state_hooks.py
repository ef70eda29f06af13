"""torch.optim.Optimizer's state-dict hooks, run by tierlift's Adam where torch's own
state_dict()/load_state_dict() would run them at the wrong moment for an offloaded state, and
optimizer.state's entries under offload (their moments live in the offload tiers).

torch runs load pre-hooks on the dict it is given and uses what they return; its post-hooks
after the state is in place. Our load reads the dict again after torch's (the moments in their
own dtype, the offloaded state into its tiers), so the hooks run here, once, around all of it,
and torch's own run of them is suppressed. state_dict() likewise under offload: the post-hooks
see the returned dict with the moments read back from the tiers."""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict, defaultdict

import torch

from tierlift.offload.checks import TIER_KEYS
from tierlift.offload.tier_values import TierValue

_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
          "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


@contextlib.contextmanager
def torch_hooks_off(opt):
    """torch's state_dict()/load_state_dict() called inside run none of the optimizer's
    state-dict hooks (the caller runs them)."""
    saved = {name: opt.__dict__.get(name) for name in _HOOKS}
    for name in _HOOKS:
        opt.__dict__[name] = OrderedDict()
    try:
        yield
    finally:
        for name, hooks in saved.items():
            if hooks is None:
                opt.__dict__.pop(name, None)
            else:
                opt.__dict__[name] = hooks


def _hooks(opt, name: str):
    return list(getattr(opt, name, {}).values())


def load_pre_hooks(opt, state_dict: dict) -> dict:
    """The dict to load: torch's shallow copy of `state_dict`, passed through each load pre-hook
    (one that returns a dict replaces it)."""
    state_dict = state_dict.copy()
    for hook in _hooks(opt, "_optimizer_load_state_dict_pre_hooks"):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_post_hooks(opt) -> None:
    for hook in _hooks(opt, "_optimizer_load_state_dict_post_hooks"):
        hook(opt)


def state_dict_pre_hooks(opt) -> None:
    for hook in _hooks(opt, "_optimizer_state_dict_pre_hooks"):
        hook(opt)


def state_dict_post_hooks(opt, state_dict: dict) -> dict:
    for hook in _hooks(opt, "_optimizer_state_dict_post_hooks"):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


class TierState(dict):
    """optimizer.state[p] of an offloaded optimizer: a dict that holds "step" and, as a mapping,
    also the moments the tiers hold, before "step" and under torch's names, read when used and
    never changed in place (offload/tier_values.py). Keys, iteration, `in`, len(), get(),
    state[p][name], items() and values() all see them, so that a loop over the keys or the
    items neither reads nor resets the step count alone, and code that reads a moment by name
    reads the tiers' value as torch's AdamW would give it. What the dict itself holds is what
    dict.__iter__, dict.__contains__ and dict.items() give (what tierlift's own code reads)."""

    _owner = None  # weakref to the Offloader
    _param = None  # weakref to p

    def bind(self, owner, p) -> TierState:
        self._owner, self._param = weakref.ref(owner), weakref.ref(p)
        return self

    def _moments(self) -> dict:
        """{name: TierValue} of the moments the tiers hold and the dict does not."""
        if not dict.__contains__(self, "step"):  # not stepped: no moments (and no recursion)
            return {}
        owner = self._owner() if self._owner is not None else None
        p = self._param() if self._param is not None else None
        if owner is None or p is None:
            return {}
        return {k: v for k, v in owner.tier_values(p).items() if not dict.__contains__(self, k)}

    def _all(self) -> dict:
        return {**self._moments(), **dict(dict.items(self))}

    def keys(self):
        return self._all().keys()

    def items(self):
        return list(self._all().items())  # moments before the step

    def values(self):
        return list(self._all().values())

    def __iter__(self):
        return iter(list(self._all()))

    def __len__(self):
        return dict.__len__(self) + len(self._moments())

    def __bool__(self):  # moments only beside a step count: no tiers read
        return dict.__len__(self) > 0

    def __contains__(self, key):
        return dict.__contains__(self, key) or key in self._moments()

    def get(self, key, default=None):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self._moments().get(key, default)

    def setdefault(self, key, default=None):
        if key in self:
            return self[key]
        self[key] = default
        return default

    def copy(self) -> dict:  # a plain dict, moments included, as a copy of torch's holds them
        return dict(self.items())

    def _refuse_removal(self, key) -> None:
        value = self._moments().get(key)
        if value is not None:
            raise RuntimeError(value.refusal())

    def __delitem__(self, key):
        self._refuse_removal(key)
        super().__delitem__(key)

    def pop(self, key, *default):
        self._refuse_removal(key)
        return super().pop(key, *default)

    def popitem(self):
        moments = self._moments()
        if moments:  # torch's would remove a moment (the last one in), ours only the step
            raise RuntimeError(next(iter(moments.values())).refusal())
        return super().popitem()

    def __reduce__(self):  # copied or pickled: a plain dict, moments read (as torch's hold them)
        return dict, (dict(self.items()),)

    def _put_back(self, key, value) -> bool:
        """Whether `value` is this entry's own TierValue for `key` (a framework's loop moving
        the state puts it back): the tiers keep it."""
        return isinstance(value, TierValue) and self._param is not None and \
            value.bound(self._owner(), self._param(), key)

    def __setitem__(self, key, value):
        if self._put_back(key, value):
            return
        # another value for a moment the tiers hold: torch's reset loop `state[k] =
        # zeros_like(state[k])` would go on to zero the step count, which the next step's
        # refusal of the written moment could not put back
        if key != "step":
            self._refuse_removal(key)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        # as __setitem__ for each, all refused before any is put in: torch's reset
        # `state.update({k: zeros_like(v) ...})` would change the step count with them
        new = dict(*args, **kwargs)
        for key, value in new.items():
            if key != "step" and not self._put_back(key, value):
                self._refuse_removal(key)
        for key, value in new.items():
            self[key] = value

    def __missing__(self, key):
        moment = self._moments().get(key)
        if moment is not None:
            return moment
        if key in TIER_KEYS:  # held by the offload tiers instead, or none yet
            raise KeyError(
                f"{key!r}: an offloaded optimizer keeps its moments and master weights in the "
                "offload tiers, not in optimizer.state[p]; its moments read by name are those "
                "of a parameter that has stepped (this one has none, or this optimizer does "
                "not keep that moment); the master weights are read from "
                "optimizer.state_dict()['state']")
        raise KeyError(key)


class TierStates(defaultdict):
    """optimizer.state of an offloaded optimizer: TierState entries bound to their parameter
    (a new one on first access, as defaultdict(dict) makes one, or one put in)."""

    def __init__(self, owner, *args):
        super().__init__(TierState, *args)
        self.owner = weakref.ref(owner)

    def __setitem__(self, key, value):
        owner = self.owner()
        if owner is not None and isinstance(key, torch.Tensor):
            if type(value) is dict and any(isinstance(v, TierValue) for v in value.values()):
                # rebuilt from this state's items (a framework moving it): the moments stay
                # in the tiers, and the new entry yields them again
                value = TierState({k: v for k, v in value.items()
                                   if not (isinstance(v, TierValue) and v.bound(owner, key, k))})
            if isinstance(value, TierState):
                value.bind(owner, key)
        super().__setitem__(key, value)

    def __reduce__(self):  # a plain defaultdict when copied or pickled
        return defaultdict, (dict, dict(self))

    def copy(self) -> defaultdict:  # defaultdict's would call TierStates(factory, self)
        return defaultdict(dict, self)

    __copy__ = copy


def tier_states(state, owner) -> TierStates:
    """`state` (optimizer.state) with TierState entries bound to Offloader `owner`, the same
    mapping otherwise; entries already TierState are kept as they are (a reference a user holds
    stays live)."""
    out = TierStates(owner)
    for k, v in state.items():
        out[k] = v if isinstance(v, TierState) or not isinstance(v, dict) else TierState(v)
    return out
