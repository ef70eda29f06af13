"""bench_offload.py --legs: the ZeRO-3 offloaded step split into its legs on any machine (a CPU
too), with and without the overlap, so a change that serializes the pipeline shows in a table.

One process, a stack of blocks under tierlift.zero.shard(stage=3, offload_params="cpu") and
tierlift.optim.AdamW(offload="cpu"|"nvme", overlap=False|True, max_grad_norm=1e9). Every
configuration steps once per round (round robin: a loaded machine's drift hits them alike),
two warm-up rounds, then --repeats; medians. Per leg:

  forward, backward, step()   wall time on the training thread (exposed by definition)
  CPU Adam kernel             last_step_stats cpu_step_s, on whichever thread ran it
  worker (overlap)            overlapped_s: the worker's chunk steps (read, Adam, write)
  step() waits for worker     overlap_wait_s: the part of that work backward did not hide
  worker not waited for       the difference: what ran while the training thread went on
                              (not free where they share cores: see backward's change)
  NVMe read/write wait        nvme_read_wait_s / nvme_write_wait_s, both threads
  H2D params, D2H grads       bytes per step (model._tierlift_zero.stats)

What is not recorded: last_step_stats adds each leg over the worker and step(), so only the
optimizer's work as a whole is split into hidden (in backward) and exposed (step()); the
parameter copies have byte counts but no times (on a CPU they are plain copies inside forward
and backward); NVMe I/O records the waits, not the time the device was busy.
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
ROWS = [  # (label, key): keys ending in _s are shown in ms, _bytes in MB
    ("forward", "fwd_s"), ("backward", "bwd_s"), ("step()", "step_s"),
    ("iteration", "iter_s"), ("CPU Adam kernel", "cpu_step_s"),
    ("worker (overlap)", "overlapped_s"), ("step() waits for worker", "overlap_wait_s"),
    ("worker not waited for", "hidden_s"),
    ("NVMe read wait", "nvme_read_wait_s"), ("NVMe write wait", "nvme_write_wait_s"),
    ("CRC-32C", "checksum_s"), ("publish", "publish_s"), ("H2D params", "h2d_bytes"),
    ("D2H grads", "d2h_bytes"),
]
OPT_KEYS = [k for _, k in ROWS if k not in ("fwd_s", "bwd_s", "step_s", "iter_s", "hidden_s",
                                            "h2d_bytes", "d2h_bytes")]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _build(tier: str, overlap: bool, dim: int, layers: int, chunk_bytes: int, directory: str):
    torch.manual_seed(0)
    model = tierlift.zero.shard(nn.Sequential(*(Block(dim) for _ in range(layers))), stage=3,
                                offload_params="cpu")
    n = sum(p.numel() for p in model.parameters())
    kw = dict(offload=tier, overlap=overlap, max_grad_norm=1e9, chunk_bytes=chunk_bytes)
    if tier == "nvme":
        kw.update(nvme_path=directory, cpu_budget=12 * n // 3)
    return model, tierlift.optim.AdamW(model.parameters(), lr=1e-4, **kw), n


def _step(model, opt, x) -> dict:
    zs = model._tierlift_zero.stats
    moved = zs["h2d_bytes"], zs["d2h_bytes"]
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    st = opt.last_step_stats
    out = {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "step_s": t3 - t2, "iter_s": t3 - t0,
           "h2d_bytes": zs["h2d_bytes"] - moved[0], "d2h_bytes": zs["d2h_bytes"] - moved[1]}
    out.update({k: float(st.get(k, 0.0)) for k in OPT_KEYS})
    out["hidden_s"] = max(0.0, out["overlapped_s"] - out["overlap_wait_s"])
    return out


def _cell(key: str, v: float) -> str:
    if key.endswith("_bytes"):
        return f"{v / 1e6:.1f} MB"
    return f"{v * 1e3:.1f}"


LEG_LABELS = [  # (label, last_step_stats["legs"] key)
    ("forward (host waits for compute)", "forward"),
    ("backward (host waits for compute)", "backward"),
    ("H2D params", "h2d"), ("D2H grads", "d2h"), ("CPU Adam", "adam"),
    ("NVMe read", "nvme_read"), ("NVMe write", "nvme_write"),
    ("optimizer other", "other"),
]


def leg_rows(by_case: dict[str, dict]) -> tuple[list[dict], list[str]]:
    """Table rows of last_step_stats["legs"] per case: for each leg its time and the part of it
    the training thread waited for ("exposed"), in ms; CPU Adam again per thread; the bytes of
    the legs that move them. Returns (rows, columns)."""
    columns = ["leg"]
    for case in by_case:
        columns += [f"{case} ms", f"{case} exposed"]
    rows = []

    def row(label: str, get) -> None:
        r = {"leg": label}
        for case, legs in by_case.items():
            got = get(legs)
            r[f"{case} ms"], r[f"{case} exposed"] = (("-", "-") if got is None else
                                                     (f"{got[0] * 1e3:.1f}", f"{got[1] * 1e3:.1f}"))
        rows.append(r)

    for label, key in LEG_LABELS:
        row(label, lambda legs, key=key: (legs[key]["total_s"], legs[key]["exposed_s"])
            if key in legs else None)
        if key == "adam":
            threads = sorted({t for legs in by_case.values() for t in legs.get(key, {})
                              .get("threads", {})})
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
    return rows, columns


def print_leg_table(by_case: dict[str, dict], title: str) -> None:
    """print_table of leg_rows; a case without legs is left out."""
    by_case = {case: legs for case, legs in by_case.items() if legs}
    if by_case:
        rows, columns = leg_rows(by_case)
        print_table(rows, columns, title=title)


def bench_legs(args) -> int:
    dim, layers = args.legs_dim, args.legs_layers
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        built = [_build(t, o, dim, layers, args.legs_chunk_bytes, tmp) for t, o in CONFIGS]
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
    names = [f"{t}{' + overlap' if o else ''}" for t, o in CONFIGS]
    med = [{k: statistics.median(s[k] for s in runs) for k in runs[0]} for runs in samples]
    rows = [{"leg": label, **{name: _cell(key, m[key]) for name, m in zip(names, med)}}
            for label, key in ROWS]
    info = machine()
    print_table(rows, ["leg", *names],
                title=f"ZeRO-3 offloaded step by leg, ms (median of {args.repeats}), "
                      f"{n / 1e6:.1f}M fp32 params in {layers} units, offload_params='cpu', "
                      f"chunk_bytes {args.legs_chunk_bytes >> 10} KiB, {info['cpu']}, "
                      f"{info['cores']} cores")
    for tier in ("cpu", "nvme"):
        off, on = (med[CONFIGS.index((tier, o))] for o in (False, True))
        print(f"{tier}: step() waited for {on['overlap_wait_s'] * 1e3:.1f} of the worker's "
              f"{on['overlapped_s'] * 1e3:.1f} ms; overlap off -> on: step() "
              f"{off['step_s'] * 1e3:.1f} -> {on['step_s'] * 1e3:.1f} ms, "
              f"backward {off['bwd_s'] * 1e3:.1f} -> {on['bwd_s'] * 1e3:.1f} ms, iteration "
              f"{on['iter_s'] / off['iter_s']:.2f}x")
    print("not recorded: which thread each leg ran on (last_step_stats adds the worker's and "
          "step()'s), H2D/D2H times (bytes only), NVMe busy time (waits only)")
    write_json("bench_offload_legs", {"params": n, "dim": dim, "layers": layers,
                                      "chunk_bytes": args.legs_chunk_bytes,
                                      "repeats": args.repeats,
                                      "configs": dict(zip(names, med)),
                                      "rounds": dict(zip(names, samples))})
    return 0
