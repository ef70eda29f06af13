"""The gather's processing order (locality) and CUDA kernel shapes against torch.index_select.

locality="sorted" has the CUDA kernel read rows in ascending row order (output positions
unchanged); kernel="warp" | "grouped" | "auto" picks its shape (csrc/cuda/gather.cuh). The CPU
gather ignores both, so on CPU every choice must give the same bytes; bad choices are refused
before anything is written. GPU tests (skipped without one) run every kernel x locality.
"""

import warnings

import pytest
import torch
from test_gnn import make_index

import tierlift
from tierlift import ops
from tierlift.gnn import FeatureStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

LOCALITIES = ["index", "sorted"]
KERNELS = ["auto", "warp", "grouped"]




@pytest.mark.parametrize("locality", LOCALITIES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_op_gives_the_same_rows_for_every_choice(locality, kernel, index_dtype):
    table = torch.randn(301, 13)
    idx = make_index(301, 999, index_dtype, seed=0)
    out = torch.empty(999, 13)
    ops.gather_rows(table, idx, out, locality=locality, kernel=kernel)
    assert torch.equal(out, table.index_select(0, idx.long()))


def test_cpu_store_sorted_locality_reports_the_callers_position():
    table = torch.randn(500, 7)
    idx = make_index(500, 1000, torch.int64, seed=0)
    with FeatureStore(table, device="cpu", locality="sorted") as store:
        assert store.options.locality == "sorted"
        assert torch.equal(store.gather(idx), table[idx])
        bad = idx.clone()
        bad[9], bad[5] = -1, 500
        with pytest.raises(IndexError, match=r"index\[5\] = 500"):
            store.gather(bad)


def test_bad_choices_are_refused_before_anything_is_written():
    table = torch.randn(10, 4)
    out = torch.zeros(3, 4)
    idx = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="locality must be one of"):
        ops.gather_rows(table, idx, out, locality="rows")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops.gather_rows(table, idx, out, kernel="block")
    # The compiled op checks them too (called directly, without the Python wrapper).
    with pytest.raises(ValueError, match="locality must be 'index' or 'sorted'"):
        torch.ops.tierlift.gather_rows(table, idx, None, None, out, None, "Sorted", "auto")
    with pytest.raises(ValueError, match="kernel must be 'auto', 'warp' or 'grouped'"):
        torch.ops.tierlift.gather_rows(table, idx, None, None, out, None, "index", "")
    assert not out.any()
    with pytest.raises(ValueError, match="locality must be one of"):
        FeatureStore(table, device="cpu", locality="page")


def test_sort_true_is_the_deprecated_spelling_of_sorted():
    with pytest.warns(DeprecationWarning, match="locality='sorted'"):
        store = FeatureStore(torch.randn(8, 4), device="cpu", sort=True)
    assert store.options.locality == "sorted"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FeatureStore(torch.randn(8, 4), device="cpu").options.locality == "index"


def test_opcheck_with_the_new_arguments():
    table = torch.randn(20, 8)
    idx = torch.tensor([3, 1, 19, 3])
    for locality in LOCALITIES:
        torch.library.opcheck(torch.ops.tierlift.gather_rows,
                              (table, idx, None, None, torch.empty(4, 8), None, locality, "warp"))


# ---- GPU: every kernel x locality ----

# Row sizes around every lane count of the grouped kernel (16 bytes a lane, up to 512 bytes),
# odd ones (the unaligned path) and rows above its limit (warp per row whatever the choice).
ROW_BYTES = [4, 12, 16, 48, 64, 100, 128, 256, 512, 516, 1024, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("locality", LOCALITIES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_cuda_variants_match_index_select(locality, kernel, row_bytes):
    rows = 3001
    base = torch.randint(0, 256, (rows * row_bytes + 8,), dtype=torch.uint8).pin_memory()
    for offset in (0, 4):  # 16-byte aligned rows (the batched path), then 4-byte aligned ones
        table = base[offset:offset + rows * row_bytes].view(rows, row_bytes)
        want_table = table.cuda()
        for index_dtype in (torch.int32, torch.int64):
            idx = make_index(rows, 9999, index_dtype, seed=row_bytes).cuda()
            out = torch.empty(9999, row_bytes, dtype=torch.uint8, device="cuda")
            ops.gather_rows(table, idx, out, locality=locality, kernel=kernel)
            assert torch.equal(out, want_table.index_select(0, idx.long())), (offset, index_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("locality", LOCALITIES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_variants_report_the_smallest_bad_position(locality, kernel):
    table = torch.randn(100, 16).pin_memory()
    idx = torch.randint(0, 100, (5000,), device="cuda")
    idx[4000], idx[77], idx[3001] = 100, -1, 1 << 40  # sorted, position 77 comes first
    out = torch.zeros(5000, 16, device="cuda")
    with pytest.raises(IndexError, match=r"index\[77\] = -1 "):
        ops.gather_rows(table, idx, out, locality=locality, kernel=kernel)
    good = torch.ones(5000, dtype=torch.bool)
    good[[77, 3001, 4000]] = False
    assert torch.equal(out[good.cuda()], table.cuda()[idx[good.cuda()]])
    assert not out[~good.cuda()].any()  # bad rows never written
    flag = torch.full((2,), -1, dtype=torch.long, device="cuda")
    ops.gather_rows(table, idx, out, bad_index=flag, locality=locality, kernel=kernel)
    pos, value = flag.tolist()
    assert pos in (77, 3001, 4000) and value == int(idx[pos])  # one consistent pair


@pytest.mark.gpu
@pytest.mark.parametrize("locality", LOCALITIES)
@pytest.mark.parametrize("check", ["sync", "async"])
def test_cuda_store_locality_with_cache(locality, check):
    table = torch.randn(4000, 32)  # 128-byte rows: the grouped kernel, 8 lanes a row
    deg = torch.rand(4000)
    with FeatureStore(table, cache=0.1, degrees=deg, locality=locality, check=check) as store:
        for seed in range(3):
            idx = make_index(4000, 20000, torch.int64, seed=seed)
            assert torch.equal(store.gather(idx.cuda()), table.cuda()[idx.cuda()])
            assert torch.equal(store.gather(idx), table.cuda()[idx.cuda()])  # host index
        bad = idx.cuda()
        bad[123] = 4000
        with pytest.raises(IndexError, match=r"index\[123\] = 4000"):
            store.gather(bad)
            store.synchronize()
