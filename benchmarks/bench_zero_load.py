"""Loading a model larger than one rank's memory share: peak RSS per rank while
tierlift.zero.shard(stage=3) builds a Llama-shaped model (examples/llama_model.py), three ways,
2 gloo ranks on the CPU, one run.

    python benchmarks/bench_zero_load.py                          # ~70 MB fp32 model
    python benchmarks/bench_zero_load.py --dim 2048 --layers 4 --vocab 32000   # ~1.3 GB
    python benchmarks/bench_zero_load.py --plot zero_load.png     # also draw the table

  eager     build the whole model on every rank (torch.manual_seed), then shard() it
  deferred  build it inside tierlift.zero.deferred_init(), shard(device="cpu") replays the
            construction and keeps this rank's slices (the same values as eager)
  weights   build it inside deferred_init(), shard(device="cpu", weights=DIR) reads this rank's
            byte ranges of model.safetensors (written once by the parent beforehand)

With --limit-mib N each rank runs in its own memory cgroup capped at N MiB (the whole process:
torch's libraries included; needs root and a cgroup v1 or v2 memory controller): a mode that
needs more is killed by the kernel and reported as such.

Peak RSS growth is VmHWM after the call minus VmRSS before it (VmHWM reset through
/proc/self/clear_refs, freed heap trimmed first, glibc's mmap threshold fixed at 128 KiB so big
frees leave RSS at once); "x model" divides it by the model's fp32 bytes. The largest of the two
ranks is reported. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import RESULTS, machine, print_table  # noqa: E402

MODES = ["eager", "deferred", "weights"]
COLUMNS = ["mode", "model MB", "shard MB/rank", "peak RSS growth MB/rank", "x model", "time s"]


def _config(args):
    from llama_model import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layer=args.layers,
                       n_head=args.dim // 64, n_kv_head=args.dim // 64,
                       ffn_dim=int(8 * args.dim / 3 / 64 + 1) * 64, max_seq_len=64)


def _rank(args) -> None:
    """One rank: build and shard the model the way `args.mode` says; print a JSON result."""
    import datetime

    import torch
    import torch.distributed as dist

    import tierlift
    from llama_model import Llama
    from tierlift import _peak_rss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=2, timeout=datetime.timedelta(seconds=600))
    cfg = _config(args)
    with tierlift.zero.deferred_init():
        # torch imports its dispatch-mode machinery (torch._dynamo) at the first recorded op:
        # a one-time cost of every process (seconds, ~100 MB), kept out of the measurement.
        torch.nn.Linear(2, 2)
    dist.barrier()
    before = _peak_rss.reset_peak()
    t0 = time.perf_counter()
    if args.mode == "eager":
        torch.manual_seed(0)
        model = tierlift.zero.shard(Llama(cfg), stage=3)
    else:
        with tierlift.zero.deferred_init():
            torch.manual_seed(0)
            model = Llama(cfg)
        model = tierlift.zero.shard(model, stage=3, device="cpu",
                                    weights=args.weights if args.mode == "weights" else None)
    elapsed = time.perf_counter() - t0
    growth = _peak_rss.status("VmHWM:") - before
    shard = sum(u.shard.numel() * 4 for u in model._tierlift_zero.units)
    print("RESULT " + json.dumps({"growth": growth, "shard": shard, "time": elapsed}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _cgroup_dir(name: str) -> tuple[Path, str, str]:
    """A new memory cgroup's folder and its limit / member files (v2 if mounted, else v1)."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists():
        return v2 / name, "memory.max", "cgroup.procs"
    return v2 / "memory" / name, "memory.limit_in_bytes", "cgroup.procs"


def _memory_cgroup(name: str, limit_mib: int) -> tuple[Path, Path]:
    """A new memory cgroup capped at limit_mib MiB (swap included where the kernel accounts it):
    its folder, removed by the caller once its processes are gone, and its member file."""
    folder, limit_file, procs = _cgroup_dir(name)
    folder.mkdir()
    (folder / limit_file).write_text(str(limit_mib << 20))
    for swap, value in (("memory.memsw.limit_in_bytes", str(limit_mib << 20)),
                        ("memory.swap.max", "0")):
        if (folder / swap).exists():
            (folder / swap).write_text(value)
    return folder, folder / procs


def _model_bytes(args) -> int:
    return _config(args).num_params() * 4


def _write_weights(args, path: str) -> None:
    """model.safetensors of the eager model (built once, in the parent, outside the ranks)."""
    import torch
    from safetensors.torch import save_file

    from llama_model import Llama

    cfg = _config(args)
    torch.manual_seed(0)
    model = Llama(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def _run_mode(args, mode: str, weights: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1",
           "TIERLIFT_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [sys.executable, __file__, "--mode", mode, "--port", str(port), "--weights", weights,
           "--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    groups = ([_memory_cgroup(f"tierlift-bench-{os.getpid()}-{r}", args.limit_mib)
               for r in range(2)] if args.limit_mib else [])

    def joins(r: int):  # the rank enters its cgroup before exec: all it allocates counts
        return None if not groups else lambda: groups[r][1].write_text(str(os.getpid()))

    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, text=True, preexec_fn=joins(r),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=1800)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            if p.returncode == -9 and args.limit_mib:
                for q in procs:  # the other rank would wait for it at the next collective
                    q.kill()
    finally:
        for p in procs:
            p.wait()
        for folder, _ in groups:
            folder.rmdir()
    if args.limit_mib and any(p.returncode == -9 for p in procs):
        return {"killed": True}
    results = []
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"{mode} rank failed:\n{out[-3000:]}")
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    return max(results, key=lambda r: r["growth"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(RESULTS / "bench_zero_load-cpu.json"))
    parser.add_argument("--limit-mib", type=int,
                        help="each rank's memory cap (a cgroup; needs root), MiB")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the results as a PNG here (needs matplotlib)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank(args)
    total = _model_bytes(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _write_weights(args, tmp)
        for mode in args.modes.split(","):
            r = _run_mode(args, mode, tmp)
            if r.get("killed"):
                rows.append({"mode": mode, "model MB": round(total / 2**20, 1),
                             "peak RSS growth MB/rank": f"killed over {args.limit_mib} MiB"})
                continue
            rows.append({"mode": mode, "model MB": round(total / 2**20, 1),
                         "shard MB/rank": round(r["shard"] / 2**20, 1),
                         "peak RSS growth MB/rank": round(r["growth"] / 2**20, 1),
                         "x model": round(r["growth"] / total, 3), "time s": round(r["time"], 2)})
    limit = f", each rank capped at {args.limit_mib} MiB" if args.limit_mib else ""
    print_table(rows, COLUMNS, f"shard(stage=3) of a {total / 2**30:.2f} GiB fp32 Llama-shaped "
                f"model, 2 gloo ranks (dim={args.dim}, layers={args.layers}, "
                f"vocab={args.vocab}){limit}")
    result = {"machine": machine(), "config": {"dim": args.dim, "layers": args.layers,
                                               "vocab": args.vocab, "model_bytes": total,
                                               "limit_mib": args.limit_mib},
              "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        from plots import plot_zero_load

        print(f"wrote {plot_zero_load(result, args.plot)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
