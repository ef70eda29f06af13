"""Sizing for bench_offload.py --gpu (offload_finetune.py): the Llama ladder, the memory each
contender needs on the GPU and in host RAM, the RAM tier's cpu_budget, and the NVMe tier's step
against the disk bandwidth that benchmarks/bench_io.py measured. Pure arithmetic: no GPU, no
tierlift call, so the sizing runs (and refuses) before any case starts.

Per parameter (n) and per token of a step (activation_bytes):
  GPU, every contender   bf16 params + bf16 grads (4 n) + activations; DeepSpeed (one rank, params
                         on the GPU) keeps a bf16 partition and grad buckets: counted the same
  GPU, tierlift          --device-fraction f: the device part's fp32 master, m, v, 12 f n (at
                         most: it takes whole parameters); the host tier is still sized for all n
  tierlift, RAM tier     fp32 master, m, v: 12 n in one generation (s = 12); with
                         --state-dtype bf16 (compact state: fp32 master, bf16 m, 8-bit v codes
                         and a scale per 256) s = 7.02; --overlap without a budget: two
                         generations, 2 s n; --overlap with --cpu-budget B below that: B
                         (one generation plus spare chunk blocks in the rest)
  tierlift, NVMe tier    2 s n on the disk (two generations), --nvme-budget in RAM
  torch-cpu              fp32 masters, their grads, m, v (16 n) + bf16 grad staging (2 n): 18 n
  torch-gpu (no offload) on the GPU: bf16 params + grads (4 n), fp32 masters, their grads, m, v
                         (16 n) + activations: 20 n + activations (measured only where it fits)
  DeepSpeed              fp32 master, m, v + an fp32 grad partition in pinned RAM: 16 n
The RAM tier pins its state at its size (tierlift._pinned: cudaHostRegister; torch's pinned
allocator would round each block up to a power of two) plus its staging slots, which come from
torch's allocator (already powers of two): pinned_tier_bytes.
"""

from __future__ import annotations

import json
import os

from llama_model import LlamaConfig

LADDER = {
    "tiny": dict(dim=64, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=192, vocab_size=256),
    "1b": dict(dim=2048, n_layer=16, n_head=32, n_kv_head=8, ffn_dim=8192),
    "3b": dict(dim=3072, n_layer=28, n_head=24, n_kv_head=8, ffn_dim=8192),
    "7b": dict(dim=4096, n_layer=32, n_head=32, n_kv_head=32, ffn_dim=11008),
    "8b": dict(dim=4096, n_layer=32, n_head=32, n_kv_head=8, ffn_dim=14336),
    "13b": dict(dim=5120, n_layer=40, n_head=40, n_kv_head=40, ffn_dim=13824),
}
GiB = 1 << 30
FIT = 0.85  # share of each memory a plan may fill: the process, CUDA context, page cache
STAGING = 384 << 20  # the RAM tier's pinned slots: 6 x (fp32 grad + weight staging, 32 MiB each)
NVME_TARGET = 1.25  # the NVMe step within this of (state bytes read + written) / disk bandwidth
# tierlift's host state per parameter and generation, by --state-dtype (offload.layout.state_kinds:
# fp32 master, m, v; or fp32 master, bf16 m, uint8 v code and an fp32 scale per 256 values)
STATE_BYTES = {"fp32": 12.0, "bf16": 4 + 2 + 1 + 4 / 256}


def state_bytes(args) -> float:
    """tierlift's host state bytes per parameter and generation under args' --state-dtype."""
    return STATE_BYTES[getattr(args, "state_dtype", None) or "fp32"]


def config(name: str, seq_len: int) -> LlamaConfig:
    kw = {"vocab_size": 32000, **LADDER[name]}
    return LlamaConfig(max_seq_len=seq_len, **kw)


def activation_bytes(cfg: LlamaConfig, tokens: int) -> int:
    """Rough bf16 activation memory kept for backward (no activation checkpointing). On the
    H200 the 1.1B at 2048 tokens peaked at 6.99 GB with 4.42 GB of params and grads: at most
    2.6 GB of activations where this says 4.95 GB, so it errs on the safe side."""
    return tokens * cfg.n_layer * (34 * cfg.dim + 8 * cfg.ffn_dim) + tokens * cfg.vocab_size * 8


def ram_tier_bytes(n: int, overlap: bool, cpu_budget: float | None, per: float = 12.0) -> int:
    """Host bytes of tierlift's RAM tier (cpu_budget in bytes, `per` its state bytes per
    parameter and generation; see the module docstring)."""
    one = int(per * n)
    if not overlap:
        return one
    return 2 * one if cpu_budget is None else min(int(cpu_budget), 2 * one)


def pinned_tier_bytes(n: int, host: int, per: float = 12.0) -> int:
    """What the RAM tier pins: its state (one block per kind and generation, each at its size)
    plus its staging slots."""
    return max(host, int(per * n)) + STAGING


def check_cpu_budget(args, n: int, tier: str) -> None:
    """--cpu-budget is the RAM tier's; below one generation of the state (12 B/param, 7.02 with
    --state-dtype bf16) the tier cannot hold it. Refused here, before any case starts (the
    optimizer refuses the rest exactly: a budget that holds the state but not its staging
    slots)."""
    budget = getattr(args, "cpu_budget", None)
    if budget is None:
        return
    if tier != "cpu":
        raise SystemExit(f"--cpu-budget is the RAM tier's (--tier cpu); the {tier} tier's host "
                         "memory is --nvme-budget")
    per = state_bytes(args)
    if budget * GiB < per * n:
        what = "fp32 master, m, v" if per == 12 else "compact state"
        raise SystemExit(
            f"--cpu-budget {budget:g} GiB is below one generation of the optimizer state: "
            f"{per:.4g} B/param x {n / 1e9:.2f}B params = {per * n / GiB:.1f} GiB ({what}); "
            "the RAM tier cannot hold it. Raise it, or use --tier nvme")


def needs(name: str, args) -> dict:
    """Bytes each contender needs for model `name` at --batch-size x --seq-len."""
    cfg = config(name, args.seq_len)
    n = cfg.num_params()
    tokens = args.batch_size * args.seq_len
    device_part = 12 * int(getattr(args, "device_fraction", 0.0) * n)  # tierlift's only
    gpu = 4 * n + activation_bytes(cfg, tokens) + device_part
    budget = None if getattr(args, "cpu_budget", None) is None else args.cpu_budget * GiB
    per = state_bytes(args)
    host = ram_tier_bytes(n, args.overlap, budget, per)
    return {"params": n, "tokens_per_step": tokens, "gpu_bytes": gpu,
            "device_part_gpu_bytes": device_part,
            "activation_bytes": activation_bytes(cfg, tokens), "state_bytes_per_param": per,
            "ram_tier_bytes": host, "ram_tier_pinned_bytes": pinned_tier_bytes(n, host, per),
            "spare_share": max(0.0, min(1.0, (host - per * n - STAGING) / (per * n)))
            if args.overlap and budget is not None and host < 2 * per * n else None,
            "nvme_disk_bytes": int(2 * per * n), "torch_cpu_host_bytes": 18 * n,
            "torch_gpu_bytes": 20 * n + activation_bytes(cfg, tokens),
            "deepspeed_host_bytes": 16 * n}


def plan(args) -> dict:
    """The largest ladder model that tierlift and DeepSpeed both hold (or --model, checked),
    tierlift's tier, and what each contender needs."""
    gpu, ram = args.gpu_mem * GiB * FIT, args.cpu_mem * GiB * FIT
    disk = args.disk * GiB * FIT

    def sized(name: str) -> dict | None:
        need = needs(name, args)
        if need["gpu_bytes"] > gpu:
            return None
        tier = args.tier or ("cpu" if need["ram_tier_pinned_bytes"] <= ram else "nvme")
        if tier == "cpu" and need["ram_tier_pinned_bytes"] > ram:
            return None
        if tier == "nvme" and need["nvme_disk_bytes"] > disk:
            return None
        return {"model": name, "tier": tier,
                "deepspeed_fits": need["deepspeed_host_bytes"] <= ram,
                "torch_cpu_fits": need["torch_cpu_host_bytes"] <= ram,
                "torch_gpu_fits": need["torch_gpu_bytes"] <= gpu, **need}

    if args.model is not None:
        check_cpu_budget(args, config(args.model, args.seq_len).num_params(),
                         args.tier or "cpu")
        best = sized(args.model)
        if best is None:
            need = needs(args.model, args)
            raise SystemExit(
                f"--model {args.model} at batch {args.batch_size} x {args.seq_len} does not fit: "
                f"GPU {need['gpu_bytes'] / GiB:.1f} of {gpu / GiB:.1f} GiB (--gpu-mem x {FIT}), "
                f"RAM tier {need['ram_tier_pinned_bytes'] / GiB:.1f} GiB pinned of "
                f"{ram / GiB:.1f} (--cpu-mem x {FIT}), "
                f"NVMe {need['nvme_disk_bytes'] / GiB:.1f} of {disk / GiB:.1f}")
        return best
    best = None
    for name in LADDER:
        if name == "tiny":
            continue
        got = sized(name)
        if got is None or (best is not None and not got["deepspeed_fits"]):
            continue
        best = got
    if best is None:
        raise SystemExit("no model of the ladder fits --gpu-mem/--cpu-mem/--disk")
    check_cpu_budget(args, best["params"], best["tier"])
    return best


def read_disk_json(path: str) -> dict:
    """The disk's read and write bandwidth from benchmarks/bench_io.py --out: its "gbps" table
    ({contender: {"read": GB/s, "write": GB/s}}); the fastest row of each counts (the roofline
    is the least time the disk needs). Refuses a file without it."""
    try:
        with open(path) as f:
            rows = json.load(f)["gbps"]
        best = {rw: max(((float(r[rw]), name) for name, r in rows.items()
                         if isinstance(r.get(rw), (int, float)) and r[rw] > 0), default=None)
                for rw in ("read", "write")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"--disk-json {path}: no bench_io.py result there ({err})") from err
    if None in best.values():
        raise SystemExit(f"--disk-json {path}: no row with a read and a write bandwidth")
    return {"path": os.path.abspath(path), "read_Bps": best["read"][0] * 1e9,
            "write_Bps": best["write"][0] * 1e9, "read_row": best["read"][1],
            "write_row": best["write"][1]}


def nvme_roofline(stats: dict, step_s: float, disk: dict) -> dict:
    """The NVMe step against the least time the disk needs for its state bytes: bytes read /
    read bandwidth + bytes written / write bandwidth (reads and writes one after the other,
    as on a disk that shares one bandwidth between them). The step is the whole training step
    (forward and backward included), so the ratio is an upper bound on the tier's own."""
    rd, wr = float(stats.get("nvme_read_bytes", 0)), float(stats.get("nvme_write_bytes", 0))
    if rd + wr <= 0:
        raise ValueError("the step read and wrote no state bytes: not an NVMe step")
    roof = rd / disk["read_Bps"] + wr / disk["write_Bps"]
    return {"read_bytes": rd, "write_bytes": wr, "read_GBps": disk["read_Bps"] / 1e9,
            "write_GBps": disk["write_Bps"] / 1e9, "roofline_s": roof, "step_s": step_s,
            "ratio": step_s / roof, "target": NVME_TARGET, "met": step_s / roof <= NVME_TARGET,
            "disk_json": disk["path"], "rows": [disk["read_row"], disk["write_row"]]}


# With no earlier result (gpu_check's dry run, --plan-only), the sizing is checked at this
# fraction: about the share of a 1.1B's CPU Adam that backward cannot hide on the H200 at batch
# 8 by arithmetic (0.2 s of backward against ~0.4 s of Adam); a real run reads it (below).
FRACTION_STANDIN = 0.5
FRACTION_STEP = 0.05


def device_fraction_from(path: str, plan_only: bool = False) -> tuple[float, str]:
    """(device_fraction, why) from an earlier result of the same fine-tune: its tierlift row's
    CPU Adam left exposed after backward, as a share of that Adam. Those are the chunks whose
    gradients come last, the first parameters', which device_fraction keeps on the GPU; rounded
    down to FRACTION_STEP, at most 0.9."""
    if plan_only and not os.path.exists(path):
        return FRACTION_STANDIN, f"{path} not there (sizing only): {FRACTION_STANDIN} stands in"
    try:
        with open(path) as f:
            rows = json.load(f)["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--device-fraction-from {path}: cannot read an earlier result: "
                         f"{e}") from e
    for r in rows:
        case, adam = r.get("case", ""), (r.get("legs") or {}).get("adam") or {}
        if (case.startswith("tierlift offload=") and "device_fraction" not in case
                and "state_dtype" not in case and adam.get("total_s", 0) > 0):
            share = adam["exposed_s"] / adam["total_s"]
            f = min(0.9, int(share / FRACTION_STEP + 1e-9) * FRACTION_STEP)
            return round(f, 2), (f"{path}: {case}: {adam['exposed_s']:.3f} s of its "
                                 f"{adam['total_s']:.3f} s of CPU Adam exposed ({share:.0%})")
    raise SystemExit(f"--device-fraction-from {path}: no tierlift row (without device_fraction) "
                     "with a CPU Adam leg")


def fit_device_fraction(args) -> str | None:
    """Lowers args.device_fraction (by FRACTION_STEP) until --model's GPU bytes fit --gpu-mem;
    says so, or None if it fitted as it was."""
    if args.model is None or not args.device_fraction:
        return None
    was, gpu = args.device_fraction, args.gpu_mem * GiB * FIT
    while args.device_fraction > 0 and needs(args.model, args)["gpu_bytes"] > gpu:
        args.device_fraction = round(max(0.0, args.device_fraction - FRACTION_STEP), 2)
    if args.device_fraction == was:
        return None
    return (f"device_fraction {was:g} -> {args.device_fraction:g}: the device part's state "
            f"(12 B/param) must fit --gpu-mem {args.gpu_mem:g} GiB beside the rest")
