"""tierlift.io.IoEngine on both backends: round trips, many requests in flight, striping, the
pool budget, and every fault as a clear Python exception."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tierlift
from tierlift.io import EngineConfig, IoEngine

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _backends():
    out = ["threads"]
    if tierlift._extension.available() and tierlift._extension.has_uring():
        out.append("uring")
    return out


@pytest.fixture(params=["threads", "uring"])
def engine(request):
    if request.param not in _backends():
        pytest.skip("built without liburing")
    why = tierlift._extension._C.io.uring_unavailable_reason()
    if request.param == "uring" and why:
        pytest.skip(f"io_uring unavailable: {why}")
    eng = IoEngine(EngineConfig(backend=request.param, queue_depth=8, block_size=64 << 10,
                                pool_bytes=4 << 20))
    yield eng
    eng.close()


def test_backend_names(engine):
    assert engine.backend in ("io_uring", "threads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_round_trip_random_sizes(engine, tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "rt.bin"
    offset = 0
    for _ in range(6):
        n = int(torch.randint(1, 200_000, (1,), generator=g))
        src = (torch.randn(n, generator=g) * 100).to(dtype)
        engine.write(src, path, offset).wait()
        dst = torch.empty_like(src)
        assert engine.read(dst, path, offset).wait() is dst
        assert torch.equal(src, dst)
        offset += src.nbytes + 4096 * int(torch.randint(0, 3, (1,), generator=g))
    engine.sync()
    assert engine.pool_in_use == 0


def test_many_requests_in_flight_with_striping(engine, tmp_path):
    paths = [tmp_path / f"stripe{i}" for i in range(3)]
    block = engine.config.block_size
    srcs = [torch.randint(0, 255, (block * 2,), dtype=torch.uint8) for _ in range(48)]
    handles = [engine.write(s, paths, i * block * 2) for i, s in enumerate(srcs)]
    for h in handles:
        h.wait()
    engine.sync()
    for p in paths:
        assert os.stat(p).st_size == block * 2 * 48 // 3
        assert os.stat(p).st_mode & 0o777 == 0o600
    outs = [torch.empty_like(s) for s in srcs]
    handles = [engine.read(o, paths, i * block * 2) for i, o in enumerate(outs)]
    for h in handles:
        h.wait()
    assert all(h.done() for h in handles)
    assert all(torch.equal(a, b) for a, b in zip(srcs, outs, strict=True))


def test_pool_tensor_budget(engine, tmp_path):
    t = engine.pool_tensor(1 << 20)
    assert t.data_ptr() % 4096 == 0 and t.numel() == 1 << 20
    t.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    engine.write(t, tmp_path / "p", 0).wait()
    others = [engine.pool_tensor(1 << 20) for _ in range(3)]
    assert engine.pool_tensor(4096, block=False) is None  # 4 MiB budget used up
    with pytest.raises(ValueError, match="pool budget"):
        engine.pool_tensor(8 << 20)
    del others, t
    assert engine.pool_in_use == 0


def test_missing_and_unwritable_dir(engine, tmp_path):
    with pytest.raises(FileNotFoundError, match="nodir"):
        engine.write(torch.ones(10), tmp_path / "nodir" / "x", 0)
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="afile"):
        engine.write(torch.ones(10), tmp_path / "afile" / "x", 0)
    with pytest.raises(OSError, match="/proc/"):
        engine.write(torch.ones(10), "/proc/tierlift_cannot_create", 0)


def test_device_full_is_enospc(engine):
    # /dev/full also refuses O_DIRECT (EINVAL at open, like tmpfs before Linux 6.6): the engine
    # falls back to buffered I/O with one warning.
    with pytest.raises(OSError, match="No space left") as info:
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
            h = engine.write(torch.ones(4096), "/dev/full", 0)
        h.wait()
    assert info.value.errno == 28 and info.value.filename == "/dev/full"


def test_read_past_eof(engine, tmp_path):
    """A raw file shorter than the tensor read from it: EOFError with the file, its size and
    the size needed, before a byte of the tensor changes (striped: the short stripe named)."""
    path = tmp_path / "short"
    engine.write(torch.ones(1000, dtype=torch.uint8), path, 0).wait()
    out = torch.zeros(5000, dtype=torch.uint8)
    with pytest.raises(EOFError, match=r"short' past its end: the file has 1000 bytes, the read "
                                       r"of 5000 bytes at offset 0 needs 5000"):
        engine.read(out, path, 0)
    assert not out.any()  # nothing was read into it
    with pytest.raises(EOFError, match="has 1000 bytes, the read of 100 bytes at offset 950 "
                                       "needs 1050"):
        engine.read(out[:100], path, 950)
    block = engine.config.block_size
    a, b = tmp_path / "a", tmp_path / "b"
    engine.write(torch.ones(4 * block, dtype=torch.uint8), [a, b], 0).wait()
    os.truncate(b, block + 10)
    with pytest.raises(EOFError, match=f"'{b}' past its end: the file has {block + 10} bytes.* "
                                       f"needs {2 * block}"):
        engine.read(torch.zeros(4 * block, dtype=torch.uint8), [a, b], 0)
    engine.forget(b)
    assert torch.equal(engine.read(torch.zeros(3 * block, dtype=torch.uint8), [a, b], 0).wait(),
                       torch.ones(3 * block, dtype=torch.uint8))
    with pytest.raises(FileNotFoundError):
        engine.read(torch.empty(10), tmp_path / "missing", 0)


def test_bad_arguments(engine, tmp_path):
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        engine.write(torch.ones(4, 4).t(), tmp_path / "x", 0)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        engine.write([1, 2], tmp_path / "x", 0)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        engine.write(torch.ones(4), tmp_path / "x", -1)
    with pytest.raises(ValueError, match="path must name at least one file"):
        engine.write(torch.ones(4), [], 0)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=1000)
    with pytest.raises(ValueError, match="backend"):
        EngineConfig(backend="libaio")
    with pytest.raises(TypeError):
        EngineConfig(bogus=1)  # unknown keys are errors


def test_use_after_close(engine, tmp_path):
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.write(torch.ones(4), tmp_path / "x", 0)
    with pytest.raises(RuntimeError, match="after close"):
        engine.sync()


def test_env_forces_threads(monkeypatch):
    monkeypatch.setenv("TIERLIFT_IO_BACKEND", "threads")
    with IoEngine() as eng:
        assert eng.backend == "threads"
    monkeypatch.setenv("TIERLIFT_IO_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TIERLIFT_IO_BACKEND"):
        IoEngine()


@pytest.mark.parametrize("backend", _backends())
def test_efbig_under_rlimit_fsize(tmp_path, backend):
    """RLIMIT_FSIZE gives EFBIG; runs in a subprocess so the limit does not leak."""
    code = textwrap.dedent(f"""
        import resource, signal, torch
        from tierlift.io import EngineConfig, IoEngine
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        with IoEngine(EngineConfig(backend={backend!r})) as eng:
            eng.write(torch.ones(1024, dtype=torch.uint8), {str(tmp_path / "big")!r}, 0).wait()
            try:
                eng.write(torch.ones(1 << 18, dtype=torch.uint8), {str(tmp_path / "big")!r},
                          0).wait()
            except OSError as e:
                print("ERRNO", e.errno, e)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERRNO 27" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(0, 16), (1, 16), (1000, 64), (4099, 1024)])
def test_block_crc32c_matches_reference(dtype, n, block):
    from tierlift import reference

    t = torch.randint(0, 100, (n,)).to(dtype)
    assert list(tierlift._extension._C.io.block_crc32c(t, block)) == \
        reference.block_crc32c(t, block)
    assert reference.io.crc32c(b"123456789") == 0xE3069283


@pytest.mark.gpu
def test_pool_tensor_is_pinned_with_a_gpu(tmp_path):
    with IoEngine(EngineConfig(pool_bytes=8 << 20)) as eng:
        t = eng.pool_tensor(1 << 20)
        assert t.is_pinned()
        t.copy_(torch.arange(1 << 20).to(torch.uint8))
        eng.write(t, tmp_path / "pinned", 0).wait()
        d = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), t)
        del t, d


def test_ordinary_tensor_larger_than_the_pool_goes_o_direct(engine, tmp_path):
    # 16 MiB through a 4 MiB pool, from memory 64 bytes past a page (torch's usual alignment):
    # staged block by block, or in place where the drive's O_DIRECT takes 64-byte memory.
    raw = torch.randint(0, 256, ((16 << 20) + 8192,), dtype=torch.uint8)
    skip = (64 - raw.data_ptr()) % 4096
    t = raw[skip:skip + (16 << 20)]
    path = tmp_path / "big"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.write(t, path, 0).wait()
    back = torch.zeros_like(t)
    engine.read(back, path, 0).wait()
    assert torch.equal(back, t)
    moved = engine.path_bytes
    assert sum(moved.values()) == 2 * t.nbytes
    if not any("O_DIRECT" in str(w.message) for w in caught):  # the file system has O_DIRECT
        assert moved["direct"] + moved["staged"] == 2 * t.nbytes, moved
    assert engine.pool_in_use == 0


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_staged_requests_in_flight_with_copy_threads(engine, tmp_path, copy_threads):
    # 12 requests from odd addresses (staged wherever the drive has O_DIRECT) through a pool
    # of 8 blocks, all in flight at once each way; every request's bytes land in place.
    cfg = dataclasses.replace(engine.config, copy_threads=copy_threads,
                              pool_bytes=8 * engine.config.block_size)
    n, count = 3 * engine.config.block_size + 1001, 12
    src = torch.randint(0, 256, (count * n + 1,), dtype=torch.uint8)[1:]
    back = torch.zeros(count * n + 1, dtype=torch.uint8)[1:]
    assert src.data_ptr() % 2 == 1 and back.data_ptr() % 2 == 1  # the allocator aligns to 64
    path = tmp_path / "staged"
    with IoEngine(cfg) as eng:
        for h in [eng.write(src[i * n:(i + 1) * n], path, i * n) for i in range(count)]:
            h.wait()
        for h in [eng.read(back[i * n:(i + 1) * n], path, i * n) for i in range(count)]:
            h.wait()
        assert torch.equal(back, src)
        assert sum(eng.path_bytes.values()) == 2 * count * n
        assert eng.pool_in_use == 0


def test_copy_threads_out_of_range():
    with pytest.raises(ValueError, match="copy_threads"):
        EngineConfig(copy_threads=-1)
    with pytest.raises(ValueError, match="copy_threads"):
        EngineConfig(copy_threads=257)


_NO_FDS = """
import os, resource, warnings, torch
import tierlift
from tierlift.io import EngineConfig, IoEngine
warnings.simplefilter("error")  # a "no O_DIRECT" fallback warning fails the run
d = {path!r}
engines = [IoEngine(EngineConfig(backend=b, queue_depth=8, block_size=64 << 10,
                                 pool_bytes=4 << 20)) for b in {backends!r}]
params = [torch.nn.Parameter(torch.randn(4096))]
opt = tierlift.optim.AdamW(params, lr=0.1, offload="nvme", nvme_path=d)
params[0].grad = torch.ones(4096)
before = params[0].detach().clone()
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 32, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(held.pop())  # one descriptor left: the buffered open gets it, the O_DIRECT one cannot
for eng in engines:
    path = os.path.join(d, "x." + eng.backend)
    try:
        eng.write(torch.ones(4096), path, 0).wait()
        raise SystemExit("write did not fail")
    except OSError as e:
        assert e.errno == 24 and e.filename == path, e
        assert not os.path.exists(path), "the failed open left the file behind"
        print("ENGINE:", e)
try:
    opt.step()
    raise SystemExit("step did not fail")
except OSError as e:
    assert e.errno == 24, e
    print("STEP:", e)
assert torch.equal(params[0].detach(), before)
print("OK")
"""


def test_too_many_open_files_names_the_limit_and_is_not_a_fallback(tmp_path):
    """EMFILE while opening (here the O_DIRECT open, the buffered one having taken the last
    descriptor) is an OSError naming the file and RLIMIT_NOFILE, not a buffered fallback; the
    file is not created and the optimizer step changes nothing. In a subprocess: the limit is
    lowered there."""
    backends = [b for b in _backends()
                if b == "threads" or not tierlift._extension._C.io.uring_unavailable_reason()]
    code = _NO_FDS.format(path=str(tmp_path), backends=backends)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ENGINE:", "STEP:"))]
    assert len(lines) == len(backends) + 1, out.stdout
    for line in lines:
        assert "Too many open files" in line and "RLIMIT_NOFILE = " in line, line
        assert "ulimit -n" in line and str(tmp_path) in line, line
    assert "OK" in out.stdout
