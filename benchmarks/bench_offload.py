"""Optimizer step time with offloaded state: tierlift AdamW offload="none"/"cpu"/"nvme" against
torch.optim.AdamW, and the NVMe step against its I/O roofline, measured in the same run; with
--gpu, TFLOPS fine-tuning the largest Llama-shaped model the machine holds, tierlift offload
against DeepSpeed ZeRO-3 with CPU optimizer offload.

    python benchmarks/bench_offload.py                              # 16M params, state under /tmp
    python benchmarks/bench_offload.py --params 1e8 --dir /nvme0 --repeats 5
    python benchmarks/bench_offload.py --gpu --dir /nvme0           # GPU machine: plan + both runs
    python benchmarks/bench_offload.py --gpu --plan-only            # the sizing, anywhere
    python benchmarks/bench_offload.py --gpu --model 1b --tier nvme --overlap \
        --offload-params cpu --peer torch-cpu --steps 10            # ZeRO-3 vs torch AdamW on CPU
    python benchmarks/bench_offload.py --gpu --model 1b --tier cpu --overlap --batch-size 8 \
        --contenders tierlift,torch-cpu,deepspeed                   # side by side, state in RAM
    python benchmarks/bench_offload.py --gpu --gpu-mem 140 --model 7b --tier cpu --overlap \
        --cpu-budget 92 --batch-size 4                              # one generation + spare
    python benchmarks/bench_offload.py --gpu --model 1b --tier nvme --batch-size 8 \
        --disk-json benchmarks/results/bench_io-disk.json           # step vs disk roofline
    python benchmarks/bench_offload.py --deepspeed-check            # DeepSpeed config + CPU Adam
    python benchmarks/bench_offload.py --finetune-check             # the --gpu code, CPU, tiny
    python benchmarks/bench_offload.py --layouts                    # RAM vs hybrid vs NVMe
    python benchmarks/bench_offload.py --layouts --state-dtype both # each: compact vs fp32 state
    python benchmarks/bench_offload.py --layouts --durable          # + all-NVMe, durable=True
    python benchmarks/bench_offload.py --recipes --params 8e6       # overlap kept per recipe
    python benchmarks/bench_offload.py --clipped --params 3.2e7     # clipped steps, overlapped
    python benchmarks/bench_offload.py --legs                       # ZeRO-3 step split by leg

Step mode: fp32 CPU parameters. The NVMe case gets cpu_budget = a third of its state (fp32
master, m, v = 12 B/param), so every step streams the whole state through the pool. It runs
first (before torch's OpenMP threads are woken by the other cases), round by round: one step,
one I/O replay (the step's own requests and pipeline with no CRC and no Adam, which separates
the cost of the I/O pattern from the compute the step adds), one disk probe. Roofline of a
round: the state bytes the step read and wrote (from last_step_stats; only the used part of
each chunk moves) over the read and write bandwidth of that round's probe: O_DIRECT through
tierlift.io from aligned pool buffers, one request as large as one state file, the fastest of
six buffers, two each with 1, 2 and 4 MiB engine blocks (a lower bound takes the best the disk
serves; on the development VM the speed follows how physically contiguous a buffer is, which
is printed for the step's, the replay's and the probes' buffers, with a warning when every
probe buffer is more fragmented than the step's). Read and
write bandwidths add up as time (bytes read / read bw + bytes written / write bw) because the
probe's read-while-writing takes as long as one after the other on this disk (shown as
"parallel"; were it faster, the mixed rate would bound the roofline instead). The ratio is
taken per round and its median reported: the disk of a shared VM changes speed by 2x within a
minute, so a probe taken once, apart from the steps, does not describe them. Also shown: the
page-cache roofline (buffered probe). Other cases: median of --repeats steps. Last, the last
step of the cpu and nvme cases by leg (last_step_stats, all on the stepping thread here).

Fine-tuning mode (--gpu): see offload_finetune.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import tierlift  # noqa: E402, F401
from common import machine, median_time, print_table, write_json  # noqa: E402
from offload_clipped import bench_clipped  # noqa: E402
from offload_finetune import add_finetune_args, finetune, run_case  # noqa: E402
from offload_legs import bench_legs  # noqa: E402
from offload_recipes import bench_recipes  # noqa: E402
from plots import plot_json, plot_offload  # noqa: E402
from tierlift.offload.durable import durable_dir  # noqa: E402
from tierlift.optim import AdamW  # noqa: E402
from tierlift.plan.measure import disk_bandwidth  # noqa: E402
from tierlift.plan.planner import state_bytes_per_param  # noqa: E402


def _params(n: int) -> list[torch.nn.Parameter]:
    sizes = [n // 4] * 3 + [n - 3 * (n // 4)]  # a few large tensors, like a model's matrices
    ps = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


class IoReplay:
    """The NVMe step's own I/O with nothing else: the same engine settings, files, request sizes
    and pipeline (S slots: reads S-2 chunks ahead, waits for the writes of the chunk that last
    used a slot, writes chunk k back to the other generation, one sync at the end), no CRC-32C,
    no Adam. It tells the I/O pattern's cost on this disk apart from the compute the step adds."""

    def __init__(self, directory: str, *, used_bytes: list[int], kinds: int, chunk_bytes: int,
                 slots: int, queue_depth: int, block_size: int):
        from tierlift.io import EngineConfig, IoEngine

        self.used, self.kinds, self.chunk, self.slots = used_bytes, kinds, chunk_bytes, slots
        self.eng = IoEngine(EngineConfig(queue_depth=queue_depth,
                                         pool_bytes=slots * kinds * chunk_bytes,
                                         block_size=block_size))
        self.bufs = [[self.eng.pool_tensor(chunk_bytes) for _ in range(kinds)]
                     for _ in range(slots)]
        self.paths = [[os.path.join(directory, f"replay.{k}.{g}") for g in (0, 1)]
                      for k in range(kinds)]
        for path in self._all_paths():
            with open(path, "wb") as f:
                os.ftruncate(f.fileno(), len(used_bytes) * chunk_bytes)
        self.gen = 0

    def _all_paths(self):
        return [p for pair in self.paths for p in pair]

    def _io(self, i: int, gen: int, write: bool) -> list:
        op = self.eng.write if write else self.eng.read
        return [op(self.bufs[i % self.slots][k][:self.used[i]], self.paths[k][gen],
                   i * self.chunk) for k in range(self.kinds)]

    def step(self) -> None:
        n, reads, writes, issued = len(self.used), {}, {}, 0
        for i in range(n):
            while issued < min(i + self.slots - 1, n):
                for h in writes.pop(issued - self.slots, []):
                    h.wait()
                reads[issued] = self._io(issued, self.gen, False)
                issued += 1
            for h in reads.pop(i):
                h.wait()
            writes[i] = self._io(i, 1 - self.gen, True)
        for hs in writes.values():
            for h in hs:
                h.wait()
        self.eng.sync()
        self.gen = 1 - self.gen

    def close(self) -> None:
        for path in self._all_paths():
            self.eng.forget(path)
            os.unlink(path)
        self.eng.close()


class DiskProbe:
    """O_DIRECT bandwidth of the directory through tierlift.io, from aligned pool buffers as the
    step does its I/O: one `nbytes` read, one `nbytes` write + fdatasync, and both at once (a
    read of one file while another is written, then the sync), which says whether the device
    serves reads and writes in parallel or shares one bandwidth between them. `block_size`: the
    engine's largest request (DiskProbe.best() takes the fastest of several)."""

    def __init__(self, directory: str, nbytes: int, block_size: int = 1 << 20):
        from tierlift.io import EngineConfig, IoEngine

        self.n = -(-nbytes // 4096) * 4096
        self.eng = IoEngine(EngineConfig(pool_bytes=2 * self.n, block_size=block_size))
        self.rbuf, self.wbuf = self.eng.pool_tensor(self.n), self.eng.pool_tensor(self.n)
        self.wbuf.fill_(7)
        self.src, self.dst = (os.path.join(directory, f"probe{block_size}.{id(self)}.{x}")
                              for x in ("src", "dst"))
        for path in (self.src, self.dst):
            self.eng.write(self.wbuf, path, 0).wait()
        self.eng.sync()

    def measure(self) -> tuple[float, float, float]:
        """(read_s, write_s, both_s) for nbytes each."""
        t0 = time.perf_counter()
        self.eng.read(self.rbuf, self.src, 0).wait()
        t1 = time.perf_counter()
        self.eng.write(self.wbuf, self.dst, 0).wait()
        self.eng.sync()
        t2 = time.perf_counter()
        r, w = self.eng.read(self.rbuf, self.src, 0), self.eng.write(self.wbuf, self.dst, 0)
        r.wait()
        w.wait()
        self.eng.sync()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def close(self) -> None:
        for path in (self.src, self.dst):
            self.eng.forget(path)
            os.unlink(path)
        self.eng.close()


# Request sizes the probe tries, two buffers each (the best counts): on the development VM the
# speed follows how physically contiguous a buffer's pages are (see contiguity()), so more
# buffers give the probe more chances at the device's real speed.
PROBE_BLOCKS = (1 << 20, 2 << 20, 4 << 20) * 2


def probe_best(probes: list[DiskProbe]) -> tuple[float, float, float]:
    """One round: every probe once, the fastest read, write and read+write of them (the
    roofline is a lower bound, so it takes the best request shape the disk was seen to serve,
    not only the one the step uses)."""
    got = [p.measure() for p in probes]
    return tuple(min(g[i] for g in got) for i in range(3))


def roofline_of(read_bytes: float, write_bytes: float, n: int, probe) -> tuple[float, float]:
    """(roofline_s, parallel): the least time the disk needs to read and write those bytes,
    from one round of DiskProbe.measure(). If the device shares one bandwidth between reads and
    writes (read and write at once take as long as one after the other), that is bytes read /
    read bandwidth + bytes written / write bandwidth; if it serves both in parallel, the mixed
    probe's rate bounds it lower. The smaller of the two is taken, so it stays a lower bound
    either way; `parallel` = (read_s + write_s) / both_s tells which held (1.0: shared)."""
    r, w, both = probe
    serial = read_bytes * r / n + write_bytes * w / n
    mixed = (read_bytes + write_bytes) * both / (2 * n)
    return min(serial, mixed), (r + w) / both


def contiguity(t: torch.Tensor) -> float | None:
    """Mean length in 4 KiB pages of the physically contiguous runs under tensor `t` (from
    /proc/self/pagemap; None without the privilege to see frame numbers). On the development VM
    the disk's O_DIRECT speed follows it: ~2.5 GB/s read into 1-page runs, ~4 GB/s at 3 pages,
    ~6 GB/s at 25 and more (likely: each discontiguous piece is one segment of a device
    request, at most 254 per request on virtio-blk)."""
    first, n = t.data_ptr() // 4096, -(-t.nbytes // 4096)
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read(n * 8)
    except OSError:
        return None
    pfns = [int.from_bytes(raw[i:i + 8], "little") & ((1 << 55) - 1) for i in range(0, len(raw), 8)]
    if not any(pfns):
        return None
    return len(pfns) / (1 + sum(1 for a, b in zip(pfns, pfns[1:]) if b != a + 1))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def bench_nvme(n: int, budget: int, directory: str, repeats: int) -> dict:
    """The NVMe step, its I/O replay and the disk probe, interleaved round by round: the disk
    of a shared VM changes speed by 2x within a minute, so each step is compared with the
    roofline measured right next to it (the ratio is taken per round, then its median)."""
    ps = _params(n)
    opt = AdamW(ps, lr=1e-3, offload="nvme", nvme_path=directory, cpu_budget=budget)
    off = opt._offload
    shape = {"used_bytes": [u * 4 for lay in off.layouts for u in
                            (lay.used_elems(c.ci) for c in lay.chunks)],
             "kinds": len(off.tiers[0].kinds), "chunk_bytes": off.chunk_elems * 4,
             "slots": off.n_slots, "queue_depth": off.config.queue_depth,
             "block_size": off._engine.config.block_size}
    replay = IoReplay(directory, **shape)
    probes = [DiskProbe(directory, 4 * n, bs) for bs in PROBE_BLOCKS]
    rounds = []
    try:
        opt.step()  # warm-up: first-step master init, files touched
        replay.step()
        probe_best(probes)
        runs = {"step": _median([contiguity(b) or 0 for slot in off._slots for b in slot.values()]),
                "replay": _median([contiguity(b) or 0 for slot in replay.bufs for b in slot]),
                "probe": [contiguity(p.rbuf) or 0 for p in probes]}
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            step_s = time.perf_counter() - t0
            st = dict(opt.last_step_stats)
            t0 = time.perf_counter()
            replay.step()
            replay_s = time.perf_counter() - t0
            pr = probe_best(probes)
            n_probe = probes[0].n
            roof, parallel = roofline_of(st["nvme_read_bytes"], st["nvme_write_bytes"],
                                         n_probe, pr)
            rounds.append({"step_s": step_s, "replay_s": replay_s, "roofline_s": roof,
                           "read_bps": n_probe / pr[0], "write_bps": n_probe / pr[1],
                           "parallel": parallel, "stats": st})
    finally:
        for probe in probes:
            probe.close()
        replay.close()
        off.close()
    ratios = [r["step_s"] / r["roofline_s"] for r in rounds]
    return {"rounds": rounds, "ratio_median": _median(ratios), "ratio_best": min(ratios),
            "replay_ratio_median": _median([r["replay_s"] / r["roofline_s"] for r in rounds]),
            "step_s": _median([r["step_s"] for r in rounds]),
            "best_step_s": min(r["step_s"] for r in rounds),
            "replay_s": _median([r["replay_s"] for r in rounds]),
            "roofline_s": _median([r["roofline_s"] for r in rounds]),
            "parallel": _median([r["parallel"] for r in rounds]), "shape": shape,
            "contiguous_pages": runs}


def bench_step(args) -> int:
    n = int(args.params)
    state_bytes = 12 * n
    budget = state_bytes // 3
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    # First, before torch's OpenMP threads are woken by the cases below.
    nv = bench_nvme(n, budget, tmp.name, args.repeats)
    cases = {
        "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "tierlift none": lambda ps: AdamW(ps, lr=1e-3),
        "tierlift cpu": lambda ps: AdamW(ps, lr=1e-3, offload="cpu"),
    }
    times, best = {}, {}
    for name, make in cases.items():
        ps = _params(n)
        opt = make(ps)
        samples = []

        def timed(opt=opt, samples=samples):
            t0 = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - t0)

        times[name] = median_time(timed, repeats=args.repeats, warmup=1)
        best[name] = min(samples[1:])  # on a shared machine, the least disturbed step
        if name == "tierlift cpu":
            cpu_stats = dict(opt.last_step_stats)
        del opt, ps
    times["tierlift nvme"], best["tierlift nvme"] = nv["step_s"], nv["best_step_s"]
    cached_read_bps, cached_write_bps = disk_bandwidth(tmp.name, 4 * n, direct=False)
    last = nv["rounds"][-1]["stats"]
    cached_roofline = (last["nvme_read_bytes"] / cached_read_bps
                       + last["nvme_write_bytes"] / cached_write_bps)
    base = times["torch AdamW"]
    rows = []
    for name, t in times.items():
        rows.append({"case": name, "step_ms": f"{t * 1e3:.1f}",
                     "best_ms": f"{best[name] * 1e3:.1f}", "vs_torch": f"{t / base:.2f}x",
                     "vs_roofline": f"{nv['ratio_median']:.2f}x" if name == "tierlift nvme"
                     else ""})
    rows.append({"case": "nvme I/O replay", "step_ms": f"{nv['replay_s'] * 1e3:.1f}",
                 "vs_torch": f"{nv['replay_s'] / base:.2f}x",
                 "vs_roofline": f"{nv['replay_ratio_median']:.2f}x"})
    rows.append({"case": "nvme I/O roofline", "step_ms": f"{nv['roofline_s'] * 1e3:.1f}",
                 "vs_torch": f"{nv['roofline_s'] / base:.2f}x", "vs_roofline": "1.00x"})
    rows.append({"case": "page-cache roofline", "step_ms": f"{cached_roofline * 1e3:.1f}",
                 "vs_torch": f"{cached_roofline / base:.2f}x",
                 "vs_roofline": f"{cached_roofline / nv['roofline_s']:.2f}x"})
    print_table(rows, ["case", "step_ms", "best_ms", "vs_torch", "vs_roofline"],
                title=f"AdamW step, {n / 1e6:.0f}M fp32 params, state {state_bytes >> 20} MiB, "
                      f"cpu_budget {budget >> 20} MiB, dir {tmp.name}")
    rd = [r["read_bps"] / 1e9 for r in nv["rounds"]]
    wr = [r["write_bps"] / 1e9 for r in nv["rounds"]]
    sh = nv["shape"]
    print(f"{len(sh['used_bytes'])} chunks of {sh['kinds']} x {sh['chunk_bytes'] / 1e6:.1f} MB, "
          f"{sh['slots']} pipeline slots; step moved {last['nvme_read_bytes'] / 1e6:.0f} MB read "
          f"+ {last['nvme_write_bytes'] / 1e6:.0f} MB written (state {state_bytes / 1e6:.0f} MB)")
    print(f"disk (O_DIRECT probe, per round): read {min(rd):.2f}-{max(rd):.2f} GB/s, write "
          f"{min(wr):.2f}-{max(wr):.2f} GB/s; read+write at once took "
          f"1/{nv['parallel']:.2f} of one after the other (1.00: one shared bandwidth); "
          f"page cache: read {cached_read_bps / 1e9:.2f}, write {cached_write_bps / 1e9:.2f} GB/s")
    print(f"nvme step / roofline, per round: median {nv['ratio_median']:.2f}x, best "
          f"{nv['ratio_best']:.2f}x; I/O replay (no CRC/Adam) / roofline: median "
          f"{nv['replay_ratio_median']:.2f}x")
    cp = nv["contiguous_pages"]
    print(f"pool memory, mean physically contiguous run (4 KiB pages; 0: unknown): step "
          f"{cp['step']:.1f}, replay {cp['replay']:.1f}, probes "
          f"{', '.join(f'{x:.1f}' for x in cp['probe'])} (the disk's speed follows it here)")
    fragmented = bool(cp["step"]) and max(cp["probe"]) < cp["step"]
    if fragmented:
        print("WARNING: every probe buffer was more fragmented than the step's, so this run's "
              "roofline may be above the device's floor (not a lower bound)")
    print_legs({"tierlift cpu": cpu_stats, "tierlift nvme": last})
    path = write_json("bench_offload", {
        "machine": machine(), "params": n, "state_bytes": state_bytes, "cpu_budget": budget,
        "step_s": times, "best_step_s": best, "roofline_s": nv["roofline_s"],
        "ratio_median": nv["ratio_median"], "ratio_best": nv["ratio_best"],
        "io_replay_s": nv["replay_s"], "io_replay_ratio_median": nv["replay_ratio_median"],
        "read_write_parallel": nv["parallel"], "page_cache_roofline_s": cached_roofline,
        "page_cache_read_bps": cached_read_bps, "page_cache_write_bps": cached_write_bps,
        "io_replay_shape": sh, "contiguous_pages": nv["contiguous_pages"],
        "roofline_buffer_more_fragmented": fragmented, "rounds": nv["rounds"]})
    if args.plot:
        print(f"wrote {plot_json(plot_offload, path, args.plot)}")
    tmp.cleanup()
    return 0


# (label, last_step_stats key, counted: "other" is total_s less the counted legs; the others
# are parts of a counted leg, as the read CRCs are of the read wait)
STEP_LEGS = [("CPU Adam kernel", "cpu_step_s", True), ("gradient check", "grad_check_s", True),
             ("NVMe read wait", "nvme_read_wait_s", True),
             ("NVMe write wait", "nvme_write_wait_s", True),
             ("  of which fdatasync", "nvme_sync_s", False),
             ("CRC-32C (reads: in the wait)", "checksum_s", False),
             ("D2H grads", "d2h_s", True), ("H2D params", "h2d_s", True)]


def print_legs(stats: dict[str, dict]) -> None:
    """The last step of each case by leg (last_step_stats), in ms; "other" is the step's time
    outside them. Every leg here is on the stepping thread, so all of it is exposed."""
    rows = []
    for label, key, _ in STEP_LEGS + [("other", None, False), ("step (total_s)", "total_s", False)]:
        row = {"leg": label}
        for case, st in stats.items():
            if key is None:
                v = st.get("total_s", 0.0) - sum(st.get(k, 0.0) for _, k, part in STEP_LEGS
                                                 if part)
            else:
                v = st.get(key, 0.0)
            row[case] = f"{v * 1e3:.1f}"
        rows.append(row)
    print_table(rows, ["leg", *stats], title="last step by leg, ms (D2H/H2D: device parameters "
                                             "only; bench_offload.py --legs: the ZeRO-3 step)")


# ---- layouts mode (--layouts) ---------------------------------------------------------------
DURABLE_TAG = ", durable"


def layout_cases(n: int, directory: str, state_dtypes=("fp32",), durable: bool = False) -> dict:
    """The same model's state all in host memory, split half and half between host memory and
    NVMe (two generations and one), and all on NVMe (two and one), each as AdamW kwargs. The
    NVMe-only cases get a third of the fp32 state (master, m, v: 12 B/param) as their pool, as
    in step mode; the hybrids a quarter of it (the pool takes at most a quarter of a hybrid
    budget) plus half of it. Compact state (state_dtype="bf16", 7.02 B/param) gets the same
    budgets in bytes, so its hybrids hold a larger share of their state in RAM: each layout is
    compared at the same host memory. Names of compact cases end in ", bf16". With `durable`,
    the all-NVMe layouts also run with durable=True (names end in ", durable"), each in its own
    folder under `directory` (one process owns one nvme_path's durable state at a time)."""
    state = 12 * n
    nvme = dict(offload="nvme", nvme_path=directory, cpu_budget=state // 3)
    hybrid = dict(offload="hybrid", nvme_path=directory, cpu_budget=state // 2 + state // 12)
    base = {"all RAM": dict(offload="cpu"),
            "hybrid, 2 gens": hybrid, "hybrid, 1 gen": dict(hybrid, nvme_generations=1),
            "all NVMe, 2 gens": nvme, "all NVMe, 1 gen": dict(nvme, nvme_generations=1)}
    if durable:
        for name in ("all NVMe, 2 gens", "all NVMe, 1 gen"):
            sub = os.path.join(directory, "durable-" + name.split(", ")[1].replace(" ", ""))
            base[name + DURABLE_TAG] = dict(base[name], nvme_path=sub, durable=True)
    cases = {}
    for name, kw in base.items():
        for sd in state_dtypes:
            kw = dict(kw, state_dtype=sd)
            if kw.get("durable") and sd != "fp32":
                kw["nvme_path"] = f"{kw['nvme_path']}-{sd}"
            cases[name + ("" if sd == "fp32" else f", {sd}")] = kw
    return cases


def disk_files(path: str) -> dict[str, int]:
    """Bytes each file under `path` takes on the disk (st_blocks: sparse holes not counted)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            try:
                out[os.path.relpath(full, path)] = os.stat(full).st_blocks * 512
            except FileNotFoundError:
                pass
    return out


def _io_bytes(st: dict) -> tuple[int, int]:
    """(read, written) bytes of a step on the disk: the state's reads and writes, plus with
    durable=True the journal copy of every in-place chunk and the gradient log (0 without)."""
    return (st.get("nvme_read_bytes", 0),
            st.get("nvme_write_bytes", 0) + st.get("journal_write_bytes", 0)
            + st.get("grad_log_bytes", 0))


# Stats of a durable step shown per row (median over the rounds), in ms.
DURABLE_STATS = ("grad_log_s", "manifest_s", "nvme_write_wait_s", "nvme_sync_s",
                 "nvme_read_wait_s", "checksum_s")


def bench_layouts(args) -> int:
    """Step time per layout at one model size, against the I/O roofline of its NVMe part (the
    bytes its step read and wrote over the disk probe of the same round). Rounds interleave the
    layouts (one step each, then a probe) so a shared disk's swings hit them all alike. With
    --state-dtype both, every layout runs with fp32 and with compact state in the same rounds
    and vs_fp32 is the compact step over the fp32 one of the same layout."""
    n = int(args.params)
    dtypes = ("fp32", "bf16") if args.state_dtype == "both" else (args.state_dtype,)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    probes = [DiskProbe(tmp.name, 4 * n, bs) for bs in PROBE_BLOCKS]
    opts, steps, roofs, stats = {}, {}, {}, {}
    try:
        for name, kw in layout_cases(n, tmp.name, dtypes, args.durable).items():
            if kw.get("durable"):  # a state left by an earlier run would be reopened
                os.makedirs(kw["nvme_path"], exist_ok=True)
                shutil.rmtree(durable_dir(kw["nvme_path"]), ignore_errors=True)
            opts[name] = (AdamW(_params(n), lr=1e-3, **kw), kw)
            opts[name][0].step()  # warm-up: first-step master init
            steps[name], roofs[name], stats[name] = [], [], []
        probe_best(probes)
        for _ in range(args.repeats):
            for name, (opt, _) in opts.items():
                t0 = time.perf_counter()
                opt.step()
                steps[name].append(time.perf_counter() - t0)
                st = opt.last_step_stats
                stats[name].append(dict(st))
                roofs[name].append(_io_bytes(st))
            pr = probe_best(probes)
            for name in opts:
                rd, wr = roofs[name][-1]
                roofs[name][-1] = roofline_of(rd, wr, probes[0].n, pr)[0] if rd or wr else 0.0
        rows, out = [], {}
        for name, (opt, kw) in opts.items():
            sd = kw["state_dtype"]
            tag = "" if sd == "fp32" else f", {sd}"
            base = _median(steps["all RAM" + tag])
            fp32 = name[:-len(tag)] if tag else None
            off = opt._offload
            tier = off.tiers[0]
            in_ram = getattr(tier, "n_ram", len(tier.gen) if kw["offload"] == "cpu" else 0)
            disk = sum(getattr(t, "disk_bytes", 0) for t in off.tiers)
            step, roof = _median(steps[name]), _median(roofs[name])
            st = opt.last_step_stats
            out[name] = {"state_dtype": sd, "step_s": step, "best_step_s": min(steps[name]),
                         "roofline_s": roof,
                         "ram_chunks": in_ram, "chunks": len(tier.gen), "disk_bytes": disk,
                         "cpu_budget": kw.get("cpu_budget"), "stats": dict(st)}
            rows.append({"layout": name, "step_ms": f"{step * 1e3:.1f}",
                         "vs_all_ram": f"{step / base:.2f}x",
                         "vs_fp32": f"{step / _median(steps[fp32]):.2f}x"
                                    if fp32 in steps else "",
                         "ram_chunks": f"{in_ram}/{len(tier.gen)}",
                         "disk_MB": f"{disk / 1e6:.0f}",
                         "io_MB": f"{sum(_io_bytes(st)) / 1e6:.0f}",
                         "roofline_ms": f"{roof * 1e3:.1f}" if roof else "",
                         "vs_roofline": f"{step / roof:.2f}x" if roof else ""})
            if args.durable:
                # the state folder's files as they lie on the disk, for every layout with one
                files = disk_files(off._dir) if getattr(off, "_dir", None) else {}
                du = sum(files.values())
                plain = name.replace(DURABLE_TAG, "") if kw.get("durable") else None
                out[name].update({"durable": bool(kw.get("durable")), "folder_disk_bytes": du,
                                  "folder_files": files, "steps_s": steps[name],
                                  "round_stats": stats[name]})
                rows[-1]["du_MB"] = f"{du / 1e6:.0f}" if du else ""
                if plain:
                    rel = step / _median(steps[plain])
                    out[name].update({"plain_layout": plain, "vs_plain": rel,
                                      "vs_plain_rounds": [a / b for a, b in
                                                          zip(steps[name], steps[plain])]})
                    rows[-1]["vs_plain"] = f"{rel:.2f}x"
                    rows[-1]["extra_ms"] = f"{(step - _median(steps[plain])) * 1e3:.1f}"
    finally:
        for opt, kw in opts.values():
            opt._offload.close()
            if kw.get("durable"):  # kept on close by design; the next run starts fresh
                shutil.rmtree(durable_dir(kw["nvme_path"]), ignore_errors=True)
        for probe in probes:
            probe.close()
    cols = ["layout", "step_ms", "vs_all_ram", "vs_fp32", "ram_chunks", "disk_MB", "io_MB",
            "roofline_ms", "vs_roofline"]
    if len(dtypes) == 1:
        cols.remove("vs_fp32")
    if args.durable:
        cols[cols.index("disk_MB") + 1:cols.index("disk_MB") + 1] = ["du_MB"]
        cols[cols.index("step_ms") + 1:cols.index("step_ms") + 1] = ["vs_plain", "extra_ms"]
    sizes = ", ".join(f"{sd} {int(sum(state_bytes_per_param(sd).values()) * n) >> 20} MiB"
                      for sd in dtypes)
    print_table(rows, cols,
                title=f"AdamW step by layout, {n / 1e6:.0f}M fp32 params, state ({sizes}), "
                      f"median of {args.repeats} interleaved rounds, dir {tmp.name}")
    if args.durable:
        print("durable rows, median per step over the rounds (ms); the plain layout's beside "
              "it: " + ", ".join(DURABLE_STATS))
        for name, (_, kw) in opts.items():
            if not kw.get("durable"):
                continue
            plain = name.replace(DURABLE_TAG, "")
            for label in (name, plain):
                med = {k: _median([r.get(k, 0.0) for r in stats[label]]) for k in DURABLE_STATS}
                st = stats[label][-1]
                print(f"  {label:28s} " + " ".join(f"{k[:-2]} {v * 1e3:6.1f}"
                                                   for k, v in med.items())
                      + f"  | grad log {st.get('grad_log_bytes', 0) / 1e6:.0f} MB, journal "
                        f"{st.get('journal_write_bytes', 0) / 1e6:.0f} MB, in place/new gen "
                        f"{st.get('nvme_write_bytes', 0) / 1e6:.0f} MB written")
    name = "bench_offload_layouts" + ("" if dtypes == ("fp32",) else f"-{args.state_dtype}")
    name += "-durable" if args.durable else ""
    payload = {"machine": machine(), "params": n, "state_dtype": args.state_dtype,
               "layouts": out}
    if args.durable:
        payload.update({"durable": True, "repeats": args.repeats})
    write_json(name, payload)
    tmp.cleanup()
    return 0


# ---- fine-tuning mode (--gpu) -------------------------------------------------------------
# Llama-shaped ladder (vocab 32000), smallest first.
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--dir", default=None, help="directory on the drive (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", action="store_true",
                    help="step time of all-RAM, hybrid and all-NVMe state at one size")
    ap.add_argument("--durable", action="store_true",
                    help="--layouts: also run the all-NVMe layouts with durable=True in the "
                         "same rounds (vs_plain: their step over the same layout's without; "
                         "du_MB: the state folder's files on the disk, st_blocks)")
    ap.add_argument("--recipes", action="store_true",
                    help="overlap under training recipes (HF clip, GradScaler, max_grad_norm): "
                         "chunks kept and the content check's share of the step")
    ap.add_argument("--clipped", action="store_true",
                    help="overlap on clipped steps (max_grad_norm below the norm): step() "
                         "leaving the worker's unstarted chunks vs waiting for them vs no "
                         "overlap, timed in turn")
    ap.add_argument("--plot", metavar="PATH", help="also draw the results as a PNG here (needs "
                    "matplotlib): the step legs, or with --gpu the TFLOPS")
    ap.add_argument("--legs", action="store_true",
                    help="ZeRO-3 with parameter and optimizer offload on this machine: the step "
                         "split by leg (last_step_stats['legs']: forward, backward, H2D, D2H, "
                         "CPU Adam per thread, NVMe read/write, other), each leg's time and the "
                         "part the training thread waited for, with the overlap off and on")
    ap.add_argument("--legs-dim", type=int, default=512, help="--legs: block width")
    ap.add_argument("--legs-layers", type=int, default=6, help="--legs: blocks (units)")
    ap.add_argument("--legs-batch", type=int, default=256, help="--legs: rows per step")
    ap.add_argument("--legs-chunk-bytes", type=int, default=1 << 20,
                    help="--legs: AdamW chunk_bytes (a chunk that spans two units waits for "
                         "both gradients, so the default is below a unit's size)")
    ap.add_argument("--legs-host-idle", action="store_true",
                    help="--legs: each unit's compute a stand-in the host waits for, as for a "
                         "GPU (the overlap's worker gets the cores, as on a GPU machine)")
    add_finetune_args(ap)
    args = ap.parse_args(argv)
    finetuning = args.gpu or args.finetune_check or args.finetune_case
    if args.state_dtype == "both" and not args.layouts:
        ap.error("--state-dtype both is a --layouts option")
    if args.state_dtype != "fp32" and not (args.layouts or finetuning):
        ap.error("--state-dtype is a --layouts or fine-tuning (--gpu, --finetune-check) option")
    if args.durable and not args.layouts:
        ap.error("--durable is a --layouts option")
    if args.finetune_case:
        run_case(args, args.finetune_case)
        # Ends without tearing the case down: unpinning and freeing up to ~100 GiB of state
        # (7B) measures nothing and costs device time; the OS takes it back at exit.
        sys.stderr.flush()
        os._exit(0)
    if args.gpu or args.finetune_check or args.plan_only or args.deepspeed_check:
        return finetune(args)
    if args.recipes:
        return bench_recipes(args)
    if args.clipped:
        return bench_clipped(args)
    if args.legs:
        return bench_legs(args)
    if args.layouts:
        return bench_layouts(args)
    return bench_step(args)


if __name__ == "__main__":
    raise SystemExit(main())
