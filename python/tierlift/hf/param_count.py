"""Trainer's log line "Number of trainable parameters" for a model sharded by tierlift.zero.

transformers.Trainer takes the count from transformers.trainer.get_model_param_count, a module
global looked up when train() starts, which sums p.numel(): for a sharded model, this rank's
shards. Trainer offers no hook for it, so tierlift.hf.Trainer.train() replaces that global for
the length of the call only, and puts the function it found back afterwards. The replacement
counts a sharded model whole and gives every other model the replaced function's own result.
Nested or concurrent train() calls share one replacement (the last one out restores); if
something else replaced the global meanwhile, its function is left in place (ours, which it
wraps, still answers unsharded models with the original function's count).
"""

from __future__ import annotations

import contextlib
import threading

from tierlift.hf import model as zmodel

_LOCK = threading.Lock()
_ACTIVE: dict = {"holders": 0, "replaced": None, "ours": None}


def _counting_full(original):
    def get_model_param_count(model, trainable_only=False):
        if any(zmodel.is_sharded(m) for m in model.modules()):
            return zmodel.count_parameters(model, only_trainable=trainable_only)
        return original(model, trainable_only=trainable_only)

    get_model_param_count.__doc__ = original.__doc__
    get_model_param_count._tierlift_counts_full = True
    return get_model_param_count


@contextlib.contextmanager
def full_param_count():
    """transformers.trainer.get_model_param_count counts sharded models whole inside the
    block, and is the function it was before the block after it."""
    import transformers.trainer as hf_trainer

    with _LOCK:
        if _ACTIVE["holders"] == 0:
            found = hf_trainer.get_model_param_count
            ours = found if getattr(found, "_tierlift_counts_full", False) else \
                _counting_full(found)
            _ACTIVE.update(replaced=found, ours=ours)
            hf_trainer.get_model_param_count = ours
        _ACTIVE["holders"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE["holders"] -= 1
            if _ACTIVE["holders"] == 0:
                if hf_trainer.get_model_param_count is _ACTIVE["ours"]:
                    hf_trainer.get_model_param_count = _ACTIVE["replaced"]
                _ACTIVE.update(replaced=None, ours=None)
