"""Hugging Face Trainer / Accelerate on a model the user converted to FP8 / FP4 layers
(tierlift.lowp.convert) with blocks under tierlift.activations.offload_blocks.

One process, plain transformers.Trainer, against the same converted model without the extras:
HF gradient checkpointing (reentrant and not) on top of offload_blocks' ram and recompute
tiers, with evaluate() between steps and predict() after, trains bit for bit as without either
(and eval spills nothing); bf16=True runs the FP8 layers in autocast's dtype, as
torch.autocast does outside the Trainer; a checkpoint resumes bit for bit (FP4's stochastic
rounding too: its draws follow the restored RNG) and save_model -> from_pretrained into a
plain model -> convert again gives the trained model's logits.

Two gloo ranks (one torchrun launch, this file as the worker): tierlift.hf.Trainer at ZeRO-3
with gradient checkpointing, and with the FP8 all-gather plus load_best_model_at_end, and
tierlift.hf.Accelerator with bf16, against one process running each rank's half of a micro-batch
as its own forward (FP8 scales are per forward): losses and norms within 1e-5, logits equal;
resuming (resume_from_checkpoint, load_state) repeats steps 4-6 bit for bit; the saved model,
loaded plainly and converted again, gives the sharded model's logits.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402

import tierlift  # noqa: E402
import tierlift.activations  # noqa: E402
import tierlift.lowp  # noqa: E402

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TIERS = ["ram", "recompute"]  # block 0 spilled to host memory, block 1 recomputed
BEST = dict(eval_strategy="steps", eval_steps=W.SAVE_AT, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", greater_is_better=True,  # picks checkpoint-3
            per_device_eval_batch_size=4)
# name -> (recipe, ZeroConfig fields, extra TrainingArguments)
TRAINER_RUNS = {
    "z3_gc": ("fp8-rowwise", {"stage": 3}, {"gradient_checkpointing": True}),
    "z3_fp8_gather_best": ("fp8-tensorwise", {"stage": 3, "shard_kwargs": {"fp8_all_gather": True}},
                           BEST),
}


def converted(recipe: str):
    model = W.build("llama")
    tierlift.lowp.convert(model, recipe, min_features=0)  # every Linear (dims are 32 / 64)
    return model


def losses(trainer) -> dict:
    return W.history(trainer)["loss"]


# ---- one process, plain transformers.Trainer ----
def plain_trainer(model, out: str, trainer_cls=None, **extra):
    from transformers import Trainer

    W.quiet()
    torch.set_num_threads(1)
    return (trainer_cls or Trainer)(model=model, args=W.training_args(out, batch=4, **extra),
                                    train_dataset=W.Data(), eval_dataset=W.Data())


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_over_offload_blocks_with_eval_is_bit_exact(tmp_path, reentrant):
    evals = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
                 save_strategy="no")
    base = converted("fp8-rowwise")
    want = plain_trainer(copy.deepcopy(base), str(tmp_path / "ref"), **evals)
    want.train()
    model = copy.deepcopy(base)
    handle = tierlift.activations.offload_blocks(model, TIERS, cpu_budget=1 << 20, min_bytes=0)
    got = plain_trainer(model, str(tmp_path / "got"), gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": reentrant}, **evals)
    got.train()
    assert losses(got) == losses(want)  # bit for bit

    def eval_losses(t):
        return [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e]

    assert eval_losses(got) == eval_losses(want) and len(eval_losses(want)) == 3
    pool = handle._offload._host_pool
    assert pool.held == 0  # every forward's saved tensors returned to the budget
    stats = handle.last_stats
    predicted = got.predict(W.Data())
    assert predicted.metrics["test_loss"] == want.predict(W.Data()).metrics["test_loss"]
    assert pool.held == 0 and handle.last_stats == stats  # no_grad: nothing saved


def test_bf16_trainer_runs_fp8_layers_in_autocast_dtype(tmp_path):
    from transformers import Trainer

    from tierlift.lowp.linear import Float8Linear

    class InOrder(Trainer):  # the first batch is rows 0-3, to recompute its loss below
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    base = converted("fp8-rowwise")
    model = copy.deepcopy(base)
    seen = []
    layer = next(m for m in model.modules() if isinstance(m, Float8Linear))
    layer.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    trainer = plain_trainer(model, str(tmp_path), trainer_cls=InOrder, bf16=True, max_steps=1,
                            gradient_accumulation_steps=1)
    trainer.train()
    assert set(seen) == {torch.bfloat16}
    x = W.Data().x[:4]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = base(input_ids=x, labels=x).loss.item()
    with torch.no_grad():
        fp32 = base(input_ids=x, labels=x).loss.item()
    assert losses(trainer)[1] == want != fp32


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-quartet"])
def test_resume_and_save_model_then_convert_again_are_exact(tmp_path, recipe):
    from transformers import AutoModelForCausalLM

    base = converted(recipe)
    out = str(tmp_path / "run")
    first = plain_trainer(copy.deepcopy(base), out)
    first.train()
    again = plain_trainer(copy.deepcopy(base), out)
    again.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{W.SAVE_AT}"))
    assert losses(again) == losses(first)  # steps 4-6 recomputed bit for bit
    first.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    tierlift.lowp.convert(reloaded, recipe, min_features=0)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=W.PROBE).logits,
                           first.model(input_ids=W.PROBE).logits)


# ---- two ranks ----
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_lowp"))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERLIFT_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.abspath(__file__), root]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    result = os.path.join(root, "ranks.pt")
    assert proc.returncode == 0 and os.path.exists(result), \
        f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(result, weights_only=False), root


def split_reference(recipe: str, **extra):
    """Plain Trainer in one process, each rank's PER_RANK rows its own micro-batch: the global
    batch in the same order (accelerate hands batch 2i to rank 0, 2i+1 to rank 1)."""
    trainer = plain_trainer(converted(recipe), tempfile.mkdtemp(), save_strategy="no"
                            if "load_best_model_at_end" not in extra else "steps",
                            **{**extra, "per_device_train_batch_size": W.PER_RANK,
                               "gradient_accumulation_steps": 2 * W.ACCUM})
    trainer.train()
    with torch.no_grad():
        logits = trainer.model(input_ids=W.PROBE).logits
    return trainer, logits


def close(a: dict, b: dict, rtol=1e-5):
    assert sorted(a) == sorted(b)
    torch.testing.assert_close(torch.tensor([a[k] for k in sorted(a)]),
                               torch.tensor([b[k] for k in sorted(b)]), rtol=rtol, atol=0)


@pytest.mark.parametrize("name", list(TRAINER_RUNS))
def test_zero_trainer_on_converted_offloaded_model(name, ranks):
    from transformers import AutoModelForCausalLM

    res, root = ranks
    recipe, _, extra = TRAINER_RUNS[name]
    got = res[name]
    ref, logits = split_reference(recipe, **{k: v for k, v in extra.items()
                                             if k != "gradient_checkpointing"})
    close(got["loss"], losses(ref))
    close(got["grad_norm"], W.history(ref)["grad_norm"])
    torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    if "load_best_model_at_end" in extra:  # the live model holds checkpoint-3's weights
        assert got["best"].endswith(f"checkpoint-{W.SAVE_AT}")
        assert os.path.basename(ref.state.best_model_checkpoint) == f"checkpoint-{W.SAVE_AT}"
        assert got["spilled"] > 0
        close(got["eval"], {e["step"]: e["eval_loss"] for e in ref.state.log_history
                            if "eval_loss" in e})  # evaluate() under ZeRO-3 between steps
        return
    resumed = res[name + "_resume"]
    for step in range(W.SAVE_AT + 1, W.STEPS + 1):
        assert resumed["loss"][step] == got["loss"][step], step
        assert resumed["grad_norm"][step] == got["grad_norm"][step], step
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, name, "final"))
    tierlift.lowp.convert(reloaded, recipe, min_features=0)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=W.PROBE).logits, got["logits"])


def test_accelerate_bf16_on_converted_offloaded_model(ranks):
    from transformers import AutoModelForCausalLM

    res, root = ranks
    got, resumed = res["acc"], res["acc_resume"]
    torch.set_num_threads(1)
    model = converted("fp8-rowwise")
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR, weight_decay=0.0)
    sched = W.schedule(opt)
    want, norms = {}, {}
    for step in range(W.STEPS):
        total = 0.0
        for micro in range(W.ACCUM):
            x = W.global_micro_batch(step, micro)
            for rank in range(2):  # each rank's rows: a forward of its own
                rows = x[rank * W.PER_RANK:(rank + 1) * W.PER_RANK]
                with torch.autocast("cpu", torch.bfloat16):
                    loss = model(input_ids=rows, labels=rows).loss.float() / (2 * W.ACCUM)
                loss.backward()
                total += loss.item()
        norms[step + 1] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), W.CLIP))
        opt.step()
        for _ in range(2):  # accelerate steps the scheduler once per process
            sched.step()
        opt.zero_grad()
        want[step + 1] = total
    close(got["loss"], want)
    close(got["grad_norm"], norms)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(got["logits"], model(input_ids=W.PROBE).logits.float(),
                                   rtol=1e-5, atol=1e-5)
    assert got["unwrapped"] == "LlamaForCausalLM"
    for step in range(W.SAVE_AT + 1, W.STEPS + 1):
        assert resumed["loss"][step] == got["loss"][step], step
        assert resumed["grad_norm"][step] == got["grad_norm"][step], step
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "acc", "final"))
    tierlift.lowp.convert(reloaded, "fp8-rowwise", min_features=0)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(reloaded(input_ids=W.PROBE).logits.float(), got["logits"])


# ---- under torchrun ----
def _trainer_run(out: str, name: str, resume: bool) -> dict:
    import tierlift.hf

    recipe, zero, extra = TRAINER_RUNS[name]
    model = converted(recipe)
    handle = tierlift.activations.offload_blocks(model, TIERS, cpu_budget=1 << 20, min_bytes=0)
    trainer = tierlift.hf.Trainer(
        model=model, args=W.training_args(os.path.join(out, name), batch=W.PER_RANK, **extra),
        train_dataset=W.Data(), eval_dataset=W.Data(), zero=tierlift.hf.ZeroConfig(**zero))
    ckpt = os.path.join(out, name, f"checkpoint-{W.SAVE_AT}") if resume else None
    trainer.train(resume_from_checkpoint=ckpt)
    r = W.history(trainer)
    r["best"] = trainer.state.best_model_checkpoint
    r["eval"] = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    r["spilled"] = handle.last_stats["ram_bytes"]
    if not resume:
        trainer.save_model(os.path.join(out, name, "final"))
        with torch.no_grad():
            r["logits"] = trainer.model(input_ids=W.PROBE).logits.clone()
    return r


def _accelerate_run(out: str, rank: int, world: int, resume: bool) -> dict:
    import accelerate

    import tierlift.hf

    model = converted("fp8-rowwise")
    tierlift.activations.offload_blocks(model, TIERS, cpu_budget=1 << 20, min_bytes=0)
    model = tierlift.zero.shard(model, stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=W.LR, weight_decay=0.0)
    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = tierlift.hf.Accelerator(cpu=True, gradient_accumulation_steps=W.ACCUM,
                                          mixed_precision="bf16")
    model, opt, sched = accelerator.prepare(model, opt, W.schedule(opt))
    state = os.path.join(out, "acc", "state")
    if resume:
        accelerator.load_state(state)
    loss, norms = W.accelerate_loop(model, opt, sched, accelerator, W.SAVE_AT if resume else 0,
                                    rank, world, None if resume else state)
    r = {"loss": loss, "grad_norm": norms}
    if not resume:
        unwrapped = accelerator.unwrap_model(model)
        r["unwrapped"] = type(unwrapped).__name__
        unwrapped.save_pretrained(os.path.join(out, "acc", "final"))
        with torch.no_grad():
            r["logits"] = model(input_ids=W.PROBE).logits.float().clone()
    accelerate.state.GradientState._reset_state()
    return r


def _worker(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    W.quiet()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    for name in TRAINER_RUNS:
        res[name] = _trainer_run(out, name, resume=False)
        if "load_best_model_at_end" not in TRAINER_RUNS[name][2]:
            res[name + "_resume"] = _trainer_run(out, name, resume=True)
    res["acc"] = _accelerate_run(out, rank, world, resume=False)
    res["acc_resume"] = _accelerate_run(out, rank, world, resume=True)
    if rank == 0:
        torch.save(res, os.path.join(out, "ranks.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.15's gloo can abort at interpreter exit


if __name__ == "__main__":
    _worker(sys.argv[1])
