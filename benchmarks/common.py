"""Shared helpers for benchmarks/: timing, machine description, table printing, JSON output,
and keeping a run going past a contender that fails (failure, run_section)."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
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
    # the command line too: a table quoted from the file names the command that made it
    dump_json(path, {"machine": machine(), "argv": sys.argv, **payload}, indent=2)
    print(f"\nwrote {path}")
    return path


def dump_json(path, payload, indent: int = 1) -> None:
    """Write payload to path through a temporary file and a rename: a run killed mid-write (a
    time cap's SIGTERM) leaves the previous complete file, never a truncated one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


ERROR_CHARS = 2000  # of an error kept in a JSON row (torch's scaled-GEMM refusals run long)


def failure(what: str, exc: BaseException) -> str:
    """'<type>: <message>' of exc, for the row of `what` that it ended; printed with its
    traceback, and the GPU's cached memory is released so the next contender starts clean."""
    message = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    print(f"  {what}: FAILED: {message.splitlines()[0] if message else ''}", flush=True)
    traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 (a broken context: the next row reports it)
            pass
    return message


def run_section(result: dict, name: str, save, fn):
    """fn() as one section of a run; an exception is recorded as result[f"{name}_error"] and
    saved, and None returned, so the sections after it still run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (whatever ends a section is its result)
        result[f"{name}_error"] = failure(f"section {name}", exc)
        save()
        return None
