"""Per-rank model-state memory and step time of tierlift.zero stages 1/2/3 against torch DDP and
FSDP2 (fully_shard), same model, same ranks, same optimizer (torch.optim.AdamW), one run.

    python benchmarks/bench_zero.py                       # 2 gloo ranks on CPU
    python benchmarks/bench_zero.py --nproc 4 --dim 512 --layers 8
    python benchmarks/bench_zero.py --cuda                # NCCL, one GPU per rank

Model-state bytes = live parameter storage (shards plus any gathered unit) + gradients +
optimizer state on the rank, measured right after a backward (the per-rank peak of model
state between steps). Time is the median step (forward, backward, optimizer) after warm-up.
Prints a table with ratios to FSDP2 and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODES = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.data_ptr() in seen and s.nbytes():
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _model_state_bytes(mode, model, opt) -> dict:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    if mode.startswith("zero"):
        # The gathered buffers and gradients too (stage 1/2 fp32 shards live inside them).
        units = model._tierlift_zero.units
        params += [u.full for u in units]
        grads += [u.full.grad for u in units] + [u.full_grad for u in units]
    optim = _storage_bytes(v for s in opt.state.values() for v in s.values()
                           if torch.is_tensor(v) and v.dim() > 0)
    p = _storage_bytes(params)
    g = _storage_bytes(grads)
    return {"params": p, "grads": g, "optim": optim, "total": p + g + optim}


def _build(mode, args, device):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        import tierlift

        tierlift.zero.shard(model, stage=int(mode[-1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def _worker(rank, world, port, args, out):
    device = torch.device("cuda", rank) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if args.cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    results = {}
    for mode in args.modes:
        model, opt = _build(mode, args, device)
        times, mem = [], None
        for step in range(args.warmup + args.steps):
            idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            if args.cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            if step == args.warmup + args.steps - 1:
                mem = _model_state_bytes(mode, model, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        step_s = torch.tensor(statistics.median(times))
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[mode] = {"step_s": step_s.item(), "bytes": mem}
        del model, opt
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads may still be releasing collective buffers,
    # which aborts a finalizing interpreter (torch 2.15).
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo on CPU")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8191)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/bench_zero-{cpu,gpu}.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.cuda and torch.cuda.device_count() < args.nproc:
        p.error(f"--cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "r.json")
        mp.spawn(_worker, args=(args.nproc, port, args, raw), nprocs=args.nproc)
        with open(raw) as f:
            results = json.load(f)
    machine = (torch.cuda.get_device_name(0) if args.cuda else
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, gloo")
    print(f"bench_zero: {args.nproc} ranks on {machine}; GPT d={args.dim} L={args.layers} "
          f"vocab={args.vocab}; batch {args.batch}x{args.seq} per rank; torch {torch.__version__}")
    base = results.get("fsdp2")
    print(f"{'mode':8} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'state MB':>9} "
          f"{'vs fsdp2':>8} {'step ms':>8} {'vs fsdp2':>8}")
    for mode, r in results.items():
        b = r["bytes"]
        mem_ratio = b["total"] / base["bytes"]["total"] if base else float("nan")
        t_ratio = r["step_s"] / base["step_s"] if base else float("nan")
        print(f"{mode:8} {b['params'] / 1e6:10.2f} {b['grads'] / 1e6:9.2f} "
              f"{b['optim'] / 1e6:9.2f} {b['total'] / 1e6:9.2f} {mem_ratio:8.2f} "
              f"{r['step_s'] * 1e3:8.1f} {t_ratio:8.2f}")
    if args.out is None:
        results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(results_dir, exist_ok=True)
        args.out = os.path.join(results_dir, f"bench_zero-{'gpu' if args.cuda else 'cpu'}.json")
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plots import plot_json, plot_zero

        print(f"wrote {plot_json(plot_zero, args.out, args.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
