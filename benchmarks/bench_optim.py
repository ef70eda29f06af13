"""CPU AdamW step throughput: tierlift vs torch (foreach, fused) vs DeepSpeedCPUAdam, against the
memory-bandwidth bound of the same machine, measured in the same run.

    python benchmarks/bench_optim.py                       # 10M, 100M, 1B parameters
    python benchmarks/bench_optim.py --sizes 1e7,1e8 --repeats 3
    python benchmarks/bench_optim.py --sizes 1e7 --cases compact   # fp32 vs compact state only
    python benchmarks/bench_optim.py --gpu-only --cuda-sizes 1e8,1e9  # GPU machine: CUDA rows only
    python benchmarks/bench_optim.py --tiny 300,1000       # host overhead per step (CPU)

Two cases, where every contender does the same work:
  fp32   fp32 params, grads and state.
  mixed  bf16 gradients in, fp32 master weights and state, updated bf16 weights out. tierlift does
         it in one fused pass; the peers need grad.float() before and weight.copy_() after.
  compact  tierlift AdamW with state_dtype="bf16" (bf16 m, 8-bit v + a scale per 256) against
         its own fp32 state: step time and state bytes per parameter, as ratios.
Bound: the time of tierlift's memory pass (torch.ops.tierlift.adam_memory_pass_) over the same
tensors: the step's loads and stores, cut into the same chunks over the same threads with the same
SIMD path, with one add per stored stream in place of Adam's arithmetic. It is a STREAM-like
kernel with exactly the step's access pattern, so no step can move its bytes faster on this
machine; "% of bound" is its time over the step's. torch's copy_ and in-place add_ bandwidths are
printed for context. Ratios are what count on a shared machine; each time is the median of
--repeats steps, the better of two rounds run in opposite contender orders.
On a GPU: the fused CUDA step vs torch's fused CUDA AdamW at --cuda-sizes (fp32 and bf16 params;
bf16 also vs torch-fused-mixed, torch's AdamW on fp32 masters copied into bf16 weights, which
does the same work as ours: cuda_contender), each contender's GB/s beside its time (its bytes
per parameter, CUDA_BYTES_PER_PARAM, over its step); "params" is the number timed, 3/4 of each
size asked for (48 tensors of n/64 and 16 of 1024).
--tiny N,..: the host-side cost of one step, not its arithmetic: N parameters of 256 elements,
fp32 and bf16 (bf16: ours keeps fp32 masters; torch steps fp32 masters and copies them into the
bf16 weights with one _foreach_copy_), median step time per parameter, contenders interleaved.
Run it with OMP_NUM_THREADS=1 TIERLIFT_NUM_THREADS=1 to time the host work alone (thread-pool
wake-ups on a few shared cores otherwise dominate).
The JSON is rewritten after every row, so a run cut short keeps what it measured; a CUDA
contender that fails keeps "<name> error" in its row and the others are still timed.
--gpu-only skips what only the CPU rows use (DeepSpeed's import, torch's CPU bandwidths).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierlift  # noqa: E402
from common import (  # noqa: E402
    failure,
    interleaved_medians,
    machine,
    median_time,
    mem_available_bytes,
    print_table,
    write_json,
)
from plots import plot_json, plot_optim  # noqa: E402

BYTES_PER_PARAM = {"fp32": 28, "mixed": 28}  # loads + stores of one step, for the GB/s column
# the same for each CUDA contender and parameter dtype (cuda_contender says which bytes)
CUDA_BYTES_PER_PARAM = {("tierlift", "float32"): 28, ("tierlift", "bfloat16"): 30,
                        ("torch-fused", "float32"): 28, ("torch-fused", "bfloat16"): 14,
                        ("torch-fused-mixed", "bfloat16"): 34,
                        # fp32 weight and gradient, bf16 m, 8-bit v codes, one fp32 scale per
                        # 256 elements (whole blocks: each tensor's last block is one too)
                        ("tierlift-compact", "float32"): 18 + 8 / 256}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def torch_bandwidth(nbytes: int = 1 << 30) -> dict:
    """Bytes/s of torch's copy_ and in-place add_ over `nbytes` tensors (context only)."""
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    copy_bw = 2 * nbytes / median_time(lambda: a.copy_(b), repeats=5)
    add_bw = 3 * nbytes / median_time(lambda: a.add_(b), repeats=5)
    return {"copy": copy_bw, "inplace_add": add_bw}


def memory_pass(case: str, n: int):
    """The bound: the step's loads and stores over the tensors tierlift's step would use."""
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n) * 1e-3
    copies = []
    if case == "mixed":
        g = g.to(torch.bfloat16)
        copies = [torch.empty(n, dtype=torch.bfloat16)]
    return lambda: torch.ops.tierlift.adam_memory_pass_([p], [g], [m], [v], copies)


def deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam, None
    except Exception as exc:  # noqa: BLE001 - report whatever stopped it
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def make_contender(name: str, case: str, n: int):
    """Returns the step function of one contender doing one full step of the case's work."""
    if name == "bound":
        return memory_pass(case, n)
    g = torch.randn(n) * 1e-3
    if case == "fp32":
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = g
        if name == "tierlift":
            opt = tierlift.optim.AdamW([p], **HYPER)
        elif name == "torch-foreach":
            opt = torch.optim.AdamW([p], foreach=True, **HYPER)
        elif name == "torch-fused":
            opt = torch.optim.AdamW([p], fused=True, **HYPER)
        else:
            opt = DS_ADAM([p], adamw_mode=True, **HYPER)
        return opt.step
    # mixed precision
    g16 = g.to(torch.bfloat16)
    del g
    if name == "tierlift":
        p16 = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
        p16.grad = g16
        opt = tierlift.optim.AdamW([p16], **HYPER)
        return opt.step
    master = torch.nn.Parameter(torch.randn(n))
    p16 = torch.empty(n, dtype=torch.bfloat16)
    if name == "torch-foreach":
        opt = torch.optim.AdamW([master], foreach=True, **HYPER)
    elif name == "torch-fused":
        opt = torch.optim.AdamW([master], fused=True, **HYPER)
    else:
        opt = DS_ADAM([master], adamw_mode=True, **HYPER)

    def step():
        master.grad = g16.float()
        opt.step()
        p16.copy_(master.detach())

    return step


def cuda_contender(name: str, shapes, dtype, device: str = "cuda"):
    """The step function of one CUDA contender over `shapes`, gradients set:
      tierlift           tierlift AdamW on `dtype` params (bf16: fp32 master + bf16 weight,
                         30 B/param a step: 28 of the step, 2 to check the weight for edits);
      torch-fused        torch's fused AdamW on the `dtype` params themselves (bf16: 14 B/param,
                         no master, so not the same work);
      torch-fused-mixed  the same work as ours in the torch recipe: fused AdamW on fp32 master
                         params, then torch._foreach_copy_ of the masters into the bf16 weights
                         (28 + 6 = 34 B/param; its fp32 gradients are given, not converted);
      tierlift-compact   tierlift AdamW with state_dtype="bf16" on fp32 params (bf16 m, 8-bit v
                         codes: ~18 B/param, its own row's GB/s; no ratio, other state)."""
    mixed = name == "torch-fused-mixed"
    ps = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.float32 if mixed else dtype))
          for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    if name.startswith("tierlift"):
        state = "bf16" if name == "tierlift-compact" else "fp32"
        return tierlift.optim.AdamW(ps, state_dtype=state, **HYPER).step
    opt = torch.optim.AdamW(ps, fused=True, **HYPER)
    if not mixed:
        return opt.step
    weights = [torch.empty(s, device=device, dtype=dtype) for s in shapes]
    masters = [p.detach() for p in ps]

    def step():
        opt.step()
        torch._foreach_copy_(weights, masters)

    return step


def cuda_rows(sizes, repeats: int, rows: list, save, device: str = "cuda") -> list[dict]:
    """On a GPU: the fused multi-tensor CUDA step vs torch's fused CUDA AdamW (fp32 and bf16
    params; bf16 also against torch's fp32-master recipe, cuda_contender), over a GPT-like list of
    tensors (many sizes, not one flat buffer). Appends to rows, calling save() after each. A
    contender that fails keeps "<name> error" in the row (no ratio; tierlift's: no Mparam/s and
    no ratios) and the others are still timed. (device: a test runs this on the CPU.)"""
    sync = torch.cuda.synchronize if device == "cuda" else None
    for n in sizes:
        shapes = [(n // 64,)] * 48 + [(1024,)] * 16
        for dtype in (torch.float32, torch.bfloat16):
            times, errors = {}, {}
            names = ("tierlift", "torch-fused") + (
                ("torch-fused-mixed",) if dtype != torch.float32 else ("tierlift-compact",))
            for name in names:
                step = None
                try:
                    step = cuda_contender(name, shapes, dtype, device)
                    times[name] = median_time(step, repeats=repeats, warmup=2, sync=sync)
                except Exception as exc:  # noqa: BLE001 (this contender's result)
                    errors[name] = failure(f"{device} {str(dtype)[6:]} n={n:.0e} {name}", exc)
                del step
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            numel = sum(s[0] for s in shapes)  # 3 digits: with one, 7.5e8 read as 8e8
            row = {"case": f"{device}-{str(dtype)[6:]}", "params": f"{numel:.3g}", "numel": numel,
                   "step_ms": {name: t * 1e3 for name, t in times.items()}}  # medians
            if "tierlift" in times:
                row["tierlift Mparam/s"] = numel / times["tierlift"] / 1e6
                for name in names[1:]:
                    if name in times and name.startswith("torch"):
                        row[f"vs {name}"] = times[name] / times["tierlift"]
            row.update({f"{name} GB/s": CUDA_BYTES_PER_PARAM[name, str(dtype)[6:]] * numel / t / 1e9
                        for name, t in times.items()})
            row.update({f"{name} error": message for name, message in errors.items()})
            rows.append(row)
            print(f"  {device} {str(dtype)[6:]} n={numel:.0e}: "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
                  + "".join(f", {k} FAILED" for k in errors), flush=True)
            save()
    return rows


def compact_rows(sizes, repeats: int) -> list[dict]:
    """tierlift AdamW, fp32 state vs compact state (state_dtype="bf16"), fp32 params: step time
    and optimizer-state bytes per parameter, measured in the same run."""
    rows = []
    for n in sizes:
        result = {}
        for state_dtype in ("fp32", "bf16"):
            p = torch.nn.Parameter(torch.randn(n))
            p.grad = torch.randn(n) * 1e-3
            opt = tierlift.optim.AdamW([p], state_dtype=state_dtype, **HYPER)
            opt.step()  # allocates the state
            state = opt.state[p]
            nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
            result[state_dtype] = (median_time(opt.step, repeats=repeats), nbytes / n)
            del p, opt, state
            gc.collect()
        (t32, b32), (tc, bc) = result["fp32"], result["bf16"]
        rows.append({
            "case": "compact state",
            "params": f"{n:.0e}",
            "tierlift Mparam/s": n / tc / 1e6,
            "state B/param": bc,
            "fp32 state B/param": b32,
            "state bytes ratio": bc / b32,
            "step time ratio": tc / t32,
        })
        print(f"  compact n={n:.0e}: fp32 state {t32 * 1e3:.1f} ms, compact {tc * 1e3:.1f} ms",
              flush=True)
    return rows


def tiny_contender(name: str, count: int, dtype):
    """The step of one --tiny contender: `count` parameters of 256 elements, gradients set."""
    mixed = dtype != torch.float32 and name != "tierlift"
    ps = [torch.nn.Parameter(torch.randn(256, dtype=torch.float32 if mixed else dtype))
          for _ in range(count)]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    if name.startswith("tierlift"):
        state = "bf16" if name == "tierlift-compact" else "fp32"
        return tierlift.optim.AdamW(ps, state_dtype=state, **HYPER).step
    opt = torch.optim.AdamW(ps, **{name[6:]: True}, **HYPER)
    if not mixed:
        return opt.step
    weights = [torch.empty(256, dtype=dtype) for _ in ps]
    masters = [p.detach() for p in ps]

    def step():
        opt.step()
        torch._foreach_copy_(weights, masters)

    return step


def tiny_rows(counts, repeats: int) -> list[dict]:
    """Host overhead of a step: many 256-element parameters, where the arithmetic is negligible;
    the contenders interleaved round by round (interleaved_medians)."""
    rows = []
    names = ("tierlift", "torch-foreach", "torch-fused")
    for count in counts:
        for dtype in (torch.float32, torch.bfloat16):
            steps = {name: tiny_contender(name, count, dtype) for name in names}
            times = interleaved_medians(steps, repeats=repeats, warmup=3)
            row = {"case": f"tiny-{str(dtype)[6:]}", "params": count}
            row.update({f"{name} us/param": t / count * 1e6 for name, t in times.items()})
            row.update({f"vs {name}": times[name] / times["tierlift"] for name in names[1:]})
            rows.append(row)
            print(f"  tiny {str(dtype)[6:]} x{count}: "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()), flush=True)
    return rows


def needed_bytes(name: str, case: str, n: int) -> int:
    base = {"fp32": 16, "mixed": 16 if name in ("tierlift", "bound") else 24}[case]
    extra = 8 if name == "torch-foreach" else 0  # foreach keeps temporaries of the whole list
    return (base + extra) * n


DS_ADAM, DS_ERROR = None, None


def main() -> None:
    global DS_ADAM, DS_ERROR
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1e7,1e8,1e9", help="parameter counts, comma separated")
    ap.add_argument("--cases", default="fp32,mixed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cuda-sizes", default="1e7,1e8",
                    help="parameter counts of the CUDA rows (with a GPU), comma separated")
    ap.add_argument("--gpu-only", action="store_true",
                    help="only the CUDA rows (skips the CPU cases and --sizes)")
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw the results as a PNG here (needs matplotlib)")
    ap.add_argument("--tiny", metavar="N,..",
                    help="only the host-overhead rows: N parameters of 256 elements each")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.tiny:
        print(f"machine: {machine()}")
        rows = tiny_rows([int(float(s)) for s in args.tiny.split(",")], max(args.repeats, 50))
        print_table(rows, list(rows[0]), "AdamW step host overhead (256-element parameters; "
                    "\"vs X\" = X's time / tierlift's time; >1 = faster)")
        write_json("bench_optim_tiny", {"rows": rows})
        return
    # --gpu-only: DeepSpeed's import (seconds on a GPU machine) and the CPU bandwidths serve
    # only the CPU rows, and the part runs under a time cap
    DS_ADAM, DS_ERROR = (None, "not imported (--gpu-only)") if args.gpu_only else deepspeed_adam()
    contenders = ["bound", "tierlift", "torch-foreach", "torch-fused"] + (
        ["deepspeed"] if DS_ADAM else [])
    bws = {} if args.gpu_only else torch_bandwidth()
    info = tierlift.build_info()
    print(f"machine: {machine()}")
    print(f"tierlift SIMD path: {info.get('active_simd')}, threads: {info.get('cpu_threads')}"
          + (f"; torch copy_ {bws['copy'] / 1e9:.1f} GB/s, in-place add_ "
             f"{bws['inplace_add'] / 1e9:.1f} GB/s" if bws else ""))
    if DS_ERROR:
        print(f"DeepSpeedCPUAdam: not available ({DS_ERROR})")
    rows, compact = [], []

    def save():
        return write_json("bench_optim", {
            "torch_bandwidth_GBps": {k: v / 1e9 for k, v in bws.items()},
            "deepspeed": DS_ERROR or "ok",
            "rows": rows,
            "compact_rows": compact,
        })

    if args.gpu_only and not (torch.cuda.is_available() and tierlift._extension.has_cuda_kernels()):
        ap.error("--gpu-only needs a GPU and the extension's CUDA kernels")
    cases = [] if args.gpu_only else args.cases.split(",")
    if "compact" in cases:
        compact += compact_rows([int(float(s)) for s in args.sizes.split(",")], args.repeats)
        save()
    for case in (c for c in cases if c != "compact"):
        for n in (int(float(s)) for s in args.sizes.split(",")):
            times = {}
            # Two rounds in opposite orders, best median per contender: the first contender
            # after a big free otherwise pays for page reclaim / fragmented (non-huge) pages.
            for order in (contenders, contenders[::-1]):
                for name in order:
                    if needed_bytes(name, case, n) > 0.85 * mem_available_bytes():
                        print(
                            f"  skip {name} {case} n={n:.0e}: needs "
                            f"{needed_bytes(name, case, n) / 2**30:.1f} GiB"
                        )
                        continue
                    step = make_contender(name, case, n)
                    repeats = max(2, args.repeats if n <= 2e8 else args.repeats // 2)
                    t = median_time(step, repeats=repeats)
                    times[name] = min(t, times.get(name, t))
                    del step
                    gc.collect()
            if "tierlift" not in times:
                continue
            ours = times["tierlift"]
            row = {
                "case": case,
                "params": f"{n:.0e}",
                "tierlift Mparam/s": n / ours / 1e6,
                "bound GB/s": BYTES_PER_PARAM[case] * n / times["bound"] / 1e9,
                "% of bound": 100 * times["bound"] / ours,
            }
            for name, t in times.items():
                if name not in ("tierlift", "bound"):
                    row[f"vs {name}"] = t / ours
            rows.append(row)
            print(
                f"  {case} n={n:.0e}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()),
                flush=True,
            )
            save()
    if torch.cuda.is_available() and tierlift._extension.has_cuda_kernels():
        # bf16 params on GPU: ours keeps an fp32 master (more bytes), torch-fused works in bf16
        # and torch-fused-mixed keeps one as ours does.
        cuda_rows([int(float(s)) for s in args.cuda_sizes.split(",")], args.repeats, rows, save)
    columns = ["case", "params", "tierlift Mparam/s", "bound GB/s", "% of bound"] + [
        f"vs {c}" for c in contenders if c not in ("tierlift", "bound")
    ]
    if any("vs torch-fused-mixed" in r for r in rows):
        columns.append("vs torch-fused-mixed")
    if rows:
        print_table(rows, columns,
                    "AdamW step (\"vs X\" = X's time / tierlift's time; >1 = faster)")
        for r in rows:
            for key, message in r.items():
                if key.endswith(" error"):
                    print(f"  {r['case']} {r['params']} {key}: {message.splitlines()[0]}")
    if compact:
        print_table(compact, list(compact[0]),
                    "Compact state vs fp32 state (ratios: compact / fp32; state excludes the "
                    "4 B/param fp32 weight)")
    path = save()
    if args.plot:
        print(f"wrote {plot_json(plot_optim, path, args.plot)}")


if __name__ == "__main__":
    main()
