"""ZeRO-Infinity on one process: step time of tierlift.zero.shard(stage=3) + tierlift AdamW with
the optimizer state in RAM or on NVMe, with and without overlapping the optimizer step with
backward, and with the parameters offloaded too. Ratios against offload="none" in the same run.

    PYTHONPATH=python python benchmarks/bench_zero_offload.py --dim 512 --layers 6 --repeats 5

Before per-unit gradient notification, overlap=True under shard() did nothing (the hooks it
relied on never fired on shards): the overlap rows show what it hides now. The row with
offload_params="nvme" also prints the parameter tier's bytes and training-thread times per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import tierlift
from common import RESULTS, machine
from plots import plot_json, plot_zero_offload


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


def make(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dim) for _ in range(layers)))


def build(args, tier: str, overlap: bool, offload_params: str, tmp: str):
    extra = dict(nvme_path=tmp) if offload_params == "nvme" else {}
    model = tierlift.zero.shard(make(args.dim, args.layers), stage=3,
                                offload_params=offload_params, **extra)
    n = sum(p.numel() for p in model.parameters())
    kw = {}
    if tier != "none":
        kw = dict(offload=tier, overlap=overlap, max_grad_norm=1e9)
    if tier == "nvme":
        kw.update(nvme_path=tmp, cpu_budget=12 * n // 3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    x = torch.randn(args.batch, args.dim)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    row = {"tier": tier, "overlap": overlap, "offload_params": offload_params, "params": n}
    row["zero_stats"] = model._tierlift_zero.stats  # the parameter tier's bytes and times
    return row, step, opt


def finish(row: dict, times: list, opt) -> dict:
    stats = dict(opt.last_step_stats)
    row.update(step_s=statistics.median(times), kept_chunks=stats.get("overlap_kept_chunks", 0),
               overlapped_s=stats.get("overlapped_s", 0.0),
               overlap_wait_s=stats.get("overlap_wait_s", 0.0))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "zero_offload.json"))
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw the results as a PNG here (needs matplotlib)")
    args = ap.parse_args()
    configs = [("none", False, "none"), ("cpu", False, "none"), ("cpu", True, "none"),
               ("nvme", False, "none"), ("nvme", True, "none"), ("nvme", True, "cpu"),
               ("nvme", True, "nvme")]
    with tempfile.TemporaryDirectory() as tmp:
        built = [build(args, *c, tmp) for c in configs]
        times = [[] for _ in built]
        inside = [[] for _ in built]  # time spent inside opt.step()
        # Round robin, one step of each configuration per round: a loaded machine's drift
        # hits every configuration alike. The first two rounds warm up.
        for r in range(args.repeats + 2):
            if r == 2:  # the parameter tier's stats from here on (after the warm-up)
                before = [dict(row["zero_stats"]) for row, _, _ in built]
            for i, (_, step, _) in enumerate(built):
                t0 = time.perf_counter()
                step()
                if r >= 2:
                    times[i].append(time.perf_counter() - t0)
                    inside[i].append(built[i][2].last_step_stats.get("total_s", 0.0))
        rows = [finish(row, t, opt) for (row, _, opt), t in zip(built, times)]
        for row, old in zip(rows, before):
            stats = row.pop("zero_stats")
            if row["offload_params"] == "nvme":  # per measured step
                row["param_tier"] = {k: (v - old[k]) / args.repeats for k, v in stats.items()
                                     if k.startswith("nvme_") and k != "nvme_file_bytes"
                                     and not isinstance(v, bool)}
        for row, t in zip(rows, inside):
            row["opt_step_s"] = statistics.median(t)
    base = rows[0]["step_s"]
    print(f"ZeRO-3, 1 process, {rows[0]['params'] / 1e6:.1f}M fp32 params, {machine()['cpu']}, "
          f"{machine()['cores']} cores")
    print(f"{'optimizer state':16} {'overlap':8} {'params':7} {'step ms':>8} {'vs none':>8} "
          f"{'kept':>5} {'overlapped ms':>14} {'wait ms':>8} {'step() ms':>10}")
    for r in rows:
        r["vs_none"] = r["step_s"] / base
        print(f"{r['tier']:16} {str(r['overlap']):8} {r['offload_params']:7} "
              f"{r['step_s'] * 1e3:8.1f} {r['vs_none']:8.2f} {r['kept_chunks']:5.0f} "
              f"{r['overlapped_s'] * 1e3:14.1f} {r['overlap_wait_s'] * 1e3:8.1f} "
              f"{r['opt_step_s'] * 1e3:10.1f}")
    for r in rows:
        if "param_tier" in r:
            t = r["param_tier"]
            print(f"parameter tier per step ({r['tier']} {r['overlap']} nvme): read "
                  f"{t['nvme_read_bytes'] / 1e6:.1f} MB, written {t['nvme_write_bytes'] / 1e6:.1f} "
                  f"MB, gradients written {t['nvme_grad_bytes'] / 1e6:.1f} MB; training thread: "
                  f"read wait {t['nvme_read_wait_s'] * 1e3:.1f} ms, page "
                  f"cache warm-up {t['nvme_warm_s'] * 1e3:.1f} ms, drops "
                  f"{t['nvme_drop_s'] * 1e3:.1f} ms; read-ahead hits "
                  f"{t['nvme_prefetch_hits']:.1f}, misses {t['nvme_prefetch_misses']:.1f}")
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:
        print(f"wrote {plot_json(plot_zero_offload, args.out, args.plot)}")


if __name__ == "__main__":
    main()
