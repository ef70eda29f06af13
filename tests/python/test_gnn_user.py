"""FeatureStore used the way a PyG / DGL user would, checked against plain torch indexing
(`features[index]`), which is the reference: where tierlift cannot give the same result it
refuses, before anything is written."""

import multiprocessing
import pickle

import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore, rmat_graph, to_csr

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def test_out_that_requires_grad_is_refused_before_writing():
    # Plain torch refuses out= that requires grad (index_select(..., out=) raises); written
    # in place, out would keep its old autograd history and send gradient to what made it.
    x = torch.randn(10, 4)
    store = FeatureStore(x, device="cpu")
    index = torch.tensor([1, 7])
    w = torch.ones(2, 4, requires_grad=True)
    out = w * 2
    with pytest.raises(RuntimeError, match="out=... arguments don't support"):
        torch.index_select(x, 0, index, out=out)
    with pytest.raises(ValueError, match="out requires grad"):
        store.gather(index, out=out)
    assert torch.equal(out, torch.full((2, 4), 2.0))  # not written
    leaf = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="out requires grad"):
        store.gather(index, out=leaf)
    assert not leaf.detach().any()
    plain = torch.zeros(2, 4)
    assert store.gather(index, out=plain) is plain and torch.equal(plain, x[index])


def test_features_made_trainable_after_the_store_are_refused():
    # Frozen embeddings served by a store, then unfrozen for fine-tuning: plain indexing
    # trains them; the store's gather has no backward, so it must not run silently.
    emb = torch.nn.Embedding(12, 3)
    emb.weight.requires_grad_(False)
    store = FeatureStore(emb.weight, device="cpu")
    index = torch.tensor([3, 3, 5])
    assert torch.equal(store.gather(index), emb.weight[index])
    emb.weight.requires_grad_(True)
    emb.weight[index].sum().backward()
    assert emb.weight.grad[3].eq(2).all()  # what plain indexing gives
    with pytest.raises(RuntimeError, match="requires grad now"):
        store.gather(index)
    emb.weight.requires_grad_(False)  # frozen again: the same rows, no error
    assert torch.equal(store.gather(index), emb.weight[index])


def test_to_csr_of_an_int32_edge_index():
    # DGL's default id type is int32; the sort key src * num_nodes + dst overflowed it
    # (about every neighbour list was wrong at 70,000 nodes), with no error.
    n = 70_000
    gen = torch.Generator().manual_seed(0)
    ei = torch.randint(0, n, (2, 2000), generator=gen)
    want_ptr, want_col = to_csr(ei, n)
    src = torch.repeat_interleave(torch.arange(n), want_ptr.diff())
    assert sorted(zip(src.tolist(), want_col.tolist())) == sorted(zip(*ei.tolist()))
    rowptr, col = to_csr(ei.int(), n)
    assert col.dtype == torch.int32
    assert torch.equal(rowptr, want_ptr) and torch.equal(col.long(), want_col)


@pytest.mark.gpu
def test_cuda_store_gathers_the_rows_of_a_pinned_index_refilled_after_the_call():
    # A pinned index buffer refilled for the next batch right after gather returns (as with
    # torch indexing, which copies the index before returning): the store's non-blocking copy
    # must not read the new values.
    x = torch.randn(1000, 16)
    store = FeatureStore(x)
    index = torch.arange(100).pin_memory()
    torch.cuda._sleep(200_000_000)  # the stream is busy: a queued copy has not run yet
    out = store.gather(index)
    index.fill_(999)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), x[:100])
    store.close()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_features_and_conjugate_out_are_refused_clearly():
    # A quantized table used to pass the constructor and fail at gather in the dispatcher; an
    # out with the conjugate bit aborted the whole process inside torch's fallback.
    x = torch.randn(10, 4)
    q = torch.quantize_per_tensor(x, 0.05, 3, torch.quint8)
    with pytest.raises(ValueError, match="quantized"):
        FeatureStore(q, device="cpu")
    assert torch.equal(FeatureStore(q.int_repr(), device="cpu").gather(torch.tensor([2])),
                       q.int_repr()[[2]])
    z = torch.randn(10, 3, dtype=torch.complex64)
    store = FeatureStore(z, device="cpu")
    buf = torch.zeros(2, 3, dtype=torch.complex64)
    with pytest.raises(ValueError, match="conjugate or negative view"):
        store.gather(torch.tensor([1, 2]), out=buf.conj())
    assert not buf.any()
    assert torch.equal(store.gather(torch.tensor([1, 2]), out=buf), z[[1, 2]])


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_set_epoch_reaches_persistent_loader_workers():
    # Persistent workers hold their own copy of the sampler: set_epoch(1) in the main process
    # did not reach them, so epoch 1 silently repeated epoch 0's neighbourhoods.
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NodeLoader

    from tierlift.gnn import NeighborSampler

    n = 1 << 8
    data = pyg.data.Data(x=torch.randn(n, 4), edge_index=rmat_graph(8, 8, seed=1), num_nodes=n)

    def epochs(num_workers, **kwargs):
        sampler = NeighborSampler(data, [4, 2], seed=3)
        loader = NodeLoader(data, node_sampler=sampler, input_nodes=torch.arange(n),
                            batch_size=128, num_workers=num_workers, **kwargs)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out.append([batch.n_id for batch in loader])
        return out

    want = epochs(0)
    got = epochs(2, persistent_workers=True, multiprocessing_context="fork")
    assert not all(torch.equal(a, b) for a, b in zip(*want))  # the epochs differ
    for w, g in zip(want, got):
        assert len(w) == len(g) and all(torch.equal(a, b) for a, b in zip(w, g))


@pytest.mark.gpu
def test_a_pickled_cuda_store_refuses_to_gather_and_the_original_keeps_its_rows():
    # Spawned DataLoader workers receive the store pickled by ForkingPickler, which used to move
    # the table into shared memory under the original store (or fail on its registration).
    from multiprocessing.reduction import ForkingPickler

    x = torch.randn(300, 8)
    index = torch.tensor([5, 299, 0])
    for pin in ("inplace", "copy"):
        store = FeatureStore(x.clone(), pin=pin, cache=0.1, degrees=torch.arange(300))
        copy = pickle.loads(ForkingPickler.dumps(store))
        with pytest.raises(RuntimeError, match="pickled into another process"):
            copy.gather(index)
        assert copy.shape == store.shape and copy.dtype == store.dtype
        assert not store._table.is_shared() and store._table.is_pinned()
        assert torch.equal(store.gather(index).cpu(), x[index])
        store.close()


def test_rmat_scale_whose_edge_keys_overflow_is_refused():
    # The dedup key src * 2**scale + dst overflows int64 from scale 32 on (wrong edges); the
    # refusal comes before any allocation.
    with pytest.raises(ValueError, match=r"scale must be an int in \[1, 31\]"):
        rmat_graph(32, 1)


def test_assigning_the_sampler_epoch_still_works():
    pytest.importorskip("torch_geometric")
    from tierlift.gnn import NeighborSampler

    ei = rmat_graph(6, 4, seed=2)
    a, b = NeighborSampler(ei, [3], seed=1), NeighborSampler(ei, [3], seed=1)
    a.epoch = 5  # the attribute spelling, as before the epoch moved to shared memory
    b.set_epoch(5)
    seeds = torch.arange(0, 64, 5)
    assert a.epoch == b.epoch == 5
    assert all(torch.equal(p, q) for p, q in zip(a.sample(seeds)[:4], b.sample(seeds)[:4]))
