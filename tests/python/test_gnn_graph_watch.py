"""Files under tensors the user mapped (np.memmap, np.load(mmap_mode=...), torch.from_file),
held by a FeatureStore built from such a tensor, a NeighborSampler or a PyGGraphStore, are
watched as a FeatureStore built from a path watches its file (gnn/file_table.py's MappedFiles,
io/file_watch.py's FileWatch): another process overwriting some bytes in place, the size kept
and the modification time set back, is refused at the next gather, sample or read of the edges
instead of serving other rows or other neighbourhoods. Private pages the user wrote no longer
show the file: a table every page of which was written is not watched. Tensors in memory of
their own make no system call per gather or sample."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reducers with ForkingPickler

import tierlift
from tierlift.gnn import FeatureStore, rmat_graph
from tierlift.io import file_watch

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

ROWS, DIM = 4096, 4  # 64 KiB of float32: 16 pages
INDEX = torch.tensor([ROWS - 1, 1, 2000])

_OVERWRITE = """
import os, sys
path, offset, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(source, "rb") as f:
    data = f.read()
st = os.stat(path)
with open(path, "r+b") as f:  # dd conv=notrunc: some bytes, in place
    f.seek(offset)
    f.write(data)
os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time set back
"""


def overwrite(path, data: bytes, offset: int) -> None:
    """Another process writes `data` at `offset` of `path`, same size, and sets its
    modification time back."""
    before = os.stat(path)
    source = f"{path}.bytes"
    with open(source, "wb") as f:
        f.write(data)
    subprocess.run([sys.executable, "-c", _OVERWRITE, str(path), str(offset), source],
                   check=True)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def needs_fanotify() -> None:
    if file_watch._notifier() is None:
        pytest.skip("fanotify is unavailable here")


def features(tmp_path):
    a = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    np.save(tmp_path / "x.npy", a)
    a.tofile(tmp_path / "x.raw")
    return a


def overwrite_last_rows(path) -> None:
    """Rows ROWS-4.. of the table at the end of `path` become 127.0-ish bytes."""
    overwrite(path, b"\x7f" * 64, os.path.getsize(path) - 64)


def refused(store, path) -> None:
    out = torch.zeros(len(INDEX), DIM)
    with pytest.raises(RuntimeError, match="was written by another process") as e:
        store.gather(INDEX, out=out)
    assert str(path) in str(e.value) and "build a new FeatureStore" in str(e.value)
    assert not out.any()  # refused before a row was read


MAPPINGS = {
    "np.memmap r": lambda d: np.memmap(d / "x.raw", dtype=np.float32, mode="r",
                                       shape=(ROWS, DIM)),
    "np.load r": lambda d: np.load(d / "x.npy", mmap_mode="r"),
    "np.load r+": lambda d: np.load(d / "x.npy", mmap_mode="r+"),
    "np.load c": lambda d: np.load(d / "x.npy", mmap_mode="c"),
    "from_file shared": lambda d: torch.from_file(str(d / "x.raw"), shared=True,
                                                  size=ROWS * DIM).view(ROWS, DIM),
    "from_file private": lambda d: torch.from_file(str(d / "x.raw"), shared=False,
                                                   size=ROWS * DIM).view(ROWS, DIM),
}


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("kind", list(MAPPINGS))
def test_a_store_over_the_users_mapping_refuses_another_process_overwriting_it(tmp_path,
                                                                               kind):
    # Was: not watched, so gather served the other process's bytes as rows ROWS-4.. (silently).
    needs_fanotify()
    a = features(tmp_path)
    mapped = MAPPINGS[kind](tmp_path)
    path = tmp_path / ("x.npy" if kind.startswith("np.load") else "x.raw")
    table = mapped if isinstance(mapped, torch.Tensor) else torch.from_numpy(mapped)
    store = FeatureStore(table, device="cpu")
    want = torch.from_numpy(a)[INDEX]
    assert torch.equal(store.gather(INDEX), want)
    twin = copy.deepcopy(store)  # a private mapping is mapped again (and watched), else copied
    sent = pickle.loads(ForkingPickler.dumps(store))  # as a spawned worker gets it: the file
    overwrite_last_rows(path)
    assert not torch.equal(table[INDEX], want)  # what gather would have served
    for s in (store, sent):
        refused(s, path)
        refused(s, path)  # and every later gather
    if twin._file is not None:
        refused(twin, path)
    else:  # a shared mapping's copy holds rows of its own
        assert torch.equal(twin.gather(INDEX), want)
    with pytest.raises(RuntimeError, match="was written by another process"):
        pickle.dumps(store)


def test_private_pages_the_user_wrote_no_longer_follow_the_file(tmp_path):
    # A private (copy-on-write) mapping: the pages written before the store was built are the
    # user's, the others still show the file. Some written: watched (the others' rows would
    # change). Every one written: nothing of the file is read, not refused.
    needs_fanotify()
    a = features(tmp_path)
    some = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    some[1] = -1.0  # the first page only
    every = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    every.mul_(2.0)  # every page
    partly, wholly = FeatureStore(some, device="cpu"), FeatureStore(every, device="cpu")
    want = torch.from_numpy(a)[INDEX]
    assert partly._file is not None and wholly._file is None
    overwrite_last_rows(tmp_path / "x.npy")
    refused(partly, tmp_path / "x.npy")
    assert torch.equal(wholly.gather(INDEX), want * 2.0)


def test_own_writes_through_a_shared_mapping_are_edits_not_rewrites(tmp_path):
    # Writes through a writable shared mapping (np.memmap "r+") move the file's modification
    # time on most file systems (ext4, xfs): they are edits of the features, as through numpy
    # on a tensor in memory, and were refused as "rewritten in place". This process's rewrite
    # of a read-only mapping's file (np.save to its path) is still refused.
    a = features(tmp_path)
    path = tmp_path / "x.npy"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # an edit now moves it
    array = np.load(path, mmap_mode="r+")
    store = FeatureStore(torch.from_numpy(array), device="cpu")
    reader = FeatureStore(torch.from_numpy(np.load(path, mmap_mode="r")), device="cpu")
    array[1] = -1.0
    want = torch.from_numpy(a)[INDEX]
    want[1] = -1.0
    assert torch.equal(store.gather(INDEX), want)
    np.save(path, a + 1)  # same size, by this process: seen by its modification time
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match="rewritten in place since the store mapped it"):
        reader.gather(INDEX)


# ---- graphs ----

pyg = pytest.importorskip("torch_geometric")
from tierlift.gnn import NeighborSampler  # noqa: E402
from tierlift.gnn.pyg import PyGGraphStore  # noqa: E402

SCALE = 10
N = 1 << SCALE
FANOUTS = [4, 2]
SEEDS = torch.arange(0, N, 7)


def graph_files(tmp_path) -> NeighborSampler:
    """colptr.npy and row.raw on disk, and the in-memory sampler they were written from."""
    in_memory = NeighborSampler(rmat_graph(SCALE, 8, seed=5), FANOUTS, num_nodes=N, seed=3)
    np.save(tmp_path / "colptr.npy", in_memory.colptr.numpy())
    in_memory.row.numpy().tofile(tmp_path / "row.raw")
    return in_memory


def mapped_graph(tmp_path) -> PyGGraphStore:
    colptr = torch.from_numpy(np.load(tmp_path / "colptr.npy", mmap_mode="r"))
    row = torch.from_file(str(tmp_path / "row.raw"), shared=False,
                          size=os.path.getsize(tmp_path / "row.raw") // 8, dtype=torch.long)
    gs = PyGGraphStore()
    gs.put_edge_index((row, colptr), edge_type=None, layout="csc", size=(N, N))
    return gs


def other_graph(tmp_path, name: str, in_memory: NeighborSampler) -> tuple[bytes, int]:
    """Bytes for `name` that are a valid graph of the same size, but another one, and where."""
    if name == "row.raw":  # each node's sources are other nodes
        return in_memory.row.flip(0).numpy().tobytes(), 0
    colptr = in_memory.colptr
    even = torch.arange(N + 1) * int(colptr[-1]) // N  # the edges spread evenly over the nodes
    data = even.numpy().tobytes()
    return data, os.path.getsize(tmp_path / name) - len(data)


def samples(sampler):
    return sampler.sample(SEEDS)[:4]


def same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["row.raw", "colptr.npy"])
def test_a_graph_file_overwritten_by_another_process_is_refused_at_the_next_sample(tmp_path,
                                                                                   name):
    # Was: no check, so the sampler drew neighbourhoods of another graph, silently.
    needs_fanotify()
    in_memory = graph_files(tmp_path)
    gs = mapped_graph(tmp_path)
    sampler = NeighborSampler(gs, FANOUTS, seed=3)
    want = samples(in_memory)
    assert same(samples(sampler), want)
    sent = pickle.loads(ForkingPickler.dumps(sampler))  # as a spawned worker gets it
    twin = copy.deepcopy(sampler)  # its private mapping (row.raw) mapped again
    sent_gs = pickle.loads(ForkingPickler.dumps(gs))
    archived = pickle.loads(pickle.dumps(sampler))  # by value: edges of its own
    data, offset = other_graph(tmp_path, name, in_memory)
    overwrite(tmp_path / name, data, offset)
    # What the graph now is: a sampler built from the files as they are samples another one.
    assert not same(samples(NeighborSampler(mapped_graph(tmp_path), FANOUTS, seed=3)), want)
    path = str(tmp_path / name)
    copies = [sampler, sent] + ([twin] if name == "row.raw" else [])
    for s in copies:
        for _ in range(2):  # and every later sample
            with pytest.raises(RuntimeError, match="was written by another process") as e:
                s.sample(SEEDS)
            assert path in str(e.value) and "build a new NeighborSampler" in str(e.value)
    with pytest.raises(RuntimeError, match="was written by another process"):
        ForkingPickler.dumps(sampler)
    for store in (gs, sent_gs):
        with pytest.raises(RuntimeError, match="was written by another process") as e:
            store.csc()
        assert path in str(e.value) and "put the edge index again" in str(e.value)
        with pytest.raises(RuntimeError, match="was written by another process"):
            store.get_edge_index(edge_type=None, layout="csc", size=(N, N))
    with pytest.raises(RuntimeError, match="was written by another process"):
        pickle.dumps(gs)
    assert same(samples(archived), want)
    if name == "colptr.npy":  # a shared mapping's deepcopy holds edges of its own
        assert same(samples(twin), want)


def test_a_graph_store_forgets_the_files_of_an_edge_index_removed_or_put_again(tmp_path):
    needs_fanotify()
    in_memory = graph_files(tmp_path)
    gs = mapped_graph(tmp_path)
    gs.put_edge_index((in_memory.row, in_memory.colptr), edge_type=None, layout="csc",
                      size=(N, N))  # the same key, now in memory
    other = mapped_graph(tmp_path)
    other.remove_edge_index(edge_type=None, layout="csc", size=(N, N))
    data, offset = other_graph(tmp_path, "row.raw", in_memory)
    overwrite(tmp_path / "row.raw", data, offset)
    row, colptr = gs.get_edge_index(edge_type=None, layout="csc", size=(N, N))
    assert torch.equal(row, in_memory.row)
    pickle.loads(pickle.dumps(other))


# ---- no watch, no cost ----


class Calls:
    """Counts os.stat and FileWatch.find calls (what a watched read makes)."""

    def __init__(self, monkeypatch):
        self.count = 0
        stat, find = os.stat, file_watch.FileWatch.find

        def counted_stat(*args, **kwargs):
            self.count += 1
            return stat(*args, **kwargs)

        def counted_find(watch, *args, **kwargs):
            self.count += 1
            return find(watch, *args, **kwargs)

        monkeypatch.setattr(os, "stat", counted_stat)
        monkeypatch.setattr(file_watch.FileWatch, "find", counted_find)

    def during(self, fn, times=3) -> int:
        self.count = 0
        for _ in range(times):
            fn()
        return self.count


def test_tensors_in_memory_make_no_system_call_per_gather_or_sample(tmp_path, monkeypatch):
    features(tmp_path)
    in_memory = graph_files(tmp_path)
    store = FeatureStore(torch.randn(ROWS, DIM), device="cpu")
    edited = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    edited.mul_(2.0)  # every page the process's own
    own_pages = FeatureStore(edited, device="cpu")
    gs = PyGGraphStore()
    gs.put_edge_index((in_memory.row, in_memory.colptr), edge_type=None, layout="csc",
                      size=(N, N))
    sampler = NeighborSampler(gs, FANOUTS, seed=3)
    from_edges = NeighborSampler(rmat_graph(SCALE, 8, seed=5), FANOUTS, num_nodes=N, seed=3)
    mapped = FeatureStore(torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="r")),
                          device="cpu")
    mapped_sampler = NeighborSampler(mapped_graph(tmp_path), FANOUTS, seed=3)
    calls = Calls(monkeypatch)
    assert calls.during(lambda: store.gather(INDEX)) == 0
    assert calls.during(lambda: own_pages.gather(INDEX)) == 0
    assert calls.during(lambda: sampler.sample(SEEDS)) == 0
    assert calls.during(lambda: from_edges.sample(SEEDS)) == 0
    assert calls.during(lambda: from_edges.edge_permutation) == 0
    assert calls.during(lambda: gs.csc()) == 0
    # The count sees a watched read: mapped files cost a stat (and a find) each time.
    assert calls.during(lambda: mapped.gather(INDEX)) >= 3
    assert calls.during(lambda: mapped_sampler.sample(SEEDS)) >= 3
