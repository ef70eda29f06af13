"""Saved activations of a GPT block stack kept, copied to host memory by torch's save_on_cpu,
recomputed by torch.utils.checkpoint, or tiered by tierlift.activations (RAM; NVMe): training
step time and peak memory of each, measured side by side in one run, and the fraction of the
NVMe I/O that tierlift hides behind compute.

    python benchmarks/bench_activations.py                  # CPU: 8 blocks, files under /tmp
    python benchmarks/bench_activations.py --dir /nvme --layers 12 --plot activations.png

Contenders (every one runs forward + backward of the same model and batch):
  keep              nothing moved (the memory every other row saves from)
  save_on_cpu       torch.autograd.graph.save_on_cpu(pin_memory=True) on a GPU: synchronous
                    copies of every saved tensor; on the CPU, where save_on_cpu keeps host
                    tensors as they are, the same synchronous copy to a new host tensor
  checkpoint        torch.utils.checkpoint around every block (full recomputation)
  tierlift ram      offload_blocks(model, "ram"): every block's activations in (pinned) RAM
  tierlift nvme     offload_blocks(model, "nvme", cpu_budget=0): every block to NVMe, with an
                    I/O window of two blocks (write-behind in forward, one block read ahead in
                    backward)
Step time: median over --repeats rounds, the contenders timed in turn within each round.
Peak memory: on the CPU, the growth of the process's peak RSS over one step (VmHWM reset
through /proc/self/clear_refs; the bench re-executes itself with MALLOC_MMAP_THRESHOLD_ so
freed buffers leave RSS at once; gradients are allocated before, tierlift's reusable RAM-tier
buffers are freed before, so they count); on a GPU,
torch.cuda.max_memory_allocated over the step. Parameters and gradients are not counted.
I/O hidden: 1 - (step(tierlift nvme) - step(keep)) / io_alone, where io_alone is the time the
same bytes take to be written and read back through tierlift.io (same engine settings, same
number and size of requests) with nothing else running. Also printed: the time the step itself
waited for I/O (tierlift's write_wait_s + read_wait_s), whose complement is the I/O time that
ran beside compute; the two differ where the I/O's own CPU work (staging copies, the kernel's
block layer) slows the compute it runs beside, as on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import tierlift  # noqa: E402, F401
from common import RESULTS, interleaved_medians, machine, print_table  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from tierlift import _peak_rss  # noqa: E402
from tierlift.activations import offload_blocks  # noqa: E402
from tierlift.activations.context import Engines  # noqa: E402
from tierlift.activations.session import ActivationFile  # noqa: E402

_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def save_on_cpu():
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def copy_on_cpu():
    """save_on_cpu's synchronous copy for host tensors (save_on_cpu itself keeps them)."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.detach().clone(memory_format=torch.preserve_format), lambda t: t)


def peak_growth(step, cuda: bool) -> int:
    """Bytes the step's peak memory exceeds the memory before it."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return _peak_rss.growth(step)[0]


def Checkpointed(blocks) -> None:  # noqa: N802 - reads as the contender's name
    """torch.utils.checkpoint around each block's forward, as a model would apply it."""
    for b in blocks:
        b.forward = lambda *a, _f=b.forward: torch.utils.checkpoint.checkpoint(
            _f, *a, use_reentrant=False)


def io_alone(directory: str, n_requests: int, nbytes: int, io_bytes: int) -> float:
    """Seconds to write `n_requests` tensors of `nbytes` to an anonymous file and read them back
    through the engine tierlift.activations uses, at most io_bytes in flight (its window)."""
    from tierlift.activations.config import OffloadConfig

    engines = Engines(OffloadConfig(cpu_budget=0, nvme_path=directory, io_bytes=io_bytes))
    file = ActivationFile(directory, engines.get())
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    per = max(1, io_bytes // max(nbytes, 1))
    offsets = [file.reserve(nbytes) for _ in range(n_requests)]
    t0 = time.perf_counter()
    for op, buf in ((file.engine.write, src), (file.engine.read, dst)):
        for i in range(0, n_requests, per):
            for h in [op(buf, file.path, off) for off in offsets[i:i + per]]:
                h.wait()
    elapsed = time.perf_counter() - t0
    file.close()
    engines.close()
    return elapsed


def run(args) -> dict:
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, dim=args.dim, seq_len=args.seq_len, n_head=args.heads)
    model = GPT(cfg).to(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len), generator=g).to(device)
    y = torch.randint(0, 256, (args.batch, args.seq_len), generator=g).to(device)
    directory = tempfile.mkdtemp(prefix="bench_activations-", dir=args.dir)

    # Measure a block's saved bytes once (tierlift ram, unlimited), to size the NVMe window.
    probe = offload_blocks(model, "ram", cpu_budget=1 << 62, min_bytes=args.min_bytes)
    model(x, y).backward()
    stats = dict(probe.last_stats)
    probe.close()
    block_bytes = stats["ram_bytes"] // args.layers
    io_bytes = max(2 * block_bytes, 1 << 20)

    # Each contender trains its own copy of the model (same weights), wrapped once.
    def copy_model():
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.grad = torch.zeros_like(p)
        return twin

    def step(m, context=contextlib.nullcontext):
        def go():
            with context():
                loss = m(x, y)
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
        return go

    ckpt_model, ram_model, nvme_model = copy_model(), copy_model(), copy_model()
    Checkpointed(ckpt_model.blocks)
    ram = offload_blocks(ram_model, "ram", cpu_budget=1 << 62, min_bytes=args.min_bytes)
    nvme = offload_blocks(nvme_model, "nvme", cpu_budget=0, nvme_path=directory,
                          io_bytes=io_bytes, min_bytes=args.min_bytes)
    steps = {
        "keep": step(model),
        "save_on_cpu": step(model, save_on_cpu if cuda else copy_on_cpu),
        "checkpoint": step(ckpt_model),
        "tierlift ram": step(ram_model),
        "tierlift nvme": step(nvme_model),
    }
    times = interleaved_medians(steps, repeats=args.repeats, warmup=args.warmup)
    # The RAM tier reuses its buffers from step to step; freed first, they count in the step.
    ram.trim()
    nvme.trim()
    peaks = {name: peak_growth(fn, cuda) for name, fn in steps.items()}
    nv = dict(nvme.last_stats)
    n_req = max(nv["tensors"], 1)
    io_s = io_alone(directory, n_req, max(nv["nvme_bytes"] // n_req, 1), io_bytes)
    exposed = max(times["tierlift nvme"] - times["keep"], 0.0)
    hidden = max(0.0, 1.0 - exposed / io_s) if io_s > 0 else 0.0
    waited = nv["write_wait_s"] + nv["read_wait_s"]
    not_waited = max(0.0, 1.0 - waited / io_s) if io_s > 0 else 0.0
    ram.close()
    nvme.close()
    os.rmdir(directory)
    rows = [{"contender": name, "step s": times[name],
             "vs checkpoint": times["checkpoint"] / times[name],
             "peak MB": peaks[name] / 1e6,
             "peak vs keep": peaks[name] / max(peaks["keep"], 1)} for name in steps]
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "config": {"layers": args.layers, "dim": args.dim, "seq_len": args.seq_len,
                   "batch": args.batch, "heads": args.heads, "device": args.device,
                   "params": n_params, "min_bytes": args.min_bytes, "repeats": args.repeats},
        "rows": rows,
        "saved_bytes_per_step": stats["ram_bytes"],
        "block_bytes": block_bytes,
        "nvme": {"io_bytes_window": io_bytes, "bytes": nv["nvme_bytes"],
                 "write_wait_s": nv["write_wait_s"], "read_wait_s": nv["read_wait_s"],
                 "reads_ahead": nv["reads_ahead"], "reads_on_demand": nv["reads_on_demand"],
                 "io_alone_s": io_s, "exposed_s": exposed, "hidden_fraction": hidden,
                 "not_waited_fraction": not_waited},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-bytes", type=int, default=1 << 16,
                   help="saved tensors below this stay in place (tierlift's min_bytes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="NVMe directory")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    p.add_argument("--plot", metavar="PATH", help="also draw the results as a PNG (matplotlib)")
    args = p.parse_args(argv)
    if args.device == "cpu" and os.environ.get(_MMAP_ENV) is None:
        # Big frees must leave RSS at once, or the peak of one contender hides in the next.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, _MMAP_ENV: "131072"})
    data = {"machine": machine(), **run(args)}
    print_table(data["rows"], ["contender", "step s", "vs checkpoint", "peak MB",
                               "peak vs keep"],
                title=f"saved activations, GPT {args.layers} blocks x dim {args.dim}, "
                f"{args.batch}x{args.seq_len} tokens, {args.device} "
                f"({data['saved_bytes_per_step'] / 1e6:.0f} MB saved per step)")
    nv = data["nvme"]
    print(f"\ntierlift nvme: {nv['bytes'] / 1e6:.0f} MB written and read back per step, I/O "
          f"alone {nv['io_alone_s']:.3g} s, exposed {nv['exposed_s']:.3g} s -> "
          f"{nv['hidden_fraction']:.0%} of the I/O hidden behind compute; the step waited "
          f"{(nv['write_wait_s'] + nv['read_wait_s']) * 1e3:.3g} ms for I/O -> "
          f"{nv['not_waited_fraction']:.0%} of the I/O time overlapped "
          f"(reads ahead {nv['reads_ahead']}, on demand {nv['reads_on_demand']})")
    tag = "gpu" if args.device == "cuda" else "cpu"
    out = Path(args.out) if args.out else RESULTS / f"bench_activations-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")
    if args.plot:
        from plots import plot_activations, plot_json

        print(f"wrote {plot_json(plot_activations, out, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
