"""Training-run figures for the examples' --plot flag: loss (train, and validation when
measured), tokens/s over steps, and for offloaded runs the optimizer's per-step breakdown. Each
run is also saved as JSON beside the PNG, so runs (e.g. one per --lowp recipe) can be drawn on one
chart with --plot-with. matplotlib is optional: pip install matplotlib.
"""

from __future__ import annotations

import json
from pathlib import Path

from tierlift._plotting import pyplot


def save_run(run: dict, path, others=()) -> Path:
    """Writes `run` as JSON beside `path` (same name, .json) and draws it, with the runs saved in
    the JSON files `others` on the same axes. A run: {"label", "step": [...], "loss": [...],
    "tokens_per_s": [...], optional "val_step", "val_loss", and "breakdown": {leg: [ms per step]}
    with its own "breakdown_step"}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(run))
    runs = [json.loads(Path(o).read_text()) for o in others] + [run]
    plt = pyplot()
    panels = 3 if run.get("breakdown") else 2
    fig, axes = plt.subplots(1, panels, figsize=(3.4 * panels, 3.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        c = colors[i % len(colors)]
        axes[0].plot(r["step"], r["loss"], color=c, label=f"{r['label']} train")
        if r.get("val_loss") is not None:
            axes[0].plot(r["val_step"], r["val_loss"], "o", color=c, label=f"{r['label']} val")
        axes[1].plot(r["step"], r["tokens_per_s"], color=c, label=r["label"])
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("tokens/s")
    if run.get("breakdown"):
        ax = axes[2]
        legs = {k: v for k, v in run["breakdown"].items() if any(v)}
        ax.stackplot(run["breakdown_step"], *legs.values(), labels=list(legs))
        ax.set_ylabel("ms per step")
        ax.set_title("optimizer.last_step_stats", fontsize=9)
        ax.legend(fontsize=6, loc="upper right")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if len(runs) > 1:
        axes[1].legend(fontsize=7)
    fig.suptitle(run.get("title", run["label"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
