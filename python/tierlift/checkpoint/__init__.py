"""tierlift.checkpoint: atomic, SHA-256-checked checkpoints of models and their optimizers:
tierlift.zero models sharded and reshardable, other models replicated (rank 0 writes); the
state of an offloading optimizer is streamed within its cpu_budget, never built in RAM.

    tierlift.checkpoint.save("ckpt/step100", model, optimizer, extra={"step": 100})
    h = tierlift.checkpoint.save("ckpt/step200", model, optimizer, blocking=False,
                                 staging_budget=2 << 30)   # written in the background
    h.wait()   # or h.done(); the next save and close() wait too, and raise what failed
    extra = tierlift.checkpoint.load("ckpt/step100", model, optimizer)   # any world size
    python -m tierlift.checkpoint export ckpt/step100 model.pt   # plain torch state dict
    python -m tierlift.checkpoint export-optimizer ckpt/step100 optim.pt   # torch.optim format
    python -m tierlift.checkpoint export ckpt/step100 hf_out --format hf [--max-shard-size 5GB]
        [--config config.json]   # Hugging Face sharded safetensors, for from_pretrained(hf_out)
    python -m tierlift.checkpoint import-dcp dcp_dir ckpt/imported [--prefix model.]
        # a torch.distributed.checkpoint's model weights as a tierlift checkpoint (handoff.py)
"""

from tierlift.checkpoint.background import SaveHandle, close
from tierlift.checkpoint.format import full_state_dict
from tierlift.checkpoint.io import load, save
from tierlift.checkpoint.replicated import optimizer_state_dict

__all__ = ["SaveHandle", "close", "full_state_dict", "load", "optimizer_state_dict", "save"]
