"""Checkpoint save: how long the training thread stalls per save, and how long until the bytes
are durable, for tierlift.checkpoint.save against torch.distributed.checkpoint (DCP) save and
async_save, on the same model and optimizer state, one run.

    python benchmarks/bench_checkpoint.py                     # 1 process, then 2 gloo ranks
    python benchmarks/bench_checkpoint.py --ranks 1 --params 2e8 --repeat 5 --dir /nvme/tmp
    python benchmarks/bench_checkpoint.py --plot checkpoint.png
    python benchmarks/bench_checkpoint.py --device cuda --ranks 1 --configs ram --params 1e9

The model is a stack of Llama/GPT-shaped blocks of nn.Linear (qkv, proj, fc, out; about
--params parameters, fp32, on --device: the CPU, or with cuda the GPU, where parameters,
gradients and the optimizer state live, one process only) after two AdamW steps (tierlift's
fused CUDA kernel on the GPU). Configurations:
  1 rank, optimizer state in RAM:  tierlift.optim.AdamW
  1 rank, optimizer state on NVMe: tierlift.optim.AdamW(offload="nvme") -- DCP cannot save the
      offloaded state as it lies, so DCP gets optimizer.state_dict(), which reads it back into RAM
  N ranks (torchrun, gloo): tierlift.zero.shard(stage=3) + tierlift.optim.AdamW saved by tierlift,
      against DCP of an FSDP2 (fully_shard) model of the same shape with torch.optim.AdamW
      (tierlift's ZeRO state dict holds flat per-rank shards under one name, which DCP cannot
      place, so DCP is measured on torch's own sharded model instead)
Stall = time the save call blocks the caller (for DCP including get_state_dict); with cuda,
until the call returned and the CUDA stream it was called on is idle again, as the training
loop's next kernel would wait ("returned s": the call alone); total = until the bytes are
written and fsynced (async: until the future / handle completes). Everything is
flushed (os.sync) before each save; each save goes to a fresh directory, deleted afterwards.
Median of --repeat saves after --warmup; with ranks, the slowest rank. "stall vs sync" and
"total vs sync" divide by tierlift's blocking save (targets for blocking=False: stall <= 0.1,
total <= 1.2). tierlift's background save keeps its staging buffers between saves, as a
training run saving every N steps would (the warmup save allocates them). Prints a table and
writes JSON (--out), rewritten after every row of one process (a run cut short keeps its rows).
--configs and --contenders pick a subset (a 1B-parameter run on a time budget), run in the order
--contenders names them (the ones that matter first, where a time limit may cut the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, machine, print_table  # noqa: E402

# DCP in one process without a process group says it assumes one process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

COLUMNS = ["ranks", "device", "config", "contender", "stall s", "returned s", "total s",
           "GB written", "GB/s"]
CONFIGS = {"ram": "optim in RAM", "nvme": "optim on NVMe"}
CONTENDERS = {"sync": "tierlift save", "background": "tierlift save(blocking=False)",
              "background-budget": "tierlift save(blocking=False, budget 1/8)",
              "dcp": "dcp save", "dcp-async": "dcp async_save"}


class Block(nn.Module):
    """The Linear layers of a transformer block (no attention math: the state is what counts)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.proj(self.qkv(x).chunk(3, dim=-1)[0])
        return x + self.out(F.gelu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def shape_for(params: float) -> tuple[int, int]:
    """(width, layers) of a Stack with about `params` parameters (12 d^2 per block)."""
    layers = 8
    d = max(16, int(round((params / (12 * layers)) ** 0.5 / 16)) * 16)
    return d, layers


def _train(model, opt, d: int, steps: int = 2, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model(torch.randn(8, d, generator=g).to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def contenders(model, opt, dcp_model=None, dcp_opt=None) -> dict:
    """name -> fn(path) returning a wait() callable (None when the call itself was blocking)."""
    import torch.distributed.checkpoint as dcp

    import tierlift.checkpoint as tc

    dcp_model, dcp_opt = dcp_model or model, dcp_opt or opt
    def dcp_save(p):
        dcp.save(_dcp_state(dcp_model, dcp_opt), checkpoint_id=p)

    # an eighth of the state in staging: save() returns when 7/8 are written
    budget = max(1 << 20, 12 * sum(p.numel() for p in model.parameters()) // 8)
    def sync(p):
        tc.save(p, model, opt)

    out = {"tierlift save": sync,
           "tierlift save(blocking=False)": lambda p: tc.save(p, model, opt,
                                                              blocking=False).wait,
           "tierlift save(blocking=False, budget 1/8)": lambda p: tc.save(
               p, model, opt, blocking=False, staging_budget=budget).wait}
    out["dcp save"] = dcp_save
    out["dcp async_save"] = (
        lambda p: dcp.async_save(_dcp_state(dcp_model, dcp_opt), checkpoint_id=p).result)
    return out


def _max(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return t.item()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure(name: str, fn, root: str, repeat: int, warmup: int, cuda: bool = False) -> dict:
    """With `cuda`, the stall ends when the current CUDA stream is idle too: work save() queued
    there (device-to-host copies) holds up the next training kernel as long."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    stalls, returns, totals, nbytes = [], [], [], 0
    for i in range(-warmup, repeat):
        path = os.path.join(root, f"{name.split()[0]}-{i}")  # deleted before the next
        os.sync()  # earlier writes (the last save, the offloader's swap files) are not ours
        _barrier()
        if cuda:
            torch.cuda.synchronize()  # the GPU idle, as after a step the loop waited for
        t0 = time.perf_counter()
        wait = fn(path)
        t_ret = t1 = time.perf_counter()
        if cuda:
            torch.cuda.current_stream().synchronize()
            t1 = time.perf_counter()
        if wait is not None:
            wait()
        t2 = time.perf_counter()
        stall, total = _max(t1 - t0), _max(t2 - t0)
        if i >= 0:
            stalls.append(stall)
            returns.append(_max(t_ret - t0))
            totals.append(total)
        _barrier()
        if rank == 0:
            nbytes = _dir_bytes(path)
            shutil.rmtree(path)
        _barrier()
    total = statistics.median(totals)
    return {"contender": name, "stall s": statistics.median(stalls),
            "returned s": statistics.median(returns), "total s": total,
            "GB written": nbytes / 1e9, "GB/s": nbytes / 1e9 / total}


def _progress(r: dict) -> None:
    ret = f" (returned {r['returned s']:.3f} s)" if r["returned s"] != r["stall s"] else ""
    print(f"  {r['ranks']} rank(s), {r['config']}, {r['contender']}: stall {r['stall s']:.3f} s"
          f"{ret}, total {r['total s']:.3f} s, {r['GB written']:.3f} GB", flush=True)


def _wanted(args, table: dict) -> list[str]:
    """The contenders asked for, in the order asked (once each)."""
    return [table[k] for k in dict.fromkeys(args.contenders)]


def run_single(args, root: str, rows: list, save, info: dict) -> list[dict]:
    """One process, on args.device. `info` gets which Adam kernel stepped the state."""
    import tierlift
    from tierlift import ops

    d, layers = shape_for(args.params)
    cuda = args.device == "cuda"
    for config in (CONFIGS[k] for k in CONFIGS if k in args.configs):
        torch.manual_seed(0)
        with torch.device(args.device):  # built where it lives: no 1B-parameter host init
            model = Stack(d, layers)
        kw = {}
        if config == "optim on NVMe":
            kw = dict(offload="nvme", nvme_path=tempfile.mkdtemp(prefix="swap-", dir=root))
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-4, **kw)
        _train(model, opt, d, device=args.device)
        if not kw:
            p = next(model.parameters())
            info[config] = (f"tierlift.optim.AdamW on {p.device.type}: "
                            + ("compiled kernel" if ops.runs_kernel(p) else
                               "pure-torch reference (no compiled kernel for this device)"))
        by_name = contenders(model, opt)
        for name in _wanted(args, CONTENDERS):
            row = measure(name, by_name[name], root, args.repeat, args.warmup, cuda=cuda)
            rows.append({"ranks": 1, "device": args.device, "config": config, **row})
            _progress(rows[-1])
            save()
        del model, opt, by_name
        if cuda:
            torch.cuda.empty_cache()
    return rows


def run_ranks(args, root: str) -> list[dict]:
    """One torchrun worker: tierlift ZeRO-3 vs DCP of FSDP2, same shape, same ranks."""
    from torch.distributed.fsdp import fully_shard

    import tierlift

    world = dist.get_world_size()
    d, layers = shape_for(args.params)
    torch.manual_seed(0)
    zmodel = tierlift.zero.shard(Stack(d, layers), stage=3)
    zopt = tierlift.optim.AdamW(zmodel.parameters(), lr=1e-4)
    _train(zmodel, zopt, d)
    torch.manual_seed(0)
    fmodel = Stack(d, layers)
    for b in fmodel.blocks:
        fully_shard(b)
    fully_shard(fmodel)
    fopt = torch.optim.AdamW(fmodel.parameters(), lr=1e-4, foreach=True)
    _train(fmodel, fopt, d)
    config = "ZeRO-3 / FSDP2"
    rows = []
    by_name = contenders(zmodel, zopt, fmodel, fopt)
    for name in _wanted(args, CONTENDERS):
        row = measure(name, by_name[name], root, args.repeat, args.warmup)
        rows.append({"ranks": world, "device": "cpu", "config": config, **row})
        if dist.get_rank() == 0:
            _progress(rows[-1])
    return rows


def worker(args) -> int:
    """Entry under torchrun: every rank measures, rank 0 writes its rows to args.rows."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    root = [tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.dir)
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    try:
        rows = run_ranks(args, root[0])
    finally:
        _barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root[0], ignore_errors=True)
    if dist.get_rank() == 0:
        Path(args.rows).write_text(json.dumps(rows))
    dist.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter teardown: gloo's threads may still be releasing collective buffers,
    # which aborts a finalizing interpreter (torch 2.15; as in bench_zero.py).
    os._exit(0)


def launch(args, ranks: int, argv: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", os.path.abspath(__file__), *argv, "--rows", rows]
        print("$ " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        return json.loads(Path(rows).read_text())


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=5e7, help="model size, parameters")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model, its gradients and the optimizer state live (cuda: "
                        "one process, --ranks 1)")
    p.add_argument("--repeat", type=int, default=3, help="saves per contender (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured saves per contender")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                   help="1 = one process; N > 1 = N gloo ranks under torchrun")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: $TMPDIR)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="1 rank: optimizer state in RAM and/or on NVMe")
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS),
                   help="which saves to time: " + ", ".join(f"{k} = {v}"
                                                            for k, v in CONTENDERS.items()))
    p.add_argument("--out", default=None, help="JSON path (default: "
                   "benchmarks/results/bench_checkpoint-<device>.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    p.add_argument("--rows", help=argparse.SUPPRESS)  # set by launch() for its torchrun workers
    args = p.parse_args(argv)
    if "WORLD_SIZE" in os.environ and args.rows:
        return worker(args)
    if args.device == "cuda":  # refused before anything is built or written
        if any(r != 1 for r in args.ranks):
            p.error(f"--device cuda runs one process only: pass --ranks 1 (got --ranks "
                    f"{' '.join(map(str, args.ranks))}; ranks > 1 compare ZeRO-3 with FSDP2 "
                    "on gloo, CPU only)")
        if not torch.cuda.is_available():
            p.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False "
                    "here (use --device cpu)")

    d, layers = shape_for(args.params)
    n = 12 * d * d * layers
    notes = [
        "stall: the save call blocks the caller; total: until written and fsynced "
        "(async: until the future/handle completes); median of --repeat; ranks: slowest rank",
        "optim on NVMe: DCP saves optimizer.state_dict(), which reads tierlift's offloaded "
        "state back into RAM; tierlift streams it within the optimizer's cpu_budget",
        "ranks > 1: tierlift ZeRO-3 + tierlift AdamW (tierlift save) vs FSDP2 + torch AdamW "
        "(DCP), same shape, gloo on CPU",
    ]
    if args.device == "cuda":
        notes.append("device cuda: parameters, gradients and AdamW state on the GPU; stall "
                     "lasts until the call returned and the CUDA stream it was called on is "
                     "idle (the next training kernel waits that long); returned s: the call "
                     "alone; DCP async_save with its defaults (torch 2.15 stages with a "
                     "blocking copy into fresh pageable memory)")
    info: dict = {}
    where = (f"on {torch.cuda.get_device_name()}" if args.device == "cuda" else "on the CPU")
    print(f"bench_checkpoint: Stack d={d} L={layers} = {n / 1e6:.1f}M params fp32 "
          f"(+2 AdamW moments) {where}; {machine()['cpu']}, {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}")
    for note in notes:
        print("  " + note)
    rows = []
    out = Path(args.out) if args.out else RESULTS / f"bench_checkpoint-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps({
            "machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "rows"},
            "model": {"params": n, "dim": d, "layers": layers},
            "device": {"type": args.device, **({"name": torch.cuda.get_device_name()}
                                               if args.device == "cuda" else {})},
            "optimizer": info, "notes": notes, "rows": rows}, indent=1))

    for ranks in args.ranks:
        if ranks == 1:
            root = tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.dir)
            try:
                run_single(args, root, rows, save, info)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        else:
            rows += launch(args, ranks, _without(argv, {"--ranks", "--out", "--plot"}))
            save()
    def ref(r, name):
        return next((x for x in rows if x["ranks"] == r["ranks"] and x["config"] == r["config"]
                     and x["contender"] == name), None)

    for r in rows:  # a ratio whose reference row is missing is left out (JSON has no NaN)
        dcp_async, sync = ref(r, "dcp async_save"), ref(r, "tierlift save")
        if dcp_async:
            r["stall vs dcp async"] = r["stall s"] / dcp_async["stall s"]
        if sync:
            r["stall vs sync"] = r["stall s"] / sync["total s"]
            r["total vs sync"] = r["total s"] / sync["total s"]
    print_table(rows, COLUMNS + ["stall vs dcp async", "stall vs sync", "total vs sync"],
                title=f"checkpoint save, {n / 1e6:.1f}M params, median of {args.repeat}")
    save()
    print(f"wrote {out}", file=sys.stderr)
    if args.plot:
        from plots import plot_checkpoint, plot_json

        print(f"wrote {plot_json(plot_checkpoint, out, args.plot)}", file=sys.stderr)
    return 0


def _without(argv: list[str], flags: set[str]) -> list[str]:
    """argv less the given options and their values (`--x v`, `--x v1 v2`, `--x=v`)."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a.split("=", 1)[0] in flags
            if skip:
                continue
        elif skip:
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
