"""Fine-tune a small Llama with Hugging Face's Trainer and tierlift's AdamW (optimizer state on
NVMe by default), checkpoint, and resume exactly where the run stopped; with --zero, sharded by
tierlift.zero over the processes of torchrun (tierlift.hf.Trainer).

    torchrun --nproc-per-node 2 examples/finetune_hf.py --zero 3 --output-dir /tmp/hfz
    torchrun --nproc-per-node 2 examples/finetune_hf.py --zero 3 --output-dir /tmp/hfz --resume
    torchrun --nproc-per-node 2 examples/finetune_hf.py --zero 3 --offload-params cpu
    python examples/finetune_hf.py                                 # offload=nvme, 40 steps, CPU
    python examples/finetune_hf.py --offload cpu                   # state in host memory
    python examples/finetune_hf.py --optimizer torch               # torch.optim.AdamW, to compare
    python examples/finetune_hf.py --output-dir /tmp/hf            # checkpoints at steps 20, 40
    python examples/finetune_hf.py --output-dir /tmp/hf --resume   # killed? on from the last one

Needs `pip install transformers accelerate` (scripts/setup.sh installs them). Nothing is
downloaded: the model is a LlamaForCausalLM built from a LlamaConfig (random init), the text is
the docstrings of a few standard-library modules as bytes (vocabulary 256).

tierlift's optimizer goes in as Trainer(optimizers=(optimizer, None)): Trainer wraps it in its
lr scheduler and gradient clipping like any torch optimizer, and checkpoints it as
torch.save(optimizer.state_dict()) to optimizer.pt; state_dict() gathers the offloaded state
(torch's AdamW layout, so optimizer.pt loads into either optimizer) and load_state_dict() puts
it back into the NVMe files or host memory. That builds the whole state in RAM once per save:
for state larger than RAM, checkpoint with tierlift.checkpoint.save, which streams it within
cpu_budget (examples/finetune_offload.py). Each step's loss goes to <output-dir>/losses.json.

--zero 1|2|3 (under torchrun, gloo on CPU): tierlift.hf.Trainer shards the model
(tierlift.hf.ZeroConfig, weight decay split as Trainer's default optimizer does), builds
tierlift.optim.AdamW on the shards (--offload picks where its state lives), clips by the global
norm, checkpoints through tierlift.checkpoint (checkpoint-N/tierlift, every rank its shards) and
writes the final model, gathered, to <output-dir>/final (from_pretrained loads it). The losses
are those of one process with the same global batch (tests/python/test_hf_trainer.py).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import tempfile

import torch

import tierlift

try:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging
except ImportError:  # main() says what to install; --help still works
    LlamaConfig = None

DOC_MODULES = "argparse,collections,functools,json,textwrap"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--offload", default=None, choices=["none", "cpu", "nvme"],
                    help="where tierlift's AdamW keeps its state (default: nvme)")
    ap.add_argument("--optimizer", default="tierlift", choices=["tierlift", "torch"],
                    help="torch: torch.optim.AdamW with the same settings, to compare losses")
    ap.add_argument("--nvme-path", default=None,
                    help="directory on the drive for the state files (default: a temp dir)")
    ap.add_argument("--budget-fraction", type=float, default=0.25,
                    help="offload=nvme: cpu_budget as a fraction of the state's bytes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=None,
                    help="checkpoint every this many steps (default: half of --steps)")
    ap.add_argument("--output-dir", default=None,
                    help="checkpoints (checkpoint-<step>/) and losses.json (default: a temp dir)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the last checkpoint in --output-dir")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--modules", default=DOC_MODULES,
                    help="standard-library modules whose docstrings are the text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage over torchrun's processes (tierlift.hf.Trainer); 0: none")
    ap.add_argument("--offload-params", default="none", choices=["none", "cpu"],
                    help="--zero 3: keep the parameter shards in host memory")
    args = ap.parse_args(argv)
    if args.offload_params != "none" and args.zero != 3:
        ap.error("--offload-params needs --zero 3")
    if args.optimizer == "torch" and args.offload not in (None, "none"):
        ap.error("--offload is tierlift's: torch.optim.AdamW keeps its state by the parameters")
    if args.offload is None:
        args.offload = "nvme" if args.optimizer == "tierlift" else "none"
    if args.steps <= 0:
        ap.error(f"--steps must be > 0, got {args.steps}")
    if args.save_every is None:
        args.save_every = max(args.steps // 2, 1)
    if args.resume and args.output_dir is None:
        ap.error("--resume needs --output-dir (where the checkpoints are)")
    if not 0 < args.budget_fraction < 1:
        ap.error(f"--budget-fraction must be in (0, 1), got {args.budget_fraction}")
    return args


def docstring_bytes(modules: str) -> torch.Tensor:
    """The docstrings of the modules and of their public members, in a fixed order, as bytes."""
    parts = []
    for name in modules.split(","):
        mod = importlib.import_module(name.strip())
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if not attr.startswith("_") and getattr(obj, "__module__", None) == mod.__name__:
                parts.append(inspect.getdoc(obj) or "")
    data = "\n\n".join(p for p in parts if p).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ByteBlocks(torch.utils.data.Dataset):
    """Consecutive blocks of `seq_len` byte tokens; the model shifts the labels itself."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.blocks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_model(args) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2 or 1,
                         intermediate_size=4 * args.hidden, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def make_optimizer(model, args, nvme_path: str | None) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices, none on norms; tierlift's or torch's."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=args.lr, betas=(0.9, 0.95))
    if args.optimizer == "torch":
        return torch.optim.AdamW(groups, **kw)
    if args.offload == "nvme":
        state_bytes = 12 * sum(p.numel() for p in params)  # fp32 master, exp_avg, exp_avg_sq
        kw.update(nvme_path=nvme_path, cpu_budget=int(state_bytes * args.budget_fraction))
    return tierlift.optim.AdamW(groups, offload=args.offload, **kw)


def zero_trainer(args, model, targs, data, nvme_path: str | None):
    """tierlift.hf.Trainer: shards `model` with ZeRO stage args.zero and builds the optimizer
    on the shards (tierlift's AdamW with --offload, or torch's), lr/betas/decay from targs."""
    import tierlift.hf

    optim_kwargs, cls_and_kwargs = {}, None
    if args.optimizer == "torch":
        cls_and_kwargs = (torch.optim.AdamW, dict(lr=args.lr, betas=(0.9, 0.95)))
    elif args.offload != "none":
        optim_kwargs["offload"] = args.offload
        if args.offload == "nvme":
            shard_bytes = 12 * sum(p.numel() for p in model.parameters()) // targs.world_size
            optim_kwargs.update(nvme_path=nvme_path,
                                cpu_budget=int(shard_bytes * args.budget_fraction))
    zero = tierlift.hf.ZeroConfig(stage=args.zero, offload_params=args.offload_params,
                                  optimizer_kwargs=optim_kwargs)
    return tierlift.hf.Trainer(model=model, args=targs, train_dataset=data, zero=zero,
                               optimizer_cls_and_kwargs=cls_and_kwargs)


def train(args, output_dir: str, nvme_path: str | None) -> dict[int, float]:
    """Runs (or resumes) the fine-tuning; returns {step: loss} of every step so far."""
    model = build_model(args)
    data = ByteBlocks(docstring_bytes(args.modules), args.seq_len)
    targs = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        save_strategy="steps", save_steps=args.save_every, logging_steps=1, seed=args.seed,
        use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=args.lr, adam_beta2=0.95, weight_decay=args.weight_decay)
    if args.zero:
        trainer = zero_trainer(args, model, targs, data, nvme_path)
        optimizer = trainer.optimizer
    else:
        optimizer = make_optimizer(model, args, nvme_path)
        trainer = Trainer(model=model, args=targs, train_dataset=data,
                          optimizers=(optimizer, None))
    resume = args.resume and any(d.startswith("checkpoint-") for d in os.listdir(output_dir))
    if args.resume and not resume:
        print(f"no checkpoint in {output_dir}: starting from step 0")
    trainer.train(resume_from_checkpoint=True if resume else None)
    # log_history: every step's loss (logging_steps=1), those before a resume included
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if args.zero:
        trainer.save_model(os.path.join(output_dir, "final"))  # gathered; rank 0 writes
        optimizer = trainer.optimizer.optimizer  # inside accelerate's AcceleratedOptimizer
    if hasattr(optimizer, "close"):
        optimizer.close()  # tierlift: removes the state files now
    return dict(sorted(losses.items()))


def shared_dir(tmp: str) -> str:
    """Under torchrun every rank must write into the same folders: rank 0's temp dir."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        return tmp
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    where = [tmp]
    dist.broadcast_object_list(where, src=0)
    return where[0]


def main(argv=None) -> dict[int, float]:
    args = parse_args(argv)
    if LlamaConfig is None:
        raise SystemExit("examples/finetune_hf.py needs Hugging Face transformers: "
                         "pip install transformers accelerate")
    hf_logging.disable_progress_bar()  # Trainer prints each step's loss (disable_tqdm=True)
    rank = int(os.environ.get("RANK", 0))
    with tempfile.TemporaryDirectory(prefix="finetune-hf-") as tmp:
        output_dir = args.output_dir or os.path.join(shared_dir(tmp) if args.zero else tmp, "out")
        os.makedirs(output_dir, exist_ok=True)
        nvme_path = args.nvme_path
        if args.offload == "nvme" and nvme_path is None:
            nvme_path = os.path.join(tmp, "nvme")
            os.makedirs(nvme_path)
        if rank == 0:
            print(f"tierlift {tierlift.__version__} | optimizer {args.optimizer} | offload "
                  f"{args.offload} | zero {args.zero or 'off'} | output {output_dir}",
                  flush=True)
        losses = train(args, output_dir, nvme_path)
        if rank == 0:
            with open(os.path.join(output_dir, "losses.json"), "w") as f:
                json.dump({str(k): v for k, v in losses.items()}, f)
        if args.zero and "WORLD_SIZE" in os.environ:
            import torch.distributed as dist

            dist.barrier()  # rank 0's temp dir goes when it leaves this block
    if rank != 0:
        return losses
    steps = sorted(losses)
    head, tail = steps[: min(5, len(steps))], steps[-min(5, len(steps)):]
    print(f"loss {sum(losses[s] for s in head) / len(head):.3f} -> "
          f"{sum(losses[s] for s in tail) / len(tail):.3f} (mean of first/last 5 of "
          f"{len(steps)} steps)")
    return losses


if __name__ == "__main__":
    main()
