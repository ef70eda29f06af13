"""Markdown tables of a GPU run's results, for docs/gpu.md.

    python scripts/gpu_report.py OUT_DIR [--out FILE]

OUT_DIR is what `scripts/gpu_check.sh 2|3` leaves: summary.txt, the logs (each part's command on
a line "===== <part> (limit <N>s): <command>") and results/*.json. The parts first, then a table
per result JSON followed by the command that wrote it, each row with a target marked met or not
met. Numbers are the JSON's, rounded; failed rows show their error; a JSON of no known kind is
listed as not summarized. JSON and text only (no torch): it runs anywhere. The fine-tune's,
the disk's and the checkpoint's tables are built here, the GPU kernels' in gpu_report_kernels.py.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (importlib), not run: its siblings still import
    sys.path.insert(0, str(HERE))
from gpu_report_kernels import gather_section, lowp_section, optim_section  # noqa: E402
from gpu_report_markdown import (  # noqa: E402
    NONE,
    at_least,
    errors_of,
    first_line,
    gb,
    num,
    pct,
    plain_table,
    table,
    times,
    verdict,
)

BENCHMARKS = HERE.parent / "benchmarks"


def benchmark_constant(file: str, name: str):
    """A module-level constant read from a benchmark's source (importing it would import torch
    and tierlift), so that the benchmark stays the one place its target is set."""
    for node in ast.parse((BENCHMARKS / file).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"benchmarks/{file} no longer defines {name}: update gpu_report.TARGETS")


TARGETS = {
    # tierlift's fine-tune TFLOPS over each peer's, in the same run (offload_finetune.TARGETS)
    "finetune_vs_peer": benchmark_constant("offload_finetune.py", "TARGETS"),
    # a tierlift step at most this x its longest leg: the other legs hidden behind it
    "leg_bound": benchmark_constant("offload_finetune.py", "LEG_TARGET"),
    # the NVMe step at most this x (state bytes read + written) / the disk's bandwidth
    "nvme_roofline": benchmark_constant("finetune_sizing.py", "NVME_TARGET"),
}  # the GPU kernels' targets: gpu_report_kernels.TARGETS
# the fine-tune with nothing offloaded, and what its ratio row says instead of a target
CEILING = benchmark_constant("offload_finetune.py", "CEILING")
CEILING_TARGET = benchmark_constant("offload_finetune.py", "CEILING_TARGET")
contender = lambda row: row.get("contender") or row.get("case", "?")  # older JSONs: case only


def finetune_note(r: dict) -> str:
    """What went wrong around the row, and what its case did beyond its numbers
    (offload_finetune.case_note, shorter)."""
    st, part = r.get("stats") or {}, r.get("device_part") or {}
    timed, norm = r.get("timed_step_times"), r.get("grad_norm", st.get("grad_norm"))
    notes = errors_of(r) + [
        timed and f"{len(timed)} timed step(s) done: {', '.join(num(t) for t in timed)} s",
        r.get("after_result") and f"{r['after_result']} after its result (the result stands)",
        f"one generation + {r['spare_chunks']} spare blocks for {r['chunks']} chunks"
        if r.get("spare_chunks") else
        r.get("chunks") and f"{r.get('generations')} generation(s) of {r['chunks']} chunks",
        st.get("overlap_no_room_chunks") and
        f"{st['overlap_no_room_chunks']:.0f} chunks left to step() for want of a block",
        norm is not None and f"grad norm {num(norm)}",
        r.get("overlap_threads") is not None and
        f"CPU Adam on {r['overlap_threads']} threads during backward",
        # what the offload's host work costs the device's own compute (offload_finetune)
        r.get("compute_vs_ceiling") is not None and
        f"forward+backward {r['compute_vs_ceiling']:.2f}x the ceiling's",
        part.get("device_part_params") and
        f"{part['device_part_params']} parameters' state on the GPU "
        f"({part['device_part_elems'] / r['params']:.1%} of the elements)"]
    return "; ".join(n for n in notes if n)


def finetune_section(data: dict) -> list[str]:
    args, plan, results = data.get("args", {}), data.get("plan", {}), data.get("results", [])
    clip, n, leg_goal = args.get("max_grad_norm"), plan.get("params", 0), TARGETS["leg_bound"]
    size = f"{num(n / 1e9)}B" if n >= 1e9 else f"{num(n / 1e6)}M"
    out = [f"{plan.get('model', '?')} ({size} params), state on {plan.get('tier', '?')}, batch "
           f"{args.get('batch_size', '?')} x {args.get('seq_len', '?')} tokens, warmup "
           f"{args.get('warmup', '?')} + {args.get('steps', '?')} steps, clipping "
           + ("not recorded" if clip is None else f"at {clip:g}" if clip else "off")
           + (f", cpu_budget {args['cpu_budget']:g} GiB" if args.get("cpu_budget") else "")
           + (f", state_dtype {args['state_dtype']}"
              if args.get("state_dtype", "fp32") != "fp32" else "") + "."]
    # rows written before the FLOP count left out the input embedding (no flops_per_step)
    older = [r for r in results if "tflops" in r and "flops_per_step" not in r]
    if older:
        out += ["", "TFLOPS marked (older count): written when the FLOPs per step counted the "
                "input embedding as matmul parameters, which a lookup is not: 6 x vocab x dim "
                "FLOPs per token too many (5.6% high for the 1.1B at 2048 tokens). The ratios "
                "between rows of one table are unaffected."]
    rows = []
    for r in results:
        bound, st = r.get("leg_bound"), r.get("stats") or {}
        ratio = bound and bound["ratio"]
        rows.append([
            r.get("case", contender(r)), num(r["step_s"]) if "step_s" in r else
            "left out" if str(r.get("error")).startswith("does not fit") else "failed",
            num(r.get("tokens_per_step")), num(r.get("tokens_per_s")),
            num(r.get("tflops")) + (" (older count)" if any(r is o for o in older) else ""),
            gb(r.get("peak_gpu_bytes")), gb(r.get("peak_pinned_bytes")),
            gb(r.get("peak_host_bytes")),
            f"{st['overlap_kept_chunks']:.0f} / {st.get('overlap_redone_chunks', 0):.0f}"
            if "overlap_kept_chunks" in st else "",
            f"{times(ratio)} ({bound['leg']})" if bound else "",
            f"<= {leg_goal}x" if bound else "",
            verdict(ratio, leg_goal, at_most=True) if bound else "", finetune_note(r)])
    ok = [r for r in results if "tflops" in r]
    for a in (r for r in ok if contender(r).startswith("tierlift")):
        for b in (r for r in ok if not contender(r).startswith("tierlift")):
            goal, ratio = TARGETS["finetune_vs_peer"].get(contender(b)), a["tflops"] / b["tflops"]
            rows.append([f"{contender(a)} / {contender(b)} (TFLOPS)", "", "", "", times(ratio),
                         "", "", "", "", "", CEILING_TARGET
                         if contender(b) == CEILING else at_least(goal), verdict(ratio, goal),
                         ""])
    out += ["", *table(["case", "s/step", "tokens/step", "tokens/s", "TFLOPS", "peak GPU GB",
                        "peak pinned GB", "peak host GB", "chunks kept / redone",
                        "last step / longest leg", "target", "met", "note"], rows)]
    roofs = [(r.get("case", "?"), r["nvme_roofline"]) for r in results if r.get("nvme_roofline")]
    roofs = roofs or ([("tierlift", data["nvme_roofline"])] if data.get("nvme_roofline") else [])
    if roofs:
        goal = TARGETS["nvme_roofline"]
        out += ["NVMe roofline (bytes read / read GB/s + bytes written / write GB/s):", ""]
        out += table(["case", "GB read", "GB written", "read GB/s", "write GB/s", "roofline s",
                      "step s", "step / roofline", "target", "met"],
                     [[case, gb(r["read_bytes"]), gb(r["write_bytes"]), num(r["read_GBps"]),
                       num(r["write_GBps"]), num(r["roofline_s"]), num(r["step_s"]),
                       times(r["ratio"]), f"<= {goal}x", verdict(r["ratio"], goal, at_most=True)]
                      for case, r in roofs])
    for r in ok:
        legs = [[k, num(v.get("total_s")), num(v.get("exposed_s"))]
                for k, v in (r.get("legs") or {}).items() if v.get("total_s") or v.get("exposed_s")]
        if legs:
            out += [f"{r['case']}: the last step ({num(r.get('last_step_s'))} s) by leg (exposed: "
                    "the training thread waited for it; legs at 0 left out):", ""]
            out += table(["leg", "total s", "exposed s"], legs)
    return out


def disk_section(data: dict) -> list[str]:
    """benchmarks/bench_io.py --out: each contender's sequential read and write (the median of
    its rounds), its ratio to fio's and the path its bytes took; the rows it could not measure
    (DeepSpeed's aio where its op is not built) with their error."""
    cfg, gbps, moved = data.get("config", {}), data.get("gbps", {}), data.get("path_bytes", {})
    vs_fio = data.get("ratio_to_fio") or {}
    # the NVMe fine-tune's roofline divides by these two (finetune_sizing.read_disk_json)
    fastest = {rw: max(((r[rw], name) for name, r in gbps.items()
                        if isinstance(r.get(rw), (int, float)) and r[rw] > 0), default=(0, None))[1]
               for rw in ("read", "write")}

    def path(name: str) -> str:  # the share of its bytes each path took: direct, staged, buffered
        total = sum((moved.get(name) or {}).values())
        return ", ".join(f"{k} {pct(v / total)}" for k, v in moved[name].items() if v) \
            if total else NONE

    rows = [[name, num(r.get("read")), num(r.get("write")),
             times(vs_fio.get(name, {}).get("read")), times(vs_fio.get(name, {}).get("write")),
             path(name), "; ".join(errors_of(r) + [f"the fastest {rw}, the NVMe roofline's"
                                                   for rw in ("read", "write")
                                                   if fastest[rw] == name])]
            for name, r in gbps.items()]
    rows += [[name, NONE, NONE, NONE, NONE, NONE, f"error: {first_line(why)}"]
             for name, why in (data.get("errors") or {}).items()]
    kernel = (data.get("machine") or {}).get("kernel")
    out = [f"Sequential O_DIRECT read and write of a {cfg.get('size_mib', '?')} MiB file in "
           f"{cfg.get('dir', '?')}, block {cfg.get('block_kib', '?')} KiB, queue depth "
           f"{cfg.get('queue_depth', '?')}, median of {cfg.get('repeat', '?')} round(s)"
           + (f", Linux {kernel}" if kernel else "") + "; vs fio: GB/s over fio's. No target.", ""]
    return out + (table(["contender", "read GB/s", "write GB/s", "read vs fio", "write vs fio",
                         "path (bytes)", "note"], rows) if rows else ["No contender measured.", ""])


def checkpoint_section(data: dict) -> list[str]:
    model, device = data.get("model", {}), data.get("device", {})
    return [f"{num(model.get('params', 0) / 1e6)}M parameters + 2 AdamW moments"
            + (f", on {device.get('name', device.get('type'))}" if device else "")
            + "; stall: the save call blocks the caller; total: until durable. No target.", "",
            *plain_table(data.get("rows", []))]


KINDS = [  # (title, result name pattern, section), tried in order
    ("Fine-tune", r"bench_offload_finetune(-|$)", finetune_section),
    ("Disk read and write", r"bench_io(-|$)", disk_section),
    ("Fused CUDA AdamW", r"bench_optim-", optim_section),
    ("FP8/FP4 quantize and Float8Linear", r"bench_lowp-", lowp_section),
    ("Zero-copy gather", r"bench_gather_gpu(-|$)", gather_section),
    ("Checkpoint save", r"bench_checkpoint(-|$)", checkpoint_section)]
PART_LINE = re.compile(r"^(?P<part>.+?): (?P<status>ok|TIMED OUT|FAILED(?: rc=-?\d+)?|skipped|"
                       r"SKIPPED)\b(?P<rest>.*)$")
COMMAND_LINE = re.compile(r"^===== (?P<part>.+?) \(limit (?P<limit>\d+)s\): (?P<command>.+)$")
kind_of = lambda stem: next((i for i, k in enumerate(KINDS) if re.match(k[1], stem)), len(KINDS))


def parts_section(summary: Path) -> list[str]:
    text = summary.read_text(errors="replace") if summary.is_file() else ""
    rows, other = [], [] if text else ["- (no summary.txt)"]
    for line in filter(None, map(str.strip, text.splitlines())):
        m = PART_LINE.match(line)
        if not m:
            other.append(f"- {line}")
            continue
        secs = re.search(r"(?:\(|after )(\d+) s\b", m["rest"])
        rows.append([m["part"], f"{m['status']} {m['rest'].strip()}".strip(),
                     secs.group(1) if secs else NONE])
    out = ["### Parts (summary.txt)", "", *table(["part", "status", "seconds"], rows)]
    return out + (["Other lines of summary.txt:", "", *other, ""] if other else [])


# a result's name less the machine tag that write_json and gpu_check.sh add
base_stem = lambda stem: re.sub(r"-cpu$", "", re.sub(r"-gpu-.*$", "", stem))


def written_stems(command: str) -> set[str]:  # the results (base_stem) a logged command writes
    argv = command.split()  # gpu_check.sh logs "$*": the words, unquoted
    script = next((Path(a).name for a in argv if a.endswith(".py")), "")
    opt = lambda flag, default=None: argv[argv.index(flag) + 1] if flag in argv[:-1] else default
    suffix, device = opt("--json-suffix"), opt("--device", "cpu")
    stems = {  # each benchmark's own naming of its JSON
        "bench_offload.py": ["bench_offload_finetune" + (f"-{suffix}" if suffix else "")]
        if "--gpu" in argv or "--finetune-check" in argv else [],
        "bench_optim.py": ["bench_optim_tiny" if "--tiny" in argv else "bench_optim"],
        "bench_lowp.py": [Path(opt("--json", f"bench_lowp-{device}")).stem],
        "bench_gather.py": ["bench_gather_gpu", "bench_gather_cpu"],
        "bench_checkpoint.py": [Path(opt("--out", f"bench_checkpoint-{device}")).stem],
        "bench_io.py": [Path(opt("--out", "bench_io")).stem],
    }.get(script, [])
    return {base_stem(s) for s in stems}


def result_section(path: Path, commands) -> list[str]:
    if kind_of(path.stem) == len(KINDS):
        return [f"not summarized: {path.name}", ""]
    kind = KINDS[kind_of(path.stem)]
    try:
        data = json.loads(path.read_text())
        body = kind[2](data)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        return [f"not summarized: {path.name} ({type(exc).__name__}: {first_line(exc)})", ""]
    m = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    where = (f"GPU: {m.get('gpu') or data.get('gpu') or 'none recorded'}; CPU: "
             f"{m.get('cpu') or (not m and data.get('machine')) or '?'}"  # older: a string
             + (f" ({m.get('cores') or m['cpus']} cores)" if m.get("cores") or m.get("cpus")
                else "")
             + f"; torch {m.get('torch') or data.get('torch') or '?'}.")
    # the last logged command that writes it; first one from a log named with its GPU (logs
    # of several machines side by side)
    gpu = re.search(r"-gpu-(.+)$", path.stem)
    hits = [c for c in commands if base_stem(path.stem) in written_stems(c[2])]
    found = ([c for c in hits if gpu and gpu.group(1) in c[0]] or hits or [None])[-1]
    return [f"### {kind[0]}: `{path.name}`", "", where, "", *body,
            f"Command (part `{found[1]}`, {found[0]}): `{found[2]}`" if found else
            "Command: not found in OUT_DIR's logs.", ""]


def report(out_dir: Path) -> str:
    lines = [f"## GPU run: `{out_dir.name}`", "",
             f"From `python scripts/gpu_report.py {out_dir.name}`: the JSONs' numbers, rounded; "
             "the targets are the benchmarks' and scripts/gpu_report_kernels.py's TARGETS.", "",
             *parts_section(out_dir / "summary.txt")]
    files = sorted((out_dir / "results").glob("*.json"), key=lambda p: (kind_of(p.stem), p.name))
    commands = [(log.name, m["part"], m["command"].strip())  # (log, part, command)
                for log in sorted(out_dir.glob("*.log"))
                for m in map(COMMAND_LINE.match, log.read_text(errors="replace").splitlines()) if m]
    for path in files:
        lines += result_section(path, commands)
    return "\n".join(lines + ([] if files else ["No results/*.json in OUT_DIR."])).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="what scripts/gpu_check.sh left ($OUT)")
    ap.add_argument("--out", type=Path, help="write the markdown here instead of printing it")
    args = ap.parse_args(argv)
    if not args.out_dir.is_dir():
        ap.error(f"{args.out_dir} is not a folder")
    (args.out.write_text if args.out else sys.stdout.write)(report(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
