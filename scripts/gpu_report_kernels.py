"""The GPU kernels' tables in scripts/gpu_report.py's report: the fused CUDA AdamW
(bench_optim), the FP8/FP4 quantizers, Float8Linear and its time split (bench_lowp) and the
zero-copy gather (bench_gather), each row against its target below.
"""

from __future__ import annotations

import re

from gpu_report_markdown import (
    NONE,
    at_least,
    errors_of,
    first_line,
    is_error_key,
    num,
    pct,
    plain_table,
    table,
    times,
    verdict,
)

TARGETS = {
    # fused CUDA AdamW, torch's step time over tierlift's, every size; bf16 params (tierlift keeps
    # an fp32 master) against torch's fused on fp32 masters copied into bf16, the same work
    "adamw": {"cuda-float32": ("vs torch-fused", 1.0),
              "cuda-bfloat16": ("vs torch-fused-mixed", 1.3)},
    # quantize GB/s over the D2D copy's: one read and one write (rowwise, 1x128); an amax pass
    # or a transposed write more (tensorwise, 128x128, columnwise, every dual); FP4 (NVFP4
    # reads its input twice: its tensor scale needs the global amax first). Delayed tensorwise
    # scaling (its scale chosen ahead) is one pass, dual or not: the single-pass target.
    "quantize_of_copy": {"row": 0.85, "1x128": 0.85, "tensor": 0.60, "128x128": 0.60,
                         "col": 0.60, "dual": 0.60, "fp4-floor": 0.70, "fp4-rceil": 0.70,
                         "fp4-nv": 0.50, "tensor-delayed": 0.85},
    # Float8Linear forward + backward (train step): bf16 nn.Linear's time over its own
    "linear_speedup": {"fp8-tensorwise": 1.35, "fp8-tensorwise-delayed": 1.35, "fp8-rowwise": 1.2},
    # zero-copy gather GB/s over a pinned copy_ of the same bytes, for rows of 256 B and up
    "gather_of_copy": 0.80, "gather_min_row_bytes": 256,
}


def optim_section(data: dict) -> list[str]:
    rows, body = data.get("rows", []), []
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not is_error_key(k) and k not in ("case", "params", "numel", "step_ms")]
    for r in rows:
        key, goal = TARGETS["adamw"].get(r.get("case"), (None, None))
        body.append([r.get("case"), r.get("params")]
                    + [times(r.get(k)) if k.startswith("vs ") else num(r.get(k)) for k in keys]
                    + [f"{key} >= {goal}x" if goal else "", verdict(r.get(key), goal),
                       "; ".join(errors_of(r) + [f"{k} {num(v)} ms"  # median step times
                                                 for k, v in (r.get("step_ms") or {}).items()])])
    out = ["\"vs X\": X's step time over tierlift's (> 1: tierlift faster); bf16 is judged "
           "against torch-fused-mixed, which does tierlift's work (fp32 master).", ""]
    out += table(["case", "params", *keys, "target", "met", "note"], body)
    return out + plain_table(data.get("compact_rows") or [])  # CPU runs only


QUANTIZERS = {"tensor": "FP8 tensorwise", "row": "FP8 rowwise", "1x128": "FP8 1x128",
              "128x128": "FP8 128x128", "col": "FP8 columnwise", "fp4-floor": "MXFP4 (floor)",
              "fp4-rceil": "MXFP4 (rceil)", "fp4-nv": "NVFP4",
              "tensor-delayed": "FP8 tensorwise, delayed scale"}
# Quantizers whose dual output is still one pass over x: their own target, not "dual"'s.
SINGLE_PASS_DUAL = {"tensor-delayed"}
LINEAR_KEY = re.compile(r"^(.+?)(_sum)?_(speedup|error|emulated_gemms)$")


def split_table(split: dict) -> list[str]:
    cons = split.get("contenders", {})
    cats = list(dict.fromkeys(c for r in cons.values() for c in r.get("categories", {})))
    cell = lambda c: f"{num(c['ms'])} ({c['pct']:.0f}%)"
    return [f"Where one forward + backward spends its time (profiler, M=N=K={split.get('size')}, "
            f"{split.get('step', '?')} step; ms and % of the profiled step):", "",
            *table(["contender", "step ms", *cats, "timed ms", "vs bf16", "note"], [
                [name, num(r.get("step_ms"))]
                + [cell(r["categories"][c]) if c in r.get("categories", {}) else NONE
                   for c in cats]
                + [num(r.get("timed_ms")), times(r.get("speedup_vs_bf16")), "; ".join(
                    errors_of(r) + ([f"emulated GEMMs {r['emulated_gemms']}"]
                                    if r.get("emulated_gemms") else []))]
                for name, r in cons.items()])]


def quantize_table(quant: list[dict]) -> list[str]:
    body = []
    for r in quant:
        single = r.get("scaling") in SINGLE_PASS_DUAL
        kind = "dual" if r.get("dual") and not single else r.get("scaling")
        label = QUANTIZERS.get(r.get("scaling"), r.get("scaling")) + (
            " + transposed (dual)" if r.get("dual") else "")
        goal = TARGETS["quantize_of_copy"].get(kind)
        body.append([label, num(r.get("gbs")), pct(r.get("of_copy")),
                     f">= {pct(goal)}" if goal else "", verdict(r.get("of_copy"), goal),
                     "; ".join(errors_of(r))])
    copy = next((r["copy_gbs"] for r in quant if "copy_gbs" in r), None)
    return [f"Quantize kernels, bytes read + written per second (D2D copy {num(copy)} GB/s):",
            "", *table(["quantizer", "GB/s", "of copy", "target", "met", "note"], body)]


def linear_table(linear: list[dict]) -> list[str]:
    body = []
    for r in linear:
        if "error" in r:  # the bf16 baseline failed: nothing measured at this size
            body.append([r.get("size"), NONE, NONE, NONE, NONE, "", "", first_line(r["error"])])
            continue
        for name in dict.fromkeys(m.group(1) for k in r if (m := LINEAR_KEY.match(k))):
            got = r.get(f"{name}_speedup")  # "<recipe>/separate": the recipe's target too
            goal = TARGETS["linear_speedup"].get(name.split("/")[0])
            notes = errors_of({k: v for k, v in r.items() if k.startswith(f"{name}_")})
            if r.get(f"{name}_emulated_gemms"):
                notes.append(f"emulated GEMMs {r[f'{name}_emulated_gemms']} (not FP8 speed)")
            body.append([r["size"], num(r.get("bf16_ms")), name, times(got),
                         times(r.get(f"{name}_sum_speedup")), at_least(goal),
                         # emulated GEMMs are not an FP8 speed: no verdict either way
                         "" if r.get(f"{name}_emulated_gemms") else verdict(got, goal),
                         "; ".join(notes)])
    return ["Float8Linear forward + backward: bf16 nn.Linear's time over its own (train: fixed "
            "grad_output; sum: y.sum().backward(); a JSON without bf16_sum_ms predates the two "
            "and timed the sum step):", "",
            *table(["M=N=K", "bf16 ms", "contender", "speedup", "sum-step speedup", "target",
                    "met", "note"], body)]


def lowp_section(data: dict) -> list[str]:
    out = errors_of(data) + ([f"torchao {data['torchao']}"] if data.get("torchao") else [])
    out += [""] if out else []
    out += split_table(data["split"]) if data.get("split") else []
    quant = data.get("quantize") or []  # on a CPU: the C++ op's time against the reference's
    out += (plain_table if data.get("device") == "cpu" else quantize_table)(quant) if quant else []
    return out + (linear_table(data["linear"]) if data.get("linear") else [])


def gather_section(data: dict) -> list[str]:
    if data.get("error"):
        return [f"The GPU part did not start: {first_line(data['error'])}", ""]
    goal, least = TARGETS["gather_of_copy"], TARGETS["gather_min_row_bytes"]
    results, body = data.get("results", []), []
    for r in results:
        aimed = r.get("row_bytes", 0) >= least
        body.append([r.get("row_bytes"), num(r.get("tierlift_gbs")),
                     num(r.get("tierlift_mrows_s")), num(r.get("pinned_copy_gbs")),
                     pct(r.get("fraction_of_copy")), times(r.get("speedup_vs_cpu_path")),
                     f">= {pct(goal)}" if aimed else "",
                     verdict(r.get("fraction_of_copy"), goal if aimed else None),
                     "; ".join(errors_of(r))])
    out = ["Zero-copy gather from pinned host memory (the default kernel, as FeatureStore.gather) "
           "against a pinned copy_ of the same bytes:", "",
           *table(["row B", "GB/s", "M rows/s", "pinned copy GB/s", "of copy",
                   "vs CPU index_select + copy", "target", "met", "note"], body)]
    variants = list(dict.fromkeys(k[: -len("_of_copy")] for r in results for k in r
                                  if k.endswith("_of_copy") and k != "fraction_of_copy"))
    if variants:
        out += ["Kernel variants, GB/s (of copy); the sorted ones include the sort:", "",
                *table(["row B", *variants, "sort ms"], [
                    [r.get("row_bytes")]
                    + [f"{num(r.get(f'{v}_gbs'))} ({pct(r.get(f'{v}_of_copy'))})"
                       for v in variants] + [num(r.get("sort_ms"))] for r in results])]
    return out
