"""Shared helpers for benchmarks/: timing, machine description, table printing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def median_time(fn, *, repeats: int = 5, warmup: int = 1, sync=None) -> float:
    """Median wall time of fn() in seconds over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict, *, repeats: int = 5, warmup: int = 1) -> dict:
    """{name: median wall time of fns[name]() in seconds}, the contenders timed in turn within
    each of `repeats` rounds, so a slow spell of a shared machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in columns))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = (
        "gpu-" + torch.cuda.get_device_name().replace(" ", "_")
        if torch.cuda.is_available()
        else "cpu"
    )
    path = RESULTS / f"{name}-{tag}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    print(f"\nwrote {path}")
    return path
