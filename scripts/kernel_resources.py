#!/usr/bin/env python3
"""What ptxas and the SASS say about every CUDA kernel, without a GPU.

Compiles each csrc/cuda/*.cu alone for one architecture (default sm_90) with setup.py's nvcc
flags into a scratch folder (never into the repository), then prints one row per kernel entry
(every template instance the launchers instantiate): registers, stack and spill bytes, static
shared memory, the threads of its __launch_bounds__, the resident blocks and occupancy that
gives on an H100/H200 SM, the widths of its global loads and stores, local-memory traffic,
integer divisions (inline, or through a called routine) inside a loop, and fp64 instructions.

    python3 scripts/kernel_resources.py                    # every kernel, a Markdown table
    python3 scripts/kernel_resources.py --files adam gather --keep /tmp/sass
    python3 scripts/kernel_resources.py --json > resources.json

Needs nvcc (CUDA_HOME or PATH) and cuobjdump (the CUDA toolkit's, or the copy that triton's
wheel ships, which is used when the toolkit has none). Every unit but fp8_quant_tiles.cu takes
a few seconds; that one alone takes nvcc over 2 minutes (its front end ~85 s, ptxas ~45 s on a
2-core machine), so `--files` without it answers in about 20 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# setup.py's nvcc flags and the ones torch's CUDAExtension adds (the half/bf16 operator switches
# change which conversions the headers define, so the code compiled here is the extension's).
NVCC_FLAGS = [
    "-O3", "--fmad=false", "--expt-relaxed-constexpr", "-lineinfo", "-std=c++17",
    "-DTIERLIFT_WITH_CUDA=1", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
]

# An H100/H200 SM (compute capability 9.0).
SM_REGS = 65536
SM_THREADS = 2048
SM_BLOCKS = 32
SM_SMEM = 228 * 1024
BLOCK_SMEM_RESERVED = 1024  # the runtime's per-block reservation
REG_ALLOC_UNIT = 256  # registers, per warp

FP64_OPS = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX")


def find_tool(name: str) -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (os.path.join(cuda_home, "bin", name), shutil.which(name)):
        if candidate and os.path.exists(candidate):
            return candidate
    try:
        import triton  # its wheel carries cuobjdump and nvdisasm where the toolkit lacks them

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return None


def compile_unit(nvcc: str, source: str, arch: str, out_dir: str) -> tuple[str, str]:
    """Compiles one .cu to a cubin; returns (cubin path, ptxas -v output)."""
    stem = os.path.splitext(os.path.basename(source))[0]
    cubin = os.path.join(out_dir, stem + ".cubin")
    cmd = [nvcc, f"-arch={arch}", *NVCC_FLAGS, "-I", os.path.join(ROOT, "csrc"),
           "--ptxas-options=-v", "-cubin", "-o", cubin, source]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source}:\n{proc.stderr}")
    return cubin, proc.stderr + proc.stdout


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per mangled entry: regs, stack, spill_stores, spill_loads, smem (bytes)."""
    out: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), {"regs": 0, "stack": 0, "spill_stores": 0,
                                                  "spill_loads": 0, "smem": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(sm.group(1)) if sm else 0
            current = None
    return out


def split_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass output -> {mangled name: [(address, instruction text)]}."""
    functions: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2).strip()))
    return functions


def max_threads(elf: str) -> dict[str, int]:
    """The x of EIATTR_MAX_THREADS (__launch_bounds__) per mangled entry, from cuobjdump -elf."""
    out: dict[str, int] = {}
    current = None
    pending = False
    for line in elf.splitlines():
        m = re.match(r"\.nv\.info\.(\S+)", line.strip())
        if m:
            current = m.group(1)
            continue
        if "EIATTR_MAX_THREADS" in line:
            pending = True
            continue
        if pending and "Value:" in line and current:
            out[current] = int(line.split("Value:")[1].split()[0], 16)
            pending = False
    return out


def opcode(instr: str) -> str:
    body = re.sub(r"^@!?U?P[T0-9]+\s+", "", instr)  # the predicate
    return body.split()[0] if body.split() else ""


def is_intdiv(op: str) -> bool:
    """The reciprocal estimate that starts nvcc's integer division/modulo sequence."""
    return op.startswith("I2F") and ".RP" in op


def access_width(op: str) -> str:
    """Bits of one LDG/STG/LD/ST: .128, .64, .U8/.S8, .U16/.S16, else 32."""
    parts = op.split(".")
    for p in parts[1:]:
        if p in ("128", "64", "256"):
            return p
        if p in ("U8", "S8"):
            return "8"
        if p in ("U16", "S16"):
            return "16"
    return "32"


def analyze_sass(instrs: list[tuple[int, str]]) -> dict:
    addresses = [a for a, _ in instrs]
    # Loops: the span of every backward branch.
    loops = []
    for addr, text in instrs:
        op = opcode(text)
        m = re.search(r"\b(?:BRA|JMP)\b.*?0x([0-9a-f]+)", text)
        if m and op.startswith(("BRA", "JMP")):
            target = int(m.group(1), 16)
            if target <= addr:
                loops.append((target, addr))

    def in_loop(addr: int) -> bool:
        return any(lo <= addr <= hi for lo, hi in loops)

    # Called routines (out-of-line division, etc.): whether each holds an integer division,
    # scanned from its first instruction to its RET.
    routines: dict[int, bool] = {}
    for _, text in instrs:
        m = re.search(r"\bCALL\.REL\S*\s+.*?0x([0-9a-f]+)", text)
        if m:
            routines[int(m.group(1), 16)] = False
    for start in routines:
        for _, text in instrs[addresses.index(start) if start in addresses else len(instrs):]:
            op = opcode(text)
            if is_intdiv(op):
                routines[start] = True
            if op.startswith("RET"):
                break

    ldg: dict[str, int] = {}
    stg: dict[str, int] = {}
    generic = 0
    local = {"LDL": 0, "STL": 0}
    local_in_loop = 0
    intdiv_total = intdiv_loop = 0
    fp64 = 0
    atomics = 0
    indexed_const_in_loop = 0
    for addr, text in instrs:
        op = opcode(text)
        # A kernel parameter (constant bank 0) read at a register offset: the constant cache
        # serves one address at a time, so lanes with different indices take turns.
        if op.startswith("LDC") and re.search(r"c\[0x0\]\[R\d+", text) and in_loop(addr):
            indexed_const_in_loop += 1
        if op.startswith("LDG"):
            w = access_width(op)
            ldg[w] = ldg.get(w, 0) + 1
        elif op.startswith("STG"):
            w = access_width(op)
            stg[w] = stg.get(w, 0) + 1
        elif op.startswith(("LD.", "ST.")) or op in ("LD", "ST"):
            generic += 1
        elif op.startswith(("LDL", "STL")):
            local[op[:3]] += 1
            local_in_loop += in_loop(addr)
        elif op.startswith(("ATOMG", "RED", "ATOM.")):
            atomics += 1
        if is_intdiv(op):
            intdiv_total += 1
            if in_loop(addr):
                intdiv_loop += 1
        m = re.search(r"\bCALL\.REL\S*\s+.*?0x([0-9a-f]+)", text)
        if m and routines.get(int(m.group(1), 16)) and in_loop(addr):
            intdiv_loop += 1
        if op.startswith(FP64_OPS) or (op.startswith(("F2F", "I2F", "F2I")) and "F64" in op):
            fp64 += 1
    return {"ldg": ldg, "stg": stg, "generic_ldst": generic, "ldl": local["LDL"],
            "stl": local["STL"], "local_in_loop": local_in_loop, "intdiv": intdiv_total,
            "intdiv_in_loop": intdiv_loop, "indexed_const_in_loop": indexed_const_in_loop,
            "fp64": fp64, "atomics": atomics, "instructions": len(instrs)}


def occupancy(regs: int, smem: int, threads: int) -> tuple[int, float]:
    """Resident blocks per SM and the fraction of 2048 threads they give."""
    if threads <= 0:
        return 0, 0.0
    warps = (threads + 31) // 32
    regs_per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (SM_REGS // regs_per_warp) // warps
    by_threads = SM_THREADS // (warps * 32)
    by_smem = SM_SMEM // (smem + BLOCK_SMEM_RESERVED)
    blocks = min(by_regs, by_threads, by_smem, SM_BLOCKS)
    return blocks, blocks * warps * 32 / SM_THREADS


DTYPE_NAMES = {"0": "f32", "1": "bf16", "2": "f16", "255": "none"}


def short_name(mangled: str, demangled: str) -> str:
    name = demangled.replace("(anonymous namespace)::", "")
    depth = 0  # cut the parameter list: the first '(' outside template brackets after the name
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0 and name[i - 1] not in ", <":
            name = name[:i]
            break
    name = name.replace("(anonymous namespace)::", "").replace("tierlift::", "")
    name = name.replace("cuda::", "").replace("lowp::", "")
    name = re.sub(r"\(DType\)(\d+)", lambda m: DTYPE_NAMES.get(m.group(1), m.group(1)), name)
    name = re.sub(r"\(fp4::ScaleRule\)(\d+)", r"rule\1", name)
    return name.replace("void ", "")


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return names
    proc = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    return lines if len(lines) == len(names) else names


def widths(counts: dict[str, int]) -> str:
    order = ["256", "128", "64", "32", "16", "8"]
    return " ".join(f"{w}:{counts[w]}" for w in order if counts.get(w)) or "-"


def analyze_unit(nvcc: str, cuobjdump: str, source: str, arch: str, out_dir: str,
                 keep: str | None) -> list[dict]:
    cubin, log = compile_unit(nvcc, source, arch, out_dir)
    props = parse_ptxas(log)
    sass_text = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                               check=True).stdout
    elf = subprocess.run([cuobjdump, "-elf", cubin], capture_output=True, text=True,
                         check=True).stdout
    if keep:
        stem = os.path.splitext(os.path.basename(source))[0]
        with open(os.path.join(keep, stem + ".sass"), "w") as f:
            f.write(sass_text)
        with open(os.path.join(keep, stem + ".ptxas.txt"), "w") as f:
            f.write(log)
    sass = split_sass(sass_text)
    bounds = max_threads(elf)
    names = sorted(props)
    rows = []
    for mangled, pretty in zip(names, demangle(names)):
        p = props[mangled]
        threads = bounds.get(mangled, 0)
        blocks, occ = occupancy(p["regs"], p["smem"], threads)
        row = {"file": os.path.relpath(source, ROOT), "kernel": short_name(mangled, pretty),
               "mangled": mangled, **p, "threads": threads, "blocks_per_sm": blocks,
               "occupancy": occ, **analyze_sass(sass.get(mangled, []))}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| file | kernel | regs | stack/spill st/ld B | smem B | threads | blocks/SM | occ. "
            "| LDG bits:count | STG bits:count | LD/ST generic | LDL/STL (in loop) "
            "| int div (in loop) | LDC[R] in loop | fp64 |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {os.path.basename(r['file'])} | `{r['kernel']}` | {r['regs']} | "
            f"{r['stack']}/{r['spill_stores']}/{r['spill_loads']} | {r['smem']} | "
            f"{r['threads'] or '?'} | {r['blocks_per_sm'] if r['threads'] else '?'} | "
            f"{format(r['occupancy'], '.0%') if r['threads'] else '?'} | "
            f"{widths(r['ldg'])} | {widths(r['stg'])} | {r['generic_ldst']} | "
            f"{r['ldl']}/{r['stl']} ({r['local_in_loop']}) | "
            f"{r['intdiv']} ({r['intdiv_in_loop']}) | {r['indexed_const_in_loop']} | "
            f"{r['fp64']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90)")
    parser.add_argument("--files", nargs="*",
                        help="stems under csrc/cuda (adam gather ...); default every .cu")
    parser.add_argument("--keep", metavar="DIR",
                        help="also write each unit's SASS and ptxas output there")
    parser.add_argument("--json", action="store_true", help="JSON rows instead of the table")
    parser.add_argument("-j", "--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="parallel nvcc runs (default: up to 4, one per core)")
    args = parser.parse_args(argv)

    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    if not nvcc or not cuobjdump:
        print(f"kernel_resources: needs nvcc and cuobjdump (found nvcc={nvcc}, "
              f"cuobjdump={cuobjdump})", file=sys.stderr)
        return 2
    cuda_dir = os.path.join(ROOT, "csrc", "cuda")
    stems = args.files or sorted(f[:-3] for f in os.listdir(cuda_dir) if f.endswith(".cu"))
    sources = [os.path.join(cuda_dir, s if s.endswith(".cu") else s + ".cu") for s in stems]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        print(f"kernel_resources: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tierlift-sass-") as out_dir:
        with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
            results = pool.map(lambda s: analyze_unit(nvcc, cuobjdump, s, args.arch, out_dir,
                                                      args.keep), sources)
            rows = [r for unit in results for r in unit]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(markdown(rows))
        print(f"\n{args.arch}; occupancy on an H100/H200 SM ({SM_REGS} registers, {SM_THREADS} "
              f"threads, {SM_SMEM // 1024} KB shared) at the __launch_bounds__ block size. "
              "int div: I2F.RP sequences (32/64-bit integer division or modulo by a run-time "
              "value); in loop: inside a backward branch's span, or a call there to a routine "
              "holding one. LDC[R]: kernel-parameter reads at a register offset inside a loop, "
              "serialized across the warp where lanes' offsets differ (harmless where the "
              "offset is uniform, as a block's tensor slot is).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
