"""Feature-row gather bandwidth, tierlift vs the alternatives, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_gather.py            # CPU part (any machine)
    python benchmarks/bench_gather.py --table-mib 4096              # GPU machine: adds GPU part
    python benchmarks/bench_gather.py --gpu-only --table-mib 1024   # GPU part only

CPU: tierlift's multithreaded C++ gather vs torch.index_select (both into a preallocated out,
both with all cores) for rows of 64 B to 4 KiB, beside a contiguous copy_ of the same bytes
(the bound: a gather moves those bytes plus random access). GPU (when present): tierlift's
zero-copy gather from pinned host memory vs pinned host-to-device copy_ of the same number of
bytes (the PCIe limit) and vs the plain-PyTorch path (CPU index_select + pin + copy). GB/s
counts gathered bytes. Prints a table and writes benchmarks/results/bench_gather_<cpu|gpu>.json,
rewritten after every row (a run cut short keeps the rows it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

import tierlift
from common import interleaved_medians, median_time
from plots import plot_gather, plot_json
from tierlift.gnn import FeatureStore

ROW_BYTES = [64, 128, 256, 512, 1024, 2048, 4096]


def bench_cpu(row_bytes, table_bytes, out_bytes, repeats):
    rows = table_bytes // row_bytes
    n = out_bytes // row_bytes
    table = torch.randn(rows, row_bytes // 4)
    idx = torch.randint(0, rows, (n,))
    store = FeatureStore(table, device="cpu")
    out_t, out_r = torch.empty(n, row_bytes // 4), torch.empty(n, row_bytes // 4)
    out_c = torch.empty_like(out_r)
    t = interleaved_medians({
        "ours": lambda: store.gather(idx, out=out_t),
        "torch": lambda: torch.index_select(table, 0, idx, out=out_r),
        # the bound: the same bytes copied from contiguous rows (no random access)
        "copy": lambda: out_c.copy_(table[:n]),
    }, repeats=repeats)
    assert torch.equal(out_t, out_r)
    t_ours, t_torch, t_copy = t["ours"], t["torch"], t["copy"]
    gb = n * row_bytes / 1e9
    return {"row_bytes": row_bytes, "rows_gathered": n, "tierlift_gbs": gb / t_ours,
            "index_select_gbs": gb / t_torch, "copy_gbs": gb / t_copy,
            "speedup": t_torch / t_ours, "fraction_of_copy": t_copy / t_ours}


def bench_gpu(row_bytes, table_bytes, out_bytes, repeats):
    rows = table_bytes // row_bytes
    n = out_bytes // row_bytes
    table = torch.randn(rows, row_bytes // 4)
    idx_cpu = torch.randint(0, rows, (n,))
    idx = idx_cpu.cuda()
    sync = torch.cuda.synchronize
    store = FeatureStore(table, pin="inplace")
    out = torch.empty(n, row_bytes // 4, device="cuda")
    t_ours = median_time(lambda: store.gather(idx, out=out), repeats=repeats, sync=sync)
    src = torch.empty(n * row_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    t_copy = median_time(lambda: dst.copy_(src, non_blocking=True), repeats=repeats, sync=sync)
    t_cpu = median_time(lambda: table.index_select(0, idx_cpu).pin_memory().to("cuda"),
                        repeats=repeats, sync=sync)
    assert torch.equal(out.cpu(), table[idx_cpu])
    store.close()
    gb = n * row_bytes / 1e9
    return {"row_bytes": row_bytes, "rows_gathered": n, "tierlift_gbs": gb / t_ours,
            "pinned_copy_gbs": gb / t_copy, "cpu_path_gbs": gb / t_cpu,
            "fraction_of_copy": t_copy / t_ours, "speedup_vs_cpu_path": t_cpu / t_ours}


def print_table(title, results):
    keys = list(results[0])
    print(f"\n{title}")
    print(" | ".join(f"{k:>20}" for k in keys))
    for r in results:
        print(" | ".join(f"{v:>20.3f}" if isinstance(v, float) else f"{v:>20}" for v in r.values()))


def main():
    p = argparse.ArgumentParser(description="gather bandwidth: tierlift vs torch")
    p.add_argument("--table-mib", type=int, default=512, help="feature table size")
    p.add_argument("--out-mib", type=int, default=64, help="bytes gathered per call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU part")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib); the GPU "
                   "figure goes beside it, as <PATH stem>_gpu.png")
    args = p.parse_args()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "tierlift_threads": tierlift._extension._C.num_threads(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    tb, ob = args.table_mib << 20, args.out_mib << 20
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    if args.cpu_only and args.gpu_only:
        p.error("--cpu-only and --gpu-only exclude each other")
    if args.gpu_only and not torch.cuda.is_available():
        p.error("--gpu-only needs a CUDA GPU")
    print(f"machine: {machine}; table {args.table_mib} MiB, {args.out_mib} MiB gathered per call")
    written = {}

    def run(kind, bench):
        path = written[kind] = out_dir / f"bench_gather_{kind}.json"
        results = []
        for rb in ROW_BYTES:
            results.append(bench(rb, tb, ob, args.repeats))
            print(f"  {kind} {rb} B rows: {results[-1]['tierlift_gbs']:.2f} GB/s", flush=True)
            path.write_text(json.dumps(
                {"machine": machine, "args": vars(args), "results": results}, indent=2))
        return results

    if not args.gpu_only:
        print_table("CPU gather: tierlift vs torch.index_select and a contiguous copy_ of the same "
                    "bytes (GB/s; speedup = vs index_select)", run("cpu", bench_cpu))
    if torch.cuda.is_available() and not args.cpu_only:
        machine["gpu"] = torch.cuda.get_device_name()
        print_table("GPU zero-copy gather vs pinned copy_ and CPU index_select+pin+copy",
                    run("gpu", bench_gpu))
    if args.plot:
        png = Path(args.plot)
        for kind, path in written.items():
            dest = png if kind == "cpu" else png.with_name(f"{png.stem}_gpu{png.suffix}")
            print(f"wrote {plot_json(plot_gather, path, dest)}")


if __name__ == "__main__":
    main()
