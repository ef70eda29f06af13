"""`python -m tierlift plan --plot PATH`: the plan's bytes per tier, one stacked bar per state
kind, drawn against each tier's capacity. matplotlib is optional (tierlift._plotting)."""

from __future__ import annotations

from pathlib import Path

from tierlift._plotting import pyplot
from tierlift.plan.planner import Plan


def capacities(inp) -> dict[str, int]:
    """Bytes each tier offers: GPU memory, host memory (the optimizer's budget when one is given)
    and the free space under the NVMe directory."""
    caps = {"gpu": inp.gpu_mem, "cpu": inp.cpu_budget or inp.cpu_mem}
    if inp.nvme_free is not None:
        caps["nvme"] = inp.nvme_free
    return caps


def plot_plan(plan: Plan, caps: dict[str, int], path) -> Path:
    """Stacked bar of the planned bytes per tier (GiB), each tier's capacity as an outline."""
    plt = pyplot()
    tiers = list(plan.tiers)
    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    kinds = list(dict.fromkeys(k for t in tiers for k in plan.tiers[t]))
    bottom = [0.0] * len(tiers)
    for j, kind in enumerate(kinds):
        v = [plan.tiers[t].get(kind, 0) / gib for t in tiers]
        ax.bar(tiers, v, bottom=bottom, color=colors[j % len(colors)], label=kind, width=0.5)
        bottom = [b + x for b, x in zip(bottom, v)]
    cap = [caps.get(t, 0) / gib for t in tiers]
    ax.bar(tiers, cap, fill=False, edgecolor="black", linestyle="--", width=0.7,
           label="capacity")
    for i, (used, c) in enumerate(zip(bottom, cap)):
        text = f"{used:.1f} / {c:.0f} GiB" if c else f"{used:.1f} GiB"
        ax.annotate(text, (i, max(used, c)), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"offload={plan.offload!r}: {plan.note}\noptimizer step {plan.serial_s:.3f} s "
                 f"serial, {plan.pipelined_s:.3f} s pipelined", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
