"""Where one forward + backward of a low-precision linear spends its time (bench_lowp.py --parts
split): torch.profiler records a few steps, and every unit of time is put in one category by the
explicit name rules of SPLIT_RULES.

    PYTHONPATH=python python benchmarks/bench_lowp.py --device cpu --sizes 256 --parts split

On a GPU the units are the device activities (kernels, memcpy, memset) and the step is its wall
time with a synchronize at its end; 'gaps' is the part of the step when no kernel ran (launch
latency, host work). On a CPU the units are the ops' self times (CPU activity), and 'gaps' is
the step's own self time: Python and autograd between ops. The categories therefore add up to the
step; a test checks that they do (no event counted twice, none lost).

A unit's category: the rules are tried on its own name (the kernel's, or the CPU op's), then on
the names of the ops around it, innermost first (on a GPU, the op that launched the kernel and
its parents): the first name some rule matches decides, and among the rules matching that name
the first in the table wins. A copy inside a cast inside tierlift's GEMM wrapper is therefore
'gemm' (casts match nothing), a clone inside torchao's amax is 'layout'. Nothing matched: 'other',
whose top names are printed, so a new kernel name shows up instead of being misfiled quietly.

tierlift's GEMM wrapper (lowp/gemm.py's scaled_mm) runs inside a record_function range of its own
name (gemm.PROFILER_RANGE) whenever a profiler records, so that its inverse scales and, off the
FP8 tensor-core path (the CPU), its dequantize + fp32 matmul emulation are grouped with the GEMM.

Of the profiled steps (3 by default) the one of median length is reported: a step that ran, so
its categories add up, and one slowed by a shared machine is left out. Per category: time, its
share of the step, the count of kernels launched (GPU) or ops called (CPU), and 'arg MB': the
bytes of the tensors passed to the ops that did the work (record_shapes). On a GPU each
kernel-launching op counts once, with its longest kernel, and memcpy/memset activity tied to no
op adds its own bytes; on a CPU each op with no data-reading op below it counts (views and
allocations do not). The profiler records no outputs, so a quantizer's codes and scales are not
in its MB; a copy_ counts source and destination.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict

import torch

from tierlift.lowp.gemm import PROFILER_RANGE as GEMM_RANGE

STEP_RANGE = "tierlift_bench_step"

# The categories in print order; the last two are never matched by a rule.
CATEGORIES = ("quantize", "gemm", "layout", "amax/scale", "other", "gaps")

# (category, what the pattern is matched against, pattern): "name" is a unit's own name (kernel or
# CPU op), "op" the name of an op or range around it. re.search, case-sensitive.
SPLIT_RULES: tuple[tuple[str, str, str], ...] = (
    # tierlift's amax passes (amax_tiles/amax_flat/nv_amax/amax_to_scale kernels) and inverse scales
    ("amax/scale", "name", r"amax|absmax|reciprocal"),
    # cuBLAS / cuBLASLt / CUTLASS GEMM kernels by name (Hopper's are nvjet_* or sm90_xmma_*)
    ("gemm", "name", r"gemm|nvjet|cutlass|xmma|wgmma"),
    # tierlift's quantize kernels (tierlift::cuda::...: row_kernel, cast_tiles_kernel, ...)
    ("quantize", "name", r"tierlift::cuda::"),
    # same-dtype copies: what .contiguous() and transposes launch
    ("layout", "name", r"direct_copy_kernel|transpose\w*_kernel|Memcpy DtoD"),
    # amax and scale math done with torch ops (torchao's eager recipes: abs, max/amax, pow-2 scale)
    ("amax/scale", "op", r"^aten::(abs|amax|max|reciprocal|log2|exp2)$"),
    # tierlift's quantize ops and torchao's hp -> fp8 cast
    ("quantize", "op", r"^tierlift::fp[48]_quantize|^_ToFloat8ConstrFunc$"),
    # GEMM ops, and tierlift's GEMM wrapper (its profiler range)
    ("gemm", "op", r"^aten::(_scaled_mm|_scaled_grouped_mm|mm|addmm|bmm|matmul|linear)$"
                   rf"|^{re.escape(GEMM_RANGE)}$"),
    # layout copies: .contiguous(), clones, materialized transposes / permutes
    ("layout", "op", r"^aten::(contiguous|clone|transpose_copy|t_copy|permute_copy)$"),
)
_COMPILED = [(cat, field, re.compile(pat)) for cat, field, pat in SPLIT_RULES]

# CPU leaf ops that read no tensor data (views, allocations): no arg bytes counted for them
_NO_DATA = re.compile(r"^aten::(empty\w*|as_strided_?|view|_reshape_alias|reshape|t|transpose|"
                      r"permute|expand|unsqueeze|squeeze|select|slice|detach|alias|resolve_conj|"
                      r"resolve_neg|lift_fresh|_local_scalar_dense|item)$")

_ITEMSIZE = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "c10::Float8_e4m3fn": 1,
             "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
             "c10::Float8_e8m0fnu": 1, "c10::Float4_e2m1fn_x2": 1, "unsigned char": 1,
             "signed char": 1, "bool": 1, "short int": 2, "int": 4, "long int": 8}
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str, around: list[str]) -> str:
    """The category of a unit named `name` inside the ops `around` (innermost first)."""
    for field, candidate in [("name", name), *(("op", a) for a in around)]:
        for cat, f, pat in _COMPILED:
            if f == field and pat.search(candidate):
                return cat
    return "other"


def short_name(name: str, limit: int = 70) -> str:
    """A kernel's name without return type, template arguments and parameters."""
    n = name.replace("(anonymous namespace)::", "")
    n = re.sub(r"^void ", "", n)
    cut = min([i for i in (n.find("<"), n.find("(")) if i > 0] or [len(n)])
    n = n[:cut]
    return n if len(n) <= limit else n[: limit - 3] + "..."


def _arg_bytes(ev: dict) -> int:
    args = ev.get("args") or {}
    total = 0
    for dims, typ in zip(args.get("Input Dims") or [], args.get("Input type") or []):
        size = _ITEMSIZE.get(typ)
        if size is None or not isinstance(dims, list) or any(isinstance(d, list) for d in dims):
            continue  # not a tensor (Scalar, ScalarList, TensorList, None)
        numel = 1
        for d in dims:
            numel *= int(d)
        total += numel * size
    return total


def _forest(host: list[dict]) -> dict[int, dict | None]:
    """id(event) -> enclosing event on its thread (time nesting), for the host events."""
    parent: dict[int, dict | None] = {}
    by_thread = defaultdict(list)
    for ev in host:
        by_thread[(ev.get("pid"), ev.get("tid"))].append(ev)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for ev in evs:
            end = ev["ts"] + ev["dur"]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < end - 1e-3:
                stack.pop()
            parent[id(ev)] = stack[-1] if stack else None
            stack.append(ev)
    return parent


def _path(ev: dict | None, parent: dict) -> list[dict]:
    out = []
    while ev is not None:
        out.append(ev)
        ev = parent.get(id(ev))
    return out


class _Acc:
    def __init__(self):
        self.us = defaultdict(float)
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.names = defaultdict(lambda: defaultdict(float))

    def add(self, cat: str, us: float, label: str, calls: int = 1):
        self.us[cat] += us
        self.calls[cat] += calls
        self.names[cat][label] += us


def split_trace(events: list[dict], device: str) -> dict:
    """The split of the median-length step among those recorded in a Chrome trace's events:
    {steps, step_ms, step_ms_all, categories: {cat: {ms, pct, calls, arg_mb,
    names: [[name, ms], ...]}}}."""
    events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    steps = sorted((e for e in host if e["name"] == STEP_RANGE), key=lambda e: e["ts"])
    if not steps:
        raise RuntimeError(f"no {STEP_RANGE!r} range in the trace")
    parent = _forest(host)
    accs = {id(s): _Acc() for s in steps}
    if device == "cuda":
        _split_device(events, host, steps, parent, accs)
    else:
        _split_host(host, steps, parent, accs)
    step = sorted(steps, key=lambda e: e["dur"])[(len(steps) - 1) // 2]
    acc, total_us = accs[id(step)], step["dur"]
    cats = {}
    for cat in CATEGORIES:
        us = acc.us.get(cat, 0.0)
        names = sorted(acc.names.get(cat, {}).items(), key=lambda kv: -kv[1])[:8]
        cats[cat] = dict(ms=us / 1e3, pct=100 * us / total_us if total_us else 0.0,
                         calls=acc.calls.get(cat, 0), arg_mb=acc.bytes.get(cat, 0) / 1e6,
                         names=[[k, v / 1e3] for k, v in names])
    return dict(steps=len(steps), step_ms=total_us / 1e3,
                step_ms_all=[s["dur"] / 1e3 for s in steps], categories=cats)


def _split_host(host, steps, parent, accs: dict) -> None:
    children = defaultdict(float)
    works_below = set()  # ops with an op below them that reads data (not a view, not an alloc)
    for ev in host:
        p = parent.get(id(ev))
        if p is not None:
            children[id(p)] += ev["dur"]
        if not _NO_DATA.match(ev["name"]):
            while p is not None and id(p) not in works_below:
                works_below.add(id(p))
                p = parent.get(id(p))
    for ev in host:
        path = _path(ev, parent)
        acc = next((accs[id(p)] for p in path if id(p) in accs), None)
        if acc is None:
            continue  # outside the profiled steps (or on another thread)
        self_us = max(ev["dur"] - children[id(ev)], 0.0)
        if id(ev) in accs:
            acc.add("gaps", self_us, "(Python, autograd between ops)")
            continue
        around = [p["name"] for p in path]  # the op itself first: op rules apply to it too
        cat = classify(ev["name"], around)
        acc.add(cat, self_us, f"{ev['name']} < {around[1]}")
        if id(ev) not in works_below and not _NO_DATA.match(ev["name"]):
            acc.bytes[cat] += _arg_bytes(ev)


def _split_device(events, host, steps, parent, accs: dict) -> None:
    by_ext = {}
    for ev in host:
        ext = (ev.get("args") or {}).get("External id")
        if ext is not None:
            by_ext.setdefault(ext, ev)
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    for step in steps:
        acc = accs[id(step)]
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        inside = sorted((e for e in device if t0 <= e["ts"] < t1), key=lambda e: e["ts"])
        busy, end = 0.0, t0
        for ev in inside:  # busy time: the union of the units' intervals (streams may overlap)
            a, b = max(ev["ts"], end), min(ev["ts"] + ev["dur"], t1)
            if b > a:
                busy += b - a
                end = b
        acc.add("gaps", max(step["dur"] - busy, 0.0), "(no kernel running)", calls=0)
        longest: dict[int, tuple[float, str, dict]] = {}  # op -> (longest unit, its category, op)
        for ev in inside:
            op = by_ext.get((ev.get("args") or {}).get("External id"))
            path = _path(op, parent)
            cat = classify(ev["name"], [p["name"] for p in path])
            where = f" < {path[0]['name']}" if path else ""
            acc.add(cat, ev["dur"], short_name(ev["name"]) + where)
            if op is None:
                acc.bytes[cat] += int((ev.get("args") or {}).get("bytes", 0))
            elif ev["dur"] > longest.get(id(op), (-1.0,))[0]:
                longest[id(op)] = (ev["dur"], cat, op)
        for _, cat, op in longest.values():
            acc.bytes[cat] += _arg_bytes(op)


def profile_split(step, device: str, steps: int = 3) -> dict:
    """split_trace of `steps` calls of step() (after one unprofiled warm-up)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    sync()
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                step()
                sync()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="lowp_split_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = split_trace(events, device)
    if device == "cuda" and not any(e.get("cat") in _DEVICE_CATS for e in events):
        out["note"] = "the profiler recorded no device activity (CUPTI unavailable?)"
    return out


def print_split(split: dict) -> None:
    """Rows: contenders; columns: the categories' ms and share of the step; then launches/calls
    and arg MB per category, and the names that fell through to 'other'."""
    rows = split["contenders"]
    unit = "GPU kernel time" if split["device"] == "cuda" else "CPU op self time"
    print(f"\nsplit of one fwd+bwd, M=N=K={split['size']} ({split['device']}; torch.profiler, "
          f"{unit}, the median of {split['steps']} steps; rules: lowp_split.SPLIT_RULES)")
    name_w = max(len(n) for n in rows) + 1
    head = f"{'':<{name_w}}{'timed ms':>9}{'x bf16':>7}{'step ms':>9}"
    print(head + "".join(f"{c:>15}" for c in CATEGORIES))
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<{name_w}}  failed: {r['error']}")
            continue
        speed = f"{r['speedup_vs_bf16']:6.2f}x" if "speedup_vs_bf16" in r else f"{'':>7}"
        cells = "".join(f"{r['categories'][c]['ms']:9.3f}{r['categories'][c]['pct']:5.0f}%"
                        for c in CATEGORIES)
        print(f"{name:<{name_w}}{r['timed_ms']:9.3f}{speed}{r['step_ms']:9.3f}{cells}")
    gaps = "no kernel running" if split["device"] == "cuda" else "Python/autograd between ops"
    print(f"timed ms: median unprofiled step; x bf16: bf16 nn.Linear's timed ms over this one's; "
          f"step ms: profiled step = the categories' sum; gaps: {gaps}")
    what = "kernels" if split["device"] == "cuda" else "ops"
    print(f"\n{what} / arg MB in that step, by category")
    print(f"{'':<{name_w}}" + "".join(f"{c:>15}" for c in CATEGORIES[:-1]))
    for name, r in rows.items():
        if "error" not in r:
            print(f"{name:<{name_w}}" + "".join(
                f"{r['categories'][c]['calls']:6.0f} /{r['categories'][c]['arg_mb']:7.1f}"
                for c in CATEGORIES[:-1]))
    print("\nfell through to 'other' (ms):")
    for name, r in rows.items():
        if "error" in r:
            continue
        names = r["categories"]["other"]["names"]
        listed = "; ".join(f"{n} {ms:.3f}" for n, ms in names[:5]) or "(nothing)"
        print(f"  {name}: {listed}")
        if r.get("note"):
            print(f"  {name}: NOTE {r['note']}")


def print_passes(split: dict) -> None:
    """Per contender and step kind: the passes over layer-sized tensors one fwd+bwd makes
    (tierlift.lowp.passes), the bytes the non-GEMM ones move and, where the run measured the
    copy bandwidth, that many bytes' time at it: the floor of the split's quantize + layout +
    amax time."""
    passes, gbs = split.get("passes") or {}, split.get("copy_gbs")
    if not passes:
        return
    n = split["size"]
    copy = f"copy {gbs:.0f} GB/s" if gbs else "no copy bandwidth measured"
    print(f"\npasses over tensors of >= {n}x{n} elements per fwd+bwd (tierlift.lowp.passes; "
          f"quantizer reads as the CUDA kernels make them; {copy})")
    name_w = max(len(k) for k in passes) + 7
    cols = ("quantize", "layout", "cast", "other", "gemms", "emulated_gemms", "small_ops")
    print(f"{'':<{name_w}}" + "".join(f"{c:>10}" for c in ("quantize", "layout", "cast",
                                                             "other", "GEMMs", "emulated",
                                                             "small ops"))
          + f"{'non-GEMM MB':>13}{'at copy ms':>11}")
    for name, kinds in passes.items():
        for kind, r in kinds.items():
            label = f"{name} {kind}"
            if "error" in r:
                print(f"{label:<{name_w}}  failed: {r['error']}")
                continue
            floor = f"{r['bytes'] / (gbs * 1e9) * 1e3:11.3f}" if gbs else f"{'-':>11}"
            print(f"{label:<{name_w}}" + "".join(f"{r[c]:>10}" for c in cols)
                  + f"{r['bytes'] / 1e6:13.1f}{floor}")
    print("the ops of each (fwd/bwd, kind, op, input shapes):")
    for name, kinds in passes.items():
        for kind, r in kinds.items():
            if "error" not in r:
                print(f"  {name} {kind}: " + "; ".join(r["ops"]))
