"""Optimizer step time with offloaded state: tierlift AdamW offload="none"/"cpu"/"nvme" against
torch.optim.AdamW, and the NVMe step against its I/O roofline, measured in the same run.

    python benchmarks/bench_offload.py                              # 16M params, state under /tmp
    python benchmarks/bench_offload.py --params 1e8 --dir /nvme0 --repeats 5

fp32 CPU parameters (the GPU legs need the GPU machine). The NVMe case gets cpu_budget = a third
of its state (fp32 master, m, v = 12 B/param), so every step streams the whole state through the
pool. Roofline: the state bytes the step reads and writes (from last_step_stats) divided by the
disk's read and write bandwidth, measured on the same directory through tierlift.io in the same
run with a probe as large as one state file. Each time is the median of --repeats steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierlift  # noqa: E402, F401
from common import machine, median_time, print_table, write_json  # noqa: E402
from tierlift.optim import AdamW  # noqa: E402
from tierlift.plan.measure import _disk  # noqa: E402


def _params(n: int) -> list[torch.nn.Parameter]:
    sizes = [n // 4] * 3 + [n - 3 * (n // 4)]  # a few large tensors, like a model's matrices
    ps = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--dir", default=None, help="directory on the drive (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = int(args.params)
    state_bytes = 12 * n
    budget = state_bytes // 3
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    rows, stats = [], {}
    cases = {
        "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "tierlift none": lambda ps: AdamW(ps, lr=1e-3),
        "tierlift cpu": lambda ps: AdamW(ps, lr=1e-3, offload="cpu"),
        "tierlift nvme": lambda ps: AdamW(ps, lr=1e-3, offload="nvme", nvme_path=tmp.name,
                                          cpu_budget=budget),
    }
    times = {}
    for name, make in cases.items():
        ps = _params(n)
        opt = make(ps)
        times[name] = median_time(opt.step, repeats=args.repeats, warmup=1)
        stats[name] = dict(getattr(opt, "last_step_stats", {}))
        del opt, ps
    read_bps, write_bps = _disk(tmp.name, 4 * n)
    nv = stats["tierlift nvme"]
    roofline = nv["nvme_read_bytes"] / read_bps + nv["nvme_write_bytes"] / write_bps
    base = times["torch AdamW"]
    for name, t in times.items():
        rows.append({"case": name, "step_ms": f"{t * 1e3:.1f}", "vs_torch": f"{t / base:.2f}x"})
    rows.append({"case": "nvme I/O roofline", "step_ms": f"{roofline * 1e3:.1f}",
                 "vs_torch": f"{roofline / base:.2f}x"})
    achieved = (nv["nvme_read_bytes"] + nv["nvme_write_bytes"]) / times["tierlift nvme"]
    print_table(rows, ["case", "step_ms", "vs_torch"],
                title=f"AdamW step, {n / 1e6:.0f}M fp32 params, state {state_bytes >> 20} MiB, "
                      f"cpu_budget {budget >> 20} MiB, dir {tmp.name}")
    print(f"disk: read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s; "
          f"nvme step moved {achieved / 1e9:.2f} GB/s; "
          f"nvme step / roofline = {times['tierlift nvme'] / roofline:.2f}x")
    print("nvme step breakdown (last step):", {k: round(v, 4) if isinstance(v, float) else v
                                               for k, v in nv.items()})
    write_json("bench_offload", {
        "machine": machine(), "params": n, "state_bytes": state_bytes, "cpu_budget": budget,
        "step_s": times, "roofline_s": roofline, "disk_read_bps": read_bps,
        "disk_write_bps": write_bps, "nvme_bytes_per_s": achieved, "nvme_stats": nv})
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
