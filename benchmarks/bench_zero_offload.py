"""ZeRO-Infinity on one process: step time of tierlift.zero.shard(stage=3) + tierlift AdamW with
the optimizer state in RAM or on NVMe, with and without overlapping the optimizer step with
backward, and with the parameters offloaded too. Ratios against offload="none" in the same run.

    PYTHONPATH=python python benchmarks/bench_zero_offload.py --dim 512 --layers 6 --repeats 5

Before per-unit gradient notification, overlap=True under shard() did nothing (the hooks it
relied on never fired on shards): the overlap rows show what it hides now.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import tierlift
from common import RESULTS, machine, median_time


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


def run(args, tier: str, overlap: bool, offload_params: str, tmp: str) -> dict:
    model = tierlift.zero.shard(make(args.dim, args.layers), stage=3,
                                offload_params=offload_params)
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

    t = median_time(step, repeats=args.repeats, warmup=2)
    stats = dict(opt.last_step_stats)
    return {"tier": tier, "overlap": overlap, "offload_params": offload_params, "step_s": t,
            "kept_chunks": stats.get("overlap_kept_chunks", 0),
            "overlapped_s": stats.get("overlapped_s", 0.0),
            "overlap_wait_s": stats.get("overlap_wait_s", 0.0), "params": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "zero_offload.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tier, overlap, op in [("none", False, "none"), ("cpu", False, "none"),
                                  ("cpu", True, "none"), ("nvme", False, "none"),
                                  ("nvme", True, "none"), ("nvme", True, "cpu")]:
            rows.append(run(args, tier, overlap, op, tmp))
    base = rows[0]["step_s"]
    print(f"ZeRO-3, 1 process, {rows[0]['params'] / 1e6:.1f}M fp32 params, {machine()['cpu']}, "
          f"{machine()['cores']} cores")
    print(f"{'optimizer state':16} {'overlap':8} {'params':7} {'step ms':>8} {'vs none':>8} "
          f"{'kept':>5} {'overlapped ms':>14} {'wait ms':>8}")
    for r in rows:
        r["vs_none"] = r["step_s"] / base
        print(f"{r['tier']:16} {str(r['overlap']):8} {r['offload_params']:7} "
              f"{r['step_s'] * 1e3:8.1f} {r['vs_none']:8.2f} {r['kept_chunks']:5.0f} "
              f"{r['overlapped_s'] * 1e3:14.1f} {r['overlap_wait_s'] * 1e3:8.1f}")
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
