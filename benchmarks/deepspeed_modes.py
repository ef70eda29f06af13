"""DeepSpeed's two newer offload modes as contenders of the offload fine-tune (run by
offload_deepspeed.run_deepspeed; both ZeRO-3 with the optimizer state in pinned RAM):

deepspeed-super: SuperOffload (zero_optimization.offload_optimizer.super_offload true). DeepSpeed's
CPU Adam runs in a worker process of its own (torch.multiprocessing, spawn) and steps each
sub-group as soon as its gradients are complete during backward, speculatively: with
gradient_clipping set it does not (superoffload_stage3.partition_grads steps only `not
self.clip_grad`), and steps every sub-group after backward, clipped, in the worker. The worker
gets cpuadam_cores_perc of the cores (DeepSpeed sets both processes' affinity), at its default
0.8; the zero_optimization settings are those every SuperOffload example of DeepSpeed's runs with
(DeepSpeedExamples training/DeepSpeed-SuperOffload: sub_group_size 4e8, reduce_bucket_size 4e8,
overlap_comm false), since the overlap steps whole sub-groups and DeepSpeed's default
sub_group_size (1e9) makes one of 90% of a 1.1B model. DeepSpeed asserts a CUDA accelerator
(_validate_superoffload_accelerator): on CPU the contender is refused before it starts. With
--device-fraction it also keeps that share on the GPU (ratio, as below), as DeepSpeed's examples
pair it with ratio 0.9.

deepspeed-ratio: ZeRO-Offload++'s partial offload (offload_optimizer.ratio < 1), the peer of
tierlift's device_fraction. stage3.py (DeepSpeed 0.19.8, DeepSpeedZeroOptimizer_Stage3
._create_fp32_partitions) splits by sub-group, not by element:

    for i in range(sub_group_size):          # the number of sub-groups
        if i >= int((1 - self.partial_offload) * sub_group_size):
            self.subgroup_to_device[i] = 'cpu'
        else:
            self.subgroup_to_device[i] = get_accelerator()._name

so the first int((1 - ratio) x S) of its S sub-groups keep fp32 master, m, v and gradient on the
GPU and step there (torch.optim.AdamW, its backup_optimizer); the rest step in DeepSpeedCPUAdam.
Sub-groups take the parameters in order (_create_fp16_sub_groups: one closes at the first
parameter where it reaches sub_group_size), so the GPU part is, like tierlift's, the first
parameters. ratio_plan() maps tierlift's device_fraction onto that: tierlift keeps the first
whole parameters within device_fraction of the elements (tierlift.offload.device_part.choose,
called here on the same model); DeepSpeed's sub_group_size is kept (1e9, SuperOffload's 4e8)
where one of its sub-groups ends exactly there, else lowered until one does (at most to those
elements, whose first sub-group is then exactly tierlift's part), and ratio is 1 - that share
(or, where int() would round it to another count, the middle of the right interval). After
deepspeed.initialize the row reads DeepSpeed's own subgroup_to_device back and refuses a split
other than planned. On DeepSpeed's CPU accelerator get_accelerator()._name is 'cpu', so every
sub-group steps in DeepSpeedCPUAdam: the check runs the contender (sub-groups, the backup
optimizer, the config) but not the split itself, and its row says so.
"""

from __future__ import annotations

import math
import shutil

import torch

from finetune_sizing import config

DEFAULT_SUB_GROUP = 10**9  # DeepSpeed's zero_optimization.sub_group_size default
# DeepSpeedExamples training/DeepSpeed-SuperOffload (every script there)
SUPER_ZERO = {"sub_group_size": 4 * 10**8, "reduce_bucket_size": 4 * 10**8, "overlap_comm": False}
SUPER_CORES = 0.8  # offload_optimizer.cpuadam_cores_perc's default
CHECK_FRACTION = 0.3  # --deepspeed-check's stand-in device_fraction when none is given
SHM = "/dev/shm"


def refusal(which: str, args) -> str | None:
    """Why `which` cannot run in this run, said before its process starts; None if it can."""
    if which == "deepspeed-super" and not getattr(args, "gpu", False):
        return ("SuperOffload runs on CUDA GPUs only (DeepSpeed 0.19.8 asserts it: "
                "superoffload_stage3._validate_superoffload_accelerator); this run has no --gpu")
    return None


def check_accelerator(which: str) -> None:
    """The same refusal in the case's process, from DeepSpeed's own accelerator."""
    if which != "deepspeed-super":
        return
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cuda":
        raise SystemExit(f"deepspeed-super: SuperOffload runs on CUDA GPUs only (DeepSpeed asserts "
                         f"it); DeepSpeed's accelerator here is {name!r}")


def _params(name: str, seq_len: int) -> list[torch.nn.Parameter]:
    """The model's parameters in the order DeepSpeed and tierlift take them (built on the meta
    device: no memory, no time)."""
    from llama_model import Llama

    with torch.device("meta"):
        model = Llama(config(name, seq_len))
    return list(model.parameters())


def sub_groups(numels: list[int], size: int) -> list[int]:
    """The elements of each sub-group DeepSpeed 0.19.8 makes of one parameter group
    (stage3._create_fp16_sub_groups, SuperOffload's the same): all in one where size reaches
    the group, else parameters in order until a sub-group reaches size."""
    if size >= sum(numels):
        return [sum(numels)]
    out, local = [], 0
    for i, n in enumerate(numels):
        local += n
        if local >= size or i == len(numels) - 1:
            out.append(local)
            local = 0
    return out


def ratio_plan(name: str, seq_len: int, fraction: float, base: int) -> dict:
    """DeepSpeed's ratio and sub_group_size keeping on the GPU the elements tierlift's
    device_fraction keeps there (the module docstring)."""
    from tierlift.offload.device_part import choose

    params = _params(name, seq_len)
    numels = [p.numel() for p in params]
    kept_params = len(choose([{"params": params}], fraction)[0])  # a prefix: the first ones
    kept, total = sum(numels[:kept_params]), sum(numels)
    if kept == 0:
        raise SystemExit(f"deepspeed-ratio: device_fraction {fraction:g} keeps no whole parameter "
                         "(tierlift keeps none either): nothing to compare")
    sizes = [base] + [math.ceil(kept / m) for m in range(1, 65) if math.ceil(kept / m) <= base]
    for size in sorted(set(sizes), reverse=True) + [kept]:
        groups = sub_groups(numels, size)
        ends = [sum(groups[:i + 1]) for i in range(len(groups))]
        if kept in ends:
            k, count = ends.index(kept) + 1, len(groups)
            break
    ratio = round(1 - kept / total, 6)
    if int((1 - ratio) * count) != k:  # stage3's own expression, the same floats
        ratio = 1 - (k + 0.5) / count
    assert int((1 - ratio) * count) == k and 0 <= ratio <= 1
    return {"device_fraction": fraction, "ratio": ratio, "sub_group_size": size,
            "sub_groups": count, "device_sub_groups": k, "device_elems": kept,
            "device_params": kept_params, "params": total}


def mode_plan(which: str, args, model: str | None = None) -> dict | None:
    """The offload mode's settings for `which` (None for the plain contenders): config keys
    for offload_optimizer and zero_optimization, and the ratio's plan where there is one.
    model None: --deepspeed-check's (--model or 1b; ratio's --device-fraction or 0.3)."""
    from offload_deepspeed import DEEPSPEED

    mode = DEEPSPEED[which][2]
    if mode is None:
        return None
    fraction = getattr(args, "device_fraction", 0.0) or 0.0
    if model is None:  # the check: super as the plain RAM row runs it, ratio with a fraction
        model = getattr(args, "model", None) or "1b"
        fraction = fraction or (CHECK_FRACTION if mode == "ratio" else 0.0)
    seq_len = getattr(args, "seq_len", 2048)
    if mode == "ratio" and not fraction:
        raise SystemExit("deepspeed-ratio: needs --device-fraction (or --device-fraction-from): "
                         "its ratio keeps on the GPU the share tierlift's split row keeps")
    zero = dict(SUPER_ZERO) if mode == "super" else {}
    offload = {"super_offload": True, "cpuadam_cores_perc": SUPER_CORES} if mode == "super" else {}
    plan = None
    if fraction:
        plan = ratio_plan(model, seq_len, fraction, zero.get("sub_group_size", DEFAULT_SUB_GROUP))
        zero["sub_group_size"] = plan["sub_group_size"]
        offload["ratio"] = plan["ratio"]
    return {"mode": mode, "offload": offload, "zero": zero, "ratio_plan": plan}


def check_shm(plan: dict, params: int) -> None:
    """SuperOffload hands each CPU sub-group's fp32 master and gradient to its worker through
    torch.multiprocessing, which moves them into shared memory (/dev/shm) in place the first
    time: 8 B/param of the CPU part. A /dev/shm too small for that is a SIGBUS mid-step; it is
    refused here instead."""
    rp = plan.get("ratio_plan")
    cpu = params - (rp["device_elems"] if rp else 0)
    need, free = 8 * cpu, shutil.disk_usage(SHM).free
    if need > free:
        raise SystemExit(f"deepspeed-super: its worker shares {need / 2**30:.1f} GiB (fp32 master "
                         f"and gradient of {cpu} parameters) through {SHM}, which has "
                         f"{free / 2**30:.1f} GiB free")


def check_split(engine, plan: dict) -> dict:
    """DeepSpeed's own sub-groups and their devices, read back: on a GPU the split must be the
    planned one (the share tierlift keeps); on DeepSpeed's CPU accelerator every sub-group is
    'cpu' (the module docstring). Returns what the row reports."""
    rp = plan["ratio_plan"]
    opt = engine.optimizer
    sizes = [t.numel() for t in opt.fp32_partitioned_groups_flat]
    devices = [opt.subgroup_to_device[i] for i in range(len(sizes))]
    on_device = sum(n for n, d in zip(sizes, devices) if d != "cpu")
    first = sum(sizes[:rp["device_sub_groups"]])
    got = {"sub_groups": len(sizes), "device_elems": on_device,
           "first_sub_groups_elems": first, "devices": sorted(set(devices))}
    if len(sizes) != rp["sub_groups"] or first != rp["device_elems"]:
        raise SystemExit(f"deepspeed-ratio: DeepSpeed made {len(sizes)} sub-groups, the first "
                         f"{rp['device_sub_groups']} of {first} elements; planned "
                         f"{rp['sub_groups']} and {rp['device_elems']}")
    if "cpu" not in devices or (engine.device.type != "cpu" and on_device != rp["device_elems"]):
        raise SystemExit(f"deepspeed-ratio: DeepSpeed keeps {on_device} elements' state on "
                         f"{devices}, planned {rp['device_elems']} on the GPU")
    return got


def watch_super(engine, seen: list) -> None:
    """The fp32 gradient partitions SuperOffload hands its worker for an Adam step (not a
    rollback), kept by reference as they are queued: the worker copies them from the same
    shared memory (during backward, or after clipping when gradient_clipping is set), and
    nothing writes them after, so their norm after the last step is that of the gradients it
    stepped with; the worker's own copy is not observed."""
    worker = engine.optimizer.superoffload_cpu_optimizer
    queue = worker.async_step

    def watched(param_group_id, sub_group_id, fp32_param, fp32_grad, rollback=False, lr=None):
        if not rollback:
            seen.append(fp32_grad)
        return queue(param_group_id, sub_group_id, fp32_param, fp32_grad, rollback=rollback,
                     lr=lr)

    worker.async_step = watched


def close_super(engine) -> None:
    """Ends SuperOffload's worker: the case ends with os._exit, which runs no atexit, and the
    worker (which holds the write end of its own task queue) would stay behind, idle on it."""
    worker = getattr(getattr(engine, "optimizer", None), "superoffload_cpu_optimizer", None)
    if worker is not None:
        worker.close()


def case_name(plan: dict) -> str:
    """The row's case: what was configured beyond plain ZeRO-3 offload_optimizer=cpu."""
    rp = plan["ratio_plan"]
    parts = []
    if plan["mode"] == "super":
        parts.append(f"super_offload cpuadam_cores_perc={SUPER_CORES:g}")
    if rp:
        parts.append(f"ratio={rp['ratio']:.4g} (device_fraction {rp['device_fraction']:g})")
    return " ".join(parts)


def mode_note(res: dict) -> str:
    """What the mode configured and what DeepSpeed made of it, for the row's printed note."""
    plan, split = res["offload_mode"], res.get("split")
    rp = plan["ratio_plan"]
    parts = ["offload_optimizer " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else
                                              f"{k} {v}" for k, v in plan["offload"].items()),
             "zero_optimization " + ", ".join(f"{k} {v}" for k, v in plan["zero"].items())]
    if rp:
        parts.append(
            f"tierlift's device_fraction {rp['device_fraction']:g} keeps the first "
            f"{rp['device_params']} parameters ({rp['device_elems']} elements, "
            f"{rp['device_elems'] / rp['params']:.1%}); DeepSpeed's ratio {rp['ratio']:.4g} keeps "
            f"the first {rp['device_sub_groups']} of its {rp['sub_groups']} sub-groups "
            f"(sub_group_size {rp['sub_group_size']}), the same elements")
    if split:
        parts.append(f"DeepSpeed's sub-groups read back: {split['sub_groups']}, "
                     f"{split['device_elems']} elements' state off the CPU"
                     + (" (DeepSpeed's CPU accelerator: every sub-group is 'cpu', the split is "
                        "not exercised here)" if split["devices"] == ["cpu"] else ""))
    if res.get("stepped_grad_norm_source"):
        parts.append(res["stepped_grad_norm_source"])
    return f"{res['case']}: " + "; ".join(parts)
