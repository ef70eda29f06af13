"""Feature-row gather bandwidth, tierlift vs the alternatives, side by side in one run.

    PYTHONPATH=python python benchmarks/bench_gather.py            # CPU part (any machine)
    python benchmarks/bench_gather.py --table-mib 4096              # GPU machine: adds GPU part
    python benchmarks/bench_gather.py --gpu-only --table-mib 1024   # GPU part only

CPU: tierlift's multithreaded C++ gather vs torch.index_select (both into a preallocated out,
both with all cores) for rows of 64 B to 4 KiB, beside a contiguous copy_ of the same bytes
(the bound: a gather moves those bytes plus random access). GPU (when present): tierlift's
zero-copy gather from pinned host memory vs pinned host-to-device copy_ of the same number of
bytes (the PCIe limit) and vs the plain-PyTorch path (CPU index_select + pin + copy), and the
kernel's variants side by side, timed in turn within each round: one warp per row ("warp", the
kernel tierlift had), lanes sized to the row ("grouped"), each also reading the rows in
ascending row order ("_sorted": the index sorted on the GPU, its time included; "sort" is that
sort alone). Each gets GB/s, M rows/s and its fraction of the copy, to tell a per-row limit
in the kernel's issue (grouped beats warp) from one per host page (sorted beats unsorted) and
from one per PCIe request (neither helps). The table is registered once (pinned in place, as
FeatureStore does) and viewed at each row size. GB/s counts gathered bytes. Prints a table and
writes benchmarks/results/bench_gather_<cpu|gpu>.json, rewritten after every row (a run cut
short keeps the rows it measured). A contender that raises, or gathers wrong rows, keeps
`<name>_error` in its row (its numbers left out) and the others are still timed; a row size that
fails keeps `error`; a GPU part that cannot start (the table's registration) keeps `error` in its
JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import tierlift
from common import dump_json, failure, interleaved_medians
from plots import plot_gather, plot_json
from tierlift import ops
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
    assert torch.equal(out_t, out_r), "wrong rows: tierlift's gather differs from index_select"
    t_ours, t_torch, t_copy = t["ours"], t["torch"], t["copy"]
    gb = n * row_bytes / 1e9
    return {"row_bytes": row_bytes, "rows_gathered": n, "tierlift_gbs": gb / t_ours,
            "index_select_gbs": gb / t_torch, "copy_gbs": gb / t_copy,
            "speedup": t_torch / t_ours, "fraction_of_copy": t_copy / t_ours}


# Kernel variants the GPU part times side by side: (kernel, locality).
GPU_VARIANTS = {"warp": ("warp", "index"), "grouped": ("grouped", "index"),
                "warp_sorted": ("warp", "sorted"), "grouped_sorted": ("grouped", "sorted")}


def gpu_medians(fns: dict, repeats: int, errors: dict, sync=torch.cuda.synchronize) -> dict:
    """{name: median seconds of fns[name]()}, synchronised around each call, the contenders
    timed in turn within each round. Each is first called once alone (its warm-up): one that
    raises there keeps its error in errors[name] and is left out of the rounds."""
    sync = sync or (lambda: None)
    running = {}
    for name, fn in fns.items():
        try:
            fn()
            sync()
            running[name] = fn
        except Exception as exc:  # noqa: BLE001 (this contender's result; the others go on)
            errors[name] = failure(f"gather {name}", exc)
    times = {name: [] for name in running}
    for _ in range(repeats):
        for name, fn in running.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_gpu(base, row_bytes, out_bytes, repeats, device="cuda"):
    """`base`: the registered fp32 table, viewed here as rows of `row_bytes`. A contender that
    fails or gathers wrong rows keeps `<name>_error`; its numbers are left out. (device: a test
    runs this on the CPU, where nothing is pinned.)"""
    cuda = device == "cuda"
    pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)
    table = base.view(-1, row_bytes // 4)
    rows = table.shape[0]
    n = out_bytes // row_bytes
    idx_cpu = torch.randint(0, rows, (n,))
    idx = idx_cpu.to(device)
    out = torch.empty(n, row_bytes // 4, device=device)
    outs = {name: torch.empty_like(out) for name in GPU_VARIANTS}
    # deferred checks, one per variant so a set flag names its variant: no sync
    flags = {name: torch.full((2,), -1, dtype=torch.long, device=device) for name in GPU_VARIANTS}
    src = pin(torch.empty(n * row_bytes, dtype=torch.uint8))
    dst = torch.empty_like(src, device=device)

    def variant(name):
        kernel, locality = GPU_VARIANTS[name]
        return lambda: ops.gather_rows(table, idx, outs[name], bad_index=flags[name],
                                       kernel=kernel, locality=locality)

    # The defaults, checked synchronously: FeatureStore.gather's call for a GPU index.
    fns = {"tierlift": lambda: ops.gather_rows(table, idx, out),
           **{name: variant(name) for name in GPU_VARIANTS},
           "sort": lambda: torch.sort(idx),
           "copy": lambda: dst.copy_(src, non_blocking=True),
           "cpu_path": lambda: pin(table.index_select(0, idx_cpu)).to(device)}
    errors = {}
    t = gpu_medians(fns, repeats, errors, torch.cuda.synchronize if cuda else None)
    want = table[idx_cpu]
    for name, buf in (("tierlift", out), *outs.items()):
        if name not in t:
            continue
        flag = flags[name].tolist() if name in flags else [-1, -1]  # tierlift's: checked inline
        if not torch.equal(buf.cpu(), want):  # a wrong row is no result, however fast
            errors[name] = "wrong rows: the output differs from table[index]"
        elif flag != [-1, -1]:
            errors[name] = f"bad_index set to {flag} for an index with none out of range"
        else:
            continue
        print(f"  gather {row_bytes} B {name}: FAILED: {errors[name]}", flush=True)
        del t[name]
    gb = n * row_bytes / 1e9
    result = {"row_bytes": row_bytes, "rows_gathered": n}
    for key, name in (("tierlift_gbs", "tierlift"), ("pinned_copy_gbs", "copy"),
                      ("cpu_path_gbs", "cpu_path")):
        if name in t:
            result[key] = gb / t[name]
    if "tierlift" in t and "copy" in t:
        result["fraction_of_copy"] = t["copy"] / t["tierlift"]
    if "tierlift" in t and "cpu_path" in t:
        result["speedup_vs_cpu_path"] = t["cpu_path"] / t["tierlift"]
    if "sort" in t:
        result["sort_ms"] = 1e3 * t["sort"]
    for name in ("tierlift", *GPU_VARIANTS):
        if name not in t:
            continue
        result[f"{name}_mrows_s"] = n / t[name] / 1e6
        if name != "tierlift":
            result[f"{name}_gbs"] = gb / t[name]
            if "copy" in t:
                result[f"{name}_of_copy"] = t["copy"] / t[name]
    result.update({f"{name}_error": message for name, message in errors.items()})
    return result


def print_gpu_table(results):
    """One line per row size and contender: GB/s, M rows/s, fraction of the pinned copy."""
    print("\nGPU zero-copy gather: defaults (as FeatureStore.gather), kernel variants, pinned "
          "copy_ and CPU index_select+pin+copy (sorted variants include the sort)")
    print(f"{'row B':>6} | {'contender':>15} | {'GB/s':>7} | {'M rows/s':>8} | {'of copy':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['row_bytes']:>6} | failed: {r['error'].splitlines()[0]}")
            continue
        n, gb = r["rows_gathered"], r["rows_gathered"] * r["row_bytes"] / 1e9
        copy = r.get("pinned_copy_gbs")
        lines = [("tierlift", "tierlift_gbs", "tierlift"),
                 *((v, f"{v}_gbs", v) for v in GPU_VARIANTS),
                 ("pinned copy_", "pinned_copy_gbs", "copy"),
                 ("cpu path", "cpu_path_gbs", "cpu_path")]
        for label, key, name in lines:
            if key not in r:
                error = r.get(f"{name}_error", "not measured")
                print(f"{r['row_bytes']:>6} | {label:>15} | failed: {error.splitlines()[0]}")
                continue
            gbs = r[key]
            of_copy = f"{gbs / copy:>7.2f}" if copy else f"{'-':>7}"
            print(f"{r['row_bytes']:>6} | {label:>15} | {gbs:>7.2f} | {n / (gb / gbs) / 1e6:>8.1f}"
                  f" | {of_copy}")
        if "sort_ms" in r:
            print(f"{r['row_bytes']:>6} | {'sort alone':>15} | {r['sort_ms']:.3f} ms")


def print_table(title, results):
    measured = [r for r in results if "error" not in r]
    keys = list(measured[0]) if measured else []
    print(f"\n{title}")
    print(" | ".join(f"{k:>20}" for k in keys))
    for r in results:
        if "error" in r:
            print(f"{r['row_bytes']:>20} | failed: {r['error'].splitlines()[0]}")
            continue
        print(" | ".join(f"{v:>20.3f}" if isinstance(v, float) else f"{v:>20}" for v in r.values()))


def main():
    p = argparse.ArgumentParser(description="gather bandwidth: tierlift vs torch")
    p.add_argument("--table-mib", type=int, default=512, help="feature table size")
    p.add_argument("--out-mib", type=int, default=64, help="bytes gathered per call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU part")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"),
                   help="where the JSON files go (default: benchmarks/results)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib); the GPU "
                   "figure goes beside it, as <PATH stem>_gpu.png")
    args = p.parse_args()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "tierlift_threads": tierlift._extension._C.num_threads(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    tb, ob = args.table_mib << 20, args.out_mib << 20
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.cpu_only and args.gpu_only:
        p.error("--cpu-only and --gpu-only exclude each other")
    if args.gpu_only and not torch.cuda.is_available():
        p.error("--gpu-only needs a CUDA GPU")
    print(f"machine: {machine}; table {args.table_mib} MiB, {args.out_mib} MiB gathered per call")
    written = {}

    def run(kind, bench):
        """bench(row bytes, ...) per row size, each on its own (one that fails keeps `error`),
        the JSON rewritten after each."""
        path = written[kind] = out_dir / f"bench_gather_{kind}.json"
        results = []
        for rb in ROW_BYTES:
            try:
                row = bench(rb, ob, args.repeats)
                got = row.get("tierlift_gbs")
                print(f"  {kind} {rb} B rows: "
                      + (f"{got:.2f} GB/s" if got else "tierlift failed"), flush=True)
            except Exception as exc:  # noqa: BLE001 (this size's result; the next one runs)
                row = {"row_bytes": rb, "error": failure(f"{kind} {rb} B rows", exc)}
            results.append(row)
            dump_json(path, {"machine": machine, "args": vars(args), "results": results},
                      indent=2)
        return results

    if not args.gpu_only:
        print_table("CPU gather: tierlift vs torch.index_select and a contiguous copy_ of the same "
                    "bytes (GB/s; speedup = vs index_select)",
                    run("cpu", lambda rb, ob, reps: bench_cpu(rb, tb, ob, reps)))
    if torch.cuda.is_available() and not args.cpu_only:
        machine["gpu"] = torch.cuda.get_device_name()
        try:
            base = torch.randn(tb // 4)  # one table for every row size, registered once
            registration = tierlift._extension._C.HostRegistration(base)
        except Exception as exc:  # noqa: BLE001 (no GPU rows: the JSON says why)
            path = written["gpu"] = out_dir / "bench_gather_gpu.json"
            dump_json(path, {"machine": machine, "args": vars(args), "results": [],
                             "error": failure("GPU part: registering the table", exc)}, indent=2)
        else:
            try:
                print_gpu_table(run("gpu", lambda rb, ob, reps: bench_gpu(base, rb, ob, reps)))
            finally:
                registration.close()
    if args.plot:
        png = Path(args.plot)
        for kind, path in written.items():
            dest = png if kind == "cpu" else png.with_name(f"{png.stem}_gpu{png.suffix}")
            print(f"wrote {plot_json(plot_gather, path, dest)}")


if __name__ == "__main__":
    main()
