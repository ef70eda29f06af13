"""tierlift.gnn.NeighborSampler under PyG's NodeLoader, with features from tierlift FeatureStores.

PyG's own samplers need pyg-lib or torch-sparse; this one is pure torch, so these tests run on
any machine with torch_geometric. GPU tests (the CUDA store with its cache) run through
scripts/gpu_check.sh on the GPU machine.
"""

import multiprocessing

import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore, rmat_graph

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.loader import NodeLoader  # noqa: E402
from torch_geometric.testing import MyGraphStore  # noqa: E402

from tierlift.gnn import NeighborSampler, PyGFeatureStore  # noqa: E402

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SCALE = 10
N = 1 << SCALE
HAS_FORK = "fork" in multiprocessing.get_all_start_methods()


@pytest.fixture(scope="module")
def graph():
    return rmat_graph(SCALE, 8, seed=5)


def edge_set(ei):
    return set(zip(ei[0].tolist(), ei[1].tolist()))


def make_stores(x, ei, **store_kwargs):
    fs = PyGFeatureStore(**store_kwargs)
    fs[None, "x", None] = x
    gs = MyGraphStore()
    gs.put_edge_index(ei, edge_type=None, layout="coo", size=(N, N))
    return fs, gs


def check_sample(sampler, ei, seeds, fanouts, out):
    node, row, col, edge, nodes_per_hop, edges_per_hop = out
    assert torch.equal(node[: seeds.numel()], seeds)
    assert torch.unique(node[seeds.numel():]).numel() == node.numel() - seeds.numel()
    src, dst = node[row], node[col]
    real = edge_set(ei)
    assert all(e in real for e in zip(src.tolist(), dst.tolist()))
    eid = sampler.edge_permutation[edge]
    assert torch.equal(ei[0][eid], src) and torch.equal(ei[1][eid], dst)
    assert torch.unique(col * node.numel() + row).numel() == row.numel()  # no edge twice
    assert sum(nodes_per_hop) == node.numel() and sum(edges_per_hop) == row.numel()
    in_deg = torch.bincount(ei[1], minlength=N)
    start, hop_start = 0, 0
    for k, n_new, n_edges in zip(fanouts, nodes_per_hop, edges_per_hop):
        frontier = torch.arange(start, start + n_new)
        hop_col = col[hop_start: hop_start + n_edges]
        assert ((hop_col >= start) & (hop_col < start + n_new)).all()
        got = torch.bincount(hop_col - start, minlength=n_new)
        want = in_deg[node[frontier]] if k < 0 else in_deg[node[frontier]].clamp(max=k)
        assert torch.equal(got, want)  # min(degree, fanout) per node, exactly
        start, hop_start = start + n_new, hop_start + n_edges


@pytest.mark.parametrize("fanouts", [[10, 5], [3, 3, 3], [-1], [0, 4], [40]])
def test_sample_is_real_edges_with_fanout(graph, fanouts):
    sampler = NeighborSampler(graph, fanouts, num_nodes=N, seed=1)
    seeds = torch.randperm(N, generator=torch.Generator().manual_seed(0))[:128]
    check_sample(sampler, graph, seeds, fanouts, sampler.sample(seeds))


def test_graph_inputs_agree(graph):
    seeds = torch.arange(0, N, 17)
    fs, gs = make_stores(torch.randn(N, 4), graph, device="cpu")
    data = pyg.data.Data(edge_index=graph, num_nodes=N)
    want = None
    for g in (graph, data, gs, (fs, gs)):
        sampler = NeighborSampler(g, [6, 3], seed=2)
        dst = torch.repeat_interleave(torch.arange(N), sampler.colptr.diff())
        csc = torch.sort(dst * N + sampler.row).values  # the same CSC up to order in a column
        want = csc if want is None else want
        assert torch.equal(csc, want)
        check_sample(sampler, graph, seeds, [6, 3], sampler.sample(seeds))
    fs.close()


@pytest.mark.parametrize("deg,k", [(12, 8), (200, 7), (41, 5)])  # the random-key and redraw regimes
def test_uniform_without_replacement(deg, k):
    ei = torch.stack([torch.arange(1, deg + 1), torch.zeros(deg, dtype=torch.long)])  # a star
    sampler = NeighborSampler(ei, [k], seed=0)
    counts = torch.zeros(deg + 1)
    trials = 3000
    for epoch in range(trials):
        sampler.set_epoch(epoch)
        node, row, _, _, _, _ = sampler.sample(torch.tensor([0]))
        picked = node[row]
        assert picked.numel() == k and torch.unique(picked).numel() == k
        counts[picked] += 1
    freq = counts[1:] / trials
    expected = k / deg
    sigma = (expected * (1 - expected) / trials) ** 0.5
    assert (freq - expected).abs().max() < 5 * sigma


def test_deterministic_per_seed(graph):
    seeds = torch.arange(100, 300)
    a = NeighborSampler(graph, [8, 4], seed=7).sample(seeds)
    b = NeighborSampler(graph, [8, 4], seed=7).sample(seeds)
    c = NeighborSampler(graph, [8, 4], seed=8).sample(seeds)
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))
    assert not torch.equal(a[0], c[0])
    s = NeighborSampler(graph, [8, 4], seed=7)
    s.set_epoch(1)
    assert not torch.equal(s.sample(seeds)[0], a[0])


def test_bad_arguments(graph):
    with pytest.raises(ValueError, match="num_neighbors"):
        NeighborSampler(graph, [])
    with pytest.raises(ValueError, match="num_neighbors"):
        NeighborSampler(graph, [5, -2])
    with pytest.raises(TypeError, match="seed"):
        NeighborSampler(graph, [5], seed=1.5)
    with pytest.raises(TypeError, match="graph"):
        NeighborSampler([[0, 1], [1, 0]], [5])
    with pytest.raises(ValueError, match="edge_index"):
        NeighborSampler(torch.zeros(3, 4, dtype=torch.long), [5])
    with pytest.raises(ValueError, match="num_nodes"):
        NeighborSampler(graph, [5], num_nodes=3)
    with pytest.raises(IndexError, match="seed nodes"):
        NeighborSampler(graph, [5]).sample(torch.tensor([N]))
    with pytest.raises(NotImplementedError, match="nodes only"):
        NeighborSampler(graph, [5]).sample_from_edges(None)
    with pytest.raises(ValueError, match="input_time"):
        NeighborSampler(graph, [5]).sample_from_nodes(
            pyg.sampler.NodeSamplerInput(input_id=None, node=torch.tensor([1]),
                                         time=torch.tensor([0])))
    for seeds in (torch.tensor([1.7]), torch.tensor([True])):  # not cast to rows 1
        with pytest.raises(ValueError, match="integer tensor"):
            NeighborSampler(graph, [5]).sample_from_nodes(
                pyg.sampler.NodeSamplerInput(input_id=None, node=seeds))


def test_duplicate_seeds_keep_their_places(graph):
    seeds = torch.tensor([7, 3, 7, 7, 100])
    sampler = NeighborSampler(graph, [4, 2], seed=0)
    check_sample(sampler, graph, seeds, [4, 2], sampler.sample(seeds))


def loader_batches(graph, x, num_workers, **store_kwargs):
    fs, gs = make_stores(x, graph, **store_kwargs)
    sampler = NeighborSampler((fs, gs), [5, 3], seed=11)
    kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=torch.arange(0, N, 3),
                        batch_size=64, num_workers=num_workers, **kwargs)
    return fs, list(loader)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.skipif(
    not HAS_FORK, reason="no fork"))])
def test_node_loader_features_come_from_the_store(graph, num_workers):
    x = torch.randn(N, 12)
    fs, batches = loader_batches(graph, x, num_workers, device="cpu")
    _, reference = loader_batches(graph, x, 0, device="cpu")
    real = edge_set(graph)
    assert len(batches) == len(reference) == (N + 2) // 3 // 64 + 1
    for batch, ref in zip(batches, reference):
        assert torch.equal(batch.x, x[batch.n_id])  # gathered by the tierlift store
        assert torch.equal(batch.n_id, ref.n_id)  # same sample whichever worker drew it
        assert torch.equal(batch.edge_index, ref.edge_index)
        g = batch.n_id[batch.edge_index]
        assert all(e in real for e in zip(g[0].tolist(), g[1].tolist()))
        assert torch.equal(batch.n_id[: batch.batch_size], batch.input_id * 3)
    fs.close()


class SAGE(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.convs = torch.nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x


def train_losses(batches, y, steps):
    torch.manual_seed(0)
    model = SAGE([8, 16, 4])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for (x, edge_index, n_id, batch_size), _ in zip(batches, range(steps)):
        out = model(x, edge_index)[:batch_size]
        loss = torch.nn.functional.cross_entropy(out, y[n_id[:batch_size]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_graphsage_through_node_loader_matches_batches_built_by_hand(graph):
    x = torch.randn(N, 8)
    y = torch.randint(0, 4, (N,))
    input_nodes = torch.arange(N)
    fs, gs = make_stores(x, graph, device="cpu")
    sampler = NeighborSampler((fs, gs), [5, 3], seed=4)
    loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=input_nodes, batch_size=100)
    via_loader = ((b.x, b.edge_index, b.n_id, b.batch_size) for b in loader)
    by_hand = []
    for seeds in input_nodes.split(100):
        node, row, col, _, _, _ = sampler.sample(seeds)
        by_hand.append((x[node], torch.stack([row, col]), node, seeds.numel()))
    a, b = train_losses(via_loader, y, 6), train_losses(by_hand, y, 6)
    assert a == b and len(a) == 6
    fs.close()


@pytest.mark.gpu
def test_cuda_store_with_cache_and_workers(graph):
    x = torch.randn(N, 12)
    deg = torch.bincount(graph[1], minlength=N)
    store = FeatureStore(x, cache=0.1, degrees=deg)
    fs, gs = make_stores(store, graph)
    sampler = NeighborSampler((fs, gs), [5, 3], seed=11)
    # A CUDA store gathers in the main process; the workers only sample.
    loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=torch.arange(N),
                        batch_size=128, num_workers=2, filter_per_worker=False,
                        multiprocessing_context="fork")
    for batch in loader:
        assert batch.x.is_cuda and torch.equal(batch.x.cpu(), x[batch.n_id])
    assert store.cached_rows().numel() == N // 10
    fs.close()
