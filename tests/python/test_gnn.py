"""tierlift.gnn.FeatureStore and tierlift::gather_rows against torch.index_select.

The CPU path runs everywhere; tests marked gpu run the zero-copy CUDA kernel (scripts/gpu_check.sh
on the GPU machine), including the GPU cache and odd alignments of host tables.
"""

import multiprocessing
import os

import numpy as np
import pytest
import torch

import tierlift
from tierlift import ops, reference
from tierlift.gnn import FeatureStore, rmat_graph, to_csr

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8]
ROW_ELEMS = [1, 3, 16, 33, 256, 1500]  # 1 element up to several KB per row


def make_table(rows, row_elems, dtype, offset=0):
    """A table whose data starts `offset` elements into its storage (odd alignments)."""
    base = torch.randint(-100, 100, (rows * row_elems + offset,)).to(dtype)
    return base[offset:].view(rows, row_elems)


def make_index(rows, n, dtype, seed=None):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (n,), dtype=dtype, generator=g)
    idx[1::7] = idx[0]  # duplicates
    return idx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_elems", ROW_ELEMS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_gather_matches_index_select(dtype, row_elems, index_dtype):
    table = make_table(101, row_elems, dtype, offset=1)
    idx = make_index(101, 257, index_dtype)
    store = FeatureStore(table, device="cpu")
    torch.testing.assert_close(store.gather(idx), table.index_select(0, idx.long()), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sorted_gather(device):
    table = torch.randn(500, 7)
    idx = make_index(500, 1000, torch.int64)
    with FeatureStore(table, device=device, locality="sorted") as store:
        assert torch.equal(store.gather(idx).cpu(), table[idx])
        with pytest.raises(IndexError, match=r"index\[5\] = 500"):
            bad = idx.clone()
            bad[5], bad[9] = 500, -1
            store.gather(bad.to(device))


def test_op_matches_reference_and_multidim_rows():
    table = torch.randn(50, 3, 5)
    idx = make_index(50, 64, torch.int64)
    out, ref = torch.empty(64, 3, 5), torch.empty(64, 3, 5)
    ops.gather_rows(table, idx, out)
    reference.gather_rows(table, idx, None, None, ref)
    assert torch.equal(out, ref) and torch.equal(out, table[idx])


def test_opcheck():
    table = torch.randn(20, 8)
    idx = torch.tensor([3, 1, 19, 3])
    torch.library.opcheck(torch.ops.tierlift.gather_rows,
                          (table, idx, None, None, torch.empty(4, 8)))


def test_large_gather_uses_threads_and_out():
    table = torch.randn(20000, 64)
    idx = make_index(20000, 100000, torch.int64)
    store = FeatureStore(table, device="cpu")
    out = torch.empty(100000, 64)
    assert store.gather(idx, out=out) is out
    assert torch.equal(out, table[idx])


def test_from_npy_and_raw_file(tmp_path):
    table = torch.randn(40, 12)
    np.save(tmp_path / "x.npy", table.numpy())
    table.numpy().tofile(tmp_path / "x.bin")
    idx = torch.tensor([39, 0, 5, 5])
    with FeatureStore(tmp_path / "x.npy", device="cpu") as s:
        assert torch.equal(s.gather(idx), table[idx])
    with FeatureStore(str(tmp_path / "x.bin"), device="cpu", dtype=torch.float32,
                      shape=(40, 12)) as s:
        assert torch.equal(s.gather(idx), table[idx])
    with pytest.raises(ValueError, match="dtype= and shape="):
        FeatureStore(tmp_path / "x.bin", device="cpu")
    with pytest.raises(FileNotFoundError, match="features"):
        FeatureStore(tmp_path / "missing.npy", device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16])
def test_raw_file_of_a_dtype_numpy_lacks(tmp_path, dtype):
    table = torch.randn(40, 12).to(dtype)
    table.view(torch.uint8).numpy().tofile(tmp_path / "x.bin")
    idx = torch.tensor([39, 0, 5])
    with FeatureStore(tmp_path / "x.bin", device="cpu", dtype=dtype, shape=(40, 12)) as s:
        assert torch.equal(s.gather(idx).view(torch.uint8), table[idx].view(torch.uint8))
    with pytest.raises(ValueError, match="shape must hold ints >= 0"):
        FeatureStore(tmp_path / "x.bin", device="cpu", dtype=dtype, shape=(-40, 12))


def test_file_shorter_than_its_shape(tmp_path):
    """Named with the file, its size and the size needed (mmap only said "mmap length is
    greater than file size")."""
    table = torch.randn(40, 12)
    table.numpy().tofile(tmp_path / "x.bin")
    with pytest.raises(ValueError, match=r"x.bin' has 1920 bytes but shape \(41, 12\) of "
                                         r"float32 needs 1968 \(a truncated file"):
        FeatureStore(tmp_path / "x.bin", device="cpu", dtype=torch.float32, shape=(41, 12))
    np.save(tmp_path / "x.npy", table.numpy())
    full = os.path.getsize(tmp_path / "x.npy")
    os.truncate(tmp_path / "x.npy", full - 48)
    with pytest.raises(ValueError, match=rf"x.npy' has {full - 48} bytes but shape \(40, 12\) "
                                         rf"of float32 needs {full} \(128 of them the .npy header"):
        FeatureStore(tmp_path / "x.npy", device="cpu")


def test_bad_features():
    with pytest.raises(ValueError, match="features must be contiguous"):
        FeatureStore(torch.randn(8, 4).t(), device="cpu")
    with pytest.raises(ValueError, match="features must be a CPU tensor"):
        FeatureStore(torch.randn(8, 4, device="meta"), device="cpu")
    with pytest.raises(ValueError, match="features must have at least one dimension"):
        FeatureStore(torch.tensor(1.0), device="cpu")
    with pytest.raises(TypeError, match="features must be a torch.Tensor or a path"):
        FeatureStore([1, 2, 3], device="cpu")


def test_bad_options():
    t = torch.randn(8, 4)
    with pytest.raises(ValueError, match="pin must be"):
        FeatureStore(t, pin="maybe", device="cpu")
    with pytest.raises(ValueError, match="cache must be"):
        FeatureStore(t, cache=1.5, device="cpu")
    with pytest.raises(ValueError, match="cache_policy must be"):
        FeatureStore(t, cache_policy="lru", device="cpu")
    with pytest.raises(TypeError, match="sort must be a bool"):
        FeatureStore(t, sort=1, device="cpu")
    with pytest.raises(ValueError, match="check must be one of"):
        FeatureStore(t, check="later", device="cpu")
    with pytest.raises(ValueError, match="device must be"):
        FeatureStore(t, device="meta")
    with pytest.raises(ValueError, match="degrees must have shape"):
        FeatureStore(t, device="cpu", degrees=torch.ones(3))


def test_bad_index():
    store = FeatureStore(torch.randn(10, 4), device="cpu")
    with pytest.raises(TypeError, match="index must be int32 or int64"):
        store.gather(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="index must be a torch.Tensor"):
        store.gather([1, 2])
    with pytest.raises(ValueError, match="index must be 1-D"):
        store.gather(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="index must be on the CPU"):
        store.gather(torch.zeros(2, dtype=torch.long, device="meta"))
    with pytest.raises(IndexError, match=r"index\[2\] = 10 is out of range for a table of 10"):
        store.gather(torch.tensor([0, 9, 10, 11]))
    with pytest.raises(IndexError, match=r"index\[1\] = -1 is out of range"):
        store.gather(torch.tensor([0, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        store.gather(torch.tensor([1]), out=torch.empty(2, 4))


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_deferred_check_records_instead_of_raising(impl):
    gather = ops.gather_rows if impl == "op" else (
        lambda t, i, o, bad_index: reference.gather_rows(t, i, None, None, o, bad_index))
    table = torch.randn(10, 4)
    bad = torch.full((2,), -1, dtype=torch.long)
    out = torch.zeros(5, 4)
    gather(table, torch.tensor([1, 12, 3, -2, 9]), out, bad_index=bad)
    assert bad.tolist() == [1, 12]
    assert torch.equal(out[[0, 2, 4]], table[[1, 3, 9]])  # good rows gathered
    assert not out[[1, 3]].any()  # bad rows never read nor written
    gather(table, torch.tensor([10]), torch.empty(1, 4), bad_index=bad)
    assert bad.tolist() == [1, 12]  # an unreported error is not overwritten
    with pytest.raises(ValueError, match="bad_index must have shape"):
        ops.gather_rows(table, torch.tensor([1]), torch.empty(1, 4),
                        bad_index=torch.full((3,), -1))
    torch.library.opcheck(torch.ops.tierlift.gather_rows,
                          (table, torch.tensor([3, 1]), None, None, torch.empty(2, 4),
                           torch.full((2,), -1)))


def test_cpu_store_synchronize_is_a_no_op():
    store = FeatureStore(torch.randn(10, 4), device="cpu", check="async")
    store.synchronize()
    with pytest.raises(IndexError, match=r"index\[0\] = 10"):  # CPU gathers raise at once
        store.gather(torch.tensor([10]))


def test_empty_index_gives_empty_rows():
    store = FeatureStore(torch.randn(10, 3, 2), device="cpu")
    out = store.gather(torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 3, 2)


def test_out_sharing_memory_with_table_or_index_is_refused_before_writing():
    table = torch.arange(40).view(10, 4)
    before = table.clone()
    store = FeatureStore(table, device="cpu")
    with pytest.raises(ValueError, match="out shares memory with table"):
        store.gather(torch.tensor([1, 0]), out=table[:2])  # row 0 overwritten, then read
    with pytest.raises(ValueError, match="out shares memory with index"):
        idx = torch.tensor([3, 2, 1, 0, 5, 6, 7, 8])
        ops.gather_rows(table, idx, idx.view(2, 4))
    assert torch.equal(table, before)
    out = torch.empty(20, 4, dtype=table.dtype)
    ops.gather_rows(out[:10], torch.tensor([1, 0]), out[10:12])  # one storage, apart: fine
    assert torch.equal(out[10:12], out[:10][[1, 0]])


def test_features_that_require_grad_are_refused():
    with pytest.raises(ValueError, match="require grad"):  # rows would carry no gradient
        FeatureStore(torch.nn.Parameter(torch.randn(10, 4)), device="cpu")


def test_use_after_close():
    store = FeatureStore(torch.randn(10, 4), device="cpu")
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="FeatureStore is closed"):
        store.gather(torch.tensor([1]))


def test_cuda_request_without_gpu_falls_back_to_cpu():
    if torch.cuda.is_available() and tierlift._extension.has_cuda_kernels():
        pytest.skip("this machine has a GPU")
    with pytest.warns(RuntimeWarning, match="gathering on the CPU"):
        store = FeatureStore(torch.randn(10, 4))
    assert store.device.type == "cpu"


class _Rows(torch.utils.data.Dataset):
    def __init__(self, store):
        self.store = store

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.store.gather(torch.tensor([i, i + 1]))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_cpu_store_in_forked_dataloader_workers():
    table = torch.randn(20, 16)
    store = FeatureStore(table, device="cpu")
    store.gather(torch.arange(20))  # the thread pool is running before the fork
    loader = torch.utils.data.DataLoader(_Rows(store), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    got = list(loader)
    for i, rows in enumerate(got):
        assert torch.equal(rows, table[[i, i + 1]])


def test_cuda_store_refuses_forked_process():
    store = FeatureStore(torch.randn(4, 2), device="cpu")
    store.device, store._pid = torch.device("cuda", 0), os.getpid() + 1  # as seen in a child
    with pytest.raises(RuntimeError, match="forked process"):
        store.gather(torch.tensor([0]))


def test_rmat_graph_is_power_law_and_valid():
    ei = rmat_graph(10, 8, seed=1)
    n = 1 << 10
    assert ei.min() >= 0 and ei.max() < n
    assert (ei[0] != ei[1]).all()
    deg = torch.bincount(ei[0], minlength=n)
    assert deg.max() > 10 * deg.float().mean()  # heavy tail
    rowptr, col = to_csr(ei, n)
    assert rowptr[-1] == ei.shape[1] and torch.equal(rowptr[1:] - rowptr[:-1], deg)
    assert torch.equal(rmat_graph(10, 8, seed=1), ei)
    with pytest.raises(ValueError, match="scale"):
        rmat_graph(0)


def test_pyg_feature_store_interface():
    pyg = pytest.importorskip("torch_geometric")
    from tierlift.gnn import PyGFeatureStore

    table = torch.randn(30, 5)
    fs = PyGFeatureStore(device="cpu")
    fs["paper", "x", None] = table
    idx = torch.tensor([4, 29, 0])
    assert torch.equal(fs["paper", "x", idx], table[idx])
    attr = pyg.data.TensorAttr(group_name="paper", attr_name="x", index=idx)
    assert torch.equal(fs.multi_get_tensor([attr])[0], table[idx])
    mask = [i % 3 == 0 for i in range(30)]  # a list of bools is a mask, as for table[...]
    attr = pyg.data.TensorAttr(group_name="paper", attr_name="x", index=mask)
    assert torch.equal(fs.get_tensor(attr), table[torch.tensor(mask)])
    with pytest.raises(TypeError, match="int32 or int64"):  # torch refuses float indices too
        fs.get_tensor(pyg.data.TensorAttr(group_name="paper", attr_name="x", index=[1.5]))
    assert fs.get_tensor_size(group_name="paper", attr_name="x") == (30, 5)
    assert len(fs.get_all_tensor_attrs()) == 1
    assert fs.remove_tensor(group_name="paper", attr_name="x", index=None)
    fs.close()


# ---- CUDA (zero-copy from pinned host memory) ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_elems", ROW_ELEMS)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("pin", ["inplace", "copy"])
def test_cuda_gather_matches_index_select(dtype, row_elems, offset, pin):
    table = make_table(301, row_elems, dtype, offset=offset)
    for index_dtype in (torch.int32, torch.int64):
        idx = make_index(301, 999, index_dtype)
        with FeatureStore(table, pin=pin) as store:
            want = table.index_select(0, idx.long()).cuda()
            assert torch.equal(store.gather(idx), want)  # CPU index
            assert torch.equal(store.gather(idx.cuda()), want)  # GPU index


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["degree", "frequency"])
def test_cuda_gather_with_cache(policy):
    table = torch.randn(1000, 40)
    deg = torch.rand(1000)
    store = FeatureStore(table, cache=0.2, cache_policy=policy, degrees=deg)
    for _ in range(10):
        idx = torch.randint(0, 1000, (500,), device="cuda")
        assert torch.equal(store.gather(idx), table.cuda()[idx])
    assert store.cached_rows().numel() == 200
    store.close()


@pytest.mark.gpu
def test_cuda_bad_index_and_stream():
    store = FeatureStore(torch.randn(100, 8))
    with pytest.raises(IndexError, match=r"index\[3\] = 100"):
        store.gather(torch.tensor([0, 1, 2, 100], device="cuda"))
    with pytest.raises(IndexError, match=r"index\[0\] = -5"):
        store.gather(torch.tensor([-5, 1]))
    s = torch.cuda.Stream()
    out = torch.empty(3, 8, device="cuda")
    store.gather(torch.tensor([1, 2, 3], device="cuda"), out=out, stream=s)
    s.synchronize()
    assert torch.equal(out.cpu(), store._table[[1, 2, 3]])
    store.close()
    # Memory cannot be registered twice.
    t = torch.randn(64, 64)
    reg = tierlift._extension._C.HostRegistration(t)
    with pytest.raises(ValueError, match="already registered"):
        tierlift._extension._C.HostRegistration(t)
    reg.close()
    FeatureStore(t).close()  # registrable again after close


@pytest.mark.gpu
def test_cuda_gather_without_synchronising():
    store = FeatureStore(torch.randn(100, 8), check="async")
    want = store._table[[5, 7, 99]].cuda()
    idx_host, idx_dev = torch.tensor([5, 7, 99]), torch.tensor([5, 7, 99], device="cuda")
    idx_bad = torch.tensor([0, 1, 2, 100], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        got_host = store.gather(idx_host)  # checked on the host
        got_dev = store.gather(idx_dev)  # deferred check
        store.gather(idx_bad)  # bad: recorded, not raised
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got_host, want) and torch.equal(got_dev, want)
    with pytest.raises(IndexError, match=r"index\[3\] = 100 .*check='async'"):
        store.synchronize()
    store.synchronize()  # reported once
    store.gather(torch.tensor([-7, 1], device="cuda"))
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=r"index\[0\] = -7"):
        store.gather(torch.tensor([1], device="cuda"))  # raised by the next gather
    assert torch.equal(store.gather(torch.tensor([1], device="cuda")), store._table[[1]].cuda())
    sync = FeatureStore(torch.randn(10, 8))  # check="sync" raises in the call itself
    with pytest.raises(IndexError, match=r"index\[1\] = 10"):
        sync.gather(torch.tensor([0, 10], device="cuda"))
    # Deferred check with the flag on the GPU (the op accepts either).
    flag = torch.full((2,), -1, dtype=torch.long, device="cuda")
    out = torch.zeros(2, 8, device="cuda")
    ops.gather_rows(sync._table, torch.tensor([3, 11], device="cuda"), out, bad_index=flag)
    assert flag.tolist() == [1, 11] and torch.equal(out[0].cpu(), sync._table[3])
    store.close()
    sync.close()


@pytest.mark.gpu
def test_cuda_opcheck_many_rows_and_pageable_table():
    table = torch.randn(5000, 3).pin_memory()
    idx = torch.randint(0, 5000, (300000,), device="cuda")  # more groups than the grid
    out = torch.empty(300000, 3, device="cuda")
    ops.gather_rows(table, idx, out)
    assert torch.equal(out, table.cuda()[idx])
    # opcheck runs the op on deep copies of its inputs, and a copy of a pinned tensor is
    # pageable: its schema and fake checks run with the table in GPU memory.
    torch.library.opcheck(torch.ops.tierlift.gather_rows,
                          (table.cuda(), idx[:10], None, None, torch.empty(10, 3, device="cuda")))
    with pytest.raises(ValueError, match="pinned, mapped host memory"):
        ops.gather_rows(torch.randn(10, 3), idx[:2] % 10, out[:2])


def test_pyg_neighbor_loader_uses_the_store():
    pyg = pytest.importorskip("torch_geometric")
    if not (pyg.typing.WITH_PYG_LIB or pyg.typing.WITH_TORCH_SPARSE):
        pytest.skip("PyG's neighbour sampler needs pyg-lib or torch-sparse")
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.testing import MyGraphStore

    from tierlift.gnn import PyGFeatureStore

    n = 1 << 8
    ei = rmat_graph(8, 4, seed=3)
    x = torch.randn(n, 6)
    fs = PyGFeatureStore(device="cpu")
    fs[None, "x", None] = x
    gs = MyGraphStore()
    gs.put_edge_index(ei, edge_type=None, layout="coo", size=(n, n))
    loader = NeighborLoader((fs, gs), num_neighbors=[4, 2], batch_size=16,
                            input_nodes=torch.arange(64), filter_per_worker=False)
    for batch in loader:
        assert torch.equal(batch.x, x[batch.n_id])
    fs.close()
