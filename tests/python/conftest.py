import os

import pytest
import torch

import tierlift


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd_path(request, monkeypatch):
    """Runs a test once per SIMD path (skipping paths this CPU lacks)."""
    order = ["scalar", "avx2", "avx512"]
    if not tierlift._extension.available():
        pytest.skip("compiled extension not loaded")
    best = tierlift._extension._C.cpu_simd_level()
    if order.index(request.param) > order.index(best):
        pytest.skip(f"CPU lacks {request.param}")
    monkeypatch.setenv("TIERLIFT_SIMD", request.param)
    assert tierlift._extension._C.active_simd_level() == request.param
    yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    os.environ.setdefault("TIERLIFT_NUM_THREADS", "2")


@pytest.fixture
def one_thread():
    """Tiny models: torch's intra-op threads only contend on a shared CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def dcp_dir(tmp_path):
    """tmp_path/dcp: dcp_source.model()'s state dict saved by torch.distributed.checkpoint."""
    import dcp_source

    return dcp_source.save(dcp_source.model().state_dict(), tmp_path / "dcp")
