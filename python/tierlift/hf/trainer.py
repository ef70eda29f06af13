"""tierlift.hf.Trainer: transformers.Trainer with tierlift.zero sharding, under torchrun.

    trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=data,
                                  zero=tierlift.hf.ZeroConfig(stage=3))
    trainer.train()                        # or train(resume_from_checkpoint=True)
    trainer.save_model("out")              # full model, from_pretrained("out") loads it

Either give an unsharded model and zero=ZeroConfig(...) (the Trainer shards it, splitting weight
decay as Trainer's default optimizer does, and builds tierlift.optim.AdamW from
TrainingArguments), or a model already sharded by tierlift.zero.shard (and, if you like, an
optimizer built on its parameters). The accelerator Trainer builds becomes a
tierlift.hf.Accelerator (no DDP wrap, tierlift no_sync, global-norm clipping). Checkpoints: the
sharded model and optimizer through tierlift.checkpoint into checkpoint-N/tierlift (every rank
its shards; in the background with ZeroConfig(background_saves=True)), plus Trainer's own
scheduler.pt, rng_state_<rank>.pth and trainer_state.json, and (unless
checkpoint_full_model=False) the full model for from_pretrained. Resuming reads
checkpoint-N/tierlift as tierlift.checkpoint.load finds it: from tierlift.old where a save was
killed while replacing it (format.resolve_dir).
"""

from __future__ import annotations

import os

import torch

import tierlift.checkpoint
import tierlift.optim
from tierlift.checkpoint import in_flight
from tierlift.checkpoint.format import resolve_dir
from tierlift.hf import model as zmodel
from tierlift.hf.accelerator import Accelerator, own_clipping, unwrap_optimizer
from tierlift.hf.config import ZeroConfig
from tierlift.hf.param_count import full_param_count
from tierlift.hf.pretrained import DECAY, NO_DECAY, decay_keys, head_in_root, zero_of
from tierlift.hf.stock import StockTrainer
from tierlift.zero.groups import param_groups, shard_groups
from tierlift.zero.materialize import first_meta

TIERLIFT_DIR = "tierlift"  # checkpoint-N/tierlift: the sharded model and optimizer
_SCHEDULER = "scheduler.pt"
_OPTIMIZER = "optimizer.pt"
_ADAMW = ("adamw_torch", "adamw_torch_fused")
_NO_SPLIT = ("the model was sharded without the Trainer's weight-decay split (decay on matrices, "
             "none on norms and biases): pass an optimizer built on its shards, or "
             "zero=ZeroConfig(...) with the unsharded model, or weight_decay=0")


def _sharded_dir(checkpoint: str) -> str | None:
    """The tierlift checkpoint in Trainer checkpoint `checkpoint`: its tierlift/, or its
    tierlift.old where a save was killed while replacing it (the rule load() follows,
    format.resolve_dir); None if neither is there. This process's background save of it lands
    first, as load() waits for it: until it commits, what is there is the checkpoint before it
    (or, in a fresh folder, nothing but its .tmp)."""
    path = os.path.join(checkpoint, TIERLIFT_DIR)
    in_flight.before_load(path)
    found = resolve_dir(path)
    return found if os.path.isdir(found) else None


def _refuse_other_sharding(args) -> None:
    """TrainingArguments asking for FSDP or DeepSpeed: refused wherever they are set (on CPU,
    transformers does not enable FSDP and would train under tierlift.zero silently)."""
    if args is None:
        return
    for field in ("fsdp", "deepspeed"):
        value = getattr(args, field, None)
        if value:
            raise ValueError(f"TrainingArguments.{field}={value!r}: tierlift.hf.Trainer shards "
                             "the model with tierlift.zero (zero=tierlift.hf.ZeroConfig(...)); "
                             f"drop {field}")


class Trainer(StockTrainer):
    """transformers.Trainer for models sharded by tierlift.zero.shard (see the module doc).

    zero: a tierlift.hf.ZeroConfig to shard an unsharded model with, or None when the model is
    sharded already. Every other argument is transformers.Trainer's."""

    def __init__(self, model=None, args=None, *pos, zero: ZeroConfig | None = None, **kw):
        if zero is not None and not isinstance(zero, ZeroConfig):
            raise TypeError(f"zero must be a tierlift.hf.ZeroConfig or None, got "
                            f"{type(zero).__name__}")
        _refuse_other_sharding(args)
        meta = None if model is None or zmodel.is_sharded(model) else first_meta(model)
        if meta is not None:
            raise ValueError(f"{meta!r} is on the meta device: load the model with "
                             "tierlift.hf.from_pretrained(path, zero=...) (each rank reads its "
                             "slices) and pass it with zero=None")
        self.zero = zero
        # A model tierlift.hf.from_pretrained sharded carries its ZeroConfig (optimizer and
        # checkpoint options).
        self._save_opts = zero or zero_of(zmodel._inner(model)) or ZeroConfig()
        self._pending_save = None
        super().__init__(model, args, *pos, **kw)
        if self.args.save_only_model and not self._save_opts.checkpoint_full_model:
            raise ValueError("save_only_model=True with ZeroConfig(checkpoint_full_model=False) "
                             "would write checkpoints without weights")
        self._shard(self.model)
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)

    # ---- sharding and the optimizer ----
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("tierlift.hf.Trainer shards the model with tierlift.zero: drop the "
                             "DeepSpeed / FSDP configuration")
        Accelerator.adopt(self.accelerator)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if getattr(self, "zero", None) is None:
            raise ValueError("model_init with tierlift.hf.Trainer needs zero=ZeroConfig(...): "
                             "each new model is sharded with it")
        self._shard(model, fresh=True)
        return model

    def _shard(self, model, fresh: bool = False) -> None:
        if getattr(model, "_tierlift_hf_trainer_sharded", False):
            return
        if zmodel.is_sharded(model):
            if self.zero is not None:
                raise ValueError("the model is sharded already (tierlift.zero.shard): pass "
                                 "zero=None, or give the Trainer the unsharded model")
            zmodel.install(model)
            return
        if self.zero is None:
            raise ValueError("tierlift.hf.Trainer trains a model sharded by tierlift.zero.shard:"
                             " shard it first, or pass zero=tierlift.hf.ZeroConfig(stage=...)")
        if not fresh and self.optimizer is not None:
            raise ValueError("optimizers=(optimizer, ...) holds the unsharded model's "
                             "parameters, which zero=ZeroConfig(...) replaces by shards: leave "
                             "the optimizer out (the Trainer builds tierlift.optim.AdamW, "
                             "ZeroConfig.optimizer_kwargs), or shard the model yourself first")
        # The LM head in the root unit, as tierlift.hf.from_pretrained puts it (fused losses).
        self.zero.shard(model, param_group_fn=decay_keys(self.get_decay_parameter_names(model)),
                        **head_in_root(model, self.zero))
        model._tierlift_hf_trainer_sharded = True
        zmodel.install(model)

    def _move_model_to_device(self, model, device) -> None:
        # shard() placed the shards (host memory with offload_params); .to() would undo that.
        if not zmodel.is_sharded(model):
            super()._move_model_to_device(model, device)

    def _check_optimizer(self, opt) -> None:
        owned = {id(p) for p in self.model.parameters()}
        inner = unwrap_optimizer(opt)
        if any(id(p) not in owned for g in inner.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds parameters that are not the sharded model's: "
                             "build it after tierlift.zero.shard(model, ...), from "
                             "model.parameters()")
        own = own_clipping(inner)
        if own is not None and self.args.max_grad_norm not in (0, own):
            raise ValueError(f"TrainingArguments.max_grad_norm={self.args.max_grad_norm} and the "
                             f"optimizer's own max_grad_norm={own} differ: set max_grad_norm="
                             f"{own} (or 0: the optimizer clips, the Trainer logs the norm)")

    def get_decay_parameter_names(self, model) -> list[str]:
        """On a sharded model: the names of the shards that hold the decayed parameters (shard()
        split each unit by the stock rule), so that a create_optimizer override grouping
        model.named_parameters() by these names gets the Trainer's split; the stock names of
        the unsharded parameters would match no shard."""
        if not zmodel.is_sharded(model):
            return super().get_decay_parameter_names(model)
        groups = shard_groups(model)
        if not set(groups) <= {DECAY, NO_DECAY}:
            if self.args.weight_decay == 0:
                return [n for n, _ in model.named_parameters()]
            raise ValueError(_NO_SPLIT)
        decay = {id(p) for p in groups.get(DECAY, [])}
        return [n for n, p in model.named_parameters() if id(p) in decay]

    def create_optimizer(self, model=None):
        if self.optimizer is not None or not zmodel.is_sharded(self.model):
            return super().create_optimizer(model)
        args = self.args
        groups = shard_groups(self.model)
        if set(groups) <= {DECAY, NO_DECAY}:
            wd = {DECAY: args.weight_decay, NO_DECAY: 0.0}
            params = param_groups(self.model, {k: {"weight_decay": wd[k]} for k in groups})
        elif args.weight_decay == 0:
            params = [{"params": [p for ps in groups.values() for p in ps]}]
        else:
            raise ValueError(_NO_SPLIT)
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            self.optimizer = cls(params, **kwargs)
        else:
            optim = getattr(args.optim, "value", args.optim)
            if optim not in _ADAMW:
                raise ValueError(f"tierlift.hf.Trainer builds tierlift.optim.AdamW; optim="
                                 f"{optim!r} is not AdamW: pass optimizers=(your optimizer, "
                                 "None) or optimizer_cls_and_kwargs")
            self.optimizer = tierlift.optim.AdamW(
                params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon, **self._save_opts.optimizer_kwargs)
        self._check_optimizer(self.optimizer)
        return self.optimizer

    # ---- saving ----
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model (gathered unit by unit, rank 0 writes safetensors through
        save_pretrained; for a peft model its adapters). A collective: every rank calls it."""
        if not zmodel.is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)
        if _internal_call and not self._save_opts.checkpoint_full_model:
            return
        zmodel._state(zmodel._inner(self.model)).named_call("Trainer.save_model")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not zmodel.is_sharded(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        opts = self._save_opts
        self._pending_save = tierlift.checkpoint.save(
            os.path.join(output_dir, TIERLIFT_DIR), self.model, unwrap_optimizer(self.optimizer),
            blocking=not opts.background_saves, staging_budget=opts.staging_budget)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def wait_for_checkpoint(self) -> None:
        """Waits for the last background checkpoint to be on disk (raises what failed)."""
        handle, self._pending_save = self._pending_save, None
        if handle is not None:
            handle.wait()

    def train(self, *args, **kwargs):
        # Trainer logs the trainable count through a module global: counted whole for a
        # sharded model during this call only (param_count.py).
        with full_param_count():
            out = super().train(*args, **kwargs)
        self.wait_for_checkpoint()
        return out

    # ---- resuming ----
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        if not zmodel.is_sharded(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if _sharded_dir(resume_from_checkpoint) is not None:
            return  # with the optimizer, once it exists (_load_optimizer_and_scheduler)
        if os.path.isdir(os.path.join(resume_from_checkpoint, TIERLIFT_DIR + ".tmp")):
            raise RuntimeError(f"{resume_from_checkpoint} was still being written when its run "
                               "stopped (a background save): resume from an earlier checkpoint")
        if os.path.isfile(os.path.join(resume_from_checkpoint, _OPTIMIZER)):
            raise ValueError(f"{resume_from_checkpoint} is a checkpoint of a run that was not "
                             f"sharded (optimizer.pt, no {TIERLIFT_DIR}/): its optimizer state "
                             "cannot go into shards; start from its weights with "
                             "from_pretrained instead")
        if zmodel.read_full_weights(resume_from_checkpoint) is None:
            raise ValueError(f"{resume_from_checkpoint} has neither {TIERLIFT_DIR}/ nor a full "
                             "model.safetensors (adapter-only saves cannot be resumed into a "
                             "sharded model)")
        zmodel.load_full_weights(model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not zmodel.is_sharded(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        sharded = _sharded_dir(checkpoint)
        if sharded is not None:
            tierlift.checkpoint.load(sharded, self.model, unwrap_optimizer(self.optimizer))
        sched = os.path.join(checkpoint, _SCHEDULER)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        if not zmodel.is_sharded(self.model):
            return super()._load_best_model()
        self.wait_for_checkpoint()
        best = self.state.best_model_checkpoint
        sharded = _sharded_dir(best)
        if sharded is not None:
            tierlift.checkpoint.load(sharded, self.model)
        else:
            zmodel.load_full_weights(self.model, best)
