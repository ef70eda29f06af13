"""How a save should read an optimizer's committed generation on NVMe: through RAM (the
checkpoint writer: read each chunk, check its CRC-32C, pack the stepped parameters, write with
O_DIRECT, SHA-256 on the way) or file to file (os.copy_file_range of the same segments, a
reflink where the file system has them, then a read of the result for its SHA-256, which the
checkpoint format needs; no CRC-32C check).

    python benchmarks/bench_held_state.py                    # 50M params, state in $TMPDIR
    python benchmarks/bench_held_state.py --params 2e8 --dir /nvme/tmp --repeat 7
    python benchmarks/bench_held_state.py --plot held_state.png   # and draw it (matplotlib)

Both write the same dense kind files of one param group; the two are timed in turn, median of
--repeat after one warmup, page cache flushed (os.sync) before each. Prints a table and writes
JSON (benchmarks/results/bench_held_state-<device>.json, or --out); --plot draws that JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import Stack, _train, shape_for  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402


def through_ram(off, out: str) -> None:
    from tierlift.checkpoint import background

    job = background.Job(out, blocking=True, staging_budget=None, off=off)
    os.makedirs(job.tmp)
    job.offloaded(off, "optim", {})
    job.start(background.Vote(0, 1, None), lambda: os.rename(job.tmp, out))


def file_to_file(off, out: str) -> None:
    directory = os.path.join(out, "optim")
    os.makedirs(directory)
    for gi, group in enumerate(off.opt.param_groups):
        tier, layout = off.tiers[gi], off.layouts[gi]
        dense, pos = {}, 0
        for pi, p in enumerate(group["params"]):
            dense[pi] = pos
            pos += p.numel()
        for kind in tier.kinds:
            path = os.path.join(directory, f"g{gi}.{kind}.f32")
            dst = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            src = {g: os.open(tier.paths[(kind, g)], os.O_RDONLY) for g in (0, 1)}
            try:
                for c in layout.chunks:
                    for s in c.segments:
                        n = (s.chi - s.clo) * 4
                        so = (c.ci * off.chunk_elems + s.clo) * 4
                        do = (dense[s.pi] + s.plo) * 4
                        while n:
                            done = os.copy_file_range(src[tier.gen[c.ci]], dst, n, so, do)
                            n, so, do = n - done, so + done, do + done
                os.fsync(dst)
            finally:
                os.close(dst)
                for fd in src.values():
                    os.close(fd)
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 22), b""):
                    h.update(block)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=5e7)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where state and copies go (default: $TMPDIR)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    import tierlift

    d, layers = shape_for(args.params)
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="bench_held_state-", dir=args.dir)
    try:
        model = Stack(d, layers)
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-4, offload="nvme",
                                   nvme_path=root)
        _train(model, opt, d)
        off = opt._offload
        ways = {"through RAM (checkpoint writer)": through_ram,
                "file to file (copy_file_range)": file_to_file}
        times: dict = {name: [] for name in ways}
        for i in range(args.repeat + 1):
            for name, fn in ways.items():
                out = os.path.join(root, f"copy{i}")
                os.sync()
                t = time.perf_counter()
                fn(off, out)
                if i:
                    times[name].append(time.perf_counter() - t)
                shutil.rmtree(out)
        nbytes = 4 * sum(p.numel() for p in model.parameters()) * len(off.tiers[0].kinds)
        opt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["through RAM (checkpoint writer)"])
    rows = [{"way": name, "median s": statistics.median(t), "GB": nbytes / 1e9,
             "GB/s": nbytes / 1e9 / statistics.median(t),
             "vs through RAM": statistics.median(t) / base} for name, t in times.items()]
    print(f"bench_held_state: {nbytes / 1e9:.2f} GB of optimizer state; {machine()['cpu']}")
    print_table(rows, ["way", "median s", "GB", "GB/s", "vs through RAM"],
                title=f"reading a held generation into a checkpoint, median of {args.repeat}")
    payload = {"args": vars(args), "rows": rows}
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    else:
        out = write_json("bench_held_state", payload)
    if args.plot:
        from plots import plot_held_state, plot_json

        print(f"wrote {plot_json(plot_held_state, out, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
