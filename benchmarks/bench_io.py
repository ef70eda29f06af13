"""Sequential read/write throughput of tierlift.io against fio, in one run.

    PYTHONPATH=python python benchmarks/bench_io.py --dir /tmp --size-mib 1024

Same file size, block size, queue depth and O_DIRECT for every contender: tierlift's io_uring
backend, its pread/pwrite thread backend (both from the engine's aligned pool tensors), tierlift
reading and writing the whole file as one ordinary torch tensor ("tensor", memory 64 bytes past a
page: the common case in user code, staged through the pool where the drive's O_DIRECT wants
more alignment than that; io_uring does those copies on --copy-threads threads), and fio with
ioengine=io_uring (Debian's fio; `apt-get install -y fio`). DeepSpeed's aio handle is measured
too when deepspeed is importable (bench_deepspeed; a row under "errors" where its op does not
load or work). fio runs with registered buffers and files and whole-queue
submission batches (its fastest io_uring settings). Contenders run round-robin for --repeat
rounds and each number is the median over rounds; writes include a final fdatasync (fio:
end_fsync=1). Prints a table with each contender's ratio to fio and the path its bytes took
(direct, staged or buffered, from the engine's own counters), and writes JSON to
benchmarks/results/bench_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import tierlift
from plots import plot_io, plot_json
from tierlift.io import EngineConfig, IoEngine


def drop_page_cache(path: str) -> None:
    """Evicts the file's clean pages, so a read that falls back to buffered I/O is measured from
    the drive and not from memory (O_DIRECT reads are unaffected)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class TierliftRunner:
    """One engine per backend, kept open across rounds; each call measures one write + read."""

    def __init__(self, backend: str, path: str, size: int, bs: int, qd: int, buf_bytes: int,
                 copy_threads: int = 0):
        cfg = EngineConfig(backend=backend, queue_depth=qd, block_size=bs, pool_bytes=buf_bytes,
                           copy_threads=copy_threads)
        self.eng = IoEngine(cfg)
        self.path, self.size = path, size
        self.moved = {"direct": 0, "staged": 0, "buffered": 0}
        buf = self.eng.pool_tensor(buf_bytes)  # aligned, registered with io_uring: no bounce
        buf.copy_(torch.randint(0, 256, (buf_bytes,), dtype=torch.uint8))
        self.chunk = min(buf_bytes, 8 * bs)
        self.views = [buf[i:i + self.chunk] for i in range(0, buf_bytes, self.chunk)]

    def _run(self, write: bool) -> float:
        eng = self.eng
        t0 = time.perf_counter()
        handles = []
        for k, off in enumerate(range(0, self.size, self.chunk)):
            v = self.views[k % len(self.views)]
            handles.append(eng.write(v, self.path, off) if write else eng.read(v, self.path, off))
        for h in handles:
            h.wait()
        if write:
            eng.sync()
        return self.size / (time.perf_counter() - t0) / 1e9

    def __call__(self) -> dict:
        before = self.eng.path_bytes
        write = self._run(True)
        drop_page_cache(self.path)
        read = self._run(False)
        for k, v in self.eng.path_bytes.items():
            self.moved[k] += v - before[k]
        return {"write": write, "read": read}

    def path_label(self) -> str:
        """The path most of this contender's bytes took, with its share: 'staged 100%'."""
        total = sum(self.moved.values())
        if total == 0:
            return "-"
        kind = max(self.moved, key=self.moved.get)
        return f"{kind} {100 * self.moved[kind] / total:.0f}%"

    def close(self) -> None:
        self.views = []
        self.eng.forget(self.path)
        self.eng.close()


class OrdinaryTensorRunner(TierliftRunner):
    """The common case: the whole file in one request to or from an ordinary torch tensor, whose
    memory is not 4 KiB aligned (torch's allocator aligns to 64 bytes)."""

    def __init__(self, backend: str, path: str, size: int, bs: int, qd: int, buf_bytes: int,
                 copy_threads: int = 0):
        cfg = EngineConfig(backend=backend, queue_depth=qd, block_size=bs, pool_bytes=buf_bytes,
                           copy_threads=copy_threads)
        self.eng = IoEngine(cfg)
        self.path, self.size = path, size
        self.moved = {"direct": 0, "staged": 0, "buffered": 0}
        # 64 bytes past a 4 KiB boundary, whatever the allocator returned
        raw = torch.randint(0, 256, (size + 8192,), dtype=torch.uint8)
        skip = (64 - raw.data_ptr()) % 4096
        self.tensor = raw[skip:skip + size]
        self.views = []

    def _run(self, write: bool) -> float:
        t0 = time.perf_counter()
        if write:
            self.eng.write(self.tensor, self.path, 0).wait()
            self.eng.sync()
        else:
            self.eng.read(self.tensor, self.path, 0).wait()
        return self.size / (time.perf_counter() - t0) / 1e9


def fio_once(path: str, size: int, bs: int, qd: int) -> dict:
    out = {}
    for rw in ("write", "read"):
        cmd = ["fio", "--name=tl", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
               f"--iodepth={qd}", "--direct=1", "--ioengine=io_uring", f"--size={size}",
               "--numjobs=1", "--output-format=json",
               # fio at its best: registered buffers and files, whole-queue batches
               "--fixedbufs=1", "--registerfiles=1", f"--iodepth_batch_submit={qd}",
               f"--iodepth_batch_complete_max={qd}"]
        if rw == "write":
            cmd.append("--end_fsync=1")
        res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        out[rw] = res["jobs"][0][rw]["bw_bytes"] / 1e9
    return out


def bench_deepspeed(path: str, size: int, bs: int, qd: int, repeat: int,
                    aio_ok: str | None = None) -> dict | None:
    """DeepSpeed's aio handle (the async_io op, libaio) at the same block size and queue depth:
    one synchronous write then read of the whole file from page-locked memory it allocates,
    median over `repeat`, the bytes read back compared with those written. None where deepspeed
    is not importable; an {"error": why} row where its op does not load or move the bytes
    intact, or, with aio_ok (the file bench_offload.py --deepspeed-check --aio-ok writes), where
    that check did not write it: loading an op that is not built would build it here (a minute
    of compiling inside the timed disk part)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None
    if aio_ok is not None and not os.path.exists(aio_ok):
        return {"error": f"not measured: no {aio_ok} (DeepSpeed's async_io op did not build or "
                         "did not work in bench_offload.py --deepspeed-check)"}
    handle = src = dst = None
    try:
        aio = AsyncIOBuilder().load(verbose=False)
        handle = aio.aio_handle(block_size=bs, queue_depth=qd, single_submit=False,
                                overlap_events=True, intra_op_parallelism=1)
        like = torch.empty(0, dtype=torch.uint8)
        src, dst = (handle.new_cpu_locked_tensor(size, like) for _ in range(2))
        torch.randint(0, 256, (size,), dtype=torch.uint8, out=src)
        out: dict = {}
        for name, fn, buf in (("write", handle.sync_pwrite, src), ("read", handle.sync_pread, dst)):
            runs = []
            for _ in range(repeat):
                if name == "read":
                    drop_page_cache(path)
                t0 = time.perf_counter()
                done = fn(buf, path)
                runs.append(size / (time.perf_counter() - t0) / 1e9)
                if done < 1:
                    raise RuntimeError(f"sync_p{name} returned {done}")
            out[name] = statistics.median(runs)
        if not torch.equal(src, dst):
            raise RuntimeError("the bytes read back differ from those written")
    except Exception as e:  # its row says why; the other contenders stand
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for buf in (src, dst):
            if buf is not None:
                handle.free_cpu_locked_tensor(buf)
    return {**out, "backend": "deepspeed aio", "aio": {
        "block_size": bs, "queue_depth": qd, "single_submit": False, "overlap_events": True,
        "intra_op_parallelism": 1}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the drive to test")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--block-kib", type=int, default=1024)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--buffer-mib", type=int, default=64, help="tierlift staging buffer size")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--copy-threads", type=int, default=0,
                   help="io_uring staging copy threads (0: the engine's default)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "bench_io.json"))
    p.add_argument("--deepspeed-aio-ok", metavar="PATH",
                   help="measure DeepSpeed's aio handle only if PATH exists (bench_offload.py "
                        "--deepspeed-check --aio-ok wrote it: the op is built), else an error row")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    a = p.parse_args()
    size, bs, qd = a.size_mib << 20, a.block_kib << 10, a.queue_depth
    path = os.path.join(a.dir, f"tierlift_bench_io.{os.getpid()}.bin")
    runners = {}
    if shutil.which("fio") is not None:
        runners["fio"] = lambda: fio_once(path, size, bs, qd)
    io_c = tierlift._extension._C.io
    backends = ["threads"]
    if tierlift._extension.has_uring() and not io_c.uring_unavailable_reason():
        backends.insert(0, "uring")
    samples: dict[str, list[dict]] = {}
    try:
        for b in backends:
            runners[f"tierlift {b}"] = TierliftRunner(b, path, size, bs, qd, a.buffer_mib << 20,
                                                      a.copy_threads)
            runners[f"tensor {b}"] = OrdinaryTensorRunner(b, path, size, bs, qd,
                                                          a.buffer_mib << 20, a.copy_threads)
        # Round-robin: every round measures every contender, so drift on a shared machine
        # (other jobs, host cache) hits all of them alike; the median over rounds is reported.
        for _ in range(a.repeat):
            for name, run in runners.items():
                samples.setdefault(name, []).append(run())
        ds = bench_deepspeed(path, size, bs, qd, a.repeat, a.deepspeed_aio_ok)
        moved = {name: dict(run.moved) for name, run in runners.items()
                 if isinstance(run, TierliftRunner)}
        labels = {name: runners[name].path_label() for name in moved}
    finally:
        for run in runners.values():
            if isinstance(run, TierliftRunner):
                run.close()
        if os.path.exists(path):
            os.unlink(path)
    results = {name: {rw: statistics.median(x[rw] for x in runs) for rw in ("write", "read")}
               for name, runs in samples.items()}
    errors = {}  # rows that could not be measured, kept apart from the GB/s (read_disk_json)
    if ds and "error" in ds:
        errors["deepspeed aio"] = ds["error"]
    elif ds:
        results["deepspeed aio"] = ds

    print(f"sequential I/O, {a.size_mib} MiB file in {a.dir}, block {a.block_kib} KiB, "
          f"queue depth {qd}, O_DIRECT, median of {a.repeat} round-robin rounds; "
          f"{platform.node()}, {os.cpu_count()} CPUs")
    print(f"{'contender':<20}{'write GB/s':>12}{'read GB/s':>12}{'write/fio':>12}{'read/fio':>12}"
          f"  {'path (bytes)':<14}")
    ratios = {}
    for name, r in results.items():
        rw = rr = float("nan")
        if "fio" in results:
            rw, rr = r["write"] / results["fio"]["write"], r["read"] / results["fio"]["read"]
            ratios[name] = {"write": rw, "read": rr}
        print(f"{name:<20}{r['write']:>12.2f}{r['read']:>12.2f}{rw:>12.2f}{rr:>12.2f}"
              f"  {labels.get(name, '-'):<14}")
    for name, why in errors.items():
        print(f"{name:<20}error: {why}")
    staged = [name for name, m in moved.items() if m["staged"] * 2 > sum(m.values())]
    print(f"staged rows (most bytes copied through the pool): {', '.join(staged) or 'none'}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                                                   "kernel": platform.release()},
                   "gbps": results, "errors": errors, "ratio_to_fio": ratios, "path_bytes": moved,
                   "staged_rows": staged, "samples": samples}, f, indent=2)
    print(f"wrote {a.out}")
    if a.plot:
        print(f"wrote {plot_json(plot_io, a.out, a.plot)}")


if __name__ == "__main__":
    main()
