"""What watching the NVMe tiers' files for changes by other processes costs (io/file_watch.py):
one check() alone (a stat per file and one read of the fanotify group), and the offloaded
AdamW step with offload="nvme" (every chunk's read and write checks first) against the same
step with check() made a no-op, timed in turn within each round.

    OMP_NUM_THREADS=1 python benchmarks/bench_file_watch.py                # 8M params
    OMP_NUM_THREADS=1 python benchmarks/bench_file_watch.py --params 3e7 --dir /nvme/tmp

Prints two tables and writes JSON (benchmarks/results/bench_file_watch-<device>.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, write_json  # noqa: E402


def check_cost(directory: str, n_files: int, own_write: bool, calls: int = 20000) -> float:
    """Seconds per check() of a watch over `n_files` files (after a pwrite of this process's
    own, which queues an event the check reads and drops, if `own_write`)."""
    from tierlift.io.file_watch import FileWatch

    watch, fds = FileWatch(), []
    for i in range(n_files):
        path = os.path.join(directory, f"watched.{i}")
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.ftruncate(fds[-1], 1 << 20)
        watch.add(path, "benchmark data", 1 << 20)
    try:
        write = (lambda: os.pwrite(fds[0], b"x", 0)) if own_write else (lambda: None)
        t0 = time.perf_counter()
        for _ in range(calls):
            write()
        base = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(calls):
            write()
            watch.check()
        return (time.perf_counter() - t0 - base) / calls
    finally:
        watch.close()
        for fd in fds:
            os.close(fd)


def step_times(directory: str, params: int, repeats: int) -> dict:
    import tierlift
    from tierlift.io.file_watch import FileWatch

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(params))
    opt = tierlift.optim.AdamW([p], lr=1e-3, offload="nvme", nvme_path=directory,
                               cpu_budget=max(64 << 20, 12 * params // 4))
    p.grad = torch.randn_like(p)
    real = FileWatch.check

    def step(watched: bool):
        def run():
            FileWatch.check = real if watched else (lambda self, *a, **k: None)
            try:
                opt.step()
            finally:
                FileWatch.check = real
        return run

    try:
        return interleaved_medians({"watched": step(True), "not checked": step(False)},
                                   repeats=repeats, warmup=2)
    finally:
        opt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=8e6)
    ap.add_argument("--dir", default=None, help="where the state files go (default: $TMPDIR)")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from tierlift.io import file_watch

    watching = file_watch._notifier() is not None
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for n in (2, 8):
            for own in (False, True):
                rows.append({"files": n, "after own write": own,
                             "check us": 1e6 * check_cost(d, n, own)})
    print_table(rows, ["files", "after own write", "check us"],
                f"one check() (fanotify {'on' if watching else 'unavailable: stat only'})")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        t = step_times(d, int(args.params), args.repeat)
    step_rows = [{"step": k, "ms": 1e3 * v, "x not checked": v / t["not checked"]}
                 for k, v in t.items()]
    print_table(step_rows, ["step", "ms", "x not checked"],
                f"offload='nvme' AdamW step, {int(args.params)} params, median of {args.repeat}")
    write_json("bench_file_watch", {"fanotify": watching, "check": rows, "step": step_rows})


if __name__ == "__main__":
    main()
