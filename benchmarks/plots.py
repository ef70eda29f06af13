"""Figures from the JSON the benchmarks write: each plot_* function takes the dict one
benchmarks/bench_*.py wrote (the same numbers its table prints) and saves a small PNG.

    python benchmarks/bench_optim.py --plot optim.png     # run, write JSON, draw from that JSON
    python benchmarks/plot_all.py                         # docs/img/*.png from benchmarks/results/

matplotlib is optional (`pip install matplotlib`); it is imported on the first plot only, with the
Agg backend (no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path

from tierlift._plotting import pyplot

DPI = 80
SIZE = (6.4, 3.6)  # inches; at DPI 80 a PNG of a few tens of KB


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def _machine(data: dict) -> str:
    m = data.get("machine")
    if isinstance(m, dict):
        parts = [m.get("gpu") or m.get("cpu") or m.get("node"), m.get("cores") or m.get("cpus")]
        return ", ".join(f"{p} cores" if isinstance(p, int) else str(p) for p in parts if p)
    return str(m or "")


def _title(ax, text: str, data: dict) -> None:
    where = _machine(data)
    ax.set_title(f"{text}\n{where}" if where else text, fontsize=9)


# ---- bench_optim -------------------------------------------------------------------------------


def _points(rows: list, x: str, y: str) -> tuple[list, list]:
    """(xs, ys) of the rows that measured y: a row or contender that failed on the GPU machine
    carries an error key instead of its number, and is left out of the plot, not a KeyError."""
    pts = [(r[x], r[y]) for r in rows if r.get(y) is not None and r.get(x) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_optim(data: dict, path) -> Path:
    """Mparam/s vs parameter count per case: tierlift, each peer (from its "vs X" time ratio) and
    the measured memory-bandwidth bound (from "% of bound") as a dashed line."""
    plt = pyplot()
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases) + 0.4, SIZE[1]),
                             squeeze=False, sharey=True)
    for ax, case in zip(axes[0], cases):
        rows = [r for r in data["rows"] if r["case"] == case]
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r.get("tierlift Mparam/s") is None:  # failed on that machine (bench_optim)
                continue
            n, ours = float(r["params"]), r["tierlift Mparam/s"]
            if r.get("% of bound"):
                series.setdefault("bound", []).append((n, ours * 100 / r["% of bound"]))
            series.setdefault("tierlift", []).append((n, ours))
            for k, ratio in r.items():
                if k.startswith("vs ") and ratio:
                    series.setdefault(k[3:], []).append((n, ours / ratio))
        for name, pts in series.items():
            xs, ys = zip(*pts)
            style = dict(color="black", linestyle="--") if name == "bound" else dict(marker="o")
            label = "bound (measured bandwidth)" if name == "bound" else name
            ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(case, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("AdamW step, Mparam/s")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"AdamW step throughput ({_machine(data)})", fontsize=9)
    return _save(fig, path)


# ---- bench_io ----------------------------------------------------------------------------------


def plot_io(data: dict, path) -> Path:
    """Sequential O_DIRECT read and write GB/s per contender, fio first (the reference)."""
    plt = pyplot()
    gbps = data["gbps"]
    names = sorted(gbps, key=lambda n: (n != "fio", n))
    fig, ax = plt.subplots(figsize=SIZE)
    width = 0.38
    for i, rw in enumerate(("read", "write")):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars = ax.bar(xs, [gbps[n][rw] for n in names], width, label=rw)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    cfg = data.get("config", {})
    _title(ax, f"sequential I/O, {cfg.get('size_mib', '?')} MiB, block {cfg.get('block_kib', '?')}"
               f" KiB, queue depth {cfg.get('queue_depth', '?')}", data)
    return _save(fig, path)


# ---- bench_gather ------------------------------------------------------------------------------

_GATHER_LABELS = {"tierlift_gbs": "tierlift gather", "index_select_gbs": "torch.index_select",
                  "pinned_copy_gbs": "pinned copy_ (bound)", "cpu_path_gbs":
                  "index_select + pin + copy", "copy_gbs": "contiguous copy_ (bound)"}
_GATHER_BOUNDS = ("pinned_copy_gbs", "copy_gbs")


def plot_gather(data: dict, path) -> Path:
    """Gather GB/s vs row size for each contender in the JSON; the copy bound (a contiguous copy
    of the same bytes: pinned host to GPU on GPU runs, memory to memory on CPU runs) dashed."""
    plt = pyplot()
    rows = data["results"]
    fig, ax = plt.subplots(figsize=SIZE)
    keys = dict.fromkeys(k for r in rows for k in r if k.endswith("_gbs"))
    for key in keys:
        style = dict(color="black", linestyle="--") if key in _GATHER_BOUNDS else {"marker": "o"}
        ax.plot(*_points(rows, "row_bytes", key), label=_GATHER_LABELS.get(key, key), **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row size, bytes")
    ax.set_ylabel("GB/s gathered")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    where = "GPU zero-copy" if "pinned_copy_gbs" in keys else "CPU"
    _title(ax, f"{where} gather of random rows", data)
    return _save(fig, path)


# ---- bench_offload -----------------------------------------------------------------------------

_OFFLOAD_LEGS = ("cpu_step_s", "nvme_read_wait_s", "nvme_write_wait_s", "checksum_s",
                 "grad_check_s", "nvme_sync_s")


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def plot_offload(data: dict, path) -> Path:
    """Optimizer step per configuration; the NVMe step as a stack of its legs (median over the
    rounds of last_step_stats), beside the I/O replay and the I/O roofline."""
    plt = pyplot()
    if "results" in data and "step_s" not in data:
        return plot_offload_finetune(data, path)
    fig, ax = plt.subplots(figsize=SIZE)
    names = list(data["step_s"])
    stats = [r["stats"] for r in data.get("rounds", [])]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        total = data["step_s"][name] * 1e3
        if name.endswith("nvme") and stats:
            bottom = 0.0
            for j, leg in enumerate(_OFFLOAD_LEGS):
                v = _median([s.get(leg, 0.0) for s in stats]) * 1e3
                ax.bar(i, v, bottom=bottom, color=colors[(j + 1) % len(colors)],
                       label=leg[:-2].replace("_", " "))
                bottom += v
            ax.bar(i, max(total - bottom, 0.0), bottom=bottom, color="lightgray", label="other")
        else:
            ax.bar(i, total, color=colors[0], label="step" if i == 0 else None)
        ax.annotate(f"{total:.1f}", (i, total), ha="center", va="bottom", fontsize=7)
    refs = [("I/O replay", data.get("io_replay_s"), ":"), ("I/O roofline", data.get("roofline_s"),
                                                           "--")]
    for label, v, ls in refs:
        if v:
            ax.axhline(v * 1e3, color="black", linestyle=ls, linewidth=1, label=label)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("step, ms (median)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    _title(ax, f"AdamW step, {data.get('params', 0) / 1e6:.0f}M fp32 params, NVMe legs stacked",
           data)
    return _save(fig, path)


def plot_offload_finetune(data: dict, path) -> Path:
    """bench_offload --gpu: TFLOPS per case."""
    plt = pyplot()
    ok = [r for r in data["results"] if "tflops" in r]
    fig, ax = plt.subplots(figsize=SIZE)
    bars = ax.bar([r["case"] for r in ok], [r["tflops"] for r in ok])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylabel("TFLOPS")
    plan = data.get("plan", {})
    _title(ax, f"fine-tuning {plan.get('model', '')}", data)
    return _save(fig, path)


def plot_zero_offload(data: dict, path) -> Path:
    """ZeRO-3 step per configuration as a stack: optimizer step() and the rest (forward,
    backward), with the optimizer work overlapped with backward hatched inside the rest."""
    plt = pyplot()
    rows = data["rows"]
    labels = [f"state {r['tier']}" + ("\n+overlap" if r["overlap"] else "")
              + (f"\nparams {r['offload_params']}" if r["offload_params"] != "none" else "")
              for r in rows]
    fig, ax = plt.subplots(figsize=SIZE)
    xs = range(len(rows))
    step = [r["step_s"] * 1e3 for r in rows]
    opt = [r.get("opt_step_s", 0.0) * 1e3 for r in rows]
    rest = [s - o for s, o in zip(step, opt)]
    hidden = [min(r.get("overlapped_s", 0.0) * 1e3, x) for r, x in zip(rows, rest)]
    ax.bar(xs, [x - h for x, h in zip(rest, hidden)], label="forward + backward")
    ax.bar(xs, hidden, bottom=[x - h for x, h in zip(rest, hidden)], hatch="//",
           label="optimizer work during backward")
    ax.bar(xs, opt, bottom=rest, label="optimizer step()")
    for x, s in zip(xs, step):
        ax.annotate(f"{s:.0f}", (x, s), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("training step, ms (median)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    _title(ax, f"ZeRO-3 + AdamW offload, {rows[0]['params'] / 1e6:.1f}M params", data)
    return _save(fig, path)


# ---- bench_zero --------------------------------------------------------------------------------


def plot_zero(data: dict, path) -> Path:
    """Per rank: training-state memory (params, grads, optimizer, stacked) and step time per mode,
    FSDP2 marked as the reference."""
    plt = pyplot()
    res = data["results"]
    modes = list(res)
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(SIZE[0] + 1.2, SIZE[1]))
    bottom = [0.0] * len(modes)
    for kind in ("params", "grads", "optim"):
        v = [res[m]["bytes"][kind] / 1e6 for m in modes]
        mem.bar(modes, v, bottom=bottom, label=kind)
        bottom = [b + x for b, x in zip(bottom, v)]
    mem.set_ylabel("MB per rank")
    mem.legend(fontsize=7)
    mem.set_title("training state per rank", fontsize=9)
    step = [res[m]["step_s"] * 1e3 for m in modes]
    colors = ["tab:gray" if m == "fsdp2" else "tab:blue" for m in modes]
    bars = tim.bar(modes, step, color=colors)
    base = res.get("fsdp2", {}).get("step_s")
    if base:
        tim.bar_label(bars, [f"{res[m]['step_s'] / base:.2f}x" for m in modes], fontsize=7)
        tim.axhline(base * 1e3, color="black", linestyle="--", linewidth=1, label="FSDP2")
        tim.legend(fontsize=7)
    tim.set_ylabel("step, ms")
    tim.set_title("step time (label: vs FSDP2)", fontsize=9)
    for ax in (mem, tim):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    a = data.get("args", {})
    fig.suptitle(f"{a.get('nproc', '?')} ranks, GPT d={a.get('dim', '?')} "
                 f"L={a.get('layers', '?')}; {_machine(data)}", fontsize=9)
    return _save(fig, path)


# ---- bench_checkpoint --------------------------------------------------------------------------


def plot_checkpoint(data: dict, path) -> Path:
    """Per configuration, each contender's stall (the save call blocks training) as a solid bar
    and its total time until durable as a light bar behind it."""
    plt = pyplot()
    rows = data["rows"]
    configs = list(dict.fromkeys((r["ranks"], r["config"]) for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(2.6 * len(configs) + 0.6, SIZE[1]),
                             squeeze=False)
    for ax, (ranks, config) in zip(axes[0], configs):
        rs = [r for r in rows if (r["ranks"], r["config"]) == (ranks, config)]
        names = [r["contender"].replace(" ", "\n", 1) for r in rs]
        ax.bar(names, [r["total s"] for r in rs], color="tab:blue", alpha=0.3,
               label="total (durable)")
        bars = ax.bar(names, [r["stall s"] for r in rs], color="tab:blue", label="stall")
        ax.bar_label(bars, [f"{r['stall s']:.2g}" for r in rs], fontsize=7)
        ax.set_title(f"{ranks} rank{'s' if ranks > 1 else ''}, {config}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("seconds per save")
    axes[0][0].legend(fontsize=7)
    m = data.get("model", {})
    fig.suptitle(f"checkpoint save, {m.get('params', 0) / 1e6:.3g}M params + AdamW state; "
                 f"{_machine(data)}", fontsize=9)
    return _save(fig, path)


# ---- bench_lowp --------------------------------------------------------------------------------


def plot_lowp(data: dict, path) -> Path:
    """One panel per section the run wrote (bench_lowp.py --parts): quantize (CPU: reference
    time / C++ time per scaling; GPU: GB/s against the copy bandwidth), linear (Float8Linear
    speedup over bf16 vs size), split (each contender's step by category). A section the run
    left out is named under the figure; a JSON with none of them is refused."""
    sections = [k for k in ("quantize", "linear", "split") if data.get(k)]
    missing = [k for k in ("quantize", "linear", "split") if k not in sections]
    if not sections:
        raise ValueError("bench_lowp JSON has none of the sections quantize, linear, split: "
                         "nothing to plot")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sections), squeeze=False,
                             figsize=(SIZE[0] * (1 + 0.5 * (len(sections) - 1)), SIZE[1]))
    for ax, section in zip(axes[0], sections):
        if section == "quantize":
            _lowp_quantize(ax, data["quantize"])
        elif section == "linear":
            _lowp_linear(ax, data["linear"])
        else:
            _lowp_split(ax, data["split"])
    fig.suptitle(f"{data.get('gpu') or data.get('machine', '')} ({data.get('device', '')})",
                 fontsize=9)
    if missing:
        fig.text(0.01, 0.01, f"not in this run: {', '.join(missing)}", fontsize=7)
    return _save(fig, path)


def _lowp_quantize(ax, q: list) -> None:
    q = [r for r in q if r.get("gbs", r.get("speedup")) is not None]  # failed rows left out
    labels = [f"{r['scaling']}{' dual' if r['dual'] else ''}"
              + (f"\n{r['shape'][0]}x{r['shape'][1]}" if "shape" in r else "") for r in q]
    if "gbs" in q[0]:
        ax.bar(range(len(q)), [r["gbs"] for r in q])
        ax.axhline(q[0]["copy_gbs"], color="black", linestyle="--", linewidth=1,
                   label="device copy")
        ax.set_ylabel("quantize GB/s")
        ax.legend(fontsize=7)
    else:
        ax.bar(range(len(q)), [r["speedup"] for r in q])
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_ylabel("reference time / C++ time")
    ax.set_xticks(range(len(q)), labels, fontsize=6, rotation=60)
    ax.set_title("FP8 quantize", fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def _lowp_linear(ax, lin: list) -> None:
    for key in dict.fromkeys(k for r in lin for k in r if k.endswith("_speedup")):
        ax.plot(*_points(lin, "size", key), marker="o", label=key[: -len("_speedup")])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="bf16")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M = N = K")
    ax.set_ylabel("speedup over bf16 (fwd+bwd)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title("Float8Linear", fontsize=9)


def _lowp_split(ax, split: dict) -> None:
    """Stacked bars: each contender's profiled step, ms per category (a failed one named)."""
    rows = {n: r for n, r in split["contenders"].items() if "categories" in r}
    failed = [n for n, r in split["contenders"].items() if "categories" not in r]
    names = list(rows)
    cats = list(next(iter(rows.values()))["categories"]) if rows else []
    left = [0.0] * len(names)
    for cat in cats:
        ms = [rows[n]["categories"][cat]["ms"] for n in names]
        ax.barh(range(len(names)), ms, left=left, label=cat)
        left = [a + b for a, b in zip(left, ms)]
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms in the profiled fwd+bwd")
    if cats:
        ax.legend(fontsize=6)
    ax.grid(axis="x", alpha=0.3)
    title = f"where a step goes, M=N=K={split.get('size')}"
    ax.set_title(title + (f"\nfailed: {', '.join(failed)}" if failed else ""), fontsize=9)


def plot_json(plot, json_path, png_path) -> Path:
    """Read a benchmark's JSON file and draw it with `plot` (what each bench's --plot calls)."""
    with open(json_path) as f:
        return plot(json.load(f), png_path)


# ---- bench_activations -------------------------------------------------------------------------


def plot_activations(data: dict, path) -> Path:
    """Step time and peak memory per contender, side by side."""
    plt = pyplot()
    rows = data["rows"]
    names = [r["contender"].replace(" ", "\n", 1) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(SIZE[0] * 1.3, SIZE[1]))
    bars = a.bar(names, [r["step s"] for r in rows], color="tab:blue")
    a.bar_label(bars, [f"{r['step s']:.2g}" for r in rows], fontsize=7)
    a.set_ylabel("seconds per training step")
    bars = b.bar(names, [r["peak MB"] for r in rows], color="tab:orange")
    b.bar_label(bars, [f"{r['peak MB']:.0f}" for r in rows], fontsize=7)
    b.set_ylabel("peak memory growth, MB")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    c, nv = data["config"], data["nvme"]
    fig.suptitle(f"saved activations: GPT {c['layers']}x{c['dim']}, {c['batch']}x{c['seq_len']}"
                 f" tokens, {c['device']}; NVMe I/O {nv['hidden_fraction']:.0%} hidden, "
                 f"{nv.get('not_waited_fraction', 0):.0%} not waited for; {_machine(data)}",
                 fontsize=8)
    return _save(fig, path)


# ---- bench_held_state --------------------------------------------------------------------------


def plot_held_state(data: dict, path) -> Path:
    """Median seconds per way of reading a held optimizer generation into a checkpoint, with
    each bar's GB/s and its ratio to the checkpoint writer's path."""
    plt = pyplot()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=SIZE)
    names = [r["way"].replace(" (", "\n(", 1) for r in rows]
    bars = ax.bar(names, [r["median s"] for r in rows], color=["tab:blue", "tab:orange"])
    ax.bar_label(bars, [f"{r['median s']:.3g} s, {r['GB/s']:.2f} GB/s, "
                        f"{r['vs through RAM']:.2f}x" for r in rows], fontsize=7)
    ax.set_ylabel("seconds (median)")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    gb = rows[0]["GB"] if rows else 0
    repeat = data.get("args", {}).get("repeat", "?")
    _title(ax, f"a held optimizer generation ({gb:.2f} GB) into a checkpoint, median of "
               f"{repeat}", data)
    return _save(fig, path)


# ---- bench_zero_load ---------------------------------------------------------------------------


def plot_zero_load(data: dict, path) -> Path:
    """Peak RSS growth per rank of each way of building a sharded model, against the model's
    bytes and one rank's shard (a mode killed by the memory cap is drawn at the cap, hatched)."""
    plt = pyplot()
    rows, cfg = data["rows"], data.get("config", {})
    fig, ax = plt.subplots(figsize=SIZE)
    cap = cfg.get("limit_mib")
    heights, labels, hatches = [], [], []
    for r in rows:
        growth = r["peak RSS growth MB/rank"]
        killed = not isinstance(growth, (int, float))
        heights.append((cap or 0) if killed else growth)
        labels.append("killed" if killed else f"{growth:.0f} MB, {r['x model']:.2f}x, "
                                              f"{r['time s']:.1f} s")
        hatches.append("//" if killed else "")
    bars = ax.bar([r["mode"] for r in rows], heights, color="tab:blue")
    for bar, hatch in zip(bars, hatches):
        bar.set_hatch(hatch)
    ax.bar_label(bars, labels, fontsize=7)
    model_mb = cfg.get("model_bytes", 0) / 2**20
    ax.axhline(model_mb, color="black", linestyle="--", linewidth=1, label="model (fp32)")
    shard = next((r["shard MB/rank"] for r in rows if "shard MB/rank" in r), None)
    if shard is not None:
        ax.axhline(shard, color="tab:green", linestyle=":", linewidth=1, label="shard per rank")
    ax.set_ylabel("peak RSS growth per rank (MB)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    limit = f", capped at {cap} MiB" if cap else ""
    _title(ax, f"shard(stage=3) of a {model_mb:.0f} MB model, 2 gloo ranks{limit}", data)
    return _save(fig, path)
