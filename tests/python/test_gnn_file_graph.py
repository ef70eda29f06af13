"""A graph whose CSC arrays are mapped files (np.memmap, torch.from_file), held by a
NeighborSampler and a PyGGraphStore, goes to a spawned process through multiprocessing's
pickler as a reference to its files: a spawned DataLoader worker maps the same files again
instead of receiving the graph copied into /dev/shm (torch's pickling for workers), and the main
process keeps its mappings. Plain pickle and torch.save carry the edges, which outlive the
files. Written copy-on-write pages go by value; a file replaced or gone since is refused. The
sampler draws the same subgraphs in spawned workers as in the main process, and no two batches
repeat a sample."""

from __future__ import annotations

import copy
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reducers with ForkingPickler

import tierlift
from tierlift.gnn import FeatureStore, rmat_graph

pyg = pytest.importorskip("torch_geometric")
from test_gnn_file_store import mapped_file  # noqa: E402
from torch_geometric.loader import NodeLoader  # noqa: E402

from tierlift.gnn import NeighborSampler, PyGFeatureStore  # noqa: E402
from tierlift.gnn.pyg import PyGGraphStore  # noqa: E402

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SCALE = 10
N = 1 << SCALE
FANOUTS = [4, 2]
SEEDS = torch.arange(0, N, 7)


def graph_files(tmp_path):
    """colptr.npy and row.raw on disk, and the in-memory sampler they were written from."""
    in_memory = NeighborSampler(rmat_graph(SCALE, 8, seed=5), FANOUTS, num_nodes=N, seed=3)
    np.save(tmp_path / "colptr.npy", in_memory.colptr.numpy())
    in_memory.row.numpy().tofile(tmp_path / "row.raw")
    return in_memory


def mapped_graph(tmp_path, mode="r+"):
    colptr = torch.from_numpy(np.load(tmp_path / "colptr.npy", mmap_mode=mode))
    row = torch.from_file(str(tmp_path / "row.raw"), shared=False,
                          size=os.path.getsize(tmp_path / "row.raw") // 8, dtype=torch.long)
    gs = PyGGraphStore()
    gs.put_edge_index((row, colptr), edge_type=None, layout="csc", size=(N, N))
    return gs


def edge_arrays(gs):
    (pair,) = gs._edges.values()
    return pair


def same_sample(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.sample(SEEDS)[:4], b.sample(SEEDS)[:4],
                                                   strict=True))


def test_loader_workers_map_the_graph_files_and_sample_as_the_main_process(tmp_path):
    # Was: "Bad file descriptor" in the workers (torch.from_file arrays), and np.memmap arrays
    # were copied into /dev/shm, the main process's too.
    graph_files(tmp_path)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((N, 4), np.float32))
    fs = PyGFeatureStore()
    fs[None, "x", None] = FeatureStore(tmp_path / "x.npy", device="cpu")
    gs = mapped_graph(tmp_path)
    sampler = NeighborSampler((fs, gs), FANOUTS, seed=3)

    def batches(**workers):
        torch.manual_seed(0)  # the shuffle (PyG's generator= cannot reach spawned workers)
        loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=torch.arange(N),
                            batch_size=128, shuffle=True, **workers)
        return [(b.n_id, b.edge_index, b.x) for b in loader]

    want = batches()
    assert len(want) == N // 128
    for workers in ({"num_workers": 1, "multiprocessing_context": "spawn"},
                    {"num_workers": 2, "multiprocessing_context": "fork"}):
        got = batches(**workers)
        for w, g in zip(want, got, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(w, g, strict=True))
        # Each worker draws its own batches' samples, not copies of another worker's.
        assert len({tuple(n_id[128:].tolist()) for n_id, _, _ in got}) == len(got)
    row, colptr = edge_arrays(gs)
    for t, name in ((sampler.colptr, "colptr.npy"), (sampler.row, "row.raw"),
                    (colptr, "colptr.npy"), (row, "row.raw")):
        assert mapped_file(t) == str(tmp_path / name)  # not moved into /dev/shm
    fs.close()


def test_workers_get_the_graph_files_and_archives_get_the_edges(tmp_path):
    # Was: pickle and torch.save carried the files' names too, so an archived sampler or graph
    # store lost its edges with the files. Only a spawned process's arguments carry the names.
    in_memory = graph_files(tmp_path)
    gs = mapped_graph(tmp_path)
    sampler = NeighborSampler(gs, FANOUTS, seed=3)
    data = bytes(ForkingPickler.dumps(sampler))
    assert len(data) < 4096  # the graph holds 64 KiB of edges
    twin = pickle.loads(data)
    assert mapped_file(twin.row) == str(tmp_path / "row.raw")
    assert mapped_file(twin.colptr) == str(tmp_path / "colptr.npy")
    assert same_sample(twin, in_memory)
    data = bytes(ForkingPickler.dumps(gs))
    assert len(data) < 4096
    row, colptr = edge_arrays(pickle.loads(data))
    assert mapped_file(row) == str(tmp_path / "row.raw")
    assert torch.equal(row, in_memory.row) and torch.equal(colptr, in_memory.colptr)
    # deepcopy maps a private mapping again (not read whole) and copies a shared one (np.memmap
    # "r+"): edits of the original's arrays would reach the file, and so a copy mapped from it.
    twin = copy.deepcopy(sampler)
    assert twin.row.data_ptr() != sampler.row.data_ptr()
    assert mapped_file(twin.row) == str(tmp_path / "row.raw")
    assert mapped_file(twin.colptr) != str(tmp_path / "colptr.npy")
    kept = sampler.colptr.clone()
    sampler.colptr[1:] = sampler.colptr[-1]  # node 0 takes every edge, in the file too
    assert same_sample(twin, in_memory)  # was: the copy, mapped from the file, changed as well
    sampler.colptr.copy_(kept)
    assert copy.copy(sampler).row is sampler.row  # a shallow copy shares the edges
    archives = []
    for holder in (sampler, gs):
        saved = io.BytesIO()
        torch.save(holder, saved)
        archives += [pickle.dumps(holder), saved.getvalue()]
    os.unlink(tmp_path / "row.raw")
    os.unlink(tmp_path / "colptr.npy")
    for i, data in enumerate(archives):
        assert len(data) > in_memory.row.numel() * 8
        twin = torch.load(io.BytesIO(data), weights_only=False) if i % 2 else pickle.loads(data)
        if i < 2:
            assert same_sample(twin, in_memory)
            row, colptr = twin.row, twin.colptr
        else:
            row, colptr = edge_arrays(twin)
        assert torch.equal(row, in_memory.row) and torch.equal(colptr, in_memory.colptr)
    coo = PyGGraphStore()  # an edge index put as one (2, E) tensor stays one tensor
    coo.put_edge_index(torch.tensor([[0, 1], [1, 0]]), edge_type=None, layout="coo", size=(2, 2))
    for dumps in (pickle.dumps, ForkingPickler.dumps):
        assert torch.equal(edge_arrays(pickle.loads(dumps(coo))), edge_arrays(coo))


def test_written_copy_on_write_pages_pickle_by_value(tmp_path):
    # A graph edited in memory after mapping (a private np.load(mmap_mode="c")) is not the
    # file's: mapping the file again would give the copy the old edges.
    graph_files(tmp_path)
    gs = mapped_graph(tmp_path, mode="c")
    row, colptr = edge_arrays(gs)
    colptr[1:] = colptr[-1]  # node 0 takes every edge; the file still spreads them out
    sampler = NeighborSampler(gs, FANOUTS, seed=3)
    for holder in (sampler, gs):
        twin = pickle.loads(bytes(ForkingPickler.dumps(holder)))
        twin_colptr = twin.colptr if holder is sampler else edge_arrays(twin)[1]
        assert torch.equal(twin_colptr, colptr)
        assert mapped_file(twin_colptr) != str(tmp_path / "colptr.npy")
    assert same_sample(pickle.loads(bytes(ForkingPickler.dumps(sampler))), sampler)


def test_a_graph_file_replaced_or_gone_since_pickling_is_refused(tmp_path):
    in_memory = graph_files(tmp_path)
    sampler = NeighborSampler(mapped_graph(tmp_path), FANOUTS, seed=3)
    gs = mapped_graph(tmp_path)
    pickles = [(ForkingPickler.dumps(sampler), "sampler"),
               (ForkingPickler.dumps(gs), "graph store")]
    (in_memory.row.flip(0)).numpy().tofile(tmp_path / "row.raw")  # same size: the mtime tells
    st = os.stat(tmp_path / "row.raw")
    os.utime(tmp_path / "row.raw", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for data, holder in pickles:
        with pytest.raises(RuntimeError, match=f"replaced or rewritten since this {holder} was"):
            pickle.loads(data)
    pickles = [ForkingPickler.dumps(NeighborSampler(mapped_graph(tmp_path), FANOUTS)),
               ForkingPickler.dumps(mapped_graph(tmp_path))]
    os.unlink(tmp_path / "row.raw")
    for data in pickles:
        with pytest.raises(FileNotFoundError, match="must be reachable where it is unpickled"):
            pickle.loads(data)
