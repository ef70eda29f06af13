"""tierlift.hf: Hugging Face Trainer and Accelerate with tierlift.zero sharding (torchrun).

    # No code change: the script's own Trainer / Accelerator / from_pretrained use tierlift
    torchrun --nproc-per-node 8 -m tierlift.hf.launch --config zero.json run_clm.py [ARGS...]

    # Trainer: give it the unsharded model and a ZeroConfig (or a model you sharded yourself)
    trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=data,
                                  zero=tierlift.hf.ZeroConfig(stage=3, offload_params="cpu"))
    trainer.train(resume_from_checkpoint=...)
    trainer.save_model("out")        # full model: AutoModel.from_pretrained("out")

    # A checkpoint loaded straight into shards (never whole on a rank), the Trainer's decay split
    model = tierlift.hf.from_pretrained("path", zero=tierlift.hf.ZeroConfig(stage=3))
    trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=data)

    # Accelerate: shard, build the optimizer on the shards, prepare with tierlift's Accelerator
    model = tierlift.zero.shard(model, stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)
    accelerator = tierlift.hf.Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)

Needs transformers (Trainer) and accelerate: pip install transformers accelerate.
See docs/zero-hugging-face.md.
"""

try:
    import accelerate  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tierlift.hf needs Hugging Face accelerate (and transformers for the "
                      "Trainer): pip install transformers accelerate") from exc

from tierlift.hf.accelerator import Accelerator
from tierlift.hf.config import ZeroConfig
from tierlift.hf.config_file import LaunchConfig, load_config
from tierlift.hf.model import clip_grad_norm_, count_parameters, gathered_state_dict, install


def __getattr__(name: str):
    # The Trainer needs transformers; Accelerate alone does not.
    if name == "Trainer":
        from tierlift.hf.trainer import Trainer

        return Trainer
    if name == "from_pretrained":
        from tierlift.hf.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'tierlift.hf' has no attribute {name!r}")


__all__ = ["Accelerator", "LaunchConfig", "Trainer", "ZeroConfig", "clip_grad_norm_",
           "count_parameters", "from_pretrained", "gathered_state_dict", "install", "load_config"]
