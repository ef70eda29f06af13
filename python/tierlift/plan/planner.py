"""The placement rule: keep everything on the GPU when it fits; else the fp32 master, m and v go
to host memory (offload="cpu"); else as much of them as host memory holds stays there and the
rest goes to NVMe (offload="hybrid"; "nvme" when host memory holds only the pipeline's pool).
Bytes per parameter (mixed precision): bf16 weight 2, bf16 gradient 2, fp32 master 4, m 4, v 4;
with compact state (state_dtype="bf16") m 2, v 1 and a 4-byte scale per 256 elements, taken
from the offload tiers' layout at the default chunk size (7.02 B/param of optimizer state
instead of 12). The bf16 weights and gradients always stay on the GPU here: a model whose
weights do not fit there needs tierlift.zero stage 3 (across GPUs, or offload_params="cpu" or
"nvme"), which this planner does not place.
The NVMe part takes twice its bytes when the drive has room (a step reads one generation and
writes the other, so any failed step is undone), else once (nvme_generations=1: rewritten in
place; docs/offload.md); the plan refuses a drive without room for one generation.
The expected optimizer time per step is the sum of its legs (no overlap) and their maximum
(the pipelined bound that overlap=True aims at)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from tierlift.offload.layout import chunk_bytes, state_kinds
from tierlift.plan.measure import Bandwidths

_PCIE_ASSUMED = 25e9  # PCIe 4.0 x16, used when no GPU is here to measure
# The NVMe pipeline's pool with the default chunk_bytes and pipeline_slots (6 slots x 32 MiB x
# master, m, v, grad and copy staging); a hybrid budget gives it at most a quarter.
POOL_BYTES = 6 * (32 << 20) * 5
_CHUNK_ELEMS = (32 << 20) // 4  # the default chunk_bytes, in elements
_STATE_DTYPES = ("fp32", "bf16")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{what} must be a size like 80G, 512M or 1e9, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {text!r}")
    return int(value)


@dataclass(kw_only=True)
class PlanInput:
    params: float
    gpu_mem: int
    cpu_mem: int
    nvme: str | None = None
    cpu_budget: int | None = None
    nvme_free: int | None = None  # bytes free under `nvme` (checked when the state goes there)
    gpu_reserve: float = 0.3  # share of GPU memory kept for activations and workspace
    pool_bytes: int = POOL_BYTES  # the NVMe pipeline's pool (smaller with a smaller chunk_bytes)
    state_dtype: str = "fp32"  # "bf16": compact optimizer state (tierlift.optim state_dtype)

    def __post_init__(self):
        if self.state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {_STATE_DTYPES}, got "
                             f"{self.state_dtype!r}")
        if not self.params > 0:
            raise ValueError(f"params must be > 0, got {self.params}")
        if not 0 <= self.gpu_reserve < 1:
            raise ValueError(f"gpu_reserve must be in [0, 1), got {self.gpu_reserve}")


@dataclass(kw_only=True)
class Plan:
    offload: str
    tiers: dict = field(default_factory=dict)  # tier -> {state kind: bytes}
    legs_s: dict = field(default_factory=dict)  # leg -> seconds per step
    note: str = ""
    generations: int | None = None  # of the NVMe part

    @property
    def serial_s(self) -> float:
        return sum(self.legs_s.values())

    @property
    def pipelined_s(self) -> float:
        return max(self.legs_s.values(), default=0.0)


def state_bytes_per_param(state_dtype: str = "fp32") -> dict[str, float]:
    """Bytes per parameter of each optimizer state kind (fp32 master included), as the offload
    tiers lay them out in chunks of the default size (each kind of a chunk 4 KiB aligned)."""
    kinds = state_kinds(False, state_dtype)
    names = {"master": "fp32 master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    if state_dtype == "bf16":
        names.update(exp_avg="exp_avg (bf16)", exp_avg_sq="exp_avg_sq (8-bit)",
                     exp_avg_sq_scale="exp_avg_sq scales")
    return {names[k]: chunk_bytes({k: d}, _CHUNK_ELEMS) / _CHUNK_ELEMS for k, d in kinds.items()}


def make_plan(inp: PlanInput, bw: Bandwidths) -> Plan:
    n = int(inp.params)
    model = {"bf16 params": 2 * n, "bf16 grads": 2 * n}
    state = {k: b * n for k, b in state_bytes_per_param(inp.state_dtype).items()}
    gpu_room = inp.gpu_mem * (1 - inp.gpu_reserve)
    cpu_room = inp.cpu_budget if inp.cpu_budget is not None else int(inp.cpu_mem * 0.8)
    if sum(model.values()) > gpu_room:
        raise ValueError(
            f"the bf16 parameters and gradients ({_fmt(sum(model.values()))}) do not fit in "
            f"{_fmt(gpu_room)} of GPU memory (short by {_fmt(sum(model.values()) - gpu_room)}); "
            "use more GPUs with tierlift.zero stage 3, or its parameter offload "
            "(offload_params='cpu' or 'nvme'), which this planner does not place")
    if sum(model.values()) + sum(state.values()) <= gpu_room:
        return Plan(offload="none", tiers={"gpu": {**model, **state}},
                    legs_s={"gpu adam": (4 + sum(state.values()) / n) * n / (3e12)},
                    note="everything fits on the GPU" + _dtype_note(inp))
    pcie_h2d = bw.h2d_bps or _PCIE_ASSUMED
    pcie_d2h = bw.d2h_bps or _PCIE_ASSUMED
    legs = {"d2h grads": 2 * n / pcie_d2h, "cpu adam": n / bw.adam_elems_per_s,
            "h2d params": 2 * n / pcie_h2d}
    if sum(state.values()) <= cpu_room:
        return Plan(offload="cpu", tiers={"gpu": model, "cpu": state}, legs_s=legs,
                    note="optimizer state in pinned host memory" + _dtype_note(inp))
    if inp.nvme is None or bw.disk_read_bps is None:
        raise ValueError(
            f"the optimizer state ({_fmt(sum(state.values()))}) does not fit in "
            f"{_fmt(cpu_room)} of host memory (short by {_fmt(sum(state.values()) - cpu_room)}); "
            "give --nvme PATH for the NVMe tier")
    return _on_nvme(inp, bw, n, model, state, cpu_room, legs)


def _on_nvme(inp, bw, n, model, state, cpu_room, legs) -> Plan:
    """offload="hybrid": the pipeline's pool, as many whole chunks of state in host memory as
    the rest of the budget holds, the remainder on NVMe, in two generations when the drive has
    room for them and in one (rewritten in place) when it has room only for that."""
    total = sum(state.values())
    pool = min(inp.pool_bytes, cpu_room // 4)
    ram = max(0, min(total, cpu_room - pool))
    if ram < total / 100:  # not worth a RAM part: the whole budget is the pipeline's pool
        pool, ram = cpu_room, 0
    disk = total - ram
    share = {k: v * disk / total for k, v in state.items()}
    gens = 2
    if inp.nvme_free is not None and 2 * disk > inp.nvme_free:
        gens = 1
        if disk > inp.nvme_free:
            raise ValueError(
                f"the optimizer state needs {_fmt(disk)} under {inp.nvme} beyond the "
                f"{_fmt(ram)} host memory holds (one generation of {', '.join(state)}, "
                f"rewritten in place) and the drive has {_fmt(inp.nvme_free)} free "
                f"(short by {_fmt(disk - inp.nvme_free)}); host memory would be short by "
                f"{_fmt(total - cpu_room)}")
    legs["nvme read"] = disk / bw.disk_read_bps
    legs["nvme write"] = disk / bw.disk_write_bps
    label = "2 gens" if gens == 2 else "1 gen, in place"
    tiers = {"gpu": model, "cpu": {"staging pool": pool}, "nvme": {
        f"{k} ({label})": gens * v for k, v in share.items()}}
    if ram:
        tiers["cpu"].update({k: v - share[k] for k, v in state.items()})
        offload = "hybrid"
        note = (f"optimizer state {ram / total:.0%} in host memory, {disk / total:.0%} on NVMe "
                f"under {inp.nvme} (offload='hybrid', cpu_budget={int(cpu_room)}, "
                f"nvme_generations={gens})")
    else:
        offload = "nvme"
        note = f"optimizer state on NVMe under {inp.nvme} (nvme_generations={gens})"
    note += _dtype_note(inp)
    return Plan(offload=offload, tiers=tiers, legs_s=legs, note=note, generations=gens)


def _dtype_note(inp: PlanInput) -> str:
    return "; compact state (state_dtype='bf16')" if inp.state_dtype == "bf16" else ""


def max_params(inp: PlanInput, bw: Bandwidths) -> tuple[int, Plan]:
    """The largest parameter count (and its plan) that fits these budgets, by bisection:
    whatever fits a tier, a smaller model fits too."""
    def fits(n: int) -> Plan | None:
        try:
            return make_plan(dataclasses.replace(inp, params=n), bw)
        except ValueError:
            return None

    if fits(1) is None:
        raise ValueError("not even a one-parameter model fits these budgets")
    lo, hi = 1, 2
    while fits(hi) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 1000):  # 0.1% is as exact as the byte counts are
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not None else (lo, mid)
    return lo, fits(lo)


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def render(plan: Plan, bw: Bandwidths) -> str:
    lines = [f"offload={plan.offload!r}: {plan.note}", "",
             f"tier   {'state':30} bytes"]
    for tier, kinds in plan.tiers.items():
        for kind, nbytes in kinds.items():
            lines.append(f"{tier:6} {kind:30} {_fmt(nbytes)}")
    lines += ["", "measured: " + ", ".join(
        f"{k}={v / 1e9:.2f} GB/s" if k.endswith("bps") else f"{k}={v / 1e9:.2f} G/s"
        for k, v in vars(bw).items() if v is not None)]
    if bw.h2d_bps is None:
        lines.append(f"(no GPU here: PCIe assumed {_PCIE_ASSUMED / 1e9:.0f} GB/s each way)")
    lines += ["", "leg              s/step"]
    lines += [f"{leg:16} {s:.3f}" for leg, s in plan.legs_s.items()]
    how = ("overlap=True" if plan.generations != 1 else
           "within step(): chunks kept in one generation cannot overlap backward")
    lines.append(f"optimizer step: {plan.serial_s:.3f} s serial, {plan.pipelined_s:.3f} s "
                 f"pipelined ({how})")
    return "\n".join(lines)
