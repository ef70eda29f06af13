"""DeepSpeed's contenders of the offload fine-tune (offload_finetune.py): ZeRO-3 and ZeRO-2 with
the optimizer state in pinned RAM (offload_optimizer cpu), and ZeRO-Infinity's optimizer side,
ZeRO-3 with the state on NVMe (deepspeed-nvme); params on the GPU for all of them. DeepSpeed's two
newer offload modes, SuperOffload (deepspeed-super) and ZeRO-Offload++'s partial offload
(deepspeed-ratio), are set up in deepspeed_modes.py and run here.

deepspeed-nvme: fp32 master, m and v live in swap files under --dir, and so do the fp32 gradient
partitions of at least 1 MiB (DeepSpeed's least swap size; smaller ones stay in RAM). Each step
DeepSpeed writes the gradients out during backward, then per sub-group reads state + gradient into
its pinned swap buffers, runs its CPU Adam and writes the state back: 16 B/param read and written
per step, 16 B/param on the disk, buffer_count x the largest sub-group x 4 B pinned (deepspeed_nvme
_needs). DeepSpeed counts none of those bytes, so the case counts them at its aio handle (every
read and write its optimizer swapper submits): the row's nvme_read_bytes / nvme_write_bytes, the
keys tierlift's NVMe row has, so both are set against the same disk roofline.

The settings are DeepSpeed's documented ones (deepspeed.ai/docs/config-json: offload_optimizer
buffer_count 4, "at least the number of states maintained per parameter": Adam's param, gradient,
m, v; fast_init false, which only acts with the params on NVMe; sub_group_size 1e9; the aio
section's block_size 1 MiB, queue_depth 8, single_submit false, overlap_events true and one thread
per request). DeepSpeed 0.19.8 reads that thread count as `intra_op_parallelism`: the `thread_count`
of the page would be ignored without a word, as would any key its aio section does not know, so
check_deepspeed_config refuses unknown aio keys and reads every setting back.

--deepspeed-check builds the async_io op (libaio, JIT) after the CPU Adam, each timed, and moves
a few MiB through it under --dir; with --aio-ok PATH it writes PATH once that worked, which is
what scripts/gpu_check.sh gates the deepspeed-nvme contender on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import deepspeed_modes as modes
from finetune_sizing import FIT, GiB, config
from tierlift._peak_rss import peak_with_children

# contender: (ZeRO stage, where its optimizer state lives, offload mode: deepspeed_modes.py)
DEEPSPEED = {"deepspeed": (3, "cpu", None), "deepspeed-zero2": (2, "cpu", None),
             "deepspeed-nvme": (3, "nvme", None), "deepspeed-super": (3, "cpu", "super"),
             "deepspeed-ratio": (3, "cpu", "ratio")}

# DeepSpeed's documented ZeRO-Infinity settings (the module docstring)
NVME_BUFFER_COUNT = 4
NVME_SUB_GROUP = 10**9
AIO = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
       "single_submit": False, "overlap_events": True}
# The --finetune-check's tiny model holds 0.5 MB of fp32 state, below DeepSpeed's 1 MiB least swap
# size (it would keep all of it in RAM and the check would swap nothing): lowered there only.
CHECK_MIN_SWAP_BYTES = 4096


def deepspeed_nvme_needs(name: str, seq_len: int) -> dict:
    """deepspeed-nvme's bytes for model `name`: on the disk, fp32 master, m, v and gradient
    (16 B/param; the gradient pieces under 1 MiB stay in RAM, so this is an upper bound); pinned,
    buffer_count swap buffers of the largest sub-group. A sub-group takes parameters in order
    until it reaches sub_group_size, so it holds at most that plus the largest parameter."""
    cfg = config(name, seq_len)
    n = cfg.num_params()
    largest = max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_dim)
    return {"deepspeed_nvme_disk_bytes": 16 * n,
            "deepspeed_nvme_pinned_bytes": 4 * NVME_BUFFER_COUNT * min(n, NVME_SUB_GROUP + largest)}


def check_nvme_fits(args, info: dict) -> dict:
    """deepspeed-nvme's disk and pinned bytes against --disk and --cpu-mem (each x FIT), before
    any case runs: a swap file that fills the disk half-way through the steps is refused here.
    The contenders run one after the other, each one's files deleted before the next starts, so
    each needs the disk alone."""
    need = deepspeed_nvme_needs(info["model"], args.seq_len)
    disk, ram = args.disk * GiB * FIT, args.cpu_mem * GiB * FIT
    if need["deepspeed_nvme_disk_bytes"] > disk:
        raise SystemExit(
            f"deepspeed-nvme: {need['deepspeed_nvme_disk_bytes'] / GiB:.1f} GiB of swap files "
            f"(16 B/param) do not fit {disk / GiB:.1f} GiB of --dir (--disk x {FIT})")
    if need["deepspeed_nvme_pinned_bytes"] > ram:
        raise SystemExit(
            f"deepspeed-nvme: {need['deepspeed_nvme_pinned_bytes'] / GiB:.1f} GiB of pinned swap "
            f"buffers do not fit {ram / GiB:.1f} GiB of RAM (--cpu-mem x {FIT})")
    return need


def deepspeed_config(args, device, stage: int = 3, nvme_path: str | None = None,
                     mode: dict | None = None) -> dict:
    """The config run_deepspeed gives DeepSpeed; `mode` (deepspeed_modes.mode_plan) adds the
    offload mode's offload_optimizer and zero_optimization keys."""
    pin = device.type == "cuda"
    offload = {"device": "cpu", "pin_memory": pin, **(mode["offload"] if mode else {})}
    if nvme_path is not None:
        offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin,
                   "buffer_count": NVME_BUFFER_COUNT, "fast_init": False}
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(getattr(args, "max_grad_norm", 1.0)),  # 0.0: none
        "bf16": {"enabled": device.type == "cuda"},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": offload,
            "offload_param": {"device": "none"},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-5, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "wall_clock_breakdown": False,
    }
    if nvme_path is not None:
        cfg["zero_optimization"]["sub_group_size"] = NVME_SUB_GROUP
        cfg["aio"] = dict(AIO)
    if mode:
        cfg["zero_optimization"].update(mode["zero"])
    return cfg


class CountingHandle:
    """DeepSpeed's aio handle, counting the bytes of each read and write asked of it (the
    tensor's, as DeepSpeed sizes it: aligned up to its I/O alignment). Everything else passes
    through to the handle."""

    READS = ("async_pread", "sync_pread", "pread", "read")
    WRITES = ("async_pwrite", "sync_pwrite", "pwrite", "write")

    def __init__(self, handle):
        self._handle = handle
        self.read_bytes = self.write_bytes = 0

    def __getattr__(self, name):
        attr = getattr(self._handle, name)
        if name not in self.READS + self.WRITES:
            return attr
        counter = "read_bytes" if name in self.READS else "write_bytes"

        def counted(buffer, *a, **kw):
            setattr(self, counter, getattr(self, counter) + buffer.numel() * buffer.element_size())
            return attr(buffer, *a, **kw)

        return counted


def _count_swapper_io(engine) -> CountingHandle:
    """Puts a CountingHandle where ZeRO-3's optimizer swapper and its gradient swapper read
    their aio handle (at each call). Refuses an engine that swaps nothing: its row would not be
    an NVMe step."""
    swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    if swapper is None:
        raise SystemExit("deepspeed-nvme: DeepSpeed built no optimizer swapper (nothing on NVMe)")
    handle = CountingHandle(swapper.aio_handle)
    swapper.aio_handle = handle
    swapper.gradient_swapper.aio_handle = handle
    return handle


def _lower_min_swap_bytes() -> None:
    """For the check's tiny model only (CHECK_MIN_SWAP_BYTES): ZeRO-3 builds its swapper and then
    asks it which sub-groups are big enough to swap, so the floor is lowered on the instance."""
    import deepspeed.runtime.zero.stage3 as stage3

    base = stage3.PartitionedOptimizerSwapper

    class CheckSwapper(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.min_aio_bytes = CHECK_MIN_SWAP_BYTES

    stage3.PartitionedOptimizerSwapper = CheckSwapper


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_deepspeed(args, info: dict, device, which: str = "deepspeed") -> dict:
    """DeepSpeed with its CPU Adam: ZeRO-3 as the peer the comparison names, ZeRO-2 (ZeRO-Offload's
    own recipe, which on one GPU skips ZeRO-3's parameter gathering), each with the state in
    pinned RAM, or ZeRO-3 with the state on NVMe (deepspeed-nvme, the module docstring)."""
    import deepspeed

    from offload_finetune import _time_steps, build_model

    stage, tier, _ = DEEPSPEED[which]
    modes.check_accelerator(which)
    mode = modes.mode_plan(which, args, info["model"])
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    check_deepspeed_config(args, stage, tier == "nvme", mode)  # before any work
    if mode and mode["mode"] == "super":
        modes.check_shm(mode, config(info["model"], args.seq_len).num_params())
    nvme = tempfile.mkdtemp(prefix="deepspeed-nvme-", dir=args.dir) if tier == "nvme" else None
    engine = None
    try:
        check = tier == "nvme" and info["model"] == "tiny"
        if check:
            _lower_min_swap_bytes()
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        model = build_model(info["model"], args.seq_len, device)
        n = sum(p.numel() for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=deepspeed_config(args, device, stage, nvme, mode))
        io = _count_swapper_io(engine) if nvme is not None else None
        split = modes.check_split(engine, mode) if mode and mode["ratio_plan"] else None
        gen = torch.Generator().manual_seed(0)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the one ZeRO wraps
        stepped: list[torch.Tensor] = []
        # the CPU Adam's, and ratio's GPU part's (torch AdamW, DeepSpeed's backup_optimizer)
        for opt in (inner, getattr(engine.optimizer, "backup_optimizer", None)):
            if opt is not None:
                _watch_stepped_grads(opt, stepped)
        if mode and mode["mode"] == "super":  # its CPU Adam steps in its worker process
            modes.watch_super(engine, stepped)
        io_steps: list[tuple[int, int]] = []  # (read, written) per step, warmup first

        def step():
            stepped.clear()  # only the last step's gradients are read (after the timed steps)
            if io is not None:
                io.read_bytes = io.write_bytes = 0
            x = torch.randint(model.cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                              generator=gen).to(device)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            if io is not None:
                io_steps.append((io.read_bytes, io.write_bytes))

        t = _time_steps(step, args.steps, args.warmup, device)
        norm = engine.get_global_grad_norm()  # DeepSpeed's, before clipping; None unclipped
        case = f"deepspeed zero{stage} offload_optimizer={tier}"
        if mode:
            case += " " + modes.case_name(mode)
        out = {"case": case + (" (check: least swap size lowered)" if check else ""),
               "params": n, "step_s": t,
               "optimizer": f"{type(engine.optimizer).__name__}({type(inner).__name__})",
               "deepspeed": deepspeed.__version__,
               **({} if norm is None else {"grad_norm": float(norm)}),
               # the norm of the gradients the CPU Adam stepped with in the last step: at most
               # --max-grad-norm when DeepSpeed clipped, its grad_norm when it did not
               "stepped_grad_norm": _norm(stepped),
               "gradient_clipping": float(engine.gradient_clipping())}
        if mode:
            out.update(offload_mode=mode, split=split)
            if mode["mode"] == "super":
                out["stepped_grad_norm_source"] = (
                    "stepped_grad_norm: the fp32 gradient partitions handed to SuperOffload's "
                    "worker process (read here, in the shared memory it copies them from)")
        if io is not None:
            swapper = engine.optimizer.optimizer_swapper
            locked = sum(b.numel() * b.element_size()
                         for b in swapper.swap_buffer_manager.all_buffers)
            rd, wr = io_steps[-1]
            if rd <= 0 or wr <= 0:
                raise SystemExit(f"deepspeed-nvme: its last step read {rd} and wrote {wr} bytes "
                                 "through the aio handle: not an NVMe step")
            out.update(
                # the last step's, as tierlift's last_step_stats (the roofline reads these keys)
                stats={"nvme_read_bytes": float(rd), "nvme_write_bytes": float(wr)},
                nvme_io_steps=io_steps, nvme_disk_bytes=_dir_bytes(nvme), swap_buffer_bytes=locked,
                # mlock'ed by DeepSpeed outside torch's allocator: run_case adds these to the
                # torch-pinned peak for the row's pinned GB, as it adds tierlift's registered ones
                registered_pinned_bytes=locked,
                aio={k: getattr(io, f"get_{k}")() for k in AIO})
        # read while SuperOffload's worker process lives: close_super (below) ends it, and
        # run_case's own reading, after this returns, would count none of its memory
        out["peak_host_bytes"] = peak_with_children()
        return out
    finally:
        modes.close_super(engine)
        if nvme is not None:
            shutil.rmtree(nvme, ignore_errors=True)


def deepspeed_nvme_note(res: dict) -> str:
    """deepspeed-nvme's last step: its bytes through the aio handle, its files and buffers, and
    the step against the disk's roofline for those bytes where --disk-json gave one."""
    st, roof = res["stats"], res.get("nvme_roofline")
    note = (f"{res['case']}: last step read {st['nvme_read_bytes'] / 1e9:.4g} GB and wrote "
            f"{st['nvme_write_bytes'] / 1e9:.4g} GB through DeepSpeed's aio handle (counted "
            f"there; DeepSpeed reports none), {res['nvme_disk_bytes'] / 1e9:.4g} GB of swap files, "
            f"{res['swap_buffer_bytes'] / 1e9:.4g} GB of pinned swap buffers, aio "
            + ", ".join(f"{k} {v}" for k, v in res["aio"].items()))
    if roof:
        note += (f"; roofline {roof['roofline_s']:.4g} s, step {roof['step_s']:.4g} s = "
                 f"{roof['ratio']:.2f}x")
    return note


def _watch_stepped_grads(opt: torch.optim.Optimizer, seen: list) -> list[torch.Tensor]:
    """The gradients opt.step() is called with, as it is called (ZeRO clips its flat fp32
    gradient partitions in place just before), added to `seen`: kept by reference, without a
    copy or a norm, so the timed step does no extra work; read after the last step, which
    leaves them in place."""
    step = opt.step

    def watched(*a, **kw):
        seen.extend(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
        return step(*a, **kw)

    opt.step = watched
    return seen


def _norm(grads: list[torch.Tensor]) -> float | None:
    if not grads:
        return None
    # the CPU Adam's on the host, ratio's GPU part's on the device
    return float(torch.stack([g.detach().float().norm().cpu() for g in grads]).norm())


def check_deepspeed_config(args, stage: int = 3, nvme: bool = False,
                           mode: dict | None = None) -> dict:
    """The ZeRO config (stage 3 or 2, state in RAM or on NVMe, with an offload mode's keys:
    deepspeed_modes.mode_plan) run_deepspeed gives DeepSpeed, parsed by DeepSpeed's own config
    class, and each setting read back (those of the mode too, and for every contender that
    super_offload is off and ratio 1 unless the mode sets them). Its sections
    (zero_optimization, bf16) refuse unknown keys, but a misspelt top-level key is silently
    ignored (and may even match the default, as gradient_clipping's 1.0 does), so every top-level
    key must be one DeepSpeed names in its constants; so must each key of the aio section, which
    DeepSpeed reads key by key and ignores the rest. The GPU's config (bf16, pinned) is checked;
    parsing needs no GPU."""
    import deepspeed.runtime.constants as ds_constants
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
    from deepspeed.runtime.swap_tensor.constants import AIO as AIO_KEY
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    path = "/deepspeed-nvme-check" if nvme else None  # parsed, never created
    # positional, and the mode only where there is one (a test wraps this function)
    want = deepspeed_config(args, torch.device("cuda"), stage, path, *([mode] if mode else []))
    known = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)}
    unknown = sorted(set(want) - known - {ZERO_OPTIMIZATION, AIO_KEY})
    unknown += sorted(f"aio.{k}" for k in set(want.get("aio", {})) - set(AIO_DEFAULT_DICT))
    if unknown:
        raise SystemExit(f"DeepSpeed knows no config key {unknown} (it would ignore it)")
    cfg = DeepSpeedConfig(json.loads(json.dumps(want)))
    zero, opt, off = cfg.zero_config, want["optimizer"], cfg.zero_config.offload_optimizer
    got = {
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "bf16": cfg.bfloat16_config.enabled if hasattr(cfg, "bfloat16_config")
        else cfg.bfloat16_enabled,
        "zero stage": zero.stage,
        "offload_optimizer": off.device if off else None,
        "offload_optimizer pin_memory": off.pin_memory if off else None,
        "offload_param": zero.offload_param.device if zero.offload_param else None,
        "optimizer": cfg.optimizer_name,
        "optimizer params": cfg.optimizer_params,
        "super_offload": off.super_offload if off else None,
        "ratio": off.ratio if off else None,
    }
    expect = {
        "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
        "gradient_clipping": float(getattr(args, "max_grad_norm", 1.0)), "bf16": True,
        "zero stage": stage,
        "offload_optimizer": OffloadDeviceEnum.nvme if nvme else OffloadDeviceEnum.cpu,
        "offload_optimizer pin_memory": True,
        "offload_param": None, "optimizer": opt["type"].lower(), "optimizer params": opt["params"],
        "super_offload": False, "ratio": 1.0,
    }
    if mode:  # every key the mode sets, where DeepSpeed put it
        got.update({k: getattr(off, k) for k in mode["offload"]})
        got.update({f"zero {k}": getattr(zero, k) for k in mode["zero"]})
        expect.update(mode["offload"])
        expect.update({f"zero {k}": v for k, v in mode["zero"].items()})
    if nvme:
        got.update({"nvme_path": str(off.nvme_path), "buffer_count": off.buffer_count,
                    "fast_init": off.fast_init, "pipeline": off.pipeline_read or off.pipeline_write,
                    "sub_group_size": zero.sub_group_size,
                    **{f"aio {k}": v for k, v in cfg.aio_config.items()}})
        expect.update({"nvme_path": path, "buffer_count": NVME_BUFFER_COUNT, "fast_init": False,
                       "pipeline": False, "sub_group_size": NVME_SUB_GROUP,
                       **{f"aio {k}": v for k, v in {**AIO_DEFAULT_DICT, **AIO}.items()}})
    if expect["offload_param"] is None and got["offload_param"] == OffloadDeviceEnum.none:
        got["offload_param"] = None
    wrong = {k: (got.get(k), v) for k, v in expect.items() if got.get(k) != v}
    if wrong:
        raise SystemExit(f"DeepSpeed reads the config otherwise than meant (got, meant): {wrong}")
    return got


def aio_round_trip(folder: str, mib: int = 8) -> float:
    """Writes and reads back `mib` MiB through DeepSpeed's aio handle (the contender's settings,
    O_DIRECT) in `folder` and compares; returns the seconds it took. Raises if a byte differs."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load(verbose=False)
    handle = aio.aio_handle(**AIO)
    n = mib << 20
    src = handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    dst = handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    fd, path = tempfile.mkstemp(prefix="deepspeed-aio-", dir=folder)
    os.close(fd)
    try:
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        dst.zero_()
        t0 = time.perf_counter()
        wrote, read = handle.sync_pwrite(src, path), handle.sync_pread(dst, path)
        took = time.perf_counter() - t0
        if wrote < 1 or read < 1 or not torch.equal(src, dst):
            raise RuntimeError(f"async_io round trip in {folder}: write returned {wrote}, read "
                               f"{read}, bytes equal: {torch.equal(src, dst)}")
        return took
    finally:
        handle.free_cpu_locked_tensor(src)
        handle.free_cpu_locked_tensor(dst)
        os.unlink(path)


# The async_io op built in a process of its own, beside the CPU Adam's (each a chain of a few
# translation units: in parallel the check takes the longer chain, not the sum); it prints
# whether libaio was found and how long the build took.
AIO_BUILD = """
import sys, time
from deepspeed.ops.op_builder import AsyncIOBuilder
t0 = time.perf_counter()
if not AsyncIOBuilder().is_compatible(verbose=True):
    sys.exit("libaio's header and library are not found (libaio-dev; CPATH / LIBRARY_PATH)")
AsyncIOBuilder().load(verbose=False)
print(f"{time.perf_counter() - t0:.1f}")
"""


def deepspeed_check(args) -> int:
    """--deepspeed-check: DeepSpeed imports, reads its five configs as meant, and its CPU Adam
    and async_io ops build (JIT, ninja and the host compiler; async_io needs libaio; both at
    once, each build's time printed); the async_io op then moves bytes under --dir. Needs no
    GPU: run before the timed cases so that they do not spend them building. The async_io op is
    deepspeed-nvme's alone: where it does not build (no libaio), or not within --aio-timeout,
    that is said, --aio-ok is not written, and the check still passes for the other DeepSpeed
    contenders."""
    t0 = time.perf_counter()
    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder

    print(f"deepspeed {deepspeed.__version__} imported in {time.perf_counter() - t0:.1f} s "
          f"(torch {torch.__version__}, accelerator "
          f"{deepspeed.accelerator.get_accelerator()._name})", flush=True)
    for stage, nvme in ((3, False), (2, False), (3, True)):
        check_deepspeed_config(args, stage, nvme)
        print(f"ZeRO-{stage}{' NVMe' if nvme else ''} config: every setting read back as meant",
              flush=True)
    for which in ("deepspeed-super", "deepspeed-ratio"):  # their model: --model or 1b
        mode = modes.mode_plan(which, args)
        got = check_deepspeed_config(args, 3, False, mode)
        print(f"ZeRO-3 {which} config: every setting read back as meant ("
              + ", ".join(f"{k} {got[k]}" for k in dict.fromkeys((*mode["offload"], "ratio")))
              + ", "
              + ", ".join(f"zero {k} {got['zero ' + k]}" for k in mode["zero"]) + ")", flush=True)
    aio_ok = getattr(args, "aio_ok", None)
    if aio_ok and os.path.exists(aio_ok):
        os.unlink(aio_ok)  # an earlier run's must not stand for this one
    limit = getattr(args, "aio_timeout", None)
    t_aio = time.perf_counter()
    # --aio-timeout 0: its build is left for later (gpu_check builds it just before the NVMe
    # row, not beside tierlift's own build, whose cores it would take)
    aio = None if limit == 0 else subprocess.Popen(
        [sys.executable, "-c", AIO_BUILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        t0 = time.perf_counter()
        CPUAdamBuilder().load()
        print(f"DeepSpeedCPUAdam op (cpu_adam) built or loaded in {time.perf_counter() - t0:.1f} "
              f"s (cache: {os.environ.get('TORCH_EXTENSIONS_DIR', 'the default')})", flush=True)
        if aio is None:
            print("DeepSpeed async_io op not built here (--aio-timeout 0)", flush=True)
            return 0
        left = None if limit is None else max(1.0, limit - (time.perf_counter() - t_aio))
        out, err = aio.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        aio.kill()
        aio.communicate()
        print(f"DeepSpeed async_io op NOT built within --aio-timeout {limit:g} s: deepspeed-nvme "
              "left out", flush=True)
        return 0
    finally:
        if aio is not None and aio.poll() is None:  # the CPU Adam failed: its error is the check's
            aio.kill()
            aio.communicate()
    if aio.returncode != 0:
        why = (err.strip().splitlines() or [f"exit {aio.returncode}"])[-1]
        print(f"DeepSpeed async_io op NOT built: {why}; deepspeed-nvme cannot run here",
              flush=True)
        return 0
    folder = args.dir or tempfile.gettempdir()
    try:
        took = aio_round_trip(folder)
    except Exception as e:  # the other contenders do not need it
        print(f"DeepSpeed async_io op built but not working in {folder}: {type(e).__name__}: "
              f"{e}", flush=True)
        return 0
    print(f"DeepSpeed async_io op built or loaded in {float(out.split()[-1]):.1f} s; 8 MiB "
          f"written and read back through it in {folder} in {took:.3f} s", flush=True)
    if aio_ok:
        with open(aio_ok, "w") as f:
            f.write(f"{deepspeed.__version__}\n")
    return 0
