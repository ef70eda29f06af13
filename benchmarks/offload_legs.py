"""bench_offload.py --legs: the ZeRO-3 offloaded step split into its legs on any machine (a CPU
too), with and without the overlap, so a change that serializes the pipeline shows in a table.

One process, a stack of blocks under tierlift.zero.shard(stage=3, offload_params="cpu") and
tierlift.optim.AdamW(offload="cpu"|"nvme", overlap=False|True, max_grad_norm=1e9). Every
configuration steps once per round (round robin: a loaded machine's drift hits them alike),
two warm-up rounds, then --repeats; medians. The legs are last_step_stats["legs"]
(tierlift/offload/legs.py); per leg, its time and the part of it the training thread waited for
("exp"):

  forward, backward   the host's time in them (a GPU's compute as the host sees it; here the
                      CPU's), less the copies made or waited for inside them
  H2D params          the parameter copies to the device (on a CPU, host copies in forward
                      and backward); on CUDA plus the device's copy time (events)
  D2H grads           the gradient copies to host memory, and the waits for them on any thread
  CPU Adam            the kernel, on whichever thread ran it, and again per thread
  device adam         the device part's own step (device_fraction; none here): its launch on
                      the host, plus on CUDA its kernels' time (events, read once done), which
                      runs after step() returns, before the next forward
  NVMe read, write    the engine's busy time (each request from its issue until first seen
                      done), its bytes; exposed: the waits for it on the training thread and
                      the worker's waits that step() waited for
  optimizer other     step()'s and the worker's other work (checks, fingerprints, masters,
                      publish) and step()'s waits for a worker between jobs

The exposed column adds up to the training thread's time from forward to the end of step(),
less the loss and zero_grad: the "wall" rows beside it. A leg on the overlap's worker is hidden
from that thread, not free: on two shared cores it slows forward and backward instead.

--legs-host-idle replaces each block's compute by a stand-in that sleeps (HOST_IDLE_S per block
in forward and backward) and fills the weight gradients: the host waits for the compute as it
waits for a GPU, so the overlap's worker has the cores to itself, as on a GPU machine, and its
legs show the optimizer's own work rather than its contention with the model's CPU compute. The
last lines give, per tier, the optimizer's CPU work (CPU Adam + optimizer other, every thread)
with the overlap over that without it.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import tierlift
from common import machine, print_table, write_json

CONFIGS = [("cpu", False), ("cpu", True), ("nvme", False), ("nvme", True)]
NAMES = [f"{t}{'+ovl' if o else ''}" for t, o in CONFIGS]
WALL = [("wall: forward", "fwd_s"), ("wall: backward", "bwd_s"), ("wall: step()", "step_s"),
        ("wall: iteration", "iter_s")]
LEG_LABELS = [  # (label, last_step_stats["legs"] key)
    ("forward (host waits for compute)", "forward"),
    ("backward (host waits for compute)", "backward"),
    ("H2D params", "h2d"), ("D2H grads", "d2h"), ("CPU Adam", "adam"),
    ("device adam", "device_adam"), ("NVMe read", "nvme_read"), ("NVMe write", "nvme_write"),
    ("optimizer other", "other"),
]

DEVICE_LEGS = ("forward", "backward", "h2d", "d2h", "device_adam")  # those with CUDA events


HOST_IDLE_S = (0.01, 0.03)  # --legs-host-idle: a block's forward and backward on the "device"


class DeviceStandIn(torch.autograd.Function):
    """A block's compute on a device the host waits for: sleeps, passes x through, and gives
    `y` (the block run on one row, which gathers the unit and gives each weight a gradient for
    about the price of writing it) a gradient."""

    @staticmethod
    def forward(ctx, x, y):
        time.sleep(HOST_IDLE_S[0])
        ctx.y_shape = y.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(HOST_IDLE_S[1])
        return grad, torch.full(ctx.y_shape, 1e-3 * (1.0 + float(grad.reshape(-1)[0])))


class Block(nn.Module):
    def __init__(self, dim: int, host_idle: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.host_idle = host_idle

    def forward(self, x):
        if self.host_idle:
            return DeviceStandIn.apply(x, self.down(F.gelu(self.up(x[:1]))))
        return x + self.down(F.gelu(self.up(x)))


def _build(tier: str, overlap: bool, dim: int, layers: int, chunk_bytes: int, directory: str,
           host_idle: bool = False):
    torch.manual_seed(0)
    blocks = (Block(dim, host_idle) for _ in range(layers))
    model = tierlift.zero.shard(nn.Sequential(*blocks), stage=3, offload_params="cpu")
    n = sum(p.numel() for p in model.parameters())
    kw = dict(offload=tier, overlap=overlap, max_grad_norm=1e9, chunk_bytes=chunk_bytes)
    if tier == "nvme":
        kw.update(nvme_path=directory, cpu_budget=12 * n // 3)
    return model, tierlift.optim.AdamW(model.parameters(), lr=1e-4, **kw), n


def _step(model, opt, x) -> dict:
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    st = opt.last_step_stats
    return {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "step_s": t3 - t2, "iter_s": t3 - t0,
            "overlapped_s": float(st.get("overlapped_s", 0.0)),
            "overlap_wait_s": float(st.get("overlap_wait_s", 0.0)), "legs": st["legs"]}


def _median_legs(runs: list[dict]) -> dict:
    """Per leg and field, the median over the rounds (threads too)."""
    out = {}
    for leg in runs[0]:
        got = [r[leg] for r in runs]
        entry = {k: statistics.median(g[k] for g in got) for k in ("total_s", "exposed_s")}
        entry["bytes"] = int(statistics.median(g["bytes"] for g in got))
        device = [g["device_s"] for g in got if g["device_s"] is not None]
        entry["device_s"] = statistics.median(device) if device else None
        names = sorted({t for g in got for t in g["threads"]})
        entry["threads"] = {t: {k: statistics.median(g["threads"].get(t, {}).get(k, 0.0)
                                                     for g in got)
                                for k in ("total_s", "exposed_s")} for t in names}
        out[leg] = entry
    return out


def leg_rows(by_case: dict[str, dict]) -> tuple[list[dict], list[str]]:
    """Table rows of last_step_stats["legs"] per case: for each leg its time and the part of it
    the training thread waited for ("exp"), in ms; CPU Adam again per thread; the bytes of the
    legs that move them. Returns (rows, columns)."""
    columns = ["leg"]
    for case in by_case:
        columns += [f"{case} ms", f"{case} exp"]
    rows = []

    def row(label: str, get) -> None:
        r = {"leg": label}
        for case, legs in by_case.items():
            got = get(legs)
            r[f"{case} ms"], r[f"{case} exp"] = (("-", "-") if got is None else
                                                 (f"{got[0] * 1e3:.1f}", f"{got[1] * 1e3:.1f}"))
        rows.append(r)

    for label, key in LEG_LABELS:
        row(label, lambda legs, key=key: (legs[key]["total_s"], legs[key]["exposed_s"])
            if key in legs else None)
        if key == "adam":
            threads = sorted({t for legs in by_case.values()
                              for t in legs.get(key, {}).get("threads", {})})
            for t in threads:
                row(f"  on {t}", lambda legs, t=t: (
                    legs["adam"]["threads"][t]["total_s"], legs["adam"]["threads"][t]["exposed_s"])
                    if t in legs.get("adam", {}).get("threads", {}) else None)
    row("sum of legs", lambda legs: (sum(v["total_s"] for v in legs.values()),
                                     sum(v["exposed_s"] for v in legs.values())) if legs else None)
    for label, key in (("H2D params", "h2d"), ("D2H grads", "d2h"), ("NVMe read", "nvme_read"),
                       ("NVMe write", "nvme_write")):
        r = {"leg": f"{label} MB"}
        for case, legs in by_case.items():
            r[f"{case} ms"] = f"{legs[key]['bytes'] / 1e6:.1f}" if key in legs else "-"
        rows.append(r)
    if any(v.get("device_s") is not None for legs in by_case.values() for v in legs.values()):
        for label, key in LEG_LABELS:
            if key not in DEVICE_LEGS:
                continue
            r = {"leg": f"{label}: device ms"}
            for case, legs in by_case.items():
                d = legs.get(key, {}).get("device_s")
                r[f"{case} ms"] = "-" if d is None else f"{d * 1e3:.1f}"
            rows.append(r)
    return rows, columns


def print_leg_table(by_case: dict[str, dict], title: str) -> None:
    """print_table of leg_rows; a case without legs is left out, a long case name is shown as
    #1, #2, ... with a legend under the table."""
    by_case = {case: legs for case, legs in by_case.items() if legs}
    if not by_case:
        return
    short = {case: case if len(case) <= 12 else f"#{i + 1}" for i, case in enumerate(by_case)}
    rows, columns = leg_rows({short[case]: legs for case, legs in by_case.items()})
    print_table(rows, columns, title=title)
    for case, name in short.items():
        if name != case:
            print(f"{name}: {case}")


def bench_legs(args) -> int:
    dim, layers = args.legs_dim, args.legs_layers
    host_idle = getattr(args, "legs_host_idle", False)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        built = [_build(t, o, dim, layers, args.legs_chunk_bytes, tmp, host_idle)
                 for t, o in CONFIGS]
        x = torch.randn(args.legs_batch, dim)
        samples: list[list[dict]] = [[] for _ in built]
        for r in range(args.repeats + 2):
            for i, (model, opt, _) in enumerate(built):
                got = _step(model, opt, x)
                if r >= 2:
                    samples[i].append(got)
        n = built[0][2]
        for _, opt, _ in built:
            opt._offload.close()
    med = []
    for runs in samples:
        m = {k: statistics.median(s[k] for s in runs) for k in runs[0] if k != "legs"}
        m["legs"] = _median_legs([s["legs"] for s in runs])
        med.append(m)
    rows, columns = leg_rows({name: m["legs"] for name, m in zip(NAMES, med)})
    at = next(i for i, r in enumerate(rows) if r["leg"] == "sum of legs") + 1
    walls = []  # the training thread's time, beside the exposed column it is split into
    for label, key in WALL:
        walls.append({"leg": label})
        for name, m in zip(NAMES, med):
            walls[-1][f"{name} exp"] = f"{m[key] * 1e3:.1f}"
    rows[at:at] = walls
    info = machine()
    compute = (f"compute: a stand-in the host waits for ({HOST_IDLE_S[0] * 1e3:.0f}/"
               f"{HOST_IDLE_S[1] * 1e3:.0f} ms per unit)" if host_idle else "compute on the CPU")
    print_table(rows, columns,
                title=f"ZeRO-3 offloaded step by leg: ms, and exp = the part the training "
                      f"thread waited for (median of {args.repeats}); {n / 1e6:.1f}M fp32 params "
                      f"in {layers} units, offload_params='cpu', chunk_bytes "
                      f"{args.legs_chunk_bytes >> 10} KiB, {compute}, {info['cpu']}, "
                      f"{info['cores']} cores")
    for tier in ("cpu", "nvme"):
        off, on = (med[CONFIGS.index((tier, o))] for o in (False, True))
        a_off, a_on = off["legs"]["adam"], on["legs"]["adam"]
        print(f"{tier}: CPU Adam exposed {a_off['exposed_s'] * 1e3:.1f} of "
              f"{a_off['total_s'] * 1e3:.1f} ms without the overlap, "
              f"{a_on['exposed_s'] * 1e3:.1f} of {a_on['total_s'] * 1e3:.1f} ms with it; "
              f"step() {off['step_s'] * 1e3:.1f} -> {on['step_s'] * 1e3:.1f} ms, backward "
              f"{off['bwd_s'] * 1e3:.1f} -> {on['bwd_s'] * 1e3:.1f} ms, iteration "
              f"{on['iter_s'] / off['iter_s']:.2f}x")
    for tier in ("cpu", "nvme"):
        work = [sum(med[CONFIGS.index((tier, o))]["legs"][leg]["total_s"]
                    for leg in ("adam", "other")) for o in (False, True)]
        print(f"{tier}: the optimizer's CPU work (CPU Adam + optimizer other, every thread) "
              f"{work[0] * 1e3:.1f} ms without the overlap, {work[1] * 1e3:.1f} ms with it: "
              f"{work[1] / work[0]:.2f}x")
    write_json("bench_offload_legs" + ("-host-idle" if host_idle else ""), {
        "host_idle": host_idle, "params": n, "dim": dim, "layers": layers,
        "chunk_bytes": args.legs_chunk_bytes, "repeats": args.repeats,
        "configs": dict(zip(NAMES, med)), "rounds": dict(zip(NAMES, samples))})
    return 0
