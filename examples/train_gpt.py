r"""Train a small GPT on the Python standard library's own source code (on every machine, no
download) with tierlift's optimizer.

    python examples/train_gpt.py                          # CPU or GPU, 200 steps
    python examples/train_gpt.py --steps 500 --layers 6 --dim 256 --device cuda --dtype bf16
    python examples/train_gpt.py --optim torch            # the same run with torch.optim.AdamW
    python examples/train_gpt.py --lowp fp8-rowwise --lowp-min-features 0   # FP8 linears
    python examples/train_gpt.py --lowp mxfp4-quartet --lowp-min-features 0 # FP4 (Quartet)
    python examples/train_gpt.py --offload nvme --nvme-path /tmp   # optimizer state on NVMe
    python examples/train_gpt.py --offload-activations nvme --nvme-path /tmp   # saved activations
    python examples/train_gpt.py --plot bf16.png --dtype bf16      # loss, tokens/s as a PNG
    python examples/train_gpt.py --plot fp8.png --plot-with bf16.json --lowp fp8-rowwise \
        --lowp-min-features 0        # both recipes' curves on one chart (needs matplotlib)
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero 3   # ZeRO-3, 2 ranks
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero 3 --offload-params cpu \
        --offload nvme --nvme-path /tmp      # ZeRO-Infinity: params in RAM, state on NVMe
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero 3 --offload-params nvme \
        --offload nvme --nvme-path /tmp      # ZeRO-Infinity: params and state on NVMe
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --zero 3 --dtype bf16 \
        --lowp fp8-rowwise --lowp-min-features 0 --fp8-all-gather   # FP8 weights all-gathered
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 \
        examples/train_gpt.py --zero 3 --hierarchy node --grad-comm int8   # on each of 2 nodes

Flags are grouped: model, data, training, and tierlift features (one flag per capability, each
applied in build_training() in a fixed order). It prints a progress bar with loss and tokens/s,
the validation loss, and a line comparing tierlift's optimizer step time with torch's on this
model.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierlift  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--seq-len", type=int, default=128)
    d = ap.add_argument_group("data")
    d.add_argument(
        "--data-mb",
        type=float,
        default=8.0,
        help="MB of standard-library source to read (byte-level tokens)",
    )
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="parameter dtype; with bf16 the optimizer keeps fp32 master weights",
    )
    t.add_argument("--seed", type=int, default=0)
    f = ap.add_argument_group("tierlift features")
    f.add_argument(
        "--optim",
        default="tierlift",
        choices=["tierlift", "torch"],
        help="tierlift.optim.AdamW (SIMD CPU / fused CUDA) or torch.optim.AdamW",
    )
    f.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="ZeRO stage under torchrun (0: plain DDP when there are several ranks)",
    )
    f.add_argument(
        "--offload",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="where tierlift.optim.AdamW keeps optimizer state (nvme: files under --nvme-path)",
    )
    f.add_argument(
        "--offload-params",
        default="none",
        choices=["none", "cpu", "nvme"],
        help="with --zero 3: keep the fp32 parameter shards in (pinned) host memory, or in a "
        "mapped file under --nvme-path",
    )
    f.add_argument(
        "--offload-activations",
        default="none",
        choices=["none", "ram", "nvme"],
        help="tierlift.activations.offload_blocks: each block's saved activations in (pinned) "
        "RAM or on NVMe under --nvme-path, read back one block ahead in backward",
    )
    f.add_argument("--activations-budget", type=float, default=None,
                   help="with --offload-activations: RAM bytes for saved activations (ram: "
                   "unlimited by default; nvme: 0, everything goes to the disk)")
    f.add_argument("--nvme-path", default=None,
                   help="directory for the --offload nvme / --offload-params nvme / "
                   "--offload-activations nvme files")
    f.add_argument("--cpu-budget", type=float, default=None, help="pinned/RAM budget in bytes")
    f.add_argument(
        "--lowp",
        default="none",
        choices=["none", "fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp4-quartet",
                 "nvfp4", "mxfp4-rtn"],
        help="swap nn.Linear layers for tierlift.lowp low-precision training layers",
    )
    f.add_argument(
        "--lowp-min-features",
        type=int,
        default=1024,
        help="layers with min(in, out) below this stay in high precision (too small to gain)",
    )
    f.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="with --zero 3 and an fp8 --lowp recipe: all-gather Float8Linear weights in FP8",
    )
    f.add_argument(
        "--hierarchy",
        default=None,
        choices=["node"],
        help="with --zero: shard inside each node, sum gradient shards across nodes (HSDP)",
    )
    f.add_argument(
        "--grad-comm",
        default=None,
        choices=["int8", "fp8"],
        help="with --hierarchy: send the cross-node gradient sum blockwise-quantized",
    )
    f.add_argument(
        "--compare-steps",
        type=int,
        default=10,
        help="optimizer steps timed for the tierlift-vs-torch line (0: skip)",
    )
    o = ap.add_argument_group("output")
    o.add_argument("--plot", metavar="PATH", default=None,
                   help="draw loss and tokens/s over steps as a PNG (needs matplotlib); the run "
                   "is also saved beside it as PATH with .json")
    o.add_argument("--plot-with", metavar="JSON", nargs="+", default=(),
                   help="with --plot: earlier runs' .json to draw on the same chart (compare "
                   "--lowp recipes, dtypes or optimizers)")
    args = ap.parse_args(argv)
    if args.plot_with and not args.plot:
        ap.error("--plot-with needs --plot")
    if args.fp8_all_gather and (args.zero != 3 or not args.lowp.startswith("fp8")):
        ap.error("--fp8-all-gather needs --zero 3 and an fp8 --lowp recipe")
    if args.hierarchy and not args.zero:
        ap.error("--hierarchy needs --zero 1, 2 or 3")
    if args.grad_comm and not args.hierarchy:
        ap.error("--grad-comm needs --hierarchy node")
    if args.offload_activations == "nvme" and args.nvme_path is None:
        ap.error("--offload-activations nvme needs --nvme-path DIR")
    return args


def load_corpus(megabytes: float) -> torch.Tensor:
    """Bytes of the installed standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    budget, chunks = int(megabytes * 1e6), []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            chunks.append(path.read_bytes())
        except OSError:
            continue
        budget -= len(chunks[-1])
        if budget <= 0:
            break
    data = b"".join(chunks)[: int(megabytes * 1e6)]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator, device):
    while True:
        idx = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([data[i : i + seq_len] for i in idx])
        y = torch.stack([data[i + 1 : i + 1 + seq_len] for i in idx])
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def decay_group(name: str, param: torch.Tensor) -> str:
    """Weight decay on matrices (linears, embedding), none on norms and biases."""
    return "decay" if param.dim() >= 2 else "no_decay"


def make_optimizer(kind: str, model: torch.nn.Module, args) -> torch.optim.Optimizer:
    options = {"decay": {"weight_decay": args.weight_decay}, "no_decay": {"weight_decay": 0.0}}
    if args.zero:
        # shard(param_group_fn=decay_group) gave each unit one flat shard per group.
        groups = tierlift.zero.param_groups(model, options)
    else:
        split = {key: [] for key in options}
        for name, p in model.named_parameters():
            split[decay_group(name, p)].append(p)
        groups = [{"params": split[key], **opts} for key, opts in options.items()]
    if kind == "tierlift":
        offload = {}
        if args.offload != "none":
            budget = None if args.cpu_budget is None else int(args.cpu_budget)
            # The step of each chunk overlaps backward; the optimizer clips by the global norm
            # itself (an outside clip would rescale in place and discard the overlapped work).
            offload = dict(offload=args.offload, nvme_path=args.nvme_path, cpu_budget=budget,
                           overlap=True, max_grad_norm=args.clip if args.clip > 0 else None)
        return tierlift.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **offload)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def build_training(args, device):
    """Model, then each tierlift feature in a fixed order, then the optimizer. Returns the
    model, the optimizer and the activation offload's handle (None without one)."""
    torch.manual_seed(args.seed)
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, dim=args.dim)
    model = GPT(cfg).to(device)
    if args.dtype == "bf16" and not args.zero:
        model = model.to(torch.bfloat16)
    if args.lowp != "none":
        report = tierlift.lowp.convert(model, recipe=args.lowp, min_features=args.lowp_min_features)
        print(
            f"lowp {args.lowp}: {len(report.converted)} layers converted, "
            f"{len(report.skipped)} kept in high precision"
        )
    if args.zero:
        # After convert: shard() finds the Float8Linear layers whose weights it gathers in FP8.
        # bf16 under ZeRO: fp32 master shards, bf16 compute, fp32 gradient reduction.
        mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = tierlift.zero.shard(
            model, stage=args.zero, mixed_precision=mp if args.dtype == "bf16" else None,
            offload_params=args.offload_params, fp8_all_gather=args.fp8_all_gather,
            param_group_fn=decay_group, hierarchy=args.hierarchy, grad_comm=args.grad_comm,
            nvme_path=args.nvme_path if args.offload_params == "nvme" else None,
        )
    elif dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    activations = None
    if args.offload_activations != "none":
        # Blocks' saved tensors of 64 KiB and more leave the GPU (or the CPU heap).
        budget = args.activations_budget
        budget = int(budget) if budget is not None else (
            1 << 62 if args.offload_activations == "ram" else 0)
        activations = tierlift.activations.offload_blocks(
            model, args.offload_activations, cpu_budget=budget, nvme_path=args.nvme_path,
            min_bytes=1 << 16)
    optimizer = make_optimizer(args.optim, model, args)
    return model, optimizer, activations


def init_distributed(args) -> tuple[int, int, torch.device]:
    """(rank, world size, device): torchrun's environment, or one process."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.offload_params != "none" and args.zero != 3:
        raise SystemExit("--offload-params needs --zero 3 (and torchrun)")
    if args.offload_params == "nvme" and args.nvme_path is None:
        raise SystemExit("--offload-params nvme needs --nvme-path DIR")
    if "WORLD_SIZE" not in os.environ:
        if args.zero:
            raise SystemExit("--zero needs torchrun (torchrun --standalone --nproc_per_node=2 ...)")
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def clip_gradients(model, args) -> None:
    if args.clip <= 0 or (args.optim == "tierlift" and args.offload != "none"):
        return  # off, or done by the offloaded optimizer (max_grad_norm)
    if args.zero:
        tierlift.zero.clip_grad_norm_(model, args.clip)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


@torch.no_grad()
def evaluate(model, data, args, device, batches_n: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(data, args.batch_size, args.seq_len, gen, device)
    losses = [mean_over_ranks(model(*next(it))) for _ in range(batches_n)]
    model.train()
    return sum(losses) / len(losses)


def compare_optimizer_step(model, args, device) -> str:
    """Median step time of tierlift's and torch's AdamW on copies of this model, same grads."""
    times = {}
    for kind in ("tierlift", "torch"):
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = make_optimizer(kind, twin, args)
        samples = []
        for _ in range(args.compare_steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        times[kind] = statistics.median(samples[1:])
    n = sum(p.numel() for p in model.parameters())
    return (
        f"optimizer step on {n / 1e6:.2f}M params ({device.type}, {args.dtype}): tierlift "
        f"{times['tierlift'] * 1e3:.2f} ms, torch.optim.AdamW {times['torch'] * 1e3:.2f} ms "
        f"-> {times['torch'] / times['tierlift']:.2f}x"
    )


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    rank, world, device = init_distributed(args)
    data = load_corpus(args.data_mb)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    model, optimizer, activations = build_training(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"tierlift {tierlift.__version__} | {tierlift.build_info()}")
    log(
        f"data: {len(data) / 1e6:.1f} MB of stdlib source | model: {n_params / 1e6:.2f}M params "
        f"{'(this rank) ' if args.zero else ''}| optimizer: {type(optimizer).__module__}."
        f"{type(optimizer).__name__} | {device} | ranks: {world} | zero: {args.zero}"
    )
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    it = batches(train, args.batch_size, args.seq_len, gen, device)
    tokens_per_step = args.batch_size * args.seq_len * world
    first_loss, t_start = None, time.perf_counter()
    history = {"step": [], "loss": [], "tokens_per_s": []}
    t_last, step_last = t_start, 0
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, mininterval=0.5,
               disable=rank != 0)
    for step in bar:
        x, y = next(it)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients(model, args)
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            value = mean_over_ranks(loss)
            first_loss = value if first_loss is None else first_loss
            now = time.perf_counter()
            elapsed = now - t_start
            history["step"].append(step + 1)
            history["loss"].append(value)
            history["tokens_per_s"].append(tokens_per_step * (step + 1 - step_last)
                                           / max(now - t_last, 1e-9))
            t_last, step_last = now, step + 1
            bar.set_postfix(
                loss=f"{value:.3f}", tok_s=f"{tokens_per_step * (step + 1) / elapsed:,.0f}"
            )
    elapsed = time.perf_counter() - t_start
    if args.zero:
        gathered = model._tierlift_zero.comm.all_gather_bytes / args.steps
        log(f"all-gathered per step (this rank): {gathered:,.0f} bytes")
        sent = tierlift.zero.last_step_stats(model)
        log(f"sent in the last step (this rank): {sent['intra_node_bytes']:,} bytes inside "
            f"the node, {sent['inter_node_bytes']:,} to other nodes")
    val_loss = evaluate(model, val, args, device)
    log(
        f"loss {first_loss:.3f} -> {value:.3f} | val loss {val_loss:.3f}"
        f" | {tokens_per_step * args.steps / elapsed:,.0f} tokens/s"
    )
    if args.plot and rank == 0:
        recipe = args.lowp if args.lowp != "none" else args.dtype
        run = dict(history, label=f"{recipe} {args.optim}", val_step=[args.steps],
                   val_loss=[val_loss], title=f"train_gpt: {n_params / 1e6:.2f}M params, "
                   f"{device}, {world} rank(s)")
        from plot_run import save_run

        log(f"wrote {save_run(run, args.plot, args.plot_with)}")
    if getattr(optimizer, "last_step_stats", None):
        stats = {(k[:-2] + "_ms" if k.endswith("_s") else k): (round(v * 1e3, 2)
                 if k.endswith("_s") else v) for k, v in optimizer.last_step_stats.items()}
        log(f"last optimizer step breakdown: {stats}")
    if args.zero:
        log(f"zero stats (this rank, bytes): {model._tierlift_zero.stats}")
    if activations is not None:
        s = activations.last_stats
        log(f"activations offloaded per step: {s['ram_bytes'] / 1e6:.1f} MB to RAM, "
            f"{s['nvme_bytes'] / 1e6:.1f} MB to NVMe (read ahead {s['reads_ahead']}, on demand "
            f"{s['reads_on_demand']}, waited {s['read_wait_s'] * 1e3:.1f} ms)")
    if args.compare_steps > 0 and world == 1:
        log(compare_optimizer_step(model, args, device))
    # Remove offloaded state files now: the gloo exit below skips finalizers.
    if hasattr(optimizer, "close"):
        optimizer.close()
    if activations is not None:
        activations.close()
    if args.zero:
        tierlift.zero.close(model)
    if dist.is_initialized():
        dist.destroy_process_group()
        # torch 2.15's gloo backend can abort at interpreter exit while freeing collective
        # buffers ("terminate called without an active exception"); leave without teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
