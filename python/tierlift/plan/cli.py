"""`python -m tierlift plan`: arguments, measurement, and the printed (or JSON) plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

from tierlift.plan.measure import measure
from tierlift.plan.planner import PlanInput, make_plan, parse_bytes, render


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="where training state will live and the expected step time")
    p.add_argument("--params", required=True, help="parameter count, e.g. 8e9")
    p.add_argument("--gpu-mem", required=True, help="GPU memory, e.g. 80G")
    p.add_argument("--cpu-mem", required=True, help="host memory, e.g. 128G")
    p.add_argument("--nvme", default=None, help="directory on the NVMe drive")
    p.add_argument("--cpu-budget", default=None, help="host memory the optimizer may hold")
    p.add_argument("--probe-mib", type=int, default=256, help="size of the bandwidth probes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw bytes per tier against capacity as a PNG (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    try:
        params = float(args.params)
    except ValueError:
        raise ValueError(f"--params must be a number like 8e9, got {args.params!r}") from None
    if args.nvme is not None and not os.path.isdir(args.nvme):
        raise ValueError(f"--nvme {args.nvme!r} is not an existing directory")
    if args.probe_mib <= 0:
        raise ValueError(f"--probe-mib must be > 0, got {args.probe_mib}")
    inp = PlanInput(params=params, gpu_mem=parse_bytes(args.gpu_mem, "--gpu-mem"),
                    cpu_mem=parse_bytes(args.cpu_mem, "--cpu-mem"), nvme=args.nvme,
                    cpu_budget=None if args.cpu_budget is None
                    else parse_bytes(args.cpu_budget, "--cpu-budget"),
                    nvme_free=None if args.nvme is None else shutil.disk_usage(args.nvme).free)
    bw = measure(args.nvme, args.probe_mib << 20)
    plan = make_plan(inp, bw)
    if args.json:
        print(json.dumps({"offload": plan.offload, "tiers": plan.tiers, "legs_s": plan.legs_s,
                          "serial_s": plan.serial_s, "pipelined_s": plan.pipelined_s,
                          "bandwidths": dataclasses.asdict(bw), "note": plan.note}, indent=2))
    else:
        print(render(plan, bw))
    if args.plot:
        from tierlift.plan.plot import capacities, plot_plan

        print(f"wrote {plot_plan(plan, capacities(inp), args.plot)}")
    return 0
