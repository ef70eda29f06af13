"""bench_offload.py --gpu: TFLOPS fine-tuning the largest Llama-shaped model the machine holds,
tierlift offload against DeepSpeed ZeRO-3 with CPU optimizer offload (--plan-only: the sizing;
--finetune-check: the same code on CPU with a tiny model). Run through bench_offload.py.

--offload-params cpu runs the tierlift case as ZeRO-3 (tierlift.zero.shard, one process, bf16
compute) with the fp32 parameter shards in pinned RAM as well; --peer torch-cpu measures the plain
way to offload instead of DeepSpeed: fp32 master weights and torch.optim.AdamW state in pinned
RAM, gradients copied down and weights copied back up every step; torch-gpu is the ceiling, the
same recipe with nothing offloaded (masters and state on the GPU), where it fits, and each
tierlift row's forward + backward is set against its own (compute_vs_ceiling: what the offload's
host work costs the device's compute). --contenders runs several side by side (tierlift,
tierlift-zero3, torch-cpu, torch-gpu, deepspeed, deepspeed-zero2, deepspeed-nvme,
deepspeed-super, deepspeed-ratio), each in its own process whose output (each step's time as it
finishes) is passed on at once, and prints tierlift's TFLOPS over each peer's with its target.
With --dir, each case gets a folder of its own there, deleted when its process ends (however it
ends), so one case's NVMe files never share the disk with the next's. The JSON is rewritten after
each case.

DeepSpeed (offload_deepspeed.py; SuperOffload and the partial offload's ratio: deepspeed_modes.py):
--deepspeed-check imports it, checks the ZeRO-3, ZeRO-2, ZeRO-3 NVMe, SuperOffload and ratio
configs against DeepSpeed's own config classes (every top-level and aio key known,
every setting read back as meant) and builds its CPU Adam and async_io ops (JIT; each build's time
is printed), without a GPU, so the timed case neither fails on a config typo nor spends its time
building. On a machine without CUDA DeepSpeed falls back to its CPU accelerator, and
--finetune-check runs the DeepSpeed cases there too (gloo; deepspeed-nvme needs libaio-dev;
deepspeed-super, CUDA only, is refused there with the reason in its row).

Sizing (finetune_sizing.py, per parameter): tierlift keeps bf16 params + bf16 grads on the GPU
(4 B) and the fp32 master, m, v in pinned RAM (12 B with offload="cpu"; with --overlap two
generations, 24 B, or with --cpu-budget below that the budget: one generation plus spare chunk
blocks, stepped ahead during backward) or on NVMe (24 B: two generations); torch's recipe 18 B
and DeepSpeed ZeRO-3 (one rank, params on the GPU) 16 B in RAM. The largest model of the ladder
that both hold within 85% of each memory is measured (or --model, checked the same way), each
case in its own process (pinned memory of one must not count against the other). Every row
reports tokens per step (--batch-size x --seq-len), tokens/s, TFLOPS and peak GPU, pinned and
host memory (peak_host_bytes: the case's peak RSS plus its worker processes'). FLOPs per
token: 6 N + 12 L d T, N the parameters a matmul multiplies (the input embedding and the norms
left out: a lookup and elementwise scales), plus the attention scores and their weighted sum (the
causal mask is not discounted). --max-grad-norm applies to every contender alike (0: none):
tierlift's overlap keeps its chunks only while the norm stays under it (docs/offload-overlap.md),
so the tierlift rows report the gradient norm and the chunks kept and redone. With --tier nvme
and --disk-json (the file benchmarks/bench_io.py --out wrote), the step is set against the disk's
roofline for its state bytes (target within 1.25x). --device-fraction F passes tierlift's
device_fraction (the first parameters' state stays on the GPU, 12 B/param counted in the sizing);
the row's case and note say how many parameters it kept there; deepspeed-ratio (which needs it)
keeps the same parameters' state on the GPU through DeepSpeed's offload_optimizer ratio, and so
does deepspeed-super when it is given (deepspeed_modes.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import tierlift
from common import machine, print_table, write_json
from deepspeed_modes import mode_note, refusal
from finetune_sizing import (
    FIT,
    LADDER,
    NVME_TARGET,
    GiB,
    check_cpu_budget,
    config,
    device_fraction_from,
    fit_device_fraction,
    nvme_roofline,
    plan,
    read_disk_json,
)
from llama_model import Llama, LlamaConfig, rope_tables
from offload_deepspeed import (  # noqa: F401 (check_deepspeed_config, deepspeed_config: tests)
    DEEPSPEED,
    check_deepspeed_config,
    check_nvme_fits,
    deepspeed_check,
    deepspeed_config,
    deepspeed_nvme_note,
    run_deepspeed,
)
from offload_legs import print_leg_table
from plots import plot_json, plot_offload_finetune
from tierlift._peak_rss import peak_with_children
from tierlift._pinned import registered_bytes

BENCH = Path(__file__).resolve().with_name("bench_offload.py")  # runs each case in its process


def build_model(name: str, seq_len: int, device: torch.device, dtype=None) -> Llama:
    cfg = config(name, seq_len)
    torch.manual_seed(0)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Llama(cfg)
    finally:
        torch.set_default_dtype(old)
    model.rope_cos, model.rope_sin = rope_tables(cfg, device)
    return model


def matmul_params(cfg: LlamaConfig, n: int) -> int:
    """Of the model's n parameters, those a matmul multiplies: the input embedding is a lookup
    (its backward a scatter-add) and the RMSNorm weights an elementwise scale, so neither does
    the 6 FLOPs per parameter and token (at 1.1B the embedding alone was 5.6% of the TFLOPS)."""
    return n - cfg.vocab_size * cfg.dim - (2 * cfg.n_layer + 1) * cfg.dim


def flops_per_step(cfg: LlamaConfig, n: int, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward + backward: 6 per matmul parameter and token, plus the
    attention scores and their weighted sum, 12 L d T per token (the causal mask not
    discounted)."""
    return (6 * matmul_params(cfg, n) + 12 * cfg.n_layer * cfg.dim * seq) * batch * seq


def _time_steps(step_fn, steps: int, warmup: int, device, each: list | None = None) -> float:
    """The mean time of `steps` steps after `warmup`; `each`, if given, gets every timed
    step's own time (the last one is the step whose legs last_step_stats holds)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Each step's time on stderr: a case cut off by --timeout still says how far it got.
    t_start = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        t = time.perf_counter()
        step_fn()
        sync()
        took = time.perf_counter() - t
        if each is not None and i >= warmup:
            each.append(took)
        print(f"{'warmup' if i < warmup else 'step'} {i}: {took:.2f} s "
              f"({time.perf_counter() - t_start:.0f} s in)", file=sys.stderr, flush=True)
    return (time.perf_counter() - t0) / steps


def run_tierlift(args, info: dict, device) -> dict:
    zero3 = args.offload_params != "none"
    t_setup = time.perf_counter()
    # ZeRO-3 keeps fp32 shards and computes in bf16 on the GPU (as DeepSpeed's bf16 does).
    model = build_model(info["model"], args.seq_len, device,
                        dtype=torch.float32 if zero3 else None)
    n = sum(p.numel() for p in model.parameters())
    if zero3:
        mp = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = tierlift.zero.shard(model, stage=3, mixed_precision=mp,
                                    offload_params=args.offload_params)
    nvme = tempfile.TemporaryDirectory(dir=args.dir) if info["tier"] == "nvme" else None
    kw = dict(offload=info["tier"], max_grad_norm=args.max_grad_norm or None,
              overlap=args.overlap or info["tier"] == "nvme")
    if nvme is not None:
        kw.update(nvme_path=nvme.name, cpu_budget=int(args.nvme_budget * GiB))
    elif args.cpu_budget is not None:
        kw.update(cpu_budget=int(args.cpu_budget * GiB))
    if args.chunk_bytes:
        kw.update(chunk_bytes=args.chunk_bytes)
    if args.device_fraction:
        kw.update(device_fraction=args.device_fraction)
    if args.state_dtype != "fp32":
        kw.update(state_dtype=args.state_dtype)
    if args.overlap_threads:
        kw.update(overlap_threads=args.overlap_threads)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), **kw)
    print(f"set up (model, shard, optimizer) in {time.perf_counter() - t_setup:.1f} s",
          file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(0)

    compute = ComputeTimer(device)

    def step():
        x = torch.randint(model.cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                          generator=gen).to(device)
        with compute:
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    each: list[float] = []
    t = _time_steps(step, args.steps, args.warmup, device, each)
    case = f"tierlift offload={info['tier']}" + (" overlap" if kw["overlap"] else "")
    if zero3:
        case = (f"tierlift zero3 offload_params={args.offload_params} offload={info['tier']}"
                + (" overlap" if kw["overlap"] else ""))
    if args.device_fraction:
        case += f" device_fraction={args.device_fraction:g}"
    if args.state_dtype != "fp32":
        case += f" state_dtype={args.state_dtype}"
    if args.overlap_threads:
        case += f" overlap_threads={args.overlap_threads}"
    # The RAM tier's spare chunk blocks (tiers.MemoryTier.spare: not in last_step_stats, read
    # from the optimizer's Offloader): 0 with two generations or without the overlap.
    tiers = opt._offload.tiers
    out = {"case": case, "params": n, "step_s": t, "cpu_budget": kw.get("cpu_budget"),
           "state_dtype": args.state_dtype,
           # the step whose legs and compute_s these are (leg_bound): not the mean
           "last_step_s": each[-1],
           # page-locked now, while the optimizer holds it (registered_bytes() counts only
           # open registrations; the optimizer's go when it is closed or collected)
           "registered_pinned_bytes": registered_bytes(),
           "chunks": sum(len(tr.gen) for tr in tiers),
           "spare_chunks": sum(getattr(tr, "spare", 0) for tr in tiers),
           "generations": max(getattr(tr, "generations", 0) for tr in tiers),
           "stats": {k: v for k, v in opt.last_step_stats.items() if isinstance(v, float)},
           "legs": opt.last_step_stats.get("legs", {}),  # the last step, split by leg
           # the parameters whose state stayed on the device (device_fraction)
           "device_part": {k: opt.last_step_stats.get(k, 0) for k in
                           ("device_part_params", "device_part_elems")},
           "compute_s": compute.seconds(),  # its forward + backward on the device
           # the CPU Adam's threads while training ran (OffloadConfig.overlap_threads)
           "overlap_threads": getattr(opt._offload.overlap, "threads", None)}
    if zero3:
        tierlift.zero.close(model)
    if nvme is not None:
        nvme.cleanup()
    return out


def run_torch(args, info: dict, device, offload: bool) -> dict:
    """torch's own recipes with the model in bf16 on the device and fp32 master weights for
    torch.optim.AdamW (fused): with `offload`, the plain way to offload (masters and state in
    pinned RAM; each step copies the gradients down, clips, steps on the CPU and copies the
    weights back up); without, the ceiling where it fits (masters and state beside the model,
    no copy across the bus: what the offloading contenders give up for their memory)."""
    model = build_model(info["model"], args.seq_len, device)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    pin = offload and device.type == "cuda"
    home = torch.device("cpu") if offload else device
    masters = [torch.empty(p.shape, device=home, pin_memory=pin).copy_(p.detach())
               for p in params]
    low = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params] if offload \
        else []  # without offload the gradients stay where they are
    for m in masters:
        m.grad = torch.empty_like(m)
    try:
        opt = torch.optim.AdamW(masters, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                                fused=True)
    except (RuntimeError, TypeError):  # a torch without the fused CPU AdamW
        opt = torch.optim.AdamW(masters, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    compute = ComputeTimer(device)
    norms: list[float] = []  # each step's norm before clipping

    def step():
        x = torch.randint(model.cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                          generator=gen).to(device)
        with compute:
            model(x[:, :-1], x[:, 1:]).backward()
        if offload:
            for p, g in zip(params, low):
                g.copy_(p.grad, non_blocking=True)
                p.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            for m, g in zip(masters, low):
                m.grad.copy_(g)
        else:
            for p, m in zip(params, masters):
                m.grad.copy_(p.grad)
                p.grad = None
        if args.max_grad_norm:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, args.max_grad_norm)))
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m, non_blocking=True)

    each: list[float] = []
    t = _time_steps(step, args.steps, args.warmup, device, each)
    if not norms:  # unclipped: the last step's norm, outside the timed steps
        norms.append(float(torch.nn.utils.get_total_norm([m.grad for m in masters])))
    case = ("torch AdamW on CPU (fp32 master, pinned)" if offload else
            f"torch AdamW on the {'GPU' if device.type == 'cuda' else 'CPU'} (fp32 master, "
            "no offload)")
    return {"case": case, "params": n, "step_s": t, "last_step_s": each[-1],
            "grad_norm": norms[-1], "compute_s": compute.seconds()}


def run_case(args, which: str) -> None:
    """One case in this process; prints RESULT <json>."""
    device = torch.device("cuda" if args.gpu else "cpu")
    info = json.loads(args.info)
    if which in DEEPSPEED:
        out = run_deepspeed(args, info, device, which)
    else:
        out = run_tierlift(args, info, device) if which == "tierlift" else \
            run_torch(args, info, device, offload=which == "torch-cpu")
    cfg = config(info["model"], args.seq_len)
    # kept in the row: a report tells this count from the older one (the embedding counted)
    out["flops_per_step"] = flops_per_step(cfg, out["params"], args.batch_size, args.seq_len)
    out["tflops"] = out["flops_per_step"] / out["step_s"] / 1e12
    out["tokens_per_step"] = args.batch_size * args.seq_len
    out["tokens_per_s"] = out["tokens_per_step"] / out["step_s"]
    # RSS, its worker processes' included (run_deepspeed reads it before it ends its worker)
    out.setdefault("peak_host_bytes", peak_with_children())
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        # as torch's caching host allocator holds it (each block rounded up to a power of two),
        # plus what tierlift page-locked at its size beside it (tierlift._pinned)
        host = getattr(torch.cuda, "host_memory_stats", dict)()
        out["peak_pinned_bytes"] = (host.get("allocated_bytes.peak", 0)
                                    + out.get("registered_pinned_bytes", registered_bytes()))
    print("RESULT " + json.dumps(out), flush=True)


# What each contender is; tierlift's rows are compared with every peer's, against these targets
# (tierlift's TFLOPS over the peer's).
CONTENDERS = {
    "tierlift": "tierlift AdamW, state per --tier, params as --offload-params says (GPU by "
                "default)",
    "tierlift-zero3": "tierlift ZeRO-3 with the fp32 parameter shards in pinned RAM too",
    "torch-cpu": "torch.optim.AdamW on CPU, fp32 masters in pinned RAM",
    "torch-gpu": "torch.optim.AdamW (fused) on the GPU, fp32 masters beside the model: no "
                 "offload, the ceiling where it fits",
    "deepspeed": "DeepSpeed ZeRO-3, offload_optimizer=cpu (DeepSpeedCPUAdam), bf16",
    "deepspeed-zero2": "DeepSpeed ZeRO-2, offload_optimizer=cpu (ZeRO-Offload's recipe), bf16",
    "deepspeed-nvme": "DeepSpeed ZeRO-3, offload_optimizer=nvme under --dir (ZeRO-Infinity's "
                      "optimizer side: libaio, its documented aio settings), bf16",
    "deepspeed-super": "DeepSpeed ZeRO-3 SuperOffload (offload_optimizer super_offload: its CPU "
                       "Adam in a worker process, overlapped with backward; CUDA only), bf16; "
                       "with --device-fraction also its ratio",
    "deepspeed-ratio": "DeepSpeed ZeRO-3, offload_optimizer=cpu with ratio < 1 (ZeRO-Offload++: "
                       "the first sub-groups' state on the GPU, the share --device-fraction keeps "
                       "for tierlift), bf16",
}
CEILING = "torch-gpu"  # nothing offloaded: tierlift's ratio to it has no target
CEILING_TARGET = "none: the ceiling, nothing offloaded"
TARGETS = {"torch-cpu": 2.0, "deepspeed": 1.5, "deepspeed-zero2": 1.5, "deepspeed-super": 1.5,
           "deepspeed-ratio": 1.5}


def contenders(args) -> list[str]:
    if not args.contenders:
        return ["tierlift", args.peer]
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown or not names:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    if "deepspeed-ratio" in names and not args.device_fraction:
        raise SystemExit("--contenders deepspeed-ratio needs --device-fraction (or "
                         "--device-fraction-from): its ratio keeps on the GPU the share of the "
                         "parameters tierlift's device_fraction keeps")
    return names


def ratio_rows(ok: list[dict]) -> list[dict]:
    """tierlift's TFLOPS over each peer's, measured in this run, with the target beside it."""
    mine = [r for r in ok if r["contender"].startswith("tierlift")]
    peers = [r for r in ok if not r["contender"].startswith("tierlift")]
    return [{"case": f"{a['contender']} / {b['contender']}",
             "TFLOPS": f"{a['tflops'] / b['tflops']:.2f}x",
             "target": f">= {TARGETS[b['contender']]}x" if b["contender"] in TARGETS else
             CEILING_TARGET if b["contender"] == CEILING else ""}
            for a in mine for b in peers]


def _run_case_process(cmd: list[str], timeout: float, label: str):
    """One case in its own process. Its output (each step's time as it finishes, and DeepSpeed's
    log) goes on to ours at once, prefixed with the label, so a run cut off from outside still
    shows how far each case got. Returns (exit code or None when timed out, stdout, the last
    lines of both, step times)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, errors="replace")
    out: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=200)
    steps: list[float] = []

    def pump_stderr():
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            sys.stderr.write(f"[{label}] {line}")
            sys.stderr.flush()
            m = STEP_LINE.match(line)
            if m:
                steps.append(float(m.group(1)))

    def pump_stdout():
        for line in proc.stdout:
            out.append(line)
            if not line.startswith("RESULT "):
                tail.append(line.rstrip("\n"))
                sys.stdout.write(f"[{label}] {line}")
                sys.stdout.flush()

    readers = [threading.Thread(target=pump_stderr, daemon=True),
               threading.Thread(target=pump_stdout, daemon=True)]
    for t in readers:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    for t in readers:
        t.join(timeout=10)
    return rc, "".join(out), list(tail), steps


STEP_LINE = re.compile(r"(?:warmup|step) \d+: ([0-9.]+) s ")


def case_note(res: dict) -> str:
    """What a case's last step did: tierlift's spare blocks and chunks stepped during backward
    and kept or redone; the gradient norm (against --max-grad-norm) where the case has it."""
    st = dict(res.get("stats", {}))
    if "grad_norm" in res:
        st["grad_norm"] = res["grad_norm"]
    parts = []
    if res.get("spare_chunks"):
        parts.append(f"one generation and {res['spare_chunks']} spare blocks for "
                     f"{res['chunks']} chunks (cpu_budget {res['cpu_budget'] / GiB:.4g} GiB)")
    elif res.get("chunks"):
        parts.append(f"{res['generations']} generation(s) of {res['chunks']} chunks")
    if st.get("overlapped_s") or st.get("overlap_kept_chunks") or st.get("overlap_redone_chunks"):
        parts.append(f"last step: {st.get('overlap_kept_chunks', 0):.0f} chunks stepped during "
                     f"backward and kept, {st.get('overlap_redone_chunks', 0):.0f} redone, "
                     f"{st.get('overlap_no_room_chunks', 0):.0f} left to step() for want of a "
                     f"block, {st.get('ram_chunks', 0):.0f} stepped in place, "
                     f"{st.get('device_staged_chunks', 0):.0f} published from device staging")
    if "grad_norm" in st:
        parts.append(f"grad norm {st['grad_norm']:.3g}")
    if res.get("stepped_grad_norm") is not None:  # DeepSpeed's: what its CPU Adam was given
        parts.append(f"stepped with norm {res['stepped_grad_norm']:.4g} (gradient_clipping "
                     f"{res['gradient_clipping']:g})")
    part = res.get("device_part") or {}
    if part.get("device_part_params"):
        parts.append(f"{part['device_part_params']} parameters "
                     f"({part['device_part_elems'] / res['params']:.1%} of the elements) kept "
                     f"their state beside them (device_fraction), stepped in "
                     f"{1e3 * st.get('device_part_s', 0.0):.1f} ms on the host"
                     + (f", {1e3 * st['device_part_gpu_s']:.1f} ms on the GPU"
                        if st.get("device_part_gpu_s") is not None else ""))
    return f"{res['case']}: " + "; ".join(parts) if parts else ""


class ComputeTimer:
    """The device time of what runs inside it (forward + backward) in the last step: CUDA
    events on a GPU (read after the step's synchronize), the host's clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._last = None

    def __enter__(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._last = (self._start, end)
        else:
            self._last = time.perf_counter() - self._start

    def seconds(self) -> float | None:
        if self._last is None or not self.cuda:
            return self._last
        start, end = self._last
        end.synchronize()
        return start.elapsed_time(end) / 1e3


# The legs of a tierlift step that can hide one another: the device's forward + backward, and the
# optimizer's copies, CPU Adam and NVMe I/O (their total time on whatever did them).
BOUND_LEGS = ("adam", "d2h", "h2d", "nvme_read", "nvme_write")
LEG_TARGET = 1.15  # step <= this x its longest leg: the other legs hidden behind it


def leg_bound(res: dict) -> dict | None:
    """A tierlift case's last step over its longest leg: the legs and compute_s are of the
    last step, so its own time is set against them, not the mean of the steps (a last step
    slower than the mean gave a step shorter than one of its own legs). None without them."""
    legs, compute, step = res.get("legs") or {}, res.get("compute_s"), res.get("last_step_s")
    times = {leg: legs[leg]["total_s"] for leg in BOUND_LEGS if legs.get(leg)}
    if compute:
        times["forward+backward"] = compute
    if not times or step is None:
        return None
    leg = max(times, key=times.get)
    ratio = step / times[leg]
    return {"leg": leg, "leg_s": times[leg], "step_s": step, "ratio": ratio,
            "met": ratio <= LEG_TARGET}


def compare_compute(ok: list[dict]) -> str:
    """Each tierlift row's forward + backward against the ceiling's (torch-gpu: the same model
    and batch, nothing offloaded): what the offload's host work (its threads, copies, hooks)
    costs the device's own compute, as `compute_vs_ceiling` in the row. "" without both."""
    ceiling = next((r for r in ok if r["contender"] == CEILING and r.get("compute_s")), None)
    lines = []
    for r in ok:
        if ceiling is None or not r["contender"].startswith("tierlift") or not r.get("compute_s"):
            continue
        r["compute_vs_ceiling"] = r["compute_s"] / ceiling["compute_s"]
        lines.append(f"{r['case']}: forward+backward {1e3 * r['compute_s']:.0f} ms, "
                     f"{r['compute_vs_ceiling']:.2f}x the ceiling's "
                     f"({1e3 * ceiling['compute_s']:.0f} ms, nothing offloaded)")
    return "\n".join(lines)


def _gb(x) -> str:
    return "" if x is None else f"{x / 1e9:.1f}"


def finetune(args) -> int:
    if args.deepspeed_check:
        return deepspeed_check(args)
    if args.state_dtype == "bf16" and (args.device_fraction or args.device_fraction_from):
        # the sizing counts the device part at fp32 state's 12 B/param: not measured together
        raise SystemExit("--state-dtype bf16 with --device-fraction is not a measured "
                         "combination here: run them as separate rows")
    if args.device_fraction_from:
        args.device_fraction, why = device_fraction_from(args.device_fraction_from,
                                                         args.plan_only)
        print(f"device_fraction {args.device_fraction:g}: {why}", flush=True)
        lowered = fit_device_fraction(args)
        if lowered:
            print(lowered, flush=True)
        if args.device_fraction == 0 and not args.plan_only:
            print("nothing of the CPU Adam was left exposed: no case to run", flush=True)
            return 0
    if args.gpu and not args.plan_only and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU and none is available; --gpu --plan-only "
                         "prints the sizing, --finetune-check runs the same code on CPU")
    if args.finetune_check:
        args.model, args.seq_len, args.batch_size = "tiny", 32, 2
        args.steps, args.warmup = 2, 1
        info = {"model": "tiny", "params": config("tiny", 32).num_params(),
                "tier": args.tier or "nvme", "deepspeed_fits": True, "torch_cpu_fits": True,
                "torch_gpu_fits": True,
                "tokens_per_step": args.batch_size * args.seq_len}
        check_cpu_budget(args, info["params"], info["tier"])
    else:
        info = plan(args)
    disk = None
    if args.disk_json:  # read before any case runs: a missing or malformed file is an error
        if info["tier"] != "nvme":
            raise SystemExit("--disk-json is for the NVMe tier (--tier nvme)")
        if not args.plan_only:  # the sizing alone needs no disk result (gpu_check's dry run)
            disk = read_disk_json(args.disk_json)
    # an unknown name is refused here, by --plan-only too (gpu_check's dry run), as is a
    # deepspeed-nvme whose swap files would not fit
    if "deepspeed-nvme" in contenders(args) and not args.no_deepspeed:
        info.update(check_nvme_fits(args, info))
    print(f"plan: {json.dumps(info)}")
    if args.plan_only:
        return 0
    rows, results, roofline = [], [], None

    def save():
        if args.finetune_check:
            return None
        name = "bench_offload_finetune" + (f"-{args.json_suffix}" if args.json_suffix else "")
        return write_json(name, {
            "machine": machine(), "plan": info, "nvme_roofline": roofline,
            "args": {k: v for k, v in vars(args).items() if k != "info"}, "results": results})

    for which in contenders(args):
        # deepspeed_fits: its state in RAM (16 B/param); deepspeed-nvme's was checked above
        if which.startswith("deepspeed") and (args.no_deepspeed or (
                which != "deepspeed-nvme" and not info["deepspeed_fits"])):
            continue
        if which == "torch-cpu" and not info.get("torch_cpu_fits", True):
            print("torch-cpu: left out, its 18 B/param do not fit --cpu-mem", flush=True)
            continue
        if which == CEILING and not info.get("torch_gpu_fits", True):
            why = ("does not fit: 20 B/param (bf16 params and grads, fp32 masters, their grads, "
                   "m, v) + activations, "
                   f"{info['torch_gpu_bytes'] / GiB:.0f} GiB of --gpu-mem x {FIT}")
            print(f"torch-gpu: left out, it {why}", flush=True)
            results.append({"contender": which, "case": which, "error": why})
            continue
        why = refusal(which, args)
        if why:  # its row says why, the other contenders run
            print(f"{which}: refused: {why}", flush=True)
            results.append({"contender": which, "case": which, "error": why})
            save()
            continue
        case = "tierlift" if which.startswith("tierlift") else which
        offload_params = "cpu" if which == "tierlift-zero3" else args.offload_params
        cmd = [sys.executable, str(BENCH), "--finetune-case", case,
               "--info", json.dumps(info), "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--nvme-budget", str(args.nvme_budget),
               "--max-grad-norm", str(args.max_grad_norm)]
        cmd += ["--overlap"] if args.overlap else []
        cmd += ["--cpu-budget", str(args.cpu_budget)] if args.cpu_budget is not None else []
        cmd += ["--chunk-bytes", str(args.chunk_bytes)] if args.chunk_bytes else []
        cmd += ["--device-fraction", str(args.device_fraction)] if args.device_fraction else []
        cmd += ["--state-dtype", args.state_dtype]
        cmd += ["--overlap-threads", str(args.overlap_threads)] if args.overlap_threads else []
        cmd += ["--offload-params", offload_params]
        cmd += ["--gpu"] if args.gpu else []
        # the case's files (NVMe state) in a folder of its own, gone before the next case starts
        # even when this one was killed at its --timeout
        case_dir = tempfile.mkdtemp(prefix=f"finetune-{which}-", dir=args.dir)
        cmd += ["--dir", case_dir]
        try:
            rc, stdout, tail, steps = _run_case_process(cmd, args.timeout, which)
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        why = (f"timed out after {args.timeout} s" if rc is None else
               f"failed (exit {rc})" if rc != 0 else "exited without a result")
        if not lines:
            timed = steps[args.warmup:]
            got = (f"; {len(timed)} timed step(s) done, {sum(timed) / len(timed):.3f} s/step"
                   if timed else "")
            print(f"{which}: {why}{got}; its last lines:", *tail[-6:], sep="\n  ", flush=True)
            # step_times: every step line, warmup first; timed_step_times: those after it
            results.append({"contender": which, "case": which, "error": why,
                            "step_times": steps, "timed_step_times": timed,
                            "stderr_tail": tail[-40:]})
            save()
            continue
        res = {"contender": which, **json.loads(lines[-1][len("RESULT "):]),
               "step_times": steps}
        if rc != 0:
            # measured and printed, then cut off or failed on the way out (tearing down 100 GiB
            # of pinned state takes a while): the result stands, with what happened after it
            res["after_result"] = why
            print(f"{which}: {why} after printing its result; the result stands. Its last "
                  "lines:", *tail[-6:], sep="\n  ", flush=True)
        results.append(res)
        if disk is not None and which.startswith("tierlift"):
            res["nvme_roofline"] = roofline = nvme_roofline(res["stats"], res["step_s"], disk)
        elif disk is not None and which == "deepspeed-nvme":  # its bytes, the same disk
            res["nvme_roofline"] = nvme_roofline(res["stats"], res["step_s"], disk)
        bound = res["leg_bound"] = leg_bound(res) if which.startswith("tierlift") else None
        save()
        print(f"{res['case']}: {res['step_s']:.3f} s/step, {res['tokens_per_s']:.0f} tokens/s, "
              f"{res['tflops']:.2f} TFLOPS", flush=True)
        if case_note(res):
            print(case_note(res), flush=True)
        if which == "deepspeed-nvme":
            print(deepspeed_nvme_note(res), flush=True)
        if res.get("offload_mode"):
            print(mode_note(res), flush=True)
        rows.append({"case": res["case"], "step_s": f"{res['step_s']:.3f}",
                     "tokens/step": str(res["tokens_per_step"]),
                     "tokens/s": f"{res['tokens_per_s']:.0f}", "TFLOPS": f"{res['tflops']:.2f}",
                     "GPU GB": _gb(res.get("peak_gpu_bytes")),
                     "pinned GB": _gb(res.get("peak_pinned_bytes")),
                     "host GB": _gb(res.get("peak_host_bytes")),
                     "target": "" if bound is None else
                     f"last step {bound['ratio']:.2f}x its longest leg ({bound['leg']}), "
                     f"<= {LEG_TARGET}x"})
    ok = [r for r in results if "tflops" in r]
    rows += ratio_rows(ok)
    ceiling_note = compare_compute(ok)
    if ceiling_note:
        print(ceiling_note, flush=True)
    if rows:
        print_table(rows, ["case", "step_s", "tokens/step", "tokens/s", "TFLOPS", "GPU GB",
                           "pinned GB", "host GB", "target"],
                    title=f"fine-tuning {info['model']} ({info['params'] / 1e9:.2f}B params), "
                          f"batch {args.batch_size} x {args.seq_len} = "
                          f"{args.batch_size * args.seq_len} tokens per step, clipping "
                          + (f"at {args.max_grad_norm:g}" if args.max_grad_norm else "off"))
    print_leg_table({r["case"]: r["legs"] for r in ok if r.get("legs")},
                    "the last step by leg (ms; exposed: the training thread waited for it)")
    if roofline is not None:
        r = roofline
        print(f"NVMe roofline: {r['read_bytes'] / 1e9:.4g} GB read + {r['write_bytes'] / 1e9:.4g} "
              f"GB written per step at {r['read_GBps']:.2f} / {r['write_GBps']:.2f} GB/s (read / "
              f"write, {args.disk_json}) = {r['roofline_s']:.4g} s; step {r['step_s']:.4g} s = "
              f"{r['ratio']:.2f}x the roofline (target <= {NVME_TARGET}x: "
              f"{'met' if r['met'] else 'NOT met'})", flush=True)
    path = save()
    if path is not None:
        if args.plot:
            print(f"wrote {plot_json(plot_offload_finetune, path, args.plot)}")
    return 0 if ok else 1


def add_finetune_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("fine-tuning (GPU) mode")
    g.add_argument("--gpu", action="store_true", help="TFLOPS fine-tuning a Llama on the GPU")
    g.add_argument("--finetune-check", action="store_true",
                   help="run the --gpu code path on CPU with a tiny model (a smoke test)")
    g.add_argument("--plan-only", action="store_true", help="print the sizing and stop")
    g.add_argument("--model", choices=list(LADDER), default=None, help="skip the sizing")
    g.add_argument("--tier", choices=["cpu", "nvme"], default=None)
    g.add_argument("--overlap", action="store_true",
                   help="offload='cpu' with the step overlapped with backward (two generations, "
                        "2x the RAM, unless --cpu-budget is below that)")
    g.add_argument("--cpu-budget", type=float, default=None, metavar="GIB",
                   help="cpu_budget (GiB) of the RAM tier (--tier cpu): with --overlap and below "
                        "two generations, one generation plus spare chunk blocks in the rest")
    g.add_argument("--device-fraction", type=float, default=0.0, metavar="F",
                   help="tierlift's device_fraction: the share of the parameters (by elements, "
                        "the first ones) whose optimizer state stays on the GPU and is stepped "
                        "there (DeepSpeed's offload_optimizer ratio); the sizing counts its "
                        "12 B/param (bf16 params) on the GPU")
    g.add_argument("--device-fraction-from", metavar="JSON",
                   help="--device-fraction from an earlier result of this fine-tune (a "
                        "--json-suffix file with a tierlift row): the share of its CPU Adam left "
                        "exposed after backward (finetune_sizing.device_fraction_from)")
    g.add_argument("--state-dtype", choices=["fp32", "bf16", "both"], default="fp32",
                   help="tierlift's AdamW state_dtype (its rows only): bf16 is the compact "
                        "state, 7.02 B/param with the fp32 master instead of 12, so two "
                        "generations fit where fp32's do not (docs/optim.md, 'Compact state'); "
                        "--layouts: every layout's, or both in the same rounds (with a "
                        "compact-over-fp32 column)")
    g.add_argument("--overlap-threads", type=int, default=None, metavar="N",
                   help="tierlift's AdamW overlap_threads: the CPU threads its chunks stepped "
                        "during backward use (default: the optimizer's, all but an eighth of "
                        "them when training runs on CUDA)")
    g.add_argument("--chunk-bytes", type=int, default=None,
                   help="tierlift's AdamW chunk_bytes (default: the optimizer's, 32 MiB)")
    g.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="gradient clipping of every contender (0: none); tierlift's overlap "
                        "redoes every chunk of a step whose norm is above it")
    g.add_argument("--disk-json", metavar="PATH",
                   help="--tier nvme: benchmarks/bench_io.py --out's result; the step is set "
                        "against (state bytes read + written) / that disk's bandwidth")
    g.add_argument("--gpu-mem", type=float, default=80, help="GiB (the H200: 140)")
    g.add_argument("--cpu-mem", type=float, default=128, help="GiB")
    g.add_argument("--disk", type=float, default=64, help="GiB under --dir")
    g.add_argument("--nvme-budget", type=float, default=16, help="cpu_budget (GiB), nvme tier")
    g.add_argument("--seq-len", type=int, default=2048)
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--no-deepspeed", action="store_true")
    g.add_argument("--peer", choices=["deepspeed", "torch-cpu"], default="deepspeed",
                   help="what the tierlift case is compared with (see the module docstring)")
    g.add_argument("--contenders", metavar="A,B,...",
                   help="the cases in this order, each in its own process (default: tierlift,"
                        "PEER): " + "; ".join(f"{k}: {v}" for k, v in CONTENDERS.items()))
    g.add_argument("--json-suffix", metavar="S",
                   help="write results/bench_offload_finetune-S-<machine>.json, so that several "
                        "runs in one session keep their own file")
    g.add_argument("--deepspeed-check", action="store_true",
                   help="import DeepSpeed, check the ZeRO-3/-2/-3 NVMe configs against its "
                        "schema, build its CPU Adam and async_io ops (timed) and stop; no GPU "
                        "needed")
    g.add_argument("--offload-params", choices=["none", "cpu"], default="none",
                   help="tierlift case as ZeRO-3 with the fp32 parameter shards in pinned RAM")
    g.add_argument("--timeout", type=int, default=3600, help="seconds per case")
    g.add_argument("--aio-ok", metavar="PATH",
                   help="with --deepspeed-check: write PATH once DeepSpeed's async_io op built "
                        "and moved bytes under --dir (deepspeed-nvme can run)")
    g.add_argument("--aio-timeout", type=float, default=None, metavar="S",
                   help="with --deepspeed-check: give up the async_io build after S seconds "
                        "(the CPU Adam contenders still pass); 0: do not build it")
    g.add_argument("--finetune-case", choices=["tierlift", "torch-cpu", "torch-gpu", *DEEPSPEED],
                   help=argparse.SUPPRESS)
    g.add_argument("--info", help=argparse.SUPPRESS)
