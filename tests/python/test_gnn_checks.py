"""What tierlift.gnn refuses before it could give wrong rows: the raw gather op's out= sharing
memory with what it reads (the Python wrapper checked it, the op did not) and a raw feature file
longer than the shape and dtype given."""

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
