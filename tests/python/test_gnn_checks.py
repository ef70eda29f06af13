"""What tierlift.gnn refuses before it could give wrong rows: the raw gather op's out= sharing
memory with what it reads (the Python wrapper checked it, the op did not), a raw feature file
longer than the shape and dtype given, and a features tensor edited in place after its
FeatureStore was built (a CUDA store's cached rows would stay old while the others change)."""

import pickle

import numpy as np
import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def raw_gather(table, index, out, bad_index=None):
    torch.ops.tierlift.gather_rows(table, index, None, None, out, bad_index)


def test_raw_op_refuses_out_sharing_memory_with_table_before_writing():
    table = torch.arange(40).view(10, 4)
    before = table.clone()
    with pytest.raises(ValueError, match="out shares memory with table"):
        raw_gather(table, torch.tensor([1, 0]), table[:2])  # row 0 overwritten, then read
    with pytest.raises(ValueError, match="out shares memory with table"):
        raw_gather(table, torch.tensor([9]), table[9:])  # a row gathered onto itself
    assert torch.equal(table, before)
    # two tensors over one buffer (not one storage object): found by address
    array = np.arange(40, dtype=np.int64)
    a, b = torch.from_numpy(array).view(10, 4), torch.from_numpy(array[:8]).view(2, 4)
    with pytest.raises(ValueError, match="out shares memory with table"):
        raw_gather(a, torch.tensor([1, 0]), b)
    assert torch.equal(a, before)


def test_raw_op_refuses_out_or_bad_index_sharing_memory_with_index():
    buf = torch.arange(40) % 10
    before = buf.clone()
    table = torch.arange(40).view(10, 4) * 10
    with pytest.raises(ValueError, match="out shares memory with index"):
        raw_gather(table, buf[:8], buf[4:36].view(8, 4))
    with pytest.raises(ValueError, match="bad_index shares memory with index"):
        raw_gather(table, buf[:8], torch.empty(8, 4, dtype=torch.long), buf[6:8])
    out = torch.empty(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="bad_index shares memory with out"):
        raw_gather(table, torch.tensor([1, 0]), out, out.view(-1)[:2])
    assert torch.equal(buf, before)


def test_raw_op_gathers_between_disjoint_parts_of_one_buffer():
    buf = torch.arange(60).view(15, 4)
    table, out = buf[:10], buf[10:12]  # one storage, apart: nothing is read after a write
    raw_gather(table, torch.tensor([7, 2]), out)
    assert torch.equal(out, torch.arange(40).view(10, 4)[[7, 2]])
    raw_gather(table, torch.empty(0, dtype=torch.long), buf[:0])  # empty: nothing to overlap


def test_gather_rows_refuses_an_out_that_requires_grad_or_is_a_conj_view():
    from tierlift import ops
    table = torch.arange(8.0).view(4, 2)
    w = torch.ones(1, 2, requires_grad=True)
    out = w * 2  # torch's own out= ops refuse this; writing it would leave a wrong w.grad
    with pytest.raises(ValueError, match="out requires grad"):
        ops.gather_rows(table, torch.tensor([1]), out)
    assert torch.equal(out.detach(), torch.full((1, 2), 2.0))
    cplx = torch.zeros(1, 2, dtype=torch.complex64)
    with pytest.raises(ValueError, match="conjugate or negative view"):
        ops.gather_rows(torch.ones(4, 2, dtype=torch.complex64), torch.tensor([1]), cplx.conj())
    with pytest.raises(ValueError, match="conjugate or negative view"):
        ops.gather_rows(table, torch.tensor([0]), cplx.conj().imag)  # a negative float view
    assert torch.equal(cplx, torch.zeros(1, 2, dtype=torch.complex64))


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "float32"),
                                             (torch.bfloat16, "bfloat16")])
def test_raw_file_longer_than_its_shape_is_refused(tmp_path, dtype, name):
    table = torch.randn(40, 12).to(dtype)
    table.view(torch.uint8).numpy().tofile(tmp_path / "x.bin")
    size = table.numel() * table.element_size()
    need = 39 * 12 * table.element_size()
    with pytest.raises(ValueError, match=rf"x.bin' has {size} bytes but shape \(39, 12\) of "
                                         rf"{name} needs {need}: a raw file must hold exactly"):
        FeatureStore(tmp_path / "x.bin", device="cpu", dtype=dtype, shape=(39, 12))
    with pytest.raises(ValueError, match="must hold exactly"):  # right size in rows, wrong dtype
        FeatureStore(tmp_path / "x.bin", device="cpu", dtype=torch.int8, shape=(40, 12))
    with pytest.raises(ValueError, match="a truncated file"):  # shorter: refused as before
        FeatureStore(tmp_path / "x.bin", device="cpu", dtype=dtype, shape=(41, 12))
    with FeatureStore(tmp_path / "x.bin", device="cpu", dtype=dtype, shape=(40, 12)) as s:
        idx = torch.tensor([39, 0])
        assert torch.equal(s.gather(idx).view(torch.uint8), table[idx].view(torch.uint8))


def test_features_edited_in_place_after_the_store_are_refused():
    table = torch.randn(50, 8)
    store = FeatureStore(table, device="cpu")
    idx = torch.tensor([3, 7])
    assert torch.equal(store.gather(idx), table[idx])
    out = torch.zeros(2, 8)
    table[7] += 1  # a CUDA store would give the new row 7 but an old cached row 3
    with pytest.raises(RuntimeError, match="modified in place after the store was built"):
        store.gather(idx, out=out)
    assert not out.any()  # refused before writing
    store.close()
    with FeatureStore(table, device="cpu") as fresh:  # a new store takes the edited rows
        assert torch.equal(fresh.gather(idx), table[idx])


def test_an_edit_through_a_view_or_the_base_is_refused():
    base = torch.randn(60, 8)
    store = FeatureStore(base[:50], device="cpu")  # the store's tensor is a view of base
    base[55].zero_()  # views share the base's version counter: refused as well (conservative)
    with pytest.raises(RuntimeError, match="modified in place"):
        store.gather(torch.tensor([0]))
    table = torch.randn(50, 8)
    store = FeatureStore(table, device="cpu")
    table.view(-1)[:8].mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        store.gather(torch.tensor([0]))


def test_out_of_place_use_of_the_features_is_not_an_edit():
    table = torch.randn(50, 8)
    store = FeatureStore(table, device="cpu")
    _ = table * 2, table.clone().add_(1), table[:3].float()
    idx = torch.tensor([1, 49])
    assert torch.equal(store.gather(idx), table[idx])
    with torch.inference_mode():  # inference tensors have no version counter: not watched
        frozen = torch.randn(50, 8)
    assert torch.equal(FeatureStore(frozen, device="cpu").gather(idx), frozen[idx])


@pytest.mark.gpu
def test_cuda_store_with_a_cache_refuses_an_edited_table():
    table = torch.randn(100, 8)
    store = FeatureStore(table, cache=0.5, degrees=torch.arange(100.0))
    idx = torch.tensor([99, 0])  # row 99 cached, row 0 read from host memory
    assert torch.equal(store.gather(idx).cpu(), table[idx])
    table.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        store.gather(idx)
    store.close()


def test_a_cpu_store_still_pickles_and_its_copy_is_watched_on_its_own():
    table = torch.zeros(20, 4)
    table[3] = 1  # edited before the store: its version is not 0
    store = FeatureStore(table, device="cpu")
    copy = pickle.loads(pickle.dumps(store))  # what a spawned DataLoader worker receives
    idx = torch.tensor([3, 0])
    assert torch.equal(copy.gather(idx), table[idx])
    copy._table[0] = 5  # the copy's own table, edited in place
    with pytest.raises(RuntimeError, match="modified in place"):
        copy.gather(idx)
    assert torch.equal(store.gather(idx), table[idx])  # the original is untouched
