"""FP8 quantizer and Float8Linear benchmarks; prints tables and writes JSON.

    PYTHONPATH=python python benchmarks/bench_lowp.py                 # CPU: C++ op vs reference
    PYTHONPATH=python python benchmarks/bench_lowp.py --device cuda   # GPU: GB/s and GEMM speedup
    PYTHONPATH=python python benchmarks/bench_lowp.py --device cpu --sizes 256 --parts split
    PYTHONPATH=python python benchmarks/bench_lowp.py --parts passes --sizes 8192   # no compute

CPU: time of the compiled quantizer (csrc/core/lowp) against the pure-torch reference for the
same inputs (timing only; correctness is the tests' job). GPU: quantize-kernel bandwidth
(bytes read + written per second; FP8, and FP4 with each scale rule) against the device-to-device
copy bandwidth measured in the same run, and Float8Linear forward+backward against bf16 nn.Linear
for M=N=K 2048..16384 (and torchao's float8 recipes when torchao is installed). Both devices:
the split of one forward+backward of every contender at one size (--split-size; lowp_split.py):
quantize kernels, GEMMs, layout copies, amax/scale, other, gaps, in ms and % of the step, from
torch.profiler (GPU kernels on a GPU; CPU ops on a CPU, where the GEMMs are emulated), and the
passes over memory each step makes (tierlift.lowp.passes: quantize / layout / cast / other passes,
GEMMs, bytes the non-GEMM passes move and their time at the copy bandwidth measured in the same
run, a floor the split's quantize + layout + amax time can be read against). --parts passes
counts them alone, on fake tensors (no memory, no compute: any size on any machine). Ratios are
what to
compare; absolute CPU times on a shared VM are noise. The JSON is rewritten after every row (a
run cut short keeps its rows). A contender, step kind or quantizer that fails keeps its error in
its row (`error`, `<name>_error`) and the run goes on; a section that fails keeps
`<section>_error`. A GEMM torch._scaled_mm refused runs emulated (same numbers, not the same
time): the rows it ran in name it (`emulated_gemms`, `<name>_emulated_gemms`).

Steps (STEPS): "train" is one layer's work in a training step: backward of a fixed contiguous
grad_output, gradients set to None first (AccumulateGrad takes them over, nothing is added).
"sum" is the step the earlier GPU numbers were measured with: y.sum().backward() with gradients
accumulating, which adds the sum, a copy of its expanded grad_output (or cuBLAS's own copy of
it) and two gradient additions over layer-sized tensors to every contender, bf16 included. The
linear part times both side by side (`<name>_speedup`: train, `<name>_sum_speedup`: sum);
--step picks the split's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import platform
import sys
import time

import torch

from common import RESULTS, dump_json, failure, median_time, run_section
from lowp_split import print_passes, print_split, profile_split
from plots import plot_json, plot_lowp
from tierlift import ops
from tierlift.lowp import RECIPES, Float8Linear
from tierlift.lowp.gemm import scaled_mm_fallbacks
from tierlift.lowp.passes import count_passes
from tierlift.reference import lowp as ref

SCALINGS = ("tensor", "row", "1x128", "128x128")


def timeit(fn, device: str, repeat: int) -> float:
    """Median seconds per call after one warm-up (common.median_time, synced on CUDA)."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    return median_time(fn, repeats=repeat, sync=sync)


def bench_cpu(args) -> list[dict]:
    rows = []
    for shape in ((1024, 1024), (4096, 2048)):
        x = torch.randn(shape).bfloat16()
        for scaling in SCALINGS:
            for dual in (False, True):
                op = ops.fp8_quantize_dual if dual else ops.fp8_quantize
                rf = ref.fp8_quantize_dual if dual else ref.fp8_quantize
                t_op = timeit(lambda: op(x, scaling), "cpu", args.repeat)  # noqa: B023
                t_ref = timeit(lambda: rf(x, scaling), "cpu", args.repeat)  # noqa: B023
                rows.append(dict(shape=list(shape), scaling=scaling, dual=dual, cpp_ms=t_op * 1e3,
                                 ref_ms=t_ref * 1e3, speedup=t_ref / t_op))
    print(f"{'shape':>12} {'scaling':>8} {'dual':>5} {'C++ ms':>8} {'ref ms':>8} {'ref/C++':>8}")
    for r in rows:
        print(f"{str(tuple(r['shape'])):>12} {r['scaling']:>8} {str(r['dual']):>5} "
              f"{r['cpp_ms']:8.2f} {r['ref_ms']:8.2f} {r['speedup']:8.2f}")
    return rows


FP4_RULES = ("floor", "rceil", "nv")  # MXFP4 (E8M0 scale per 32) and NVFP4 (E4M3 per 16)


def output_bytes(out) -> int:
    """Bytes of every tensor a quantizer returned: its codes (one layout or both), its scales
    and a global scale. Anything else is refused, not counted as 0 (a GB/s too low, silently)."""
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(output_bytes(o) for o in out)
    if out is None:
        return 0
    raise TypeError(f"cannot count the bytes of a quantizer output of type {type(out).__name__}")


def bench_gpu_quantize(args, rows: list, save, device: str = "cuda", n: int = 8192) -> list[dict]:
    """Each quantizer's GB/s against the copy bandwidth, a row each, saved as it comes (device
    and n: a test runs this on the CPU). Bytes moved: the bf16 input read once plus every byte
    it returned (codes, scales, global scale), counted from its output; the copy's read and
    write counted alike. A second read of the input (an amax pass) is not counted: the
    quantizers that need one have lower targets. The delayed-scaling rows ("tensor-delayed")
    pass the scale an earlier quantization of x gave, as a recipe's amax history would: it fits
    x, so the op reads x once; a scale that clipped would read x again (a recast, not counted),
    so those rows check first that the scale was kept and fail otherwise."""
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t_copy = timeit(lambda: x.clone(), device, args.repeat)
    copy_gbs = 2 * x.numel() * x.element_size() / t_copy / 1e9
    read = x.numel() * x.element_size()

    def measure(scaling: str, dual: bool, fn, check=None) -> None:
        row = dict(scaling=scaling, dual=dual)
        try:
            out = fn()  # also the warm-up
            if check is not None:
                check(out)
            moved = read + output_bytes(out)
            gbs = moved / timeit(fn, device, args.repeat) / 1e9
            row.update(bytes_per_elem=moved / x.numel(), gbs=gbs, copy_gbs=copy_gbs,
                       of_copy=gbs / copy_gbs)
        except Exception as exc:  # noqa: BLE001 (this quantizer's result; the others go on)
            row["error"] = failure(f"quantize {scaling}{' dual' if dual else ''}", exc)
        rows.append(row)
        save()

    for scaling in (*SCALINGS, "col"):
        for dual in (False, True):
            op = ops.fp8_quantize_dual if dual else ops.fp8_quantize
            measure(scaling, dual, lambda: op(x, scaling))  # noqa: B023
    given = []  # the scale an earlier quantization of x gave (made inside a row's guard)

    def delayed(dual: bool):
        if not given:
            given.append(ops.fp8_quantize(x, "tensor")[1].reshape(1))
        return ops.fp8_quantize_delayed(x, given[0], dual=dual)

    def kept_the_scale(out) -> None:
        if not torch.equal(out[1].reshape(1), given[0]):
            raise RuntimeError(f"the delayed quantize replaced scale {given[0].item()} by "
                               f"{out[1].item()}: it read x twice, which this row would not count")

    for dual in (False, True):
        measure("tensor-delayed", dual, lambda: delayed(dual), kept_the_scale)  # noqa: B023
    for rule in FP4_RULES:
        measure(f"fp4-{rule}", False, lambda: ops.fp4_quantize(x, rule))  # noqa: B023
    print(f"D2D copy: {copy_gbs:.0f} GB/s  ({n}x{n} bf16)")
    print(f"{'scaling':>14} {'dual':>5} {'B/elem':>8} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        cells = (f"{r['bytes_per_elem']:8.4g} {r['gbs']:8.0f} {r['of_copy']:8.0%}"
                 if "error" not in r
                 else f"  failed: {r['error'].splitlines()[0]}")
        print(f"{r['scaling']:>14} {str(r['dual']):>5} {cells}")
    return rows


TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def torchao_float8():
    """(Float8LinearConfig, convert_to_float8_training); None where torchao is not installed; the
    error as a string where it is but its float8 API does not import (e.g. a torch API it needs
    is missing): that is then every torchao contender's result."""
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # noqa: BLE001 (an import that fails is the contenders' result)
        return f"torchao.float8 did not import: {type(exc).__name__}: {exc}"
    return Float8LinearConfig, convert_to_float8_training


def contenders(size: int, device: str) -> tuple[torch.Tensor, dict]:
    """x [size, size] and {name: module}: bf16 nn.Linear, Float8Linear with each recipe (sharing
    its weight), each also as "<recipe>/separate" (Float8Recipe.transposed_copy: the transposed
    FP8 copies made after q instead of by the dual quantizer; same bits), and torchao's
    Float8Linear with each of its recipes where torchao is installed (a conversion that fails is
    kept as its error message)."""
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16, requires_grad=True)
    base = torch.nn.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    mods = {"bf16 nn.Linear": base}
    for recipe in RECIPES:
        mods[recipe] = Float8Linear.from_linear(base, recipe)
    for recipe, r in RECIPES.items():
        separate = dataclasses.replace(r, transposed_copy="separate")
        mods[f"{recipe}/separate"] = Float8Linear.from_linear(base, separate)
    ao = torchao_float8()
    if isinstance(ao, str):
        mods.update({f"torchao-{recipe}": ao for recipe in TORCHAO_RECIPES})
    elif ao is not None:
        config, convert = ao
        for recipe in TORCHAO_RECIPES:
            wrapped = torch.nn.Sequential(
                torch.nn.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16))
            wrapped[0].weight = base.weight
            try:
                convert(wrapped, config=config.from_recipe_name(recipe))
                mods[f"torchao-{recipe}"] = wrapped
            except Exception as exc:  # noqa: BLE001 (an API change is this row's result)
                mods[f"torchao-{recipe}"] = f"{type(exc).__name__}: {exc}"
    return x, mods


STEPS = ("train", "sum")
PHASE = {"forward": "fwd", "backward": "bwd"}


def step_fn(mod, x, kind: str = "train"):
    """One forward + backward of `kind` (STEPS, module docstring), the same for every contender.
    train: the backward of a fixed contiguous grad_output (drawn here, once), gradients reset to
    None first; sum: y.sum().backward(), gradients accumulating."""
    if kind == "sum":
        def step():
            mod(x).sum().backward()
        return step
    if kind != "train":
        raise ValueError(f"step kind must be one of {STEPS}, got {kind!r}")
    params = [p for p in mod.parameters() if p.requires_grad]
    with torch.no_grad():
        grad_out = torch.randn_like(mod(x))

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        mod(x).backward(grad_out)
    return step


def step_passes(step, size: int) -> dict:
    """The passes one call of step() makes over tensors of >= size * size elements."""
    step()  # warm: a first call may allocate or compile what later ones reuse
    with count_passes(size * size) as count:
        step()
    if not any(p.phase == "backward" for p in count.passes):  # every contender's bwd has GEMMs
        raise RuntimeError("the count saw no backward op: the dispatch mode did not reach "
                           "autograd's backward thread, so these counts would be forward only")
    return dict(**count.summary(), emulated_gemms=count.emulated_gemms(),
                ops=[f"{PHASE[p.phase]} {p.kind} {p.op} {list(p.shapes)}" for p in count.passes])


def new_fallbacks(before: dict[str, int]) -> dict[str, int]:
    """The GEMMs torch._scaled_mm refused (then emulated) since `before` (scaled_mm_fallbacks())."""
    now = scaled_mm_fallbacks()
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


def bench_gpu_linear(args, rows: list, save, device: str = "cuda") -> list[dict]:
    """Per size, every contender's speedup over bf16 nn.Linear with each step kind, the kinds
    interleaved per contender (so a drifting GPU clock hits both alike). A step kind that fails
    keeps `<name>_error` (train) or `<name>_sum_error` in the row; a size whose bf16 baseline
    fails keeps `error`. (device: a test runs this on the CPU.)"""
    t0 = time.perf_counter()  # progress lines: where a run cut off by a time cap spent it
    for size in args.sizes:
        row = dict(size=size)
        rows.append(row)  # saved as it fills: a run cut off keeps the contenders measured
        try:
            x, mods = contenders(size, device)
            base = mods.pop("bf16 nn.Linear")
            t_bf16 = {}
            for kind in STEPS:
                t_bf16[kind] = timeit(step_fn(base, x, kind), device, args.repeat)
                row["bf16_ms" if kind == "train" else "bf16_sum_ms"] = t_bf16[kind] * 1e3
        except Exception as exc:  # noqa: BLE001 (no baseline: nothing to compare at this size)
            row["error"] = failure(f"linear {size}: contenders / bf16 baseline", exc)
            save()
            continue
        for name, mod in mods.items():
            key = name.replace("-", "_") if name.startswith("torchao") else name
            if isinstance(mod, str):
                row[f"{key}_error"] = mod
                continue
            before = scaled_mm_fallbacks()
            for kind in STEPS:
                suffix = "" if kind == "train" else "_sum"
                try:
                    t = timeit(step_fn(mod, x, kind), device, args.repeat)
                    row[f"{key}{suffix}_speedup"] = t_bf16[kind] / t
                except Exception as exc:  # noqa: BLE001 (this step's result; the rest go on)
                    row[f"{key}{suffix}_error"] = failure(f"linear {size} {name} {kind}", exc)
            emulated = new_fallbacks(before)
            if emulated:
                row[f"{key}_emulated_gemms"] = emulated
            save()
            print(f"  linear {size} {name}: " + ", ".join(
                f"{k} {row[f'{key}{k}_speedup']:.2f}x" for k in ("", "_sum")
                if f"{key}{k}_speedup" in row), f"({time.perf_counter() - t0:.1f} s)", flush=True)
        del x, mods, base
    print_linear(rows)
    return rows


def print_linear(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r if k.endswith("speedup")))
    print("speedup over bf16 nn.Linear, fwd+bwd; <name>: train step, <name>_sum: sum step")
    print(f"{'M=N=K':>6} {'bf16 ms':>8} {'sum ms':>8} " + " ".join(f"{k[:-8]:>22}" for k in keys))
    for r in rows:
        if "error" in r:
            print(f"{r['size']:>6}  failed: {r['error'].splitlines()[0]}")
            continue
        print(f"{r['size']:>6} {r['bf16_ms']:8.2f} {r['bf16_sum_ms']:8.2f} "
              + " ".join(f"{r[k]:21.2f}x" if k in r else f"{'failed':>22}" for k in keys))
    for r in rows:
        for k, v in r.items():
            if k.endswith("_error") or k.endswith("_emulated_gemms"):
                print(f"  {r['size']} {k}: {v.splitlines()[0] if isinstance(v, str) else v}")


def bench_split(args, result: dict, save) -> dict:
    """The split of one fwd+bwd per contender at args.split_size (lowp_split.py)."""
    size = args.split_size or (max(args.sizes) if args.device == "cuda" else min(args.sizes))
    split = result["split"] = dict(size=size, device=args.device, steps=args.split_steps,
                                   step=args.step, contenders={}, passes={})
    t0 = time.perf_counter()  # progress lines: where a run cut off by a time cap spent it
    x, mods = contenders(size, args.device)
    # the copy bandwidth the pass bytes are read against: read + write of a bf16 size x size
    t_copy = timeit(lambda: x.detach().clone(), args.device, args.repeat)
    split["copy_gbs"] = 2 * x.numel() * x.element_size() / t_copy / 1e9
    for name, mod in mods.items():
        if isinstance(mod, str):
            split["contenders"][name] = dict(error=mod)
            save()
            continue
        before = scaled_mm_fallbacks()
        try:  # step_fn runs a forward already (the train step's grad_output)
            step = step_fn(mod, x, args.step)
            row = profile_split(step, args.device, args.split_steps)
            row["timed_ms"] = timeit(step, args.device, args.repeat) * 1e3
        except Exception as exc:  # noqa: BLE001 (one contender failing leaves the others)
            row = dict(error=failure(f"split {name}", exc))
        emulated = new_fallbacks(before)
        if emulated:
            row["emulated_gemms"] = emulated
        split["contenders"][name] = row
        split["passes"][name] = {}
        for kind in STEPS:
            try:
                split["passes"][name][kind] = step_passes(step_fn(mod, x, kind), size)
            except Exception as exc:  # noqa: BLE001 (a count that fails is this row's result)
                split["passes"][name][kind] = dict(error=failure(f"passes {name} {kind}", exc))
        save()
        print(f"  split {name}: " + (f"{row['timed_ms']:.3f} ms" if "timed_ms" in row
                                     else "failed") + f" ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    rows = split["contenders"]
    bf16 = rows["bf16 nn.Linear"].get("timed_ms")
    for r in rows.values():
        if bf16 and "timed_ms" in r:
            r["speedup_vs_bf16"] = bf16 / r["timed_ms"]
    save()
    print_split(split)
    print_passes(split)
    return split


def bench_passes(args, result: dict, save) -> dict:
    """The passes of every contender's steps per size, counted on fake tensors (FakeTensorMode:
    the ops dispatch, no data exists, so 8192^3 costs nothing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = result["passes"] = {}
    for size in args.sizes:
        block = out[str(size)] = dict(size=size, passes={})
        with FakeTensorMode():
            x, mods = contenders(size, "cpu")
            for name, mod in mods.items():
                if isinstance(mod, str):
                    continue
                block["passes"][name] = {}
                for kind in STEPS:
                    try:
                        block["passes"][name][kind] = step_passes(step_fn(mod, x, kind), size)
                    except Exception as exc:  # noqa: BLE001 (this row's result)
                        block["passes"][name][kind] = dict(
                            error=failure(f"passes {size} {name} {kind}", exc))
        save()
        print_passes(block)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--parts", nargs="+", choices=("quantize", "linear", "split", "passes"),
                   default=["quantize", "linear", "split"],
                   help="what to run (linear: GPU only; on a CPU the split shows the step times; "
                        "passes: counted on fake tensors, any device)")
    p.add_argument("--split-size", type=int, default=None,
                   help="M=N=K of the split (default: the largest of --sizes on a GPU, the "
                        "smallest on a CPU)")
    p.add_argument("--split-steps", type=int, default=3, help="profiled steps per contender")
    p.add_argument("--step", choices=STEPS, default="train",
                   help="the step the split profiles (module docstring; passes: both)")
    p.add_argument("--json", default=None,
                   help="output path (default: benchmarks/results/bench_lowp-<device>.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    args = p.parse_args()
    result = dict(machine=platform.processor() or platform.machine(), torch=torch.__version__,
                  device=args.device, argv=sys.argv,
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    if args.json is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        args.json = str(RESULTS / f"bench_lowp-{args.device}.json")

    def save():
        dump_json(args.json, result)

    ao = torchao_float8()
    if isinstance(ao, str):
        result["torchao_error"] = ao
        print(f"torchao: {ao}")
    elif ao is not None:
        import torchao

        result["torchao"] = torchao.__version__
    # Each section on its own: one that fails keeps <section>_error and the next still runs.
    if "passes" in args.parts:
        run_section(result, "passes", save, lambda: bench_passes(args, result, save))
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        if "split" in args.parts:  # first: where the Float8Linear step's time goes
            run_section(result, "split", save, lambda: bench_split(args, result, save))
        if "quantize" in args.parts:
            run_section(result, "quantize", save, lambda: bench_gpu_quantize(
                args, result.setdefault("quantize", []), save))
        if "linear" in args.parts:
            run_section(result, "linear", save, lambda: bench_gpu_linear(
                args, result.setdefault("linear", []), save))
    else:
        result["threads"] = torch.get_num_threads()
        if "quantize" in args.parts:
            def cpu_quantize():
                result["quantize"] = bench_cpu(args)

            run_section(result, "quantize", save, cpu_quantize)
        if "split" in args.parts:
            run_section(result, "split", save, lambda: bench_split(args, result, save))
    save()
    print(f"wrote {args.json}")
    if args.plot:  # draws the sections this run wrote
        print(f"wrote {plot_json(plot_lowp, args.json, args.plot)}")


if __name__ == "__main__":
    main()
