#!/usr/bin/env python3
"""Mutation testing of the CUDA kernels against the CPU simulator's tests, in CI's modes.

Plants single-point bugs in csrc/cuda one at a time on a scratch copy of the repository (never in
the working tree), rebuilds the simulator tests there and runs them as CI (scripts/test.sh) does:
plainly, with the warp-ahead schedule, under AddressSanitizer + UBSan (the mutated file's suites
in these three), and CI's ThreadSanitizer race run itself (scripts/tsan_races.sh: the same filter,
TSAN_OPTIONS and setarch -R). Modes run in that order, stopping at the first that catches the
mutant unless --all-modes. Prints a Markdown table saying which mode caught each mutant, and the
catch rate.

    python3 scripts/mutate_kernels.py                  # every mutant, every mode needed
    python3 scripts/mutate_kernels.py --only fp4_amax_atomic fp8_partial_war --modes tsan
    python3 scripts/mutate_kernels.py --modes plain,warp --all-modes
    python3 scripts/mutate_kernels.py --list

Builds take /tmp/tierlift-build.lock like every other build on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = "/tmp/tierlift-build.lock"
TARGET = "tierlift_cudasim_tests"
RACE_RUN = "scripts/tsan_races.sh"  # CI's TSan run: filter, TSAN_OPTIONS, setarch -R


@dataclass(frozen=True, kw_only=True)
class Mutant:
    name: str
    file: str  # relative to csrc/cuda
    original: str
    mutated: str
    description: str


MUTANTS = [
    Mutant(
        name="adam_scale_clobbered",
        file="adam_compact.cu",
        original="    const float old_max = scales[b0 / kCompactBlock];\n",
        mutated="    const float old_max = scales[b0 / kCompactBlock];\n"
        "    if (lane == 0) scales[b0 / kCompactBlock] = 0.f;\n",
        description="compact Adam: lane 0 overwrites the old scale before the other lanes read it",
    ),
    Mutant(
        name="adam_vote_missing",
        file="adam_compact.cu",
        original="    bad = __any_sync(0xffffffffu, bad);\n",
        mutated="",
        description="compact Adam: the NaN/Inf flag stays per lane (not voted across the warp)",
    ),
    Mutant(
        name="adam_ties_up",
        file="adam_compact.cu",
        original="(u + 0x7ffffu + ((u >> kVCodeShift) & 1u)) >> kVCodeShift",
        mutated="(u + 0x80000u) >> kVCodeShift",
        description="compact Adam: v codes round ties up instead of to even",
    ),
    Mutant(
        name="adam_nan_only",
        file="adam_compact.cu",
        original="bad |= !(__fsub_rn(e.v[k], e.v[k]) == 0.f);",
        mutated="bad |= e.v[k] != e.v[k];",
        description="compact Adam: non-finite check narrowed to NaN (infinite v not flagged)",
    ),
    Mutant(
        name="adam_half_warp",
        file="adam_compact.cu",
        original="    for (int o = 16; o > 0; o >>= 1) {\n      const float other",
        mutated="    for (int o = 8; o > 0; o >>= 1) {\n      const float other",
        description="compact Adam: warp max over half warps only",
    ),
    Mutant(
        name="adam_partial_block_vector",
        file="adam_compact.cu",
        original="const bool whole = vec && n - b0 >= kCompactBlock;",
        mutated="const bool whole = vec;",
        description="compact Adam: a partial last code block takes the vector path (past the end)",
    ),
    Mutant(
        name="adam_lane_codes",
        file="adam_compact.cu",
        original="load_lane(codes, e0, e.code);",
        mutated="load_lane(codes, e0 ^ 8, e.code);",
        description="compact Adam: the vector path decodes the neighbouring lane's 8 v codes",
    ),
    Mutant(
        name="adam_misaligned_codes",
        file="adam_compact.cu",
        original="aligned_to(t.exp_avg_sq, kLaneAccess<uint8_t>)",
        mutated="true",
        description="compact Adam: codes not 8-byte aligned still take the vector path (UBSan)",
    ),
    Mutant(
        name="bf16_inf_nan",
        file="adam_element.cuh",
        original="if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;",
        mutated="if ((u & 0x7fffffffu) >= 0x7f800000u) return 0x7fc0;",
        description="Adam element: an infinite weight becomes NaN in the bf16 copy",
    ),
    Mutant(
        name="f16_nan_sign",
        file="adam_element.cuh",
        original="return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u);",
        mutated="return static_cast<uint16_t>(0x7e00u);",
        description="Adam element: fp16 copy of a negative NaN loses its sign",
    ),
    Mutant(
        name="gather_atomic",
        file="gather.cu",
        original="if (a.first_bad != nullptr) atomicMin(a.first_bad, pos);",
        mutated="if (a.first_bad != nullptr && pos < *a.first_bad) *a.first_bad = pos;",
        description="gather: first bad index by a plain read-compare-store (lost updates)",
    ),
    Mutant(
        name="gather_pair_cas",
        file="gather.cu",
        original="if (a.bad_pair != nullptr && atomicCAS(a.bad_pair, ~0ull, pos) == ~0ull) {",
        mutated=(
            "if (a.bad_pair != nullptr && a.bad_pair[0] == ~0ull && (a.bad_pair[0] = pos) == pos) {"
        ),
        description="gather: bad_pair claimed by a plain test-and-store instead of atomicCAS",
    ),
    Mutant(
        name="gather_cache_end",
        file="gather.cu",
        original="if (slot >= 0 && slot < a.cache_rows)",
        mutated="if (slot >= 0 && slot <= a.cache_rows)",
        description="gather: cache slot == cache_rows treated as a hit (one past the cache)",
    ),
    Mutant(
        name="gather_cache_start",
        file="gather.cu",
        original="if (slot >= 0 && slot < a.cache_rows)",
        mutated="if (slot > 0 && slot < a.cache_rows)",
        description="gather: cache slot 0 treated as a miss",
    ),
    Mutant(
        name="gather_tail",
        file="gather.cu",
        original="if (lane < tail) dst[done + lane] = src[done + lane];",
        mutated="if (lane + 1 < tail) dst[done + lane] = src[done + lane];",
        description="gather: last tail byte of a row not copied",
    ),
    Mutant(
        name="gather_bound",
        file="gather.cu",
        original="return row >= 0 && row < a.num_rows;",
        mutated="return row >= 0 && row <= a.num_rows;",
        description="gather: index == num_rows accepted (reads one row past the table)",
    ),
    Mutant(
        name="gather_order",
        file="gather.cu",
        original="return a.order != nullptr ? a.order[k] : k;",
        mutated="return k;",
        description="gather: the processing order ignored (rows land at their sorted positions)",
    ),
    Mutant(
        name="gather_round_end",
        file="gather.cu",
        original="    if (k < a.count) {\n      const int64_t value",
        mutated="    if (k <= a.count) {\n      const int64_t value",
        description="gather grouped: the entry one past the index read in the last warp round",
    ),
    Mutant(
        name="gather_batch_slot",
        file="gather.cu",
        original="const int from = (first + j) * groups + group;",
        mutated="const int from = j * groups + group;",
        description="gather grouped: every pass of a round takes the first pass's entries",
    ),
    Mutant(
        name="gather_row_slot",
        file="gather.cu",
        original="const int from = e * groups + group;",
        mutated="const int from = e * groups;",
        description="gather grouped: each group of an unaligned round copies group 0's rows",
    ),
    Mutant(
        name="gather_unit_bound",
        file="gather.cu",
        original="if (r >= 0 && unit_at < a.row_bytes) {",
        mutated="if (r >= 0 && unit_at <= a.row_bytes) {",
        description="gather grouped: a lane past the row's last 16-byte unit copies one more",
    ),
    Mutant(
        name="gather_aligned_plan",
        file="gather.cu",
        original="plan.aligned = a.row_bytes % 16 == 0 && aligned16(a.table)",
        mutated="plan.aligned = aligned16(a.table)",
        description="gather: rows not a whole number of 16-byte units batched as if they were",
    ),
    Mutant(
        name="gather_cache_aligned",
        file="gather.cu",
        original="(a.cache_table == nullptr || aligned16(a.cache_table))",
        mutated="true",
        description="gather: a misaligned cache table read with 16-byte loads",
    ),
    Mutant(
        name="fp8_wide_stride",
        file="fp8_quant.cu",
        original="    jb = (block % gc) * 128;",
        mutated="    jb = (block % gc) * 64;",
        description="FP8 1x128: wrong block-to-column stride in the 64-bit index fallback",
    ),
    Mutant(
        name="fp8_amax_atomic",
        file="fp8_device.cuh",
        original="atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));",
        mutated="if (*addr < v) *addr = v;",
        description="FP8 amax (tiled and flat): plain read-compare-store instead of atomicMax",
    ),
    Mutant(
        name="fp8_partial_war",
        file="fp8_quant_tiles.cu",
        original="    __syncthreads();\n    merge_tile(tile, g1,",
        mutated="    merge_tile(tile, g1,",
        description="FP8 dual amax: barrier before warp_partial is reused removed",
    ),
    Mutant(
        name="fp8_flat_barrier",
        file="fp8_quant_tiles.cu",
        original="  if (lane == 0) warp_partial[warp] = m;\n  __syncthreads();\n",
        mutated="  if (lane == 0) warp_partial[warp] = m;\n",
        description="FP8 flat tensor amax: barrier before warp 0 reads the warp maxima removed",
    ),
    Mutant(
        name="fp8_row_scale_raw",
        file="fp8_quant.cu",
        original="  if (lane == 0) partial[threadIdx.x / 32] = m;\n  __syncthreads();\n",
        mutated="  if (lane == 0) partial[threadIdx.x / 32] = m;\n",
        description="FP8 row kernel: barrier before the warps read each other's maxima removed",
    ),
    Mutant(
        name="fp8_ties_up",
        file="fp8_device.cuh",
        original="uint32_t r = (abs + ((1u << (shift - 1)) - 1u) + lsb) >> shift;",
        mutated="uint32_t r = (abs + (1u << (shift - 1))) >> shift;",
        description="FP8 encode: normal values round ties up instead of to even",
    ),
    Mutant(
        name="fp4_amax_atomic",
        file="fp4_quant.cu",
        original="atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));",
        mutated="if (*addr < v) *addr = v;",
        description="NVFP4 per-tensor amax: plain read-compare-store instead of atomicMax",
    ),
    Mutant(
        name="fp4_nv_barrier",
        file="fp4_quant.cu",
        original="  if (lane == 0) warp_max[warp] = m;\n  __syncthreads();\n",
        mutated="  if (lane == 0) warp_max[warp] = m;\n",
        description="NVFP4 pass 1: barrier before warp 0 reads the warp maxima removed",
    ),
    Mutant(
        name="fp4_nan_only",
        file="fp4_quant.cu",
        original="const bool bad = block_bits >= kNonfiniteBits;  // the block holds a NaN/Inf",
        mutated="const bool bad = block_bits > kNonfiniteBits;  // the block holds a NaN/Inf",
        description="MXFP4: a block holding an Inf (not NaN) is not marked",
    ),
    Mutant(
        name="fp4_group_max",
        file="fp4_quant.cu",
        original="for (int h = kLanes / 2; h >= 1; h >>= 1) m = max(",
        mutated="for (int h = kLanes / 2; h > 1; h >>= 1) m = max(",
        description="FP4: block max skips the last shuffle step",
    ),
    Mutant(
        name="fp4_butterfly_down",
        file="fp4_quant.cu",
        original="const float p = __shfl_xor_sync(kFull, v[k], h / kPer);",
        mutated="const float p = __shfl_down_sync(kFull, v[k], h / kPer);",
        description="FP4 Hadamard: cross-lane butterfly partner by shfl_down instead of xor",
    ),
    Mutant(
        name="fingerprint_part_sum",
        file="fingerprint.cu",
        original="  return part + __shfl_xor_sync(kFull, part, 16);",
        mutated="  return part;",
        description="fingerprint: a lane's block sum misses the stripes of two of the four parts",
    ),
    Mutant(
        name="fingerprint_neighbour",
        file="fingerprint.cu",
        original="__shfl_xor_sync(kFull, d, 1);",
        mutated="__shfl_xor_sync(kFull, d, 2);",
        description="fingerprint: a stripe word adds the wrong neighbouring lane's word",
    ),
    Mutant(
        name="fingerprint_tail_stripe",
        file="fingerprint.cu",
        original="const bool used = static_cast<uint64_t>(s) < stripes;",
        mutated="const bool used = static_cast<uint64_t>(s) + 1 < stripes;",
        description="fingerprint: the last (partial) stripe of a range is left out",
    ),
]

# The tests each mutated file's plain, warp and ASan runs use (CI runs the whole suite in those
# modes; these are the part that can see the file). The TSan run is CI's race run, whatever the
# file (scripts/tsan_races.sh).
SUITES = {
    "adam_compact.cu": "*AdamCompact*:*AdamKernelEdges*",
    "adam_element.cuh": "*Adam*",
    "adam.cu": "*AdamKernel*:KernelRaces.Adam*",
    "launch.cuh": "*",
    "gather.cu": "*Gather*",
    "fp8_device.cuh": "*Fp8*",
    "fp8_quant.cu": "*Fp8*",
    "fp8_quant_tiles.cu": "*Fp8*",
    "fp4_quant.cu": "*Fp4*",
    "fingerprint.cu": "*Fingerprint*",
}

# CI's modes (scripts/test.sh), each with its build: name -> (build, environment).
MODES = {
    "plain": ("plain", {}),
    "warp": ("plain", {"TIERLIFT_CUDASIM_SCHEDULE": "warp"}),
    "asan": ("asan", {"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}),
    "tsan": ("tsan", {}),
}
BUILD_FLAGS = {"plain": [], "asan": ["-DTIERLIFT_SANITIZE=ON"], "tsan": ["-DTIERLIFT_TSAN=ON"]}


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 1800):
    return subprocess.run(
        cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True, check=False
    )


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, as they are now."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        src = REPO / rel
        if not src.is_file():
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists() or out.read_bytes() != src.read_bytes():
            shutil.copy2(src, out)


def set_text(path: Path, text: str) -> None:
    """Writes only a change: an unchanged file keeps its time stamp (no rebuild)."""
    if path.read_text() != text:
        path.write_text(text)


def build(src: Path, build_dir: Path, kind: str) -> tuple[bool, str]:
    if not (build_dir / "build.ninja").exists():
        flags = ["-DTIERLIFT_BENCHMARKS=OFF", *BUILD_FLAGS[kind]]
        r = run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *flags], src)
        if r.returncode != 0:
            return False, r.stdout + r.stderr
    jobs = os.environ.get("MAX_JOBS", "2")
    r = run(
        ["flock", LOCK, "cmake", "--build", str(build_dir), "-j", jobs, "--target", TARGET], src
    )
    return r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def suite_command(scratch: Path, mode: str, gtest_filter: str) -> tuple[list[str], dict]:
    """The command and environment of one mode's run, as CI runs it."""
    kind, extra = MODES[mode]
    binary = str(scratch / f"build-{kind}" / TARGET)
    if mode == "tsan":
        return ["bash", str(scratch / "repo" / RACE_RUN), binary], {}
    return [binary, f"--gtest_filter={gtest_filter}", "--gtest_brief=1"], extra


_FAILURE = re.compile(
    r"^\[  FAILED  \]|: Failure$|^(WARNING|SUMMARY|ERROR): \w+Sanitizer|runtime error:|"
    r"^cudasim: kernel|^  Thread T\d+ '"
)
_ACCESS = re.compile(r"^(  (Read|Write|Atomic \w+|Previous \w+) of size|ERROR: AddressSanitizer)")


def failure_lines(output: str, limit: int = 40) -> list[str]:
    """The lines of a failed run that say what failed: gtest's failures with the 3 lines after
    each, simulator errors and sanitizer reports (each access with the top two frames of its
    stack, the threads' names: kernel, block and thread); the last lines when none matches."""
    lines = output.splitlines()
    picked: list[str] = []
    after = frames = 0
    for line in lines:
        if _ACCESS.search(line):
            picked.append(line)
            frames = 2
        elif frames > 0 and line.startswith("    #"):
            picked.append(line)
            frames -= 1
        elif _FAILURE.search(line):
            picked.append(line)
            after = 3 if line.endswith(": Failure") else 0
        elif after > 0:
            picked.append(line)
            after -= 1
    if not picked:
        picked = lines[-20:]
    return picked[:limit]


def run_suite(scratch: Path, mode: str, gtest_filter: str, seed: str) -> tuple[str, str]:
    """('caught', 'missed' or 'hang', the run's output) for one mode."""
    cmd, extra = suite_command(scratch, mode, gtest_filter)
    env = dict(os.environ, TIERLIFT_CUDASIM_SEED=seed, **extra)
    for var in ("TIERLIFT_CUDASIM_SCHEDULE", "TSAN_OPTIONS", "ASAN_OPTIONS", "UBSAN_OPTIONS"):
        if var not in extra:
            env.pop(var, None)  # only what CI sets for this mode
    try:
        r = run(cmd, scratch / "repo", env, timeout=900)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return "hang", out
    return ("missed" if r.returncode == 0 else "caught"), r.stdout + r.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/tierlift-mutate"))
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES)
    )
    ap.add_argument(
        "--all-modes", action="store_true", help="run every mode, not just to the first catch"
    )
    ap.add_argument("--seed", default="1", help="TIERLIFT_CUDASIM_SEED for every run")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()

    if args.list:
        for m in MUTANTS:
            print(f"{m.name:20} {m.file:18} {m.description}")
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    modes = [m for m in MODES if m in modes]  # CI's order: cheapest first
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or []) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants {sorted(unknown)}")
    scratch = args.scratch.resolve()
    if scratch == REPO or REPO in scratch.parents:
        ap.error("the scratch copy must be outside the repository")
    src = scratch / "repo"
    copy_tree(src)
    for m in chosen:  # every snippet present exactly once, before anything is built
        text = (src / "csrc/cuda" / m.file).read_text()
        if text.count(m.original) != 1:
            ap.error(f"{m.name}: original snippet found {text.count(m.original)} times in {m.file}")

    ready: set[str] = set()
    filt = ":".join(sorted({SUITES[m.file] for m in chosen}))

    def baseline(kind: str) -> bool:
        """Builds `kind` unmutated (once) and checks that its modes pass the chosen suites."""
        if kind in ready:
            return True
        t = time.time()
        ok, log = build(src, scratch / f"build-{kind}", kind)
        if not ok:
            print(log, file=sys.stderr)
            print(f"baseline {kind} build failed", file=sys.stderr)
            return False
        print(f"baseline {kind} build: {time.time() - t:.0f} s", flush=True)
        for mode in modes:
            if MODES[mode][0] != kind:
                continue
            verdict, out = run_suite(scratch, mode, filt, args.seed)
            if verdict != "missed":
                cmd, extra = suite_command(scratch, mode, filt)
                env = " ".join(
                    f"{k}={v}" for k, v in {**extra, "TIERLIFT_CUDASIM_SEED": args.seed}.items()
                )
                fails = "hangs" if verdict == "hang" else "fails"
                print(f"baseline suite {fails} in mode {mode}:", file=sys.stderr)
                print(f"  {env} {' '.join(cmd)}", file=sys.stderr)
                for line in failure_lines(out):
                    print(f"  {line}", file=sys.stderr)
                print("fix that first", file=sys.stderr)
                return False
        ready.add(kind)
        return True

    rows = []
    for m in chosen:
        path = src / "csrc/cuda" / m.file
        original = path.read_text()
        t = time.time()
        result = {}
        try:
            for mode in modes:
                kind = MODES[mode][0]
                if kind not in ready:
                    set_text(path, original)
                    if not baseline(kind):
                        return 2
                set_text(path, original.replace(m.original, m.mutated))
                ok, _ = build(src, scratch / f"build-{kind}", kind)
                if not ok:
                    result[mode] = "no build"
                    break
                result[mode] = run_suite(scratch, mode, SUITES[m.file], args.seed)[0]
                if result[mode] != "missed" and not args.all_modes:
                    break
        finally:
            set_text(path, original)
        by = [k for k, v in result.items() if v in ("caught", "hang", "no build")]
        rows.append((m, result, by))
        cells = " ".join(f"{k}={v}" for k, v in result.items())
        print(
            f"{m.name:20} {'CAUGHT' if by else 'MISSED'}  {cells}  ({time.time() - t:.0f} s)",
            flush=True,
        )

    print()
    print("| mutant | bug planted | " + " | ".join(modes) + " | caught by |")
    print("|---|---|" + "---|" * len(modes) + "---|")
    for m, result, by in rows:
        cells = " | ".join(result.get(mode, "") for mode in modes)
        print(f"| `{m.name}` | {m.description} | {cells} | {', '.join(by) or '**missed**'} |")
    n = sum(bool(by) for _, _, by in rows)
    print(f"\ncaught {n} of {len(rows)} mutants ({100.0 * n / max(len(rows), 1):.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
