"""Fine-tune a small Llama with Hugging Face's Trainer and tierlift's AdamW (optimizer state on
NVMe by default), checkpoint, and resume exactly where the run stopped.

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
    args = ap.parse_args(argv)
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


def train(args, output_dir: str, nvme_path: str | None) -> dict[int, float]:
    """Runs (or resumes) the fine-tuning; returns {step: loss} of every step so far."""
    model = build_model(args)
    optimizer = make_optimizer(model, args, nvme_path)
    data = ByteBlocks(docstring_bytes(args.modules), args.seq_len)
    targs = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        save_strategy="steps", save_steps=args.save_every, logging_steps=1, seed=args.seed,
        use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(optimizer, None))
    resume = args.resume and any(d.startswith("checkpoint-") for d in os.listdir(output_dir))
    if args.resume and not resume:
        print(f"no checkpoint in {output_dir}: starting from step 0")
    trainer.train(resume_from_checkpoint=True if resume else None)
    # log_history: every step's loss (logging_steps=1), those before a resume included
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if hasattr(optimizer, "close"):
        optimizer.close()  # tierlift: removes the state files now
    return dict(sorted(losses.items()))


def main(argv=None) -> dict[int, float]:
    args = parse_args(argv)
    if LlamaConfig is None:
        raise SystemExit("examples/finetune_hf.py needs Hugging Face transformers: "
                         "pip install transformers accelerate")
    hf_logging.disable_progress_bar()  # Trainer prints each step's loss (disable_tqdm=True)
    with tempfile.TemporaryDirectory(prefix="finetune-hf-") as tmp:
        output_dir = args.output_dir or os.path.join(tmp, "out")
        os.makedirs(output_dir, exist_ok=True)
        nvme_path = args.nvme_path
        if args.offload == "nvme" and nvme_path is None:
            nvme_path = os.path.join(tmp, "nvme")
            os.makedirs(nvme_path)
        print(f"tierlift {tierlift.__version__} | optimizer {args.optimizer} | offload "
              f"{args.offload} | output {output_dir}", flush=True)
        losses = train(args, output_dir, nvme_path)
        with open(os.path.join(output_dir, "losses.json"), "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
    steps = sorted(losses)
    head, tail = steps[: min(5, len(steps))], steps[-min(5, len(steps)):]
    print(f"loss {sum(losses[s] for s in head) / len(head):.3f} -> "
          f"{sum(losses[s] for s in tail) / len(tail):.3f} (mean of first/last 5 of "
          f"{len(steps)} steps)")
    return losses


if __name__ == "__main__":
    main()
