"""tierlift.checkpoint: sharded, atomic, reshardable checkpoints of tierlift.zero models.

    tierlift.checkpoint.save("ckpt/step100", model, optimizer)   # every rank, in parallel
    tierlift.checkpoint.load("ckpt/step100", model, optimizer)   # any world size
    python -m tierlift.checkpoint export ckpt/step100 model.pt   # plain torch state dict
"""

from tierlift.checkpoint.format import full_state_dict
from tierlift.checkpoint.io import load, save

__all__ = ["full_state_dict", "load", "save"]
