"""`python -m tierlift plan`: arguments, measurement, and the printed (or JSON) plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import torch

from tierlift._plotting import pyplot
from tierlift.activations import Policy
from tierlift.plan.comm import comm_plan, render_comm
from tierlift.plan.measure import host_memory_available, measure
from tierlift.plan.planner import (
    MAX_PARAMS,
    PlanInput,
    make_plan,
    max_params,
    parse_bytes,
    render,
)

# The plan lists one tier per block: a model has far fewer blocks (its transformer layers).
MAX_ACT_BLOCKS = 1_000_000


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="where training state will live and the expected step time")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count, e.g. 8e9")
    what.add_argument("--max-params", action="store_true",
                      help="the largest model that fits the budgets given, and its plan")
    p.add_argument("--gpu-mem", required=True,
                   help="GPU memory, e.g. 80G (sizes: G or GiB 2**30 bytes, GB 10**9, 1e9 bytes)")
    p.add_argument("--cpu-mem", required=True, help="host memory, e.g. 128G")
    p.add_argument("--nvme", default=None, help="directory on the NVMe drive")
    p.add_argument("--cpu-budget", default=None, help="host memory the optimizer may hold")
    p.add_argument("--nvme-free", default=None,
                   help="free space the drive offers the state, e.g. 64G (default: what is free "
                        "under --nvme now; give it to plan for another machine's drive)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="optimizer state: fp32 (12 B/param with the master) or bf16, the compact "
                        "state of tierlift.optim's state_dtype='bf16' (7.02 B/param)")
    p.add_argument("--param-dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="the trained weights' dtype, their gradients' too: bf16 or fp16 (2 B "
                        "each, an fp32 master in the state) or fp32 (4 B each, no mixed "
                        "precision: its own master where the runtime keeps none); with "
                        "--offload-params the gathered units' dtype "
                        "(MixedPrecision(param_dtype=...))")
    p.add_argument("--offload-params", choices=("none", "cpu", "nvme"), default="none",
                   help="tierlift.zero.shard(stage=3, offload_params=...): none keeps the "
                        "weights and gradients on the GPU (4 B/param in bf16, 8 in fp32); cpu "
                        "keeps the fp32 shards "
                        "and their gradients in host memory (8 B/param, 6 with --grad-dtype bf16), "
                        "nvme in files under --nvme; the GPU then holds the gathered units and "
                        "--device-params shards")
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="with --offload-params: the gradient shards' dtype "
                        "(tierlift.zero.MixedPrecision(grad_dtype=...); bf16 halves them)")
    p.add_argument("--device-params", default="auto",
                   help="with --offload-params: parameters whose shards stay on the GPU "
                        "(shard(device_params=N)); auto: as many as its room holds")
    p.add_argument("--device-fraction", type=float, default=0.0,
                   help="AdamW(device_fraction=F): the share of the parameters whose optimizer "
                        "state stays on the GPU (12 B/param with fp32 state), counted there")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="with the state in host memory: plan AdamW(offload='cpu', overlap=True), "
                        "stepping chunks during backward (two generations, or one and the "
                        "spare chunks the budget holds: the plan sizes cpu_budget), or "
                        "--no-overlap (12 B/param in place, stepped in step(), and the staging "
                        "of device gradients and weights); default: "
                        "overlap, except with --offload-params")
    p.add_argument("--probe-mib", type=int, default=256, help="size of the bandwidth probes")
    n = p.add_argument_group("several nodes (ZeRO-3, flat or hierarchy='node')")
    n.add_argument("--nodes", type=int, default=None, help="number of nodes")
    n.add_argument("--gpus-per-node", type=int, default=None, help="ranks on each node")
    n.add_argument("--inter-node-gbps", type=float, default=None,
                   help="link bandwidth per node to the others, Gb/s each way (e.g. 400)")
    n.add_argument("--micro-batches", type=int, default=1,
                   help="forward/backward passes per optimizer step (gradient accumulation); "
                        "the gradient is reduced once, after the last (the others under "
                        "model.no_sync())")
    n.add_argument("--reduce-every-micro-batch", action="store_true",
                   help="with --micro-batches: every backward reduces its gradient (no "
                        "model.no_sync()), micro-batches times the gradient bytes")
    a = p.add_argument_group("saved activations (tierlift.activations.Policy per block)")
    a.add_argument("--act-blocks", type=int, default=None, help="number of blocks")
    a.add_argument("--act-block-bytes", default=None, help="bytes one block saves, e.g. 2G")
    a.add_argument("--act-block-forward-ms", type=float, default=None,
                   help="one block's forward time (NVMe or recompute: whichever costs less)")
    a.add_argument("--act-cpu-budget", default="0", help="host memory for activations")
    a.add_argument("--act-gpu-budget", default="0", help="GPU memory for kept activations")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw bytes per tier against capacity as a PNG (needs "
                        "matplotlib; missing parent directories are created)")


def activation_policy(args: argparse.Namespace, bw) -> Policy:
    """Each block's activation tier from the sizes given and the disk bandwidth measured."""
    disk = None
    if bw.disk_read_bps and bw.disk_write_bps:
        disk = 1 / (1 / bw.disk_read_bps + 1 / bw.disk_write_bps) * 2  # out and back
    fwd = args.act_block_forward_ms
    return Policy.plan(n_blocks=args.act_blocks,
                       block_bytes=parse_bytes(args.act_block_bytes, "--act-block-bytes"),
                       cpu_budget=_size_or_zero(args.act_cpu_budget, "--act-cpu-budget"),
                       gpu_budget=_size_or_zero(args.act_gpu_budget, "--act-gpu-budget"),
                       nvme=args.nvme is not None, nvme_bytes_per_s=disk,
                       block_compute_s=None if fwd is None else fwd / 1e3)


def _check_activations(args: argparse.Namespace, gpu_mem: int, cpu_mem: int) -> None:
    """The activation arguments, before anything is measured."""
    if (args.act_blocks is None) != (args.act_block_bytes is None):
        raise ValueError("--act-blocks and --act-block-bytes go together")
    if args.act_blocks is None:
        return
    if not 1 <= args.act_blocks <= MAX_ACT_BLOCKS:
        raise ValueError(f"--act-blocks must be in [1, {MAX_ACT_BLOCKS}] (a model's blocks, "
                         f"e.g. its transformer layers), got {args.act_blocks}")
    fwd = args.act_block_forward_ms
    if fwd is not None and not (math.isfinite(fwd) and fwd >= 0):
        raise ValueError(f"--act-block-forward-ms (one block's forward time) must be a finite "
                         f"number >= 0, got {fwd}")
    parse_bytes(args.act_block_bytes, "--act-block-bytes")
    for flag, text, mem_flag, mem in (("--act-cpu-budget", args.act_cpu_budget, "--cpu-mem",
                                       cpu_mem),
                                      ("--act-gpu-budget", args.act_gpu_budget, "--gpu-mem",
                                       gpu_mem)):
        if _size_or_zero(text, flag) > mem:
            raise ValueError(f"{flag} {text} is more than {mem_flag} {_arg(args, mem_flag)}, "
                             "the memory it is a part of")


def _arg(args: argparse.Namespace, flag: str) -> str:
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


def _check_probe(args: argparse.Namespace, probe: int) -> None:
    """The bandwidth probes fit this machine: refused before any is allocated or written."""
    host = host_memory_available()
    if host is not None and 2 * probe > host:
        raise ValueError(f"--probe-mib {args.probe_mib}: the bandwidth probes take two buffers "
                         f"of that size ({2 * probe} bytes) and this machine has {host} bytes of "
                         "host memory available; give a smaller --probe-mib")
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
        if probe > free:
            raise ValueError(f"--probe-mib {args.probe_mib}: the PCIe probe takes {probe} bytes "
                             f"of GPU memory and {free} are free; give a smaller --probe-mib")


def _check_plot(path: str) -> None:
    """--plot names a file that can be written: no directory there, none of its parents a
    file (checked before measuring); matplotlib present."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--plot {path!r} is a directory; give a file name like plan.png")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--plot {path!r}: {str(parent)!r} is a file, not a directory")
    try:
        pyplot()
    except ImportError as err:
        raise ValueError(f"--plot needs matplotlib ({err})") from None


def _nvme_free(args: argparse.Namespace) -> int | None:
    if args.nvme_free is not None:
        if args.nvme is None:
            raise ValueError("--nvme-free needs --nvme (the directory whose bandwidth is measured)")
        return parse_bytes(args.nvme_free, "--nvme-free", capacity=True)
    return None if args.nvme is None else shutil.disk_usage(args.nvme).free


def _device_params(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(float(text))
    except (ValueError, OverflowError):  # inf overflows int()
        raise ValueError(f"--device-params must be auto or a count like 4e9, got "
                         f"{text!r}") from None


def _host_json(host) -> dict | None:
    """The overlapped host tier: its layout, and what the overlap can step during backward."""
    if host is None:
        return None
    return {**dataclasses.asdict(host), "generations": host.generations,
            "state_bytes": host.state_bytes, "fraction": host.fraction}


def _size_or_zero(text: str, what: str) -> int:
    return 0 if text.strip() == "0" else parse_bytes(text, what, capacity=True)


def run(args: argparse.Namespace) -> int:
    try:
        params = 1.0 if args.max_params else float(args.params)
    except ValueError:
        raise ValueError(f"--params must be a number like 8e9, got {args.params!r}") from None
    if not (math.isfinite(params) and params > 0):  # before the bandwidths are measured
        raise ValueError(f"--params must be a finite number > 0 like 8e9, got {args.params!r}")
    if params > MAX_PARAMS:
        raise ValueError(f"--params must be at most 2**53 ({MAX_PARAMS:.4g}), the most the "
                         f"planner counts exactly, got {args.params!r}")
    if args.nvme is not None and not os.path.isdir(args.nvme):
        raise ValueError(f"--nvme {args.nvme!r} is not an existing directory")
    if args.probe_mib <= 0:
        raise ValueError(f"--probe-mib must be > 0, got {args.probe_mib}")
    probe = args.probe_mib << 20
    _check_probe(args, probe)
    if args.plot:
        _check_plot(args.plot)
    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem", capacity=True)
    cpu_mem = parse_bytes(args.cpu_mem, "--cpu-mem", capacity=True)
    cpu_budget = None if args.cpu_budget is None else parse_bytes(
        args.cpu_budget, "--cpu-budget", capacity=True)
    if cpu_budget is not None and cpu_budget > cpu_mem:
        raise ValueError(f"--cpu-budget {args.cpu_budget} is more than --cpu-mem "
                         f"{args.cpu_mem}, the host memory it is a part of")
    given = [x is not None for x in (args.nodes, args.gpus_per_node, args.inter_node_gbps)]
    if any(given) and not all(given):
        raise ValueError("--nodes, --gpus-per-node and --inter-node-gbps go together")
    if all(given):
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {args.nodes} and "
                             f"{args.gpus_per_node}")
        if not (math.isfinite(args.inter_node_gbps) and args.inter_node_gbps > 0):
            raise ValueError(f"--inter-node-gbps must be a finite number > 0, got "
                             f"{args.inter_node_gbps}")
    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    _check_activations(args, gpu_mem, cpu_mem)
    act_cpu = _size_or_zero(args.act_cpu_budget, "--act-cpu-budget")
    if cpu_budget is not None and act_cpu and cpu_budget + act_cpu > cpu_mem:
        # Both live in the same host memory at once (state during the step, activations
        # between forward and backward).
        raise ValueError(f"--cpu-budget {args.cpu_budget} plus --act-cpu-budget "
                         f"{args.act_cpu_budget} is more than --cpu-mem {args.cpu_mem}, the host "
                         "memory both are a part of")
    inp = PlanInput(params=params, gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme=args.nvme,
                    cpu_budget=cpu_budget, nvme_free=_nvme_free(args),
                    # the activations' RAM tier is host memory the state cannot take
                    act_cpu_budget=act_cpu if args.act_blocks is not None else 0,
                    state_dtype=args.state_dtype, param_dtype=args.param_dtype,
                    offload_params=args.offload_params,
                    grad_dtype=args.grad_dtype, device_params=_device_params(args.device_params),
                    overlap=args.overlap, device_fraction=args.device_fraction)
    try:
        bw = measure(args.nvme, probe)
    except MemoryError as err:
        raise ValueError(f"--probe-mib {args.probe_mib}: {err}; give a smaller --probe-mib"
                         ) from None
    except OSError as err:  # the disk probe under --nvme
        if args.nvme is None:
            raise
        raise ValueError(f"--nvme {args.nvme!r}: {err.strerror or err}; free some space or "
                         "give a smaller --probe-mib") from None
    largest = None
    if args.max_params:
        largest, plan = max_params(inp, bw)
        inp = dataclasses.replace(inp, params=largest)
    else:
        plan = make_plan(inp, bw)
    policy = None if args.act_blocks is None else activation_policy(args, bw)
    comm = None if args.nodes is None else comm_plan(inp.params, args.nodes, args.gpus_per_node,
                                                     args.inter_node_gbps, args.micro_batches,
                                                     args.reduce_every_micro_batch,
                                                     inp.param_dtype)
    if args.json:
        print(json.dumps({"params": int(inp.params), "max_params": largest,
                          "offload": plan.offload, "nvme_generations": plan.generations,
                          "state_dtype": inp.state_dtype, "param_dtype": inp.param_dtype,
                          "offload_params": inp.offload_params,
                          "grad_dtype": inp.grad_dtype, "device_params": plan.device_params,
                          "tiers": plan.tiers, "legs_s": plan.legs_s,
                          "overlap": plan.overlap, "cpu_budget": plan.cpu_budget,
                          "host_tier": _host_json(plan.host),
                          "serial_s": plan.serial_s, "pipelined_s": plan.pipelined_s,
                          "overlap_fraction": plan.overlap_fraction,
                          "during_backward_s": plan.during_backward_s,
                          "after_backward_s": plan.after_backward_s,
                          "bandwidths": dataclasses.asdict(bw), "note": plan.note,
                          "activations": None if policy is None else list(policy.tiers),
                          "across_nodes": None if comm is None else
                          [dataclasses.asdict(r) for r in comm]},
                         indent=2))
    else:
        if largest is not None:
            print(f"largest model that fits: {largest / 1e9:.2f}B parameters "
                  f"({largest} with the plan below)\n")
        print(render(plan, bw))
        if policy is not None:
            counts = {t: policy.tiers.count(t) for t in dict.fromkeys(policy.tiers)}
            print("activations per block, first to last (tierlift.activations.Policy): "
                  + ", ".join(f"{t} x{n}" for t, n in counts.items()))
        if comm is not None:
            print(render_comm(comm, args.nodes, args.gpus_per_node, args.inter_node_gbps,
                              args.micro_batches, args.reduce_every_micro_batch,
                              inp.param_dtype))
    if args.plot:
        from tierlift.plan.plot import capacities, plot_plan

        try:
            print(f"wrote {plot_plan(plan, capacities(inp), args.plot)}")
        except OSError as err:
            raise ValueError(f"--plot {args.plot!r}: could not write it ({err})") from None
    return 0
