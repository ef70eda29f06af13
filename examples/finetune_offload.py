r"""Fine-tune a Llama-shaped model whose optimizer state does not fit the RAM budget: AdamW state
(fp32 master, m, v) on NVMe, streamed through a pool of a fraction of its size, the CPU step
overlapped with backward, gradients clipped by the global norm inside the step.

    python examples/finetune_offload.py                        # 3M params, CPU, ~1 minute
    python examples/finetune_offload.py --checkpoint-dir /tmp/ft   # kill it, run again: resumes
    python examples/finetune_offload.py --durable --nvme-path /tmp/ftn  # the same, no checkpoint
    python examples/finetune_offload.py --plot ft.png   # loss, tokens/s, step legs (matplotlib)
    python examples/finetune_offload.py --pretrained base.pt --nvme-path /nvme0 \
        --layers 16 --dim 2048 --heads 16 --device cuda --dtype bf16 --steps 500

Data: the Python standard library's own source (no download); by default the `email`, `json`
and `http` packages, byte-level tokens, 95/5 train/validation split. The batch of step s is
drawn from a generator seeded with (seed, s), so a resumed run sees exactly the batches the
uninterrupted run would have seen. At the end it prints the loss, and the mean per-step
breakdown from optimizer.last_step_stats (compute, CPU step, NVMe read/write, checksums, waits).

--durable: the optimizer state on NVMe outlives the process (tierlift.optim.AdamW(...,
durable=True)), in --nvme-path/tierlift-durable-rank0. Kill the run at any moment (kill -9
included) and start it again with the same arguments: the optimizer reopens at its last
committed step (or finishes the step that was interrupted), the model takes its master weights,
and training goes on from that step, to the very bits of a run that was never killed; no
checkpoint is written. The loss history shown at the end covers only the last start. The folder
is kept while the run is unfinished and removed once its last step is done (a larger --steps
given to an unfinished run extends it); remove it by hand to start over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierlift  # noqa: E402
from llama_model import Llama, LlamaConfig, rope_tables  # noqa: E402
from tierlift.checkpoint import format as ckpt_format  # noqa: E402
from tierlift.offload.durable import durable_dir  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--dim", type=int, default=256)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=None, help="grouped KV heads (default: heads)")
    m.add_argument("--ffn-dim", type=int, default=None, help="SwiGLU width (default ~8/3 dim)")
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--pretrained", default=None,
                   help="torch state dict (.pt) of the model to fine-tune (default: random init)")
    d = ap.add_argument_group("data")
    d.add_argument("--packages", default="email,json,http",
                   help="standard-library packages whose .py files are the fine-tuning text")
    d.add_argument("--data-mb", type=float, default=4.0, help="at most this many MB of text")
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--max-grad-norm", type=float, default=1.0)
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="parameter dtype (auto: bf16 on a GPU, fp32 on CPU); the optimizer "
                        "keeps fp32 master weights")
    t.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("offload")
    o.add_argument("--nvme-path", default=None,
                   help="directory on the drive for the optimizer state (default: a temp dir)")
    o.add_argument("--budget-fraction", type=float, default=0.25,
                   help="cpu_budget as a fraction of the optimizer state's bytes (< 1)")
    o.add_argument("--no-overlap", action="store_true", help="step after backward only")
    o.add_argument("--durable", action="store_true",
                   help="keep the optimizer state in --nvme-path/tierlift-durable-rank0\n"
                        "across a kill: run again with the same arguments to go on\n"
                        "from its last step; the folder is removed once the last\n"
                        "step is done (needs --nvme-path; not with --checkpoint-dir)")
    c = ap.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", default=None,
                   help="save here every --checkpoint-every steps; resume from here if present")
    c.add_argument("--checkpoint-every", type=int, default=20)
    c.add_argument("--save-final", default=None, help="write the final model state dict here")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--plot", metavar="PATH", default=None,
                   help="draw loss, tokens/s and the per-step breakdown over steps as a PNG "
                   "(needs matplotlib); the run is also saved beside it as PATH with .json")
    args = ap.parse_args(argv)
    if not 0 < args.budget_fraction < 1:
        ap.error(f"--budget-fraction must be in (0, 1), got {args.budget_fraction}")
    if args.checkpoint_every <= 0:
        ap.error(f"--checkpoint-every must be > 0, got {args.checkpoint_every}")
    if args.pretrained is not None and not os.path.isfile(args.pretrained):
        ap.error(f"--pretrained {args.pretrained!r} is not a file")
    if args.durable and args.nvme_path is None:
        ap.error("--durable needs --nvme-path: a folder that outlives the run (the default is a "
                 "temp dir removed at exit)")
    if args.durable and args.checkpoint_dir is not None:
        ap.error("--durable and --checkpoint-dir are two ways to resume a killed run: give one")
    return args


def load_text(packages: str, megabytes: float) -> torch.Tensor:
    """Bytes of the .py files of the named standard-library packages, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in packages.split(","):
        pkg = root / name.strip()
        files += sorted(pkg.rglob("*.py")) if pkg.is_dir() else [pkg.with_suffix(".py")]
    data = b"".join(f.read_bytes() for f in files if f.is_file())[: int(megabytes * 1e6)]
    if len(data) < 10_000:
        raise SystemExit(f"--packages {packages!r}: only {len(data)} bytes of text found")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(data: torch.Tensor, step: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    idx = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
    x = torch.stack([data[i : i + args.seq_len] for i in idx])
    y = torch.stack([data[i + 1 : i + 1 + args.seq_len] for i in idx])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def build_model(args, device, dtype) -> Llama:
    heads = args.heads
    cfg = LlamaConfig(dim=args.dim, n_layer=args.layers, n_head=heads,
                      n_kv_head=args.kv_heads or heads,
                      ffn_dim=args.ffn_dim or 32 * -(-8 * args.dim // 3 // 32),
                      max_seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    model = Llama(cfg)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu", weights_only=True)
        model.load_state_dict(sd)
        print(f"pretrained weights: {args.pretrained}")
    else:
        print("pretrained weights: none given (--pretrained), random init")
    model = model.to(device=device, dtype=dtype)
    model.rope_cos, model.rope_sin = rope_tables(cfg, device)  # keep the rotary tables in fp32
    return model


def make_optimizer(model, args, nvme_path: str) -> tierlift.optim.AdamW:
    n = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n  # fp32 master, exp_avg, exp_avg_sq
    budget = int(state_bytes * args.budget_fraction)
    # durable=True: reopens a state left in nvme_path by a killed run (a RuntimeWarning says
    # so), giving the parameters its master weights and opt.state[p]["step"] its step counts.
    opt = tierlift.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                               weight_decay=args.weight_decay, offload="nvme",
                               nvme_path=nvme_path, cpu_budget=budget,
                               overlap=not args.no_overlap, max_grad_norm=args.max_grad_norm,
                               durable=args.durable)
    print(f"model: {n / 1e6:.2f}M params | optimizer state {state_bytes / 2**20:.1f} MiB on "
          f"NVMe under {nvme_path} | cpu_budget {budget / 2**20:.2f} MiB "
          f"({state_bytes / budget:.1f}x smaller than the state) | overlap {not args.no_overlap}")
    return opt


def committed_steps(model, opt) -> int:
    """The optimizer's step count: every parameter steps at every step here, so any one's
    count is the run's (0 for a new state). With --durable it is the reopened state's count, so
    the step to run next; the batch of step s depends on (seed, s) only, so the run goes on with
    the batches it would have seen. (A step skipped for a non-finite gradient is not counted: a
    run killed after one would go on from an earlier batch.)"""
    state = opt.state.get(next(model.parameters()), {})
    return int(state["step"]) if "step" in state else 0


# ---- checkpoints: tierlift.checkpoint, one directory replaced atomically -----------------
def save_checkpoint(path: str, step: int, model, opt, losses: list[float]) -> None:
    """Model, optimizer and progress (step, losses in metadata.json). The optimizer state is
    streamed from NVMe through the optimizer's own pool, never built in RAM; every file is
    SHA-256-checked; written to `path`.tmp then renamed over `path`."""
    tierlift.checkpoint.save(path, model, opt, extra={"step": step, "losses": losses})


def load_checkpoint(path: str, model, opt) -> tuple[int, list[float]] | None:
    """(step, losses) of the checkpoint at `path` after loading it, or None if there is none
    (a save killed between its two renames left `path`.old: that one is used)."""
    found = ckpt_format.resolve_dir(path)
    if not os.path.isfile(os.path.join(found, ckpt_format.METADATA)):
        return None
    extra = tierlift.checkpoint.load(path, model, opt)
    return extra["step"], extra["losses"]


# ---- the per-step breakdown ---------------------------------------------------------------
_WALL = [("compute (fwd+bwd)", "compute_s"), ("step(), blocking (GPU idle)", "step_wall_s"),
         ("  waiting for the overlap", "overlap_wait_s")]
_WORK = [("CPU Adam", "cpu_step_s"), ("NVMe read wait", "nvme_read_wait_s"),
         ("NVMe write wait + sync", "nvme_write_wait_s"), ("CRC-32C", "checksum_s"),
         ("D2H gradients", "d2h_s"), ("H2D weights", "h2d_s"),
         ("grad check + clip", "grad_check_s"), ("publish overlapped chunks", "publish_s"),
         ("first-step master init", "master_init_s")]


def print_breakdown(sums: dict, steps: int) -> None:
    """Mean ms per step. Wall time: what the training loop spent in compute and blocked in
    step(). Work: time per leg in whichever thread ran it; with overlap, part of it ran in the
    background during backward ("stepped during backward"), hidden behind compute."""
    if not steps:
        return

    def row(name, key):
        if key in sums:
            print(f"{name:<30}{sums[key] * 1e3 / steps:>10.2f}")

    print(f"\nper-step breakdown, ms (mean of {steps} steps, optimizer.last_step_stats)")
    print("-" * 40)
    for name, key in _WALL:
        row(name, key)
    row("stepped during backward", "overlapped_s")
    print("work by leg (any thread):")
    for name, key in _WORK:
        row("  " + name, key)
    mb = (sums.get("nvme_read_bytes", 0) + sums.get("nvme_write_bytes", 0)) / steps / 2**20
    print(f"NVMe traffic {mb:.2f} MiB/step | chunks stepped during backward and kept: "
          f"{int(sums.get('overlap_kept_chunks', 0))}, redone in step() (clipping scaled the "
          f"gradients): {int(sums.get('overlap_redone_chunks', 0))}")


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and cuda) else \
        torch.float32
    data = load_text(args.packages, args.data_mb)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    print(f"tierlift {tierlift.__version__} | data: {len(data) / 1e6:.2f} MB of stdlib "
          f"{args.packages} | {device} {str(dtype).removeprefix('torch.')}")
    model = build_model(args, device, dtype)
    tmp_nvme = None
    nvme_path = args.nvme_path
    if nvme_path is None:
        tmp_nvme = tempfile.TemporaryDirectory(prefix="finetune-nvme-")
        nvme_path = tmp_nvme.name
    opt = make_optimizer(model, args, nvme_path)
    start, losses = 0, []
    if args.checkpoint_dir:
        got = load_checkpoint(os.path.join(args.checkpoint_dir, "latest"), model, opt)
        if got is not None:
            start, losses = got
            print(f"resumed from {args.checkpoint_dir} at step {start}", flush=True)
    if args.durable:
        start = committed_steps(model, opt)
        where = durable_dir(nvme_path)
        if start:
            print(f"reopened the durable optimizer state {where} after {start} committed "
                  f"steps: resuming at step {start}", flush=True)
            if start >= args.steps:
                print(f"(--steps {args.steps}: nothing left to run)", flush=True)
        else:
            print(f"durable optimizer state: {where} (kill the run any time, run it again with "
                  "the same arguments to go on)", flush=True)
    sums: dict = defaultdict(float)
    timed = 0
    history = {"step": [], "loss": [], "tokens_per_s": [], "breakdown_step": [],
               "breakdown": {name.strip(): [] for name, key in _WALL[:1] + _WORK}}
    bar = tqdm(range(start, args.steps), desc="finetune", dynamic_ncols=True, mininterval=0.5,
               initial=start, total=args.steps, disable=args.no_progress)
    for step in bar:
        x, y = batch(train, step, args, device)
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        losses.append(loss.item())
        stats = opt.last_step_stats
        history["step"].append(step + 1)
        history["loss"].append(losses[-1])
        history["tokens_per_s"].append(x.numel() / (t2 - t0))
        if not stats.get("skipped"):
            history["breakdown_step"].append(step + 1)
            for name, key in _WALL[:1] + _WORK:
                value = t1 - t0 if key == "compute_s" else stats.get(key, 0.0)
                history["breakdown"][name.strip()].append(value * 1e3)
        if step > start and not stats.get("skipped"):  # the first step initialises masters
            timed += 1
            sums["compute_s"] += t1 - t0
            sums["step_wall_s"] += t2 - t1
            for k, v in stats.items():
                if isinstance(v, float):
                    sums[k] += v
        bar.set_postfix(loss=f"{losses[-1]:.3f}", norm=f"{stats.get('grad_norm', 0):.2f}")
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0):
            save_checkpoint(os.path.join(args.checkpoint_dir, "latest"), step + 1, model, opt,
                            losses)
            bar.write(f"checkpoint saved at step {step + 1}")
            sys.stdout.flush()
    bar.close()
    model.eval()
    with torch.no_grad():
        val_loss = sum(model(*batch(val, 10**9 + i, args, device)).item() for i in range(4)) / 4
    head = sum(losses[:5]) / max(len(losses[:5]), 1)
    tail = sum(losses[-5:]) / max(len(losses[-5:]), 1)
    print(f"loss {head:.3f} -> {tail:.3f} (mean of first/last 5 steps) | val loss {val_loss:.3f}")
    print_breakdown(sums, timed)
    if args.plot:
        from plot_run import save_run

        n = sum(p.numel() for p in model.parameters())
        run = dict(history, label="nvme offload", val_step=[args.steps], val_loss=[val_loss],
                   title=f"finetune_offload: {n / 1e6:.2f}M params, {device}, state on NVMe")
        print(f"wrote {save_run(run, args.plot)}")
    if args.save_final:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.save_final)
        print(f"final weights: {args.save_final}")
    opt.close()  # removes the state files now (a durable state's stay, to be reopened)
    if args.durable:  # the run is finished: nothing left to resume
        shutil.rmtree(durable_dir(nvme_path))
        print(f"all {args.steps} steps done: removed the durable optimizer state "
              f"{durable_dir(nvme_path)}")
    if tmp_nvme is not None:
        tmp_nvme.cleanup()


if __name__ == "__main__":
    main()
