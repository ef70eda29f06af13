"""Worker of the Hugging Face integration tests (test_hf_trainer.py, test_hf_accelerate.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_worker.py train OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_worker.py resume OUT

`train` runs every Trainer and Accelerate configuration for STEPS optimizer steps on 2 gloo ranks
(checkpoints at step SAVE_AT), saves the final models, generates with uneven lengths per rank;
`resume` starts each configuration again in a new process from its step-SAVE_AT checkpoint.
Rank 0 writes what the tests compare to OUT/<phase>.pt. The builders below are also what the
tests use for the one-process references: tiny config-only models, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch

VOCAB, SEQ, ROWS = 64, 16, 64
STEPS, SAVE_AT, ACCUM, PER_RANK, LR = 6, 3, 2, 2, 3e-3
CLIP = 0.5  # below the unclipped norms (about 0.8), so clipping changes the steps
PROBE = torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)  # logits are compared on this

# name -> (model kind, ZeroConfig fields, optimizer_kwargs, extra TrainingArguments)
TRAINER_RUNS = {
    "z1": ("llama", {"stage": 1}, {}, {}),
    "z2": ("llama", {"stage": 2}, {}, {}),
    "z3": ("llama", {"stage": 3}, {}, {}),
    "z3_offload": ("llama", {"stage": 3, "offload_params": "cpu", "background_saves": True},
                   {"offload": "nvme", "overlap": True, "max_grad_norm": CLIP}, {}),
    "gpt2_norm0": ("gpt2", {"stage": 2}, {}, {"max_grad_norm": 0.0}),
    "lora_z3": ("lora", {"stage": 3, "offload_params": "cpu"}, {}, {}),
}
ACCEL_RUNS = {  # name -> (stage, shard kwargs, optimizer kwargs)
    "acc_z1": (1, {}, {}),
    "acc_z2": (2, {}, {}),
    "acc_z3": (3, {}, {}),
    "acc_z3_offload": (3, {"offload_params": "cpu"}, {"offload": "nvme", "overlap": True,
                                                     "max_grad_norm": CLIP}),
}


def quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def build(kind: str):
    """A config-only model, the same on every rank and in every process (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":  # tied embedding / LM head
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                          n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # lora_B starts at zero: give the adapters a visible effect
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def training_args(out: str, *, batch: int, **extra):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=batch,
              gradient_accumulation_steps=ACCUM, logging_steps=1, learning_rate=LR,
              weight_decay=0.1, max_grad_norm=CLIP, seed=0, use_cpu=True, report_to="none",
              disable_tqdm=True, save_strategy="steps", save_steps=SAVE_AT,
              dataloader_num_workers=0)
    kw.update(extra)
    return TrainingArguments(**kw)


def history(trainer) -> dict:
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"loss": {e["step"]: e["loss"] for e in logs},
            "grad_norm": {e["step"]: e["grad_norm"] for e in logs}}


def global_micro_batch(step: int, micro: int) -> torch.Tensor:
    """Micro-batch `micro` of optimizer step `step`: PER_RANK rows for each of 2 ranks (one
    process takes them all)."""
    rows = 2 * PER_RANK
    start = ((step * ACCUM + micro) * rows) % ROWS
    return Data().x[start:start + rows]


def accelerate_loop(model, opt, sched, accelerator, start: int, rank: int, world: int,
                    save_dir: str | None = None):
    """Steps from `start` to STEPS; save_state(save_dir) after step SAVE_AT if given."""
    losses, norms = {}, {}
    for step in range(start, STEPS):
        total = torch.zeros(())
        for micro in range(ACCUM):
            with accelerator.accumulate(model):
                x = global_micro_batch(step, micro)[rank * PER_RANK:(rank + 1) * PER_RANK]
                loss = model(input_ids=x, labels=x).loss
                accelerator.backward(loss)
                total += loss.detach() / ACCUM
                if accelerator.sync_gradients:
                    norms[step + 1] = float(accelerator.clip_grad_norm_(model.parameters(), CLIP))
                opt.step()
                sched.step()
                opt.zero_grad()
        losses[step + 1] = float(accelerator.reduce(total, "mean"))
        if save_dir is not None and step + 1 == SAVE_AT:
            accelerator.save_state(save_dir)
    return losses, norms


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS * ACCUM))


_LAUNCHED: dict = {}


def launch(root: str, timeout: int = 600) -> tuple[dict, dict, str]:
    """(train results, resume results, the folder they wrote) of the two torchrun launches,
    run once per pytest session into `root` (both test files share them)."""
    if "runs" in _LAUNCHED:
        return _LAUNCHED["runs"]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERLIFT_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = []
    for phase in ("train", "resume"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", os.path.join(here, "hf_worker.py"), phase, root]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        result = os.path.join(root, f"{phase}.pt")
        assert proc.returncode == 0 and os.path.exists(result), \
            f"{phase}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        out.append(torch.load(result, weights_only=False))
    _LAUNCHED["runs"] = (*out, root)
    return _LAUNCHED["runs"]


# ---- under torchrun ----
def _trainer(name: str, out: str, rank: int, resume: bool):
    import tierlift.hf

    kind, zero, optim, extra = TRAINER_RUNS[name]
    optim = dict(optim)
    if optim.get("offload") == "nvme":
        optim["nvme_path"] = os.path.join(out, f"nvme{rank}")
        os.makedirs(optim["nvme_path"], exist_ok=True)
    trainer = tierlift.hf.Trainer(
        model=build(kind), args=training_args(os.path.join(out, name), batch=PER_RANK, **extra),
        train_dataset=Data(), zero=tierlift.hf.ZeroConfig(**zero, optimizer_kwargs=optim))
    ckpt = os.path.join(out, name, f"checkpoint-{SAVE_AT}") if resume else None
    with trainer_log() as lines:
        trainer.train(resume_from_checkpoint=ckpt)
    counts = [ln for ln in lines if "Number of trainable parameters" in ln]
    trainer.logged_trainable = int(counts[0].split("=")[1].replace(",", "")) if counts else None
    return trainer


@contextlib.contextmanager
def trainer_log():
    """The INFO lines Trainer logs (transformers.trainer), kept off the console."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("transformers.trainer")
    was = log.level, log.propagate
    keep = Keep()
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield lines
    finally:
        log.removeHandler(keep)
        log.setLevel(was[0])
        log.propagate = was[1]


def _accelerate(name: str, out: str, rank: int, world: int, resume: bool):
    import tierlift.hf

    stage, shard_kw, optim = ACCEL_RUNS[name]
    optim = dict(optim)
    if optim.get("offload") == "nvme":
        optim["nvme_path"] = os.path.join(out, f"nvme{rank}")
        os.makedirs(optim["nvme_path"], exist_ok=True)
    model = tierlift.zero.shard(build("llama"), stage=stage, **shard_kw)
    opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, **optim)
    accelerator = tierlift.hf.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, opt, sched = accelerator.prepare(model, opt, schedule(opt))
    state_dir = os.path.join(out, name, "state")
    if resume:
        accelerator.load_state(state_dir)
    losses, norms = accelerate_loop(model, opt, sched, accelerator, SAVE_AT if resume else 0,
                                    rank, world, None if resume else state_dir)
    return model, opt, accelerator, losses, norms


def _generate(model, rank: int) -> list:
    """Greedy generation with a different length on each rank (and a second call with an
    explicit synced_gpus=False, as Seq2SeqTrainer passes): returns every rank's tokens."""
    import torch.distributed as dist

    model.eval()
    prompt = PROBE[:1, :4]
    outs = []
    for kwargs in ({}, {"synced_gpus": False}):
        ids = model.generate(prompt, max_new_tokens=2 + 5 * rank, min_new_tokens=2 + 5 * rank,
                             do_sample=False, pad_token_id=0, **kwargs)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ids)
        outs.append(everyone)
    model.train()
    return outs


def _raises(fn) -> str:
    """The type and message of what fn() raises ("" when it does not)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the tests check which)
        return f"{type(e).__name__}: {e}"
    return ""


def refusals(out: str) -> dict:
    """Misuses that must raise before anything changes (every rank runs the same)."""
    import tierlift.hf

    def accel_with_stale_optimizer():
        model = build("llama")
        opt = tierlift.optim.AdamW(model.parameters(), lr=LR)
        tierlift.zero.shard(model, stage=2)
        tierlift.hf.Accelerator(cpu=True).prepare(model, opt)

    def trainer(model, **kw):
        args = training_args(os.path.join(out, "refused"), batch=PER_RANK,
                             **kw.pop("args", {}))
        return tierlift.hf.Trainer(model=model, args=args, train_dataset=Data(), **kw)

    def trainer_with_unsharded_optimizer():
        model = build("llama")
        trainer(model, zero=tierlift.hf.ZeroConfig(stage=2),
                optimizers=(tierlift.optim.AdamW(model.parameters()), None))

    def trainer_sharded_twice():
        trainer(tierlift.zero.shard(build("llama"), stage=2),
                zero=tierlift.hf.ZeroConfig(stage=2))

    def trainer_two_clipping_norms():
        model = tierlift.zero.shard(build("llama"), stage=2)
        opt = tierlift.optim.AdamW(model.parameters(), offload="cpu", max_grad_norm=1.0)
        trainer(model, optimizers=(opt, None), args={"max_grad_norm": CLIP})

    def resume(step: int, files: list[str]):
        # One directory per case: ranks run the cases without waiting for each other.
        ckpt = os.path.join(out, "refused", f"checkpoint-{step}")
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(ckpt, f)), exist_ok=True)
            open(os.path.join(ckpt, f), "w").close()
        t = trainer(build("llama"), zero=tierlift.hf.ZeroConfig(stage=3))
        t._load_from_checkpoint(ckpt)

    return {
        "stale_optimizer": _raises(accel_with_stale_optimizer),
        "unsharded_optimizer": _raises(trainer_with_unsharded_optimizer),
        "sharded_twice": _raises(trainer_sharded_twice),
        "two_norms": _raises(trainer_two_clipping_norms),
        "unsharded_checkpoint": _raises(lambda: resume(8, ["optimizer.pt"])),
        "interrupted_save": _raises(lambda: resume(9, ["tierlift.tmp/rank00000.pt"])),
        "bad_optimizer_key": _raises(lambda: tierlift.hf.ZeroConfig(
            optimizer_kwargs={"ofload": "cpu"})),
    }


def train_phase(out: str, rank: int, world: int) -> dict:
    import accelerate

    import tierlift.hf

    res = {}
    for name in TRAINER_RUNS:
        trainer = _trainer(name, out, rank, resume=False)
        model = trainer.model
        r = history(trainer)
        r["logged_trainable"] = trainer.logged_trainable
        final = os.path.join(out, name, "final")
        trainer.save_model(final)
        with torch.no_grad():
            r["logits"] = model(input_ids=PROBE).logits.detach().clone()
        r["num_parameters"] = (model.get_nb_trainable_parameters() if name == "lora_z3"
                               else model.num_parameters())
        r["trainable"] = (None if name == "lora_z3"
                          else model.num_parameters(only_trainable=True))
        r["no_embeddings"] = (None if name == "lora_z3"
                              else model.num_parameters(exclude_embeddings=True))
        if name == "z3":
            r["generate"] = _generate(model, rank)
        if name == "lora_z3":
            inner = tierlift.hf.accelerator.unwrap_optimizer(trainer.optimizer)
            frozen = [p for p in model.parameters() if not p.requires_grad]
            r["frozen_numel"] = sum(p.numel() for p in frozen)
            r["frozen_grads"] = sum(p.grad is not None for p in frozen)
            r["state_on_frozen"] = sum(id(p) in {id(q) for q in frozen} for p in inner.state)
            r["optimizer_params_all_shards"] = all(
                tierlift.zero.is_shard(p) for g in inner.param_groups for p in g["params"])
        res[name] = r
        del trainer, model
    for name in ACCEL_RUNS:
        model, opt, accelerator, losses, norms = _accelerate(name, out, rank, world, False)
        r = {"loss": losses, "grad_norm": norms, "wrapped": type(model).__name__}
        accelerator.save_model(model, os.path.join(out, name, "final"))
        with torch.no_grad():
            r["logits"] = model(input_ids=PROBE).logits.detach().clone()
        sd = accelerator.get_state_dict(model)
        r["state_dict_keys"] = sorted(sd) if rank == 0 else None
        res[name] = r
        accelerate.state.GradientState._reset_state()
        del model, opt, accelerator
    res["refusals"] = refusals(out)
    res["example"] = run_example(out)
    return res


EXAMPLE_FLAGS = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32",
                 "--modules", "json,textwrap", "--steps", "4", "--save-every", "2",
                 "--offload", "cpu"]


def load_example():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                        "finetune_hf.py")
    spec = importlib.util.spec_from_file_location("finetune_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(out: str) -> dict:
    """examples/finetune_hf.py --zero 3 on these ranks, 2 rows each per step."""
    return load_example().main([*EXAMPLE_FLAGS, "--batch-size", "2", "--zero", "3",
                                "--output-dir", os.path.join(out, "example")])


def resume_phase(out: str, rank: int, world: int) -> dict:
    import accelerate

    res = {}
    for name in TRAINER_RUNS:
        trainer = _trainer(name, out, rank, resume=True)
        res[name] = history(trainer)
        del trainer
    for name in ACCEL_RUNS:
        _, _, _, losses, norms = _accelerate(name, out, rank, world, True)
        res[name] = {"loss": losses, "grad_norm": norms}
        accelerate.state.GradientState._reset_state()
    return res


def main(argv) -> None:
    import torch.distributed as dist

    phase, out = argv
    torch.set_num_threads(1)
    quiet()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = (train_phase if phase == "train" else resume_phase)(out, rank, world)
    if rank == 0:
        torch.save(res, os.path.join(out, f"{phase}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.15's gloo can abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1:])
