"""tierlift.gnn around what GNN scripts do with a feature store: DataLoader workers (fork,
spawn, persistent, several epochs, the store closed while they hold it), features shared with a
model, odd feature layouts and dtypes, index forms, `out=`, a feature file rewritten on disk,
PyG's FeatureStore calls, and the sampler's seeding across workers. Each gives the rows plain
indexing (`x[index]`) gives, or is refused with an error that names it, before anything is
written."""

import copy
import gc
import multiprocessing
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import tierlift
from tierlift.gnn import FeatureStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")
needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="no fork")

ROWS, DIM = 3000, 16  # 64-byte rows: a 3000-row gather is split over the thread pool


class Batches(Dataset):
    """Item i: the rows of batch i, gathered in the worker, as a feature-loading dataset does."""

    def __init__(self, store, batches):
        self.store, self.batches = store, batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i], self.store.gather(self.batches[i])


class Attempt(Dataset):
    """One gather in the worker; its error, if any, as the item."""

    def __init__(self, store):
        self.store = store

    def __len__(self):
        return 1

    def __getitem__(self, i):
        try:
            return self.store.gather(torch.tensor([0]))
        except RuntimeError as e:
            return f"RuntimeError: {e}"


def batches(n=4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, ROWS, (ROWS,), generator=gen) for _ in range(n)]


def check_epoch(loader, x):
    got = list(loader)
    assert len(got) == len(loader.dataset)
    for index, rows in got:
        assert torch.equal(rows, x[index])


@needs_fork
def test_forked_persistent_workers_of_a_store_built_before_them_over_epochs():
    x = torch.randn(ROWS, DIM)
    store = FeatureStore(x, device="cpu")
    assert torch.equal(store.gather(batches(1)[0]), x[batches(1)[0]])  # the pool ran: threads
    loader = DataLoader(Batches(store, batches()), batch_size=None, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork")
    check_epoch(loader, x)
    # The script lets go of its store (the workers' copies hold their rows): still exact.
    store.close()
    del store
    gc.collect()
    check_epoch(loader, x)
    # Workers forked from a closed store refuse, naming it, instead of returning rows. (The
    # error comes back as the item: a DataLoader whose worker raised takes 5 s to shut down.)
    fresh = DataLoader(Attempt(loader.dataset.store), batch_size=None, num_workers=1,
                       multiprocessing_context="fork")
    assert list(fresh) == ["RuntimeError: FeatureStore is closed; create a new one"]


def test_a_store_sent_to_a_spawned_worker_gathers_the_same_rows():
    # What a spawn worker's Dataset gets: multiprocessing's pickler, which moves x into shared
    # memory (torch's share_memory_()) and sends a handle. A real spawn is covered for mapped
    # files in test_gnn_file_store.py; here the same round trip, in this process.
    x = torch.randn(ROWS, DIM)
    store = FeatureStore(x, device="cpu")
    index = batches(1)[0]
    sent = pickle.loads(ForkingPickler.dumps(Batches(store, [index])))
    assert x.is_shared() and sent.store._table.is_shared()
    assert torch.equal(sent[0][1], x[index])
    assert torch.equal(store.gather(index), x[index])  # the moved bytes are not an edit
    x[index[0]] += 1  # an edit after sending: refused here; the worker's copy cannot see the
    with pytest.raises(RuntimeError, match="modified in place"):  # version, and reads the
        store.gather(index)  # shared rows as they are now, as x[index] does
    assert torch.equal(sent.store.gather(index), x[index])


def test_features_shared_with_a_model_are_refused_once_they_train():
    emb = torch.nn.Embedding(50, 4)
    with pytest.raises(ValueError, match="require grad"):
        FeatureStore(emb.weight, device="cpu")
    x = emb.weight.detach()  # shares memory with the parameter
    store = FeatureStore(x, device="cpu")
    out = torch.zeros(2, 4)
    assert torch.equal(store.gather(torch.tensor([3, 4]), out=out), emb.weight[[3, 4]])
    torch.optim.SGD(emb.parameters(), lr=1.0).zero_grad()
    emb(torch.tensor([3])).sum().backward()
    torch.optim.SGD(emb.parameters(), lr=1.0).step()  # edits x in place: the store's rows
    out.zero_()
    with pytest.raises(RuntimeError, match="modified in place"):
        store.gather(torch.tensor([3, 4]), out=out)
    assert not out.any()
    store = FeatureStore(x, device="cpu")  # rebuilt after the step: its rows again
    assert torch.equal(store.gather(torch.tensor([3])), emb.weight[[3]])
    x.requires_grad_()  # the script makes the table learnable: gather would not train it
    with pytest.raises(RuntimeError, match="requires grad"):
        store.gather(torch.tensor([3, 4]), out=out)
    assert not out.any()


def test_non_contiguous_features_are_refused_and_their_contiguous_copy_is_exact():
    x = torch.randn(DIM, 40)
    for view in (x.t(), x[:, ::2], x[::2]):
        with pytest.raises(ValueError, match=r"contiguous \(call \.contiguous\(\)"):
            FeatureStore(view, device="cpu")
    index = torch.tensor([0, 39, 7, 7])
    assert torch.equal(FeatureStore(x.t().contiguous(), device="cpu").gather(index),
                       x.t()[index])
    rows = x.view(-1)[64:].view(-1, 8)  # a contiguous view at an offset: its own rows
    assert torch.equal(FeatureStore(rows, device="cpu").gather(index[:2]), rows[index[:2]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8, torch.int64, torch.bool, torch.complex64])
def test_feature_dtypes_gather_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (40, 6 * torch.empty(0, dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=gen)
    x = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)  # every bit pattern
    index = torch.tensor([5, 0, 39, 5])
    for idx in (index, index.int()):
        got = FeatureStore(x, device="cpu").gather(idx)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), x[index].view(torch.uint8))


def test_index_forms():
    x = torch.randn(40, 3)
    store = FeatureStore(x, device="cpu")
    dup = torch.tensor([1, 1, 39, 0, 1])
    assert torch.equal(store.gather(dup), x[dup])
    empty = store.gather(torch.empty(0, dtype=torch.int32))
    assert empty.shape == (0, 3) and empty.dtype == x.dtype
    for index, error in ((torch.ones(40, dtype=torch.bool), r"got torch.bool \(a mask\? "
                                                            r"gather takes row ids: pass "
                                                            r"mask.nonzero\(\).flatten\(\)"),
                         (torch.tensor([1, 2], dtype=torch.uint8), r"got torch.uint8 \(a mask"),
                         (torch.tensor([1, 2], dtype=torch.int16), "got torch.int16"),
                         (torch.tensor([1.0]), "got torch.float32"),
                         ([1, 2], "must be a torch.Tensor")):
        with pytest.raises(TypeError, match=error):
            store.gather(index)
    with pytest.raises(ValueError, match=r"index must be on the CPU \(this store's device is "
                                         r"cpu\), got meta"):
        store.gather(torch.tensor([1], device="meta"))
    with pytest.raises(ValueError, match=r"1-D, got shape \(\)"):
        store.gather(torch.tensor(3))


def test_a_wrong_out_is_refused_before_anything_is_written():
    x = torch.randn(40, 4)
    store = FeatureStore(x, device="cpu")
    index = torch.tensor([3, 9])
    for out, error in ((torch.zeros(2, 4, dtype=torch.float64), "float32 tensor of shape"),
                       (torch.zeros(3, 4), r"shape \(2, 4\)"),
                       (torch.zeros(2, 4, 1), r"shape \(2, 4\)"),
                       (torch.zeros(4, 2).t(), "contiguous"),
                       (torch.zeros(4, 4)[::2], "contiguous")):
        with pytest.raises(ValueError, match=error):
            store.gather(index, out=out)
        assert not out.any()
    out = torch.zeros(2, 4)
    assert store.gather(index, out=out) is out and torch.equal(out, x[index])


def test_close_then_gather_is_refused():
    with FeatureStore(torch.randn(4, 2), device="cpu") as store:
        store.gather(torch.tensor([0]))
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.gather(torch.tensor([0]))
    assert store.shape == (4, 2) and "closed" in repr(store)


def npy(tmp_path, a, name="x.npy"):
    np.save(tmp_path / name, a)
    return tmp_path / name


@pytest.mark.parametrize("rewrite", ["same shape", "fewer rows", "more rows"])
def test_a_feature_file_rewritten_in_place_is_refused(tmp_path, rewrite):
    # Was: the mapping showed the new bytes: another table's rows, zeros past a shorter file's
    # end (SIGBUS for a longer table), a CUDA cache still holding the old rows.
    a = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    path = npy(tmp_path, a)
    store = FeatureStore(path, device="cpu")
    archived = pickle.loads(pickle.dumps(store))  # by value: its own rows
    sent = pickle.loads(ForkingPickler.dumps(store))  # as a spawned worker gets it: the file
    twin = copy.deepcopy(store)  # the file mapped again
    index = torch.tensor([39, 1])
    assert torch.equal(store.gather(index), torch.from_numpy(a)[index])
    new = {"same shape": a + 1000, "fewer rows": a[:2], "more rows": np.repeat(a, 2, 0)}[rewrite]
    np.save(path, new)
    out = torch.zeros(2, 4)
    for s in (store, sent, twin):
        with pytest.raises(RuntimeError, match="rewritten in place since the store mapped it"):
            s.gather(index, out=out)
        assert not out.any()
    with pytest.raises(RuntimeError, match="rewritten in place"):
        pickle.dumps(store)
    assert torch.equal(archived.gather(index), torch.from_numpy(a)[index])
    assert torch.equal(FeatureStore(path, device="cpu").gather(torch.tensor([1])),
                       torch.from_numpy(new)[[1]])


def test_a_feature_file_replaced_or_deleted_keeps_the_rows_the_store_mapped(tmp_path):
    a = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    index = torch.tensor([39, 1])
    store = FeatureStore(npy(tmp_path, a), device="cpu")
    os.replace(npy(tmp_path, a + 1000, "new.npy"), tmp_path / "x.npy")  # a new inode
    assert torch.equal(store.gather(index), torch.from_numpy(a)[index])
    os.remove(tmp_path / "x.npy")
    assert torch.equal(store.gather(index), torch.from_numpy(a)[index])


def test_pyg_feature_store_calls_match_plain_indexing():
    pytest.importorskip("torch_geometric")
    from tierlift.gnn import PyGFeatureStore

    x = torch.randn(10, 3)
    fs = PyGFeatureStore(device="cpu")
    fs[None, "x", None] = x

    def get(index):
        return fs.get_tensor(group_name=None, attr_name="x", index=index)

    mask = torch.arange(10) % 3 == 0
    for index in (None, slice(2, 5), slice(None, None, 3), [1, 1, 4], torch.tensor([9, 0]),
                  torch.tensor([9, 0], dtype=torch.int32), mask, 3):
        want = x if index is None else x[index]
        assert torch.equal(get(index), want), index  # an int: one row, (3,), as x[3]
    assert torch.equal(fs[None, "x"][torch.tensor([2, 3])], x[[2, 3]])
    assert torch.equal(fs[None, "x"][2:4], x[2:4])
    with pytest.raises(IndexError, match="out of range"):  # x[-1] would wrap
        get(torch.tensor([-1]))
    with pytest.raises(IndexError, match=r"boolean index must have shape \(10,\)"):
        get(mask[:5])
    with pytest.raises(TypeError, match="got torch.uint8"):  # torch reads uint8 as a mask
        get(torch.tensor([1, 2], dtype=torch.uint8))
    assert tuple(fs.get_tensor_size(group_name=None, attr_name="x")) == (10, 3)
    assert [(a.group_name, a.attr_name) for a in fs.get_all_tensor_attrs()] == [(None, "x")]
    # PyG's stores take numpy arrays too: put without a copy.
    arr = np.arange(8, dtype=np.float32).reshape(4, 2)
    fs.put_tensor(arr, group_name="g", attr_name="z", index=None)
    assert torch.equal(fs.get_tensor(group_name="g", attr_name="z", index=[3, 0]),
                       torch.from_numpy(arr)[[3, 0]])
    # Updating after the loader was built replaces the rows whole; a row update is refused.
    fs.update_tensor(x * 2, group_name=None, attr_name="x", index=None)
    assert torch.equal(get(torch.tensor([4])), x[[4]] * 2)
    with pytest.raises(ValueError, match="whole tensors only"):
        fs.update_tensor(x[:2], group_name=None, attr_name="x", index=torch.tensor([0, 1]))
    assert torch.equal(get(None), x * 2)
    assert fs.remove_tensor(group_name=None, attr_name="x", index=None)
    assert not fs.remove_tensor(group_name=None, attr_name="x", index=None)
    assert get(None) is None and fs.get_tensor_size(group_name=None, attr_name="x") is None


@needs_fork
def test_sampler_batches_do_not_depend_on_the_workers():
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NodeLoader

    from tierlift.gnn import NeighborSampler, rmat_graph

    n = 1 << 8
    data = pyg.data.Data(x=torch.randn(n, 4), edge_index=rmat_graph(8, 8, seed=2), num_nodes=n)

    def run(num_workers, seed, epochs=(0, 1)):
        sampler = NeighborSampler(data, [4, 2], seed=seed)
        torch.manual_seed(5)  # the shuffle
        loader = NodeLoader(data, node_sampler=sampler, input_nodes=torch.arange(n),
                            batch_size=64, shuffle=True, num_workers=num_workers,
                            **({"multiprocessing_context": "fork"} if num_workers else {}))
        out = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            out.append([(b.n_id, b.edge_index) for b in loader])
        return out

    def same(a, b):
        return all(torch.equal(p, q) for u, v in zip(a, b, strict=True)
                   for s, t in zip(u, v, strict=True) for p, q in zip(s, t, strict=True))

    main = run(0, seed=7)
    assert same(run(2, seed=7), main)
    assert not same([main[1]], [main[0]])  # set_epoch changes the sample
    assert not same(run(0, seed=8, epochs=(0,)), main[:1])  # and so does the seed


@needs_fork
def test_node_loader_gathering_in_persistent_forked_workers_over_epochs():
    # PyG's default for a (feature store, graph store) pair: filter_per_worker=True, so the
    # workers gather; here from a store whose thread pool ran in the main process before fork.
    pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NodeLoader
    from torch_geometric.testing import MyGraphStore

    from tierlift.gnn import NeighborSampler, PyGFeatureStore

    n = 300
    x = torch.randn(n, DIM)
    fs, gs = PyGFeatureStore(device="cpu"), MyGraphStore()
    fs[None, "x", None] = x
    gs.put_edge_index(torch.randint(0, n, (2, 4 * n)), edge_type=None, layout="coo",
                      size=(n, n))
    fs.get_tensor(group_name=None, attr_name="x", index=torch.randint(0, n, (ROWS,)))

    def run(num_workers, **kwargs):
        sampler = NeighborSampler((fs, gs), [5, 3], seed=0)
        loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=torch.arange(n),
                            batch_size=100, num_workers=num_workers, **kwargs)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in loader:
                assert torch.equal(batch.x, x[batch.n_id])
                out.append(batch.n_id)
        return out

    want = run(0)
    got = run(2, persistent_workers=True, multiprocessing_context="fork")
    assert len(got) == len(want) == 6 and all(map(torch.equal, got, want))
