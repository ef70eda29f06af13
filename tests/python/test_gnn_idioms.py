"""tierlift.gnn under everyday GNN-script idioms, against plain indexing (`x[index]`): where the
store cannot give the same rows it refuses, before anything changes. Arguments that would be
ignored (dtype=/shape= beside a tensor or an .npy file), features given new memory after the
store was built (`x.data = ...`, a module's `.half()`), PyG's update/remove of a tensor, and
graphs whose node ids fall outside the graph."""

import numpy as np
import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def test_dtype_or_shape_that_disagree_with_a_tensor_or_npy_are_refused(tmp_path):
    # They describe a raw file; beside a tensor or an .npy they were ignored, so a table saved
    # as float32 came back float32 where the script asked for float16 (and went on as such).
    x = torch.randn(20, 6)
    with pytest.raises(ValueError, match=r"dtype=torch.float16 but a tensor holds torch.float32"):
        FeatureStore(x, device="cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"shape=\(40, 3\) but a tensor has shape \(20, 6\)"):
        FeatureStore(x, device="cpu", shape=(40, 3))
    np.save(tmp_path / "x.npy", x.numpy())
    with pytest.raises(ValueError, match=r"float16 but an .npy file .*holds torch.float32"):
        FeatureStore(tmp_path / "x.npy", device="cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"shape=\(20, 3\) but an .npy file"):
        FeatureStore(tmp_path / "x.npy", device="cpu", shape=(20, 3))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        FeatureStore(tmp_path / "x.npy", device="cpu", dtype="float32")
    index = torch.tensor([19, 0, 7])
    # Repeating what the features hold is a check that passes.
    with FeatureStore(tmp_path / "x.npy", device="cpu", dtype=torch.float32,
                      shape=(20, 6)) as store:
        assert torch.equal(store.gather(index), x[index])
    # bfloat16 bits saved as uint16 (numpy has no bfloat16) read as bfloat16, as raw files are.
    bf = x.to(torch.bfloat16)
    np.save(tmp_path / "bf.npy", bf.view(torch.uint16).numpy())
    with FeatureStore(tmp_path / "bf.npy", device="cpu", dtype=torch.bfloat16) as store:
        assert store.dtype == torch.bfloat16 and torch.equal(store.gather(index), bf[index])
    with pytest.raises(ValueError, match="dtype=torch.float16 but an .npy file"):
        FeatureStore(tmp_path / "bf.npy", device="cpu", dtype=torch.float16)  # has a twin


def test_a_fortran_order_npy_is_refused_naming_the_file(tmp_path):
    # Its rows are not contiguous in the file; the message told the user to call .contiguous()
    # on a tensor they never had.
    a = np.asfortranarray(np.arange(60, dtype=np.float32).reshape(20, 3))
    np.save(tmp_path / "f.npy", a)
    with pytest.raises(ValueError, match=r"f.npy' is stored in Fortran \(column-major\) order"):
        FeatureStore(tmp_path / "f.npy", device="cpu")
    np.save(tmp_path / "c.npy", np.ascontiguousarray(a))
    with FeatureStore(tmp_path / "c.npy", device="cpu") as store:
        assert torch.equal(store.gather(torch.tensor([4, 1])), torch.from_numpy(a[[4, 1]]))


def test_features_given_new_memory_after_the_store_are_refused():
    # `x.data = ...` puts new memory under the tensor without counting a version: a CUDA
    # store's cache (and a pin="copy" copy) kept the old rows while the rest followed x, or all
    # stayed old. Refused on every device, as an in-place edit is.
    x = torch.randn(20, 6)
    store = FeatureStore(x, device="cpu")
    index = torch.tensor([3, 3, 19])
    assert torch.equal(store.gather(index), x[index])
    x.data = x.data * 2
    assert x._version == 0  # no in-place edit counted
    out = torch.zeros(3, 6)
    with pytest.raises(RuntimeError, match="holds other memory"):
        store.gather(index, out=out)
    assert not out.any()  # refused before writing
    with FeatureStore(x, device="cpu") as fresh:  # a new store reads the tensor as it is now
        assert torch.equal(fresh.gather(index), x[index])
    # Swapped twice between gathers: the second new memory may sit where the first was freed.
    for _ in range(3):
        y = torch.randn(20, 6)
        store = FeatureStore(y, device="cpu")
        for _ in range(2):
            y.data = y.data + 1
        with pytest.raises(RuntimeError, match="holds other memory"):
            store.gather(index)
    # A frozen embedding served by a store, then the model converted (`.half()` replaces the
    # weight's memory the same way): refused with the same message, not an op error.
    emb = torch.nn.Embedding(12, 4).requires_grad_(False)
    store = FeatureStore(emb.weight, device="cpu")
    emb.half()
    with pytest.raises(RuntimeError, match="holds other memory"):
        store.gather(torch.tensor([1]))


def test_features_whose_storage_shrank_after_the_store_are_refused():
    # storage.resize_() keeps the storage's identity: the gather read past its end (rows of
    # garbage; a segmentation fault at size 0).
    index = torch.tensor([0, 19])
    x = torch.randn(20, 6)
    store = FeatureStore(x, device="cpu")
    row_bytes = 6 * x.element_size()
    x.untyped_storage().resize_(19 * row_bytes)
    with pytest.raises(RuntimeError, match="resized smaller"):
        store.gather(index)
    grown = torch.randn(20, 6)
    store = FeatureStore(grown, device="cpu")
    grown.untyped_storage().resize_(30 * row_bytes)  # larger: the rows are still there
    assert torch.equal(store.gather(index), grown[index])


def test_a_store_and_its_copies_still_gather_when_the_features_keep_their_memory():
    import copy
    import pickle

    x = torch.randn(20, 6)
    store = FeatureStore(x, device="cpu")
    index = torch.tensor([0, 19, 4])
    from multiprocessing.reduction import ForkingPickler

    # What a spawned DataLoader worker receives: ForkingPickler moves x's bytes into shared
    # memory (the same storage, a new address), which is not new memory under x.
    shared = pickle.loads(ForkingPickler.dumps(store))
    assert x.is_shared()
    for twin in (shared, pickle.loads(pickle.dumps(store)), copy.deepcopy(store),
                 copy.copy(store), store):
        assert torch.equal(twin.gather(index), x[index])
    _ = x.view(6, 20), x.t(), x.contiguous()  # views and no-op calls do not move its memory
    assert torch.equal(store.gather(index), x[index])
    store.close()
    assert pickle.loads(pickle.dumps(store)).closed


def test_pyg_update_tensor_keeps_the_old_rows_when_the_new_ones_are_refused():
    # PyG's default update_tensor removes first, then puts: rows given with an index (which a
    # store cannot take), or a tensor the store refuses, raised with the old rows already gone.
    pyg = pytest.importorskip("torch_geometric")
    from tierlift.gnn import PyGFeatureStore

    x = torch.randn(10, 4)
    fs = PyGFeatureStore(device="cpu")
    fs[None, "x", None] = x
    with pytest.raises(ValueError, match="put whole tensors only"):
        fs.update_tensor(torch.randn(2, 4), group_name=None, attr_name="x",
                         index=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="features must be contiguous"):
        fs.update_tensor(torch.randn(4, 10).t(), group_name=None, attr_name="x", index=None)
    assert torch.equal(fs[None, "x", None], x)  # still served, unchanged
    # Removing "rows" removed the whole tensor and said it had succeeded.
    with pytest.raises(ValueError, match="remove whole tensors only"):
        fs.remove_tensor(group_name=None, attr_name="x", index=torch.tensor([1]))
    assert torch.equal(fs[None, "x", None], x)
    y = torch.randn(10, 4)
    assert fs.update_tensor(y, group_name=None, attr_name="x", index=None)
    assert torch.equal(fs[None, "x", None], y)
    attr = pyg.data.TensorAttr(group_name=None, attr_name="x", index=None)
    assert fs.remove_tensor(attr) and fs.get_all_tensor_attrs() == []
    fs.close()


def test_pyg_a_store_under_two_keys_stays_open_while_one_still_serves_it():
    pytest.importorskip("torch_geometric")
    from tierlift.gnn import PyGFeatureStore

    x = torch.randn(10, 4)
    store = FeatureStore(x, device="cpu")
    fs = PyGFeatureStore(device="cpu")
    fs["paper", "x", None] = store
    fs["author", "x", None] = store
    fs["author", "x", None] = torch.randn(10, 4)  # replaced under one key only
    index = torch.tensor([9, 2])
    assert not store.closed and torch.equal(fs["paper", "x", index], x[index])
    del fs["paper", "x"]  # its last key: closed, as before
    assert store.closed
    fs.close()


def test_sampler_refuses_a_graph_whose_node_ids_fall_outside_it():
    # An edge_index tensor was checked, a Data or GraphStore was not: a source -1 was sampled
    # as node -1, which x[node] reads as the last row.
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.testing import MyGraphStore

    from tierlift.gnn import NeighborSampler

    x = torch.arange(4.0).view(4, 1)
    for edge_index, bad in (([[-1, 2, 3], [0, 0, 1]], "an edge source is node -1"),
                            ([[7, 2, 3], [0, 0, 1]], "an edge source is node 7"),
                            ([[1, 2, 3], [0, 5, 1]], "an edge destination is node 5")):
        data = pyg.data.Data(x=x, edge_index=torch.tensor(edge_index), num_nodes=4)
        with pytest.raises(ValueError, match=rf"{bad}, outside \[0, 4\)"):
            NeighborSampler(data, [5], seed=0)
    gs = MyGraphStore()
    gs.put_edge_index(torch.tensor([[1, 9], [0, 1]]), edge_type=None, layout="coo", size=(4, 4))
    with pytest.raises(ValueError, match=r"an edge source is node 9, outside \[0, 4\)"):
        NeighborSampler(gs, [5], seed=0)
    good = pyg.data.Data(x=x, edge_index=torch.tensor([[1, 2, 3], [0, 0, 1]]), num_nodes=4)
    node = NeighborSampler(good, [5], seed=0).sample(torch.tensor([0, 1]))[0]
    assert sorted(node.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("features", ["labels", "bfloat16", "int8", "bool"])
def test_everyday_index_and_feature_forms_match_plain_indexing(features):
    gen = torch.Generator().manual_seed(0)
    x = {"labels": torch.randint(0, 7, (40,), generator=gen),  # 1-D: one value per node
         "bfloat16": torch.randn(40, 5, generator=gen).to(torch.bfloat16),
         "int8": torch.randint(-128, 127, (40, 3), generator=gen, dtype=torch.int8),
         "bool": torch.rand(40, 2, generator=gen) > 0.5}[features]
    store = FeatureStore(x, device="cpu")
    ids = torch.randperm(40, generator=gen)
    for index in (ids[::3],  # strided
                  torch.tensor(5).expand(4),  # expanded: one id, stride 0
                  ids[:9].int(),  # int32, as DGL and pyg-lib give
                  torch.cat([ids[:4], ids[:4]]),  # duplicates
                  torch.empty(0, dtype=torch.long)):
        got = store.gather(index)
        assert got.dtype == x.dtype and torch.equal(got, x[index.long()])
    with pytest.raises(IndexError, match=r"index\[1\] = -1"):  # x[-1] wraps; refused here
        store.gather(torch.tensor([0, -1]))
    with pytest.raises(TypeError, match="int32 or int64"):  # a mask: use mask.nonzero()
        store.gather(torch.ones(40, dtype=torch.bool))


def test_sampler_takes_a_graph_store_put_without_size_whose_last_nodes_only_send():
    # PyG sizes such a store's CSC by the largest destination: node 4 (out-edges only) was
    # refused as outside the graph, though one hop of it samples as the edge_index does.
    pytest.importorskip("torch_geometric")
    from torch_geometric.testing import MyGraphStore

    from tierlift.gnn import NeighborSampler

    edge_index = torch.tensor([[4, 3, 0, 4, 1], [0, 0, 1, 2, 2]])
    gs = MyGraphStore()
    gs.put_edge_index(edge_index, edge_type=None, layout="coo")
    from_store = NeighborSampler(gs, [2, 2], seed=3)
    plain = NeighborSampler(edge_index, [2, 2], num_nodes=5, seed=3)
    assert from_store.num_nodes == 5
    seeds = torch.tensor([2, 0, 1])
    got, want = from_store.sample(seeds), plain.sample(seeds)
    assert got[4:] == want[4:] and all(torch.equal(g, w) for g, w in zip(got[:3], want[:3]))
    assert torch.equal(from_store.edge_permutation[got[3]], plain.edge_permutation[want[3]])
    gs = MyGraphStore()
    gs.put_edge_index(torch.tensor([[-1, 3], [0, 1]]), edge_type=None, layout="coo")
    with pytest.raises(ValueError, match="an edge source is node -1"):
        NeighborSampler(gs, [2], seed=0)


class _Registered:
    """Stands in for a CUDA store's host registration (no GPU here): what the check reads is
    the address the store recorded when it registered its table."""

    def close(self):
        pass


def test_features_moved_by_share_memory_are_refused_by_a_store_that_registered_them():
    # A pin="inplace" CUDA store's kernels read the address it registered; share_memory_()
    # keeps x's storage but moves its bytes, so the registration no longer covers x.
    x = torch.randn(50, 4)
    store = FeatureStore(x)
    store._registration, store._registered_ptr = _Registered(), x.data_ptr()
    index = torch.tensor([3, 1, 4])
    assert torch.equal(store.gather(index), x[index])
    x.share_memory_()
    with pytest.raises(RuntimeError, match=r"bytes moved .*share_memory_\(\)"):
        store.gather(index)
    store.close()
