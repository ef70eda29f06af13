"""The plan: its bytes per tier and legs per step (Plan), and the table that prints it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierlift.plan.measure import Bandwidths
from tierlift.plan.state_bytes import HostTier

_PCIE_ASSUMED = 25e9  # PCIe 4.0 x16, used when no GPU is here to measure


@dataclass(kw_only=True)
class Plan:
    offload: str
    tiers: dict = field(default_factory=dict)  # tier -> {state kind: bytes}
    legs_s: dict = field(default_factory=dict)  # leg -> seconds per step
    note: str = ""
    generations: int | None = None  # of the NVMe part
    device_params: int | None = None  # offload_params: parameters whose shards stay on the GPU
    overlap: bool | None = None  # offload="cpu": whether the plan steps during backward
    cpu_budget: int | None = None  # the optimizer's cpu_budget to give (None: none needed)
    host: HostTier | None = None  # the overlapped host tier
    # The share of the chunks stepped during backward (pipelined); None: the NVMe tiers'
    # bound, the maximum of the legs.
    overlap_fraction: float | None = None
    # Legs that only those chunks have (a hybrid's NVMe reads and writes: its chunks in host
    # memory do no I/O), whole where those chunks are stepped; the others scale with the share.
    own_legs: tuple[str, ...] = ()

    @property
    def serial_s(self) -> float:
        return sum(self.legs_s.values())

    def _fraction(self) -> float:
        return 1.0 if self.overlap_fraction is None else self.overlap_fraction

    @property
    def during_backward_s(self) -> float:
        """The overlapped chunks' legs, pipelined beside each other during backward."""
        f = self._fraction()
        if f == 0:
            return 0.0
        return max((s if leg in self.own_legs else f * s for leg, s in self.legs_s.items()),
                   default=0.0)

    @property
    def after_backward_s(self) -> float:
        """The other chunks' legs, one after another in step() after backward."""
        f = self._fraction()
        return sum((s if f == 0 else 0.0) if leg in self.own_legs else (1 - f) * s
                   for leg, s in self.legs_s.items())

    @property
    def pipelined_s(self) -> float:
        return self.during_backward_s + self.after_backward_s



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
    lines.append(_step_line(plan))
    return "\n".join(lines)


def _step_line(plan: Plan) -> str:
    """What the legs add up to, and which of them run during backward."""
    serial = f"optimizer step: {plan.serial_s:.3f} s serial"
    if plan.overlap is False:
        return f"{serial} (overlap=False: every chunk is stepped in step(), after backward)"
    host = plan.host
    if host is not None and host.spare is None:
        return (f"{serial}, {plan.pipelined_s:.3f} s pipelined (overlap=True, two generations: "
                "every chunk can be stepped during backward)")
    if host is not None:
        return (f"{serial}, {plan.pipelined_s:.3f} s with overlap=True: {host.spare} of "
                f"{host.chunks} chunks ({host.fraction:.0%}, the spare blocks) pipelined during "
                f"backward ({plan.during_backward_s:.3f} s), the other "
                f"{host.chunks - host.spare} serial in step() after it "
                f"({plan.after_backward_s:.3f} s)")
    if plan.offload == "hybrid" and plan.overlap_fraction == 0:
        return (f"{serial}, {plan.pipelined_s:.3f} s pipelined (nvme_generations=1: nothing is "
                "stepped during backward; every chunk is rewritten in place in step())")
    if plan.offload == "hybrid":
        f = plan.overlap_fraction
        return (f"{serial}, {plan.pipelined_s:.3f} s with overlap=True: the NVMe part ({f:.0%} "
                f"of the state, two generations) pipelined during backward "
                f"({plan.during_backward_s:.3f} s), the part in host memory ({1 - f:.0%}, one "
                f"generation) stepped in place in step() after it ({plan.after_backward_s:.3f} "
                "s)")
    how = ("overlap=True" if plan.generations != 1 else
           "within step(): chunks kept in one generation cannot overlap backward")
    return f"{serial}, {plan.pipelined_s:.3f} s pipelined ({how})"
