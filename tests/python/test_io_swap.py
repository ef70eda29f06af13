"""tierlift.io.SwapStore: round trips, metadata checks, checksums, crash safety and a soak test.

The soak test writes and verifies TIERLIFT_IO_SOAK_GB gigabytes (default: 64 MiB) through the
store; run the large one with  TIERLIFT_IO_SOAK_GB=8 pytest tests/python/test_io_swap.py -k soak
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tierlift
from tierlift.io import ChecksumError, EngineConfig, IoEngine, SwapStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


@pytest.fixture(params=["threads", "uring"])
def store(request, tmp_path):
    if request.param == "uring" and tierlift._extension._C.io.uring_unavailable_reason():
        pytest.skip("io_uring unavailable")
    s = SwapStore(tmp_path, config=EngineConfig(backend=request.param, queue_depth=8,
                                                block_size=64 << 10), block_bytes=16 << 10)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_round_trip(store, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}/m": (torch.randn(int(torch.randint(1, 50_000, (1,), generator=g)),
                                            generator=g) * 10).to(dtype).reshape(-1, 1)
               for i in range(8)}
    handles = [store.put(k, v) for k, v in tensors.items()]  # many puts in flight
    handles[0].wait()
    store.flush()
    for k, v in tensors.items():
        assert k in store
        got = store.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v)
        out = torch.empty_like(v)
        assert store.get(k, out=out) is out and torch.equal(out, v)
    for f in os.listdir(store.directory):
        assert not f.endswith(".tmp")
        assert os.stat(os.path.join(store.directory, f)).st_mode & 0o777 == 0o600


def test_empty_and_scalar(store):
    store.put("e", torch.empty(0, 3))
    store.put("s", torch.tensor(3.5))
    assert store.get("e").shape == (0, 3)
    assert store.get("s").item() == 3.5


def test_overwrite_keeps_latest(store):
    store.put("x", torch.zeros(1000))
    store.put("x", torch.ones(1000))
    assert torch.equal(store.get("x"), torch.ones(1000))


def _data_file(store, name):
    return os.path.join(store.directory, name + ".tlswap")


def test_bit_flip_names_the_tensor(store):
    store.put("w", torch.randn(20_000)).wait()
    path = _data_file(store, "w")
    with open(path, "r+b") as f:
        f.seek(4096 + 30_000)
        b = f.read(1)
        f.seek(4096 + 30_000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match=r"tensor 'w'.*block\(s\) \[1\]"):
        store.get("w")


def test_truncated_file(store):
    store.put("t", torch.randn(20_000)).wait()
    os.truncate(_data_file(store, "t"), 4096 + 1000)
    with pytest.raises(ChecksumError, match="tensor 't'.*truncated"):
        store.get("t")
    os.truncate(_data_file(store, "t"), 10)
    with pytest.raises(ChecksumError, match="tensor 't'.*truncated"):
        store.get("t")


def test_corrupt_header(store):
    store.put("h", torch.randn(10)).wait()
    with open(_data_file(store, "h"), "r+b") as f:
        f.seek(20)
        f.write(b"#")
    with pytest.raises(ChecksumError, match="tensor 'h'.*header"):
        store.get("h")


def test_wrong_dtype_or_size(store):
    store.put("d", torch.randn(100))
    with pytest.raises(TypeError, match="out has dtype torch.float16.*'d'"):
        store.get("d", out=torch.empty(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has 99 elements"):
        store.get("d", out=torch.empty(99))
    with pytest.raises(KeyError, match="nope"):
        store.get("nope")


def test_bad_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        SwapStore(tmp_path / "missing")
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        SwapStore(tmp_path / "f")


def test_failed_put_keeps_old_data(tmp_path):
    """A put that fails mid-write (EFBIG under RLIMIT_FSIZE, in a subprocess) raises, leaves no
    temporary file, and the previous version of the tensor is still readable."""
    code = textwrap.dedent(f"""
        import os, resource, signal, torch
        from tierlift.io import SwapStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = SwapStore({str(tmp_path)!r})
        store.put("a", torch.arange(1000.0)).wait()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            store.put("a", torch.zeros(1 << 16)).wait()
        except OSError as e:
            print("ERRNO", e.errno)
        assert not [f for f in os.listdir({str(tmp_path)!r}) if f.endswith(".tmp")]
        assert torch.equal(store.get("a"), torch.arange(1000.0))
        store.close()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERRNO 27" in out.stdout and "OK" in out.stdout, out.stdout


def test_use_after_close(tmp_path):
    store = SwapStore(tmp_path)
    store.put("x", torch.ones(3))
    store.close()
    store.close()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    with pytest.raises(RuntimeError, match="after close"):
        store.get("x")
    with pytest.raises(RuntimeError, match="after close"):
        store.put("y", torch.ones(3))
    assert torch.equal(SwapStore(tmp_path).get("x"), torch.ones(3))


def test_interpreter_exit_publishes_pending_puts(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from tierlift.io import SwapStore
        store = SwapStore({str(tmp_path)!r})
        for i in range(16):
            store.put(f"t{{i}}", torch.full((100_000,), float(i)))
        # no flush/close: the exit hook must finish and publish every put
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    store = SwapStore(tmp_path)
    for i in range(16):
        assert torch.equal(store.get(f"t{i}"), torch.full((100_000,), float(i)))


def test_soak(tmp_path):
    total = int(float(os.environ.get("TIERLIFT_IO_SOAK_GB", "0.0625")) * (1 << 30))
    chunk = 8 << 20
    with SwapStore(tmp_path, config=EngineConfig(queue_depth=16)) as store:
        n = max(1, total // chunk)
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            store.put(f"c{i % 8}", torch.randint(-2**31, 2**31 - 1, (chunk // 4,),
                                                  dtype=torch.int32, generator=g))
            if i % 8 == 7 or i == n - 1:
                store.flush()
                for j in range(i - i % 8, i + 1):
                    g = torch.Generator().manual_seed(j)
                    ref = torch.randint(-2**31, 2**31 - 1, (chunk // 4,), dtype=torch.int32,
                                        generator=g)
                    assert torch.equal(store.get(f"c{j % 8}"), ref), f"mismatch in chunk {j}"


def test_engine_shared_between_stores(tmp_path):
    with IoEngine() as eng:
        a = SwapStore(tmp_path, engine=eng)
        a.put("x", torch.ones(5))
        a.close()
        assert not eng.closed  # the store does not close an engine it was given


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to provoke EACCES")
def test_unwritable_directory_as_unprivileged_user(tmp_path):
    """Root ignores permissions, so the check runs in a subprocess as 'nobody'."""
    import pathlib
    import shutil
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is 0700 (root only)
    os.chmod(base, 0o755)
    ro = base / "ro"
    ro.mkdir(mode=0o555)
    hidden = str(tmp_path)
    code = textwrap.dedent(f"""
        import os, torch
        # Imported as root: 'nobody' cannot read a package installed under /root.
        from tierlift.io import EngineConfig, IoEngine, SwapStore
        os.setgid(65534); os.setuid(65534)
        try:
            SwapStore({str(ro)!r})
        except PermissionError as e:
            print("STORE", e)
        try:
            SwapStore({hidden!r})
        except PermissionError as e:
            print("HIDDEN", e)
        with IoEngine(EngineConfig(backend="threads")) as eng:
            try:
                eng.write(torch.ones(4), {str(ro / "x")!r}, 0)
            except PermissionError as e:
                print("ENGINE", e.errno, e.filename)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    shutil.rmtree(base)
    assert out.returncode == 0, out.stderr
    assert f"STORE directory {str(ro)!r} is not writable" in out.stdout, out.stdout
    assert "cannot be reached (permission denied" in out.stdout, out.stdout
    assert f"ENGINE 13 {ro / 'x'}" in out.stdout, out.stdout


def test_killed_writer_leaves_only_old_data(tmp_path):
    """A writer killed mid-put leaves the old version; its temporary file is removed later."""
    SwapStore(tmp_path).put("k", torch.ones(10)).wait()
    code = textwrap.dedent(f"""
        import os, signal, torch
        from tierlift.io import SwapStore
        store = SwapStore({str(tmp_path)!r})
        store.put("k", torch.zeros(1 << 22))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == -9
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    store = SwapStore(tmp_path)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert torch.equal(store.get("k"), torch.ones(10))
