"""Run by test_hf_launch.py under the launcher, on 2 gloo ranks:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m tierlift.hf.launch --config ROOT/zero.json hf_launch_cases.py ROOT

so the route (tierlift/hf/route.py) is installed as for any script. It then runs the unmodified
stock-shaped scripts as the launcher runs one (route.run_script: runpy as __main__, sys.argv set),
one torchrun launch for all of them: hf_stock_clm.py training with a checkpoint at step SAVE_AT,
the same script resuming from it, hf_stock_sft.py (TRL's SFTTrainer, when TRL is installed), an
Accelerate loop (hf_stock_accelerate.py);
then the route's Trainer on a model its from_pretrained loaded (weight-decay groups, zero=
refused), and the peak RSS of a partitioned from_pretrained against the plain one. Rank 0 writes
what the test compares to ROOT/launch.pt. The argument lists are also the one-process
references' (test_hf_launch.py runs the same scripts in its own process).
"""

from __future__ import annotations

import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CLM = os.path.join(HERE, "hf_stock_clm.py")
SFT = os.path.join(HERE, "hf_stock_sft.py")
ACCEL = os.path.join(HERE, "hf_stock_accelerate.py")
STEPS, SAVE_AT, PER_RANK = 6, 3, 2
COMMON = ["--max_steps", str(STEPS), "--save_steps", str(SAVE_AT), "--gradient_accumulation_steps",
          "2", "--learning_rate", "3e-3", "--weight_decay", "0.1", "--max_grad_norm", "0.5",
          "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--seed", "0",
          "--disable_tqdm", "true", "--dataloader_num_workers", "0"]


def clm_args(model: str, out: str, batch: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", model, "--output_dir", out, "--do_train",
            "--per_device_train_batch_size", str(batch), *COMMON, *extra]


def sft_args(model: str, out: str, batch: int) -> list[str]:
    # SFTConfig's defaults kept (gradient checkpointing on, TRL's fused LM head); bf16 off: the
    # CPU has none to compare against fp32.
    return ["--model_name_or_path", model, "--output_dir", out, "--bf16", "false",
            "--per_device_train_batch_size", str(batch), *COMMON]


def run_accelerate(model: str, out: str, batch: int) -> None:
    """hf_stock_accelerate.py, after the Trainer runs in this process: accelerate's gradient
    state is a process-wide singleton that keeps their accumulation settings otherwise."""
    import accelerate

    from tierlift.hf import route

    accelerate.state.GradientState._reset_state()
    route.run_script(ACCEL, [model, out, str(batch)])


def growth(fn) -> tuple[int, object]:
    """(peak RSS growth while fn() runs, its result), garbage collected first."""
    from tierlift import _peak_rss

    gc.collect()
    return _peak_rss.growth(fn)


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test checks which)
        return f"{type(e).__name__}: {e}"
    return ""


def route_trainer_checks(root: str) -> dict:
    """The script's own names after install(): transformers.Trainer is tierlift's, and a model
    from AutoModelForCausalLM.from_pretrained arrives sharded with the decay split."""
    import transformers
    from transformers import AutoModelForCausalLM, TrainingArguments

    import tierlift.hf
    from tierlift.hf.accelerator import unwrap_optimizer

    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "llama"))
    args = TrainingArguments(output_dir=os.path.join(root, "groups"), use_cpu=True,
                             weight_decay=0.1, report_to="none")
    trainer = transformers.Trainer(model=model, args=args)
    opt = unwrap_optimizer(trainer.create_optimizer())
    return {
        "is_tierlift_trainer": isinstance(trainer, tierlift.hf.Trainer),
        "accelerator": type(trainer.accelerator).__module__,
        "sharded": tierlift.zero.is_shard(next(model.parameters())),
        "groups": [(g["weight_decay"], sum(p.numel() for p in g["params"]))
                   for g in opt.param_groups],
        "zero_refused": _raises(lambda: transformers.Trainer(
            model=model, args=args, zero=tierlift.hf.ZeroConfig())),
    }


def _loaded(model):
    """The model with every weight read (plain from_pretrained may map the file and read
    pages only when they are used; training uses them all)."""
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return model


def rss(root: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

    from tierlift.hf import route

    path = os.path.join(root, "big")
    partitioned, model = growth(lambda: _loaded(AutoModelForCausalLM.from_pretrained(path)))
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    plain_fn = route._SAVED[(PreTrainedModel, "from_pretrained")].__get__(None, LlamaForCausalLM)
    plain, model = growth(lambda: _loaded(plain_fn(path)))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {"partitioned": partitioned, "plain": plain, "shards": shards, "model": model_bytes}


def main(root: str) -> None:
    import torch.distributed as dist

    from tierlift.hf import route

    torch.set_num_threads(1)
    llama = os.path.join(root, "llama")
    route.run_script(CLM, clm_args(llama, os.path.join(root, "clm"), PER_RANK))
    ckpt = os.path.join(root, "clm", f"checkpoint-{SAVE_AT}")
    route.run_script(CLM, clm_args(llama, os.path.join(root, "resume"), PER_RANK,
                                   "--resume_from_checkpoint", ckpt))
    try:
        import trl  # noqa: F401
    except ImportError:
        pass
    else:
        route.run_script(SFT, sft_args(llama, os.path.join(root, "sft"), PER_RANK))
    run_accelerate(llama, os.path.join(root, "accelerate"), PER_RANK)
    res = {"trainer": route_trainer_checks(root)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rss(root))
    res["rss"] = everyone
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(root, "launch.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.15's gloo can abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
