"""tierlift.hf.Accelerator: accelerate.Accelerator for models sharded by tierlift.zero.shard.

    model = tierlift.zero.shard(model, stage=3)                # under torchrun
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)
    accelerator = tierlift.hf.Accelerator()                    # any accelerate.Accelerator args
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

Only methods are overridden, each for sharded models only (anything else goes to accelerate):
prepare_optimizer (a step GradScaler skipped counts as skipped, so schedulers hold),
prepare_model (no DistributedDataParallel: ZeRO reduces the gradients itself, and DDP's
constructor would broadcast rank 0's shards over the others'), no_sync (and so accumulate:
tierlift.zero.no_sync), clip_grad_norm_ (the global norm over the ranks), get_state_dict (the
full model, gathered unit by unit, on rank 0; save_model uses it), save_state / load_state
(the sharded model and its optimizer through tierlift.checkpoint, the rest as accelerate does;
their registered pre-hooks still see every model).
The class adds no state of its own, which is what lets tierlift.hf.Trainer adopt the
accelerator transformers.Trainer built (see Accelerator.adopt).
"""

from __future__ import annotations

import contextlib
import os
import re

import accelerate
import torch

import tierlift.checkpoint
from tierlift.hf import model as zmodel
from tierlift.zero.api import no_sync as zero_no_sync
from tierlift.zero.torch_calls import check_subset

# accelerate's own class, also once tierlift.hf.launch has put this one in its place.
_BASE = accelerate.Accelerator


def unwrap_optimizer(opt):
    """The optimizer inside accelerate's AcceleratedOptimizer (as many layers as there are)."""
    while isinstance(opt, accelerate.optimizer.AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def own_clipping(opt) -> float | None:
    """The max_grad_norm a tierlift optimizer clips with inside step() (offload=..., with
    max_grad_norm=...), else None."""
    off = getattr(unwrap_optimizer(opt), "_offload", None)
    return None if off is None else off.config.max_grad_norm


def checkpoint_dir(root: str, index: int) -> str:
    """Where save_state puts the tierlift checkpoint of the index-th prepared model."""
    return os.path.join(root, "tierlift_model" if index == 0 else f"tierlift_model_{index}")


class _AmpAwareOptimizer(accelerate.optimizer.AcceleratedOptimizer):
    """accelerate tells a step GradScaler skipped by whether the optimizer's step() ran; a
    tierlift optimizer's always runs (it unscales inside), so ask it. Without this the learning
    rate scheduler would advance on every inf/NaN step, unlike with torch's optimizers."""

    @property
    def step_was_skipped(self):
        inner = unwrap_optimizer(self)
        return self._is_overflow or bool(getattr(inner, "amp_skipped_last_step", False))


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator that trains tierlift.zero-sharded models (see the module doc)."""

    @classmethod
    def adopt(cls, accelerator: accelerate.Accelerator) -> Accelerator:
        """Turns an accelerate.Accelerator built elsewhere (by transformers.Trainer) into this
        class in place: the overrides below are methods only, so its state stays valid."""
        if not isinstance(accelerator, _BASE):
            raise TypeError(f"expected an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        if type(accelerator) not in (_BASE, cls):
            raise TypeError(f"the accelerator is a {type(accelerator).__name__}, a subclass of "
                            "accelerate.Accelerator that tierlift.hf cannot extend in place")
        accelerator.__class__ = cls
        return accelerator

    # ---- models and optimizers ----
    def prepare(self, *args, device_placement=None):
        models = [a for a in args if isinstance(a, torch.nn.Module)] + list(self._models)
        if any(zmodel.is_sharded(m) for m in models):
            # An optimizer built before shard() holds parameters the model no longer has: its
            # steps would change nothing the model uses. Refused before anything is prepared.
            owned = {id(p) for m in models for p in m.parameters()}
            for a in args:
                if isinstance(a, torch.optim.Optimizer) and any(
                        id(p) not in owned for g in unwrap_optimizer(a).param_groups
                        for p in g["params"]):
                    raise ValueError(
                        "the optimizer holds parameters that are not the sharded model's: "
                        "build it after tierlift.zero.shard(model, ...), from "
                        "model.parameters()")
        return super().prepare(*args, device_placement=device_placement)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is accelerate.optimizer.AcceleratedOptimizer:
            prepared.__class__ = _AmpAwareOptimizer  # a property only: its state stays valid
        return prepared

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if not zmodel.is_sharded(model):
            return super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=evaluation_mode)
        if self.distributed_type not in (accelerate.DistributedType.NO,
                                         accelerate.DistributedType.MULTI_CPU,
                                         accelerate.DistributedType.MULTI_GPU):
            raise ValueError(f"a model sharded by tierlift.zero.shard trains with plain "
                             f"torchrun processes; this accelerator is set up for "
                             f"{self.distributed_type} (drop its DeepSpeed / FSDP config)")
        zmodel.install(model)
        # evaluation_mode: autocast and torch.compile as configured, never a DDP wrap. The
        # shards stay where shard() put them (parameter offload keeps them in host memory).
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    @contextlib.contextmanager
    def no_sync(self, model):
        if zmodel.is_sharded(model):
            with zero_no_sync(zmodel._inner(model)):
                yield
            return
        with super().no_sync(model):
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The global norm of the gradients across ranks (sharded models' shards summed over
        their ranks), clipped to max_norm; max_norm=inf returns the norm only. With a tierlift
        optimizer that clips itself (max_grad_norm=...), the norm is returned and the
        optimizer does the scaling in step(), so the overlap's early steps stay valid."""
        params = list(parameters)
        if not params and any(zmodel.is_sharded(m) for m in self._models):
            # A submodule's parameters live in its unit's flat shard after shard(): its
            # .parameters(), or a filter by the original names, is empty, and would clip nothing.
            raise ValueError("clip_grad_norm_ was given no parameters, next to a model sharded by "
                             "tierlift.zero.shard, whose parameters are one flat shard per unit "
                             "(submodules inside a unit have none, names are the shards'): pass "
                             "model.parameters(), or shard with units= making the submodule a "
                             "unit of its own")
        if not any(zmodel.shard_owner(p) is not None for p in params):
            return super().clip_grad_norm_(params, max_norm, norm_type)
        # A submodule's shards lacking its parameters kept in an enclosing unit: refused
        # before unscaling changes any gradient.
        check_subset((o for o in map(zmodel.shard_owner, params) if o is not None),
                     "clip_grad_norm_", grads=True)
        self.unscale_gradients()
        scale = True
        ids = {id(p) for p in params}
        for opt in self._optimizers:
            own = own_clipping(opt)
            inner = unwrap_optimizer(opt)
            if own is None or not any(id(p) in ids for g in inner.param_groups
                                      for p in g["params"]):
                continue
            if float(max_norm) != float("inf") and float(max_norm) != float(own):
                raise ValueError(f"clip_grad_norm_(max_norm={max_norm}) and the optimizer's own "
                                 f"max_grad_norm={own} differ: give one of them (Trainer: "
                                 "max_grad_norm equal to the optimizer's, or 0)")
            scale = False
        return zmodel.clip_grad_norm_(params, max_norm, norm_type, scale=scale)

    # ---- full weights ----
    def get_state_dict(self, model, unwrap=True):
        """Sharded model: the full state dict, gathered unit by unit, on rank 0 (in host
        memory; {} on the other ranks). A collective: every rank calls it."""
        if zmodel.is_sharded(model):
            return zmodel.gathered_state_dict(model)
        return super().get_state_dict(model, unwrap=unwrap)

    # ---- checkpoints ----
    def _sharded_pairs(self) -> list[tuple[int, torch.nn.Module, object]]:
        """(index in _models, sharded model, its optimizer or None) for every sharded model."""
        out = []
        for i, m in enumerate(self._models):
            if not zmodel.is_sharded(m):
                continue
            opts = [o for o in self._optimizers
                    if any(zmodel.owns(m, p) for g in unwrap_optimizer(o).param_groups
                           for p in g["params"])]
            if len(opts) > 1:
                raise ValueError(f"prepared model {i} is stepped by {len(opts)} optimizers; "
                                 "tierlift.checkpoint saves a sharded model with one")
            out.append((i, m, opts[0] if opts else None))
        return out

    @contextlib.contextmanager
    def _without(self, pairs):
        """accelerate's own save/load sees the models and optimizers it can handle only."""
        models, opts = self._models, self._optimizers
        gone_m = {id(m) for _, m, _ in pairs}
        gone_o = {id(o) for _, _, o in pairs if o is not None}
        self._models = [m for m in models if id(m) not in gone_m]
        self._optimizers = [o for o in opts if id(o) not in gone_o]
        try:
            yield
        finally:
            self._models, self._optimizers = models, opts

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs):
        """accelerate's save_state; each sharded model and its optimizer go through
        tierlift.checkpoint.save into <dir>/tierlift_model[_i] (every rank writes its shards)."""
        pairs = self._sharded_pairs()
        if not pairs:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        # The hooks' wrappers take the model list before _without hides the sharded ones.
        with self._hooks_see_every_model(pairs, saving=True), self._without(pairs):
            location = super().save_state(output_dir, safe_serialization,
                                          **save_model_func_kwargs)
        for i, m, opt in pairs:
            tierlift.checkpoint.save(checkpoint_dir(location, i), zmodel._inner(m),
                                     None if opt is None else unwrap_optimizer(opt))
        return location

    @contextlib.contextmanager
    def _hooks_see_every_model(self, pairs, *, saving: bool):
        """register_save_state_pre_hook / register_load_state_pre_hook hooks (diffusers'
        scripts save each model with save_pretrained there, pop its weights, and load it back
        by position) get every prepared model, as with plain accelerate: the sharded ones too,
        in their places, although _without hides them from accelerate's own saving and
        loading. A save hook gets their full weights (gathered, a collective; rank 0 holds
        them). Without this a save hook saved nothing for them, and a load hook taking a model
        by position got the wrong one. What the hooks leave of the sharded models and their
        weights accelerate does not see: tierlift.checkpoint saves and loads them."""
        hooks = self._save_model_state_pre_hook if saving else self._load_model_state_pre_hook
        if not hooks:
            yield
            return
        models = list(self._models)
        sharded = {id(m): m for _, m, _ in pairs}
        if saving:  # the state dict each save hook sees in the sharded model's place
            sharded = {id(m): self.get_state_dict(m) for _, m, _ in pairs}
        hidden = {id(v) for v in sharded.values()}
        merged: list = []  # shared by every hook, so one hook's pops hold for the next
        built = []

        def wrap(hook):
            def call(*args):  # save: (models, weights, output_dir); load: (models, input_dir)
                seen = args[1] if saving else args[0]  # the list accelerate goes on with
                if not built:
                    plain = iter(seen)
                    merged.extend(sharded[id(m)] if id(m) in sharded else next(plain)
                                  for m in models)
                    built.append(True)
                if saving:
                    hook(list(models), merged, args[2])
                else:
                    hook(merged, args[1])
                seen[:] = [x for x in merged if id(x) not in hidden]
            return call

        saved = dict(hooks)
        for key, hook in saved.items():
            hooks[key] = wrap(hook)
        try:
            yield
        finally:
            hooks.clear()
            hooks.update(saved)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs):
        """accelerate's load_state; sharded models and their optimizers from the
        tierlift.checkpoint directories save_state wrote (on any world size)."""
        pairs = self._sharded_pairs()
        if not pairs:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        where = self._resolve_input_dir(input_dir)
        for i, _, _ in pairs:  # checked before anything is loaded
            d = checkpoint_dir(where, i)
            if not os.path.isdir(d):
                raise FileNotFoundError(f"{where} has no {os.path.basename(d)} for sharded "
                                        f"model {i}: it was not saved by "
                                        "tierlift.hf.Accelerator.save_state")
        with self._hooks_see_every_model(pairs, saving=False), self._without(pairs):
            out = super().load_state(where, load_kwargs, **load_model_func_kwargs)
        for i, m, opt in pairs:
            tierlift.checkpoint.load(checkpoint_dir(where, i), zmodel._inner(m),
                                     None if opt is None else unwrap_optimizer(opt))
        return out

    def _resolve_input_dir(self, input_dir: str | None) -> str:
        if input_dir is not None:
            return os.path.expanduser(input_dir)
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = [os.path.join(root, f) for f in os.listdir(root)]
        folders.sort(key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
        return folders[-1]
