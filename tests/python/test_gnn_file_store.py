"""A FeatureStore whose rows are a mapped file (built from a path, np.memmap, torch.from_file)
goes to a spawned process through multiprocessing's pickler as a reference to its file: a
spawned DataLoader worker maps the same file again instead of receiving the table copied into
/dev/shm (torch's pickling for workers), and the main process's store keeps its mapping. Plain
pickle and torch.save carry the rows, which outlive the file. Memory that is no longer the
file's bytes (written copy-on-write pages) goes by value; a file replaced since is refused."""

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
from torch.utils.data import DataLoader, Dataset

import tierlift
from tierlift.gnn import FeatureStore, file_table
from tierlift.gnn.file_table import by_file, file_region

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

ROWS, DIM = 16384, 8  # 512 KiB of float32
INDEX = torch.tensor([0, 5, ROWS - 1, 5])


def table_file(tmp_path):
    a = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    np.save(tmp_path / "x.npy", a)
    a.tofile(tmp_path / "x.raw")
    return a


def mapped_file(t: torch.Tensor) -> str:
    """The file (or pseudo-file: /dev/shm, [heap]) this process maps `t`'s memory from."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else "[anonymous]"
    return "?"


class Rows(Dataset):
    def __init__(self, stores):
        self.stores = stores

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return [(s.gather(INDEX), mapped_file(s._table)) for s in self.stores]


def stores_of(tmp_path):
    raw = torch.from_file(str(tmp_path / "x.raw"), shared=False, size=ROWS * DIM,
                          dtype=torch.float32).view(ROWS, DIM)
    memmap = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="r+"))
    return [FeatureStore(tmp_path / "x.npy", device="cpu"),
            FeatureStore(tmp_path / "x.raw", device="cpu", dtype=torch.float32,
                         shape=(ROWS, DIM)),
            FeatureStore(raw, device="cpu"), FeatureStore(memmap, device="cpu")]


def test_a_spawned_worker_maps_the_file_again(tmp_path):
    # Was: the worker's table was a copy in /dev/shm (and the main process's store was moved
    # there too); torch.from_file tables failed to reach the worker ("Bad file descriptor").
    a = table_file(tmp_path)
    stores = stores_of(tmp_path)
    files = [str(tmp_path / n) for n in ("x.npy", "x.raw", "x.raw", "x.npy")]
    loader = DataLoader(Rows(stores), batch_size=None, num_workers=1,
                        multiprocessing_context="spawn")
    (got,) = list(loader)
    want = torch.from_numpy(a)[INDEX]
    for (rows, where), store, name in zip(got, stores, files, strict=True):
        assert torch.equal(rows, want)
        assert where == name  # the worker reads the file, not a copy
        assert mapped_file(store._table) == name  # and the main process still maps it
        assert torch.equal(store.gather(INDEX), want)


def test_workers_get_the_file_and_archives_get_the_rows(tmp_path):
    # Was: pickle and torch.save carried the file's name too, so an archived store (a dataset
    # object, a model holding it) lost its rows with the file. Only a spawned process's
    # arguments (multiprocessing's pickler) carry the name.
    a = table_file(tmp_path)
    want = torch.from_numpy(a)[INDEX]
    archives = []
    for store in stores_of(tmp_path):
        data = bytes(ForkingPickler.dumps(store))
        assert len(data) < 4096  # the table is 512 KiB
        twin = pickle.loads(data)
        assert torch.equal(twin.gather(INDEX), want)
        assert mapped_file(twin._table) == mapped_file(store._table)
        saved = io.BytesIO()
        torch.save(store, saved)
        archives += [(pickle.loads, pickle.dumps(store)),
                     (lambda b: torch.load(io.BytesIO(b), weights_only=False), saved.getvalue())]
        assert copy.copy(store)._table is store._table  # a shallow copy shares the rows
    # A tensor store keeps watching its copy's table for in-place edits (one mapping for both).
    for dumps in (pickle.dumps, ForkingPickler.dumps):
        twin = pickle.loads(dumps(stores_of(tmp_path)[2]))
        twin._table.add_(1)
        with pytest.raises(RuntimeError, match="modified in place"):
            twin.gather(INDEX)
    os.unlink(tmp_path / "x.npy")
    os.unlink(tmp_path / "x.raw")
    for load, data in archives:
        assert len(data) > a.nbytes
        twin = load(data)
        assert torch.equal(twin._table.view(torch.int32), torch.from_numpy(a).view(torch.int32))
        assert torch.equal(twin.gather(INDEX), want)


def test_written_copy_on_write_pages_pickle_by_value(tmp_path):
    # Features edited in memory before the store was built (normalized in place, say) are not
    # the file's rows: mapping the file again would give the worker the old rows.
    a = table_file(tmp_path)
    edited = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    edited[5] = -1.0
    store = FeatureStore(edited, device="cpu")
    assert file_region(store._table) is None
    want = torch.from_numpy(a)[INDEX]
    want[[1, 3]] = -1.0
    twin = pickle.loads(bytes(ForkingPickler.dumps(store)))
    assert torch.equal(twin.gather(INDEX), want)
    assert mapped_file(twin._table) != str(tmp_path / "x.npy")


def test_a_file_replaced_or_gone_since_pickling_is_refused(tmp_path):
    a = table_file(tmp_path)
    data = bytes(ForkingPickler.dumps(FeatureStore(tmp_path / "x.npy", device="cpu")))
    np.save(tmp_path / "x.npy", a + 1)  # same size; its modification time tells
    st = os.stat(tmp_path / "x.npy")
    os.utime(tmp_path / "x.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match="replaced or rewritten since this store was pickled"):
        pickle.loads(data)
    data = bytes(ForkingPickler.dumps(FeatureStore(tmp_path / "x.npy", device="cpu")))
    os.unlink(tmp_path / "x.npy")
    with pytest.raises(FileNotFoundError, match="must be reachable where it is unpickled"):
        pickle.loads(data)


def test_deepcopy_maps_the_file_again(tmp_path):
    # Was: the whole table read into memory (a table larger than RAM: an OOM).
    a = table_file(tmp_path)
    want = torch.from_numpy(a)[INDEX]
    for store in stores_of(tmp_path)[:3]:  # mapped copy-on-write
        twin = copy.deepcopy(store)
        assert twin._table.data_ptr() != store._table.data_ptr()
        assert mapped_file(twin._table) == mapped_file(store._table)
        assert torch.equal(twin.gather(INDEX), want)
        twin._table[5] = -1.0  # copy-on-write: the original and its file keep their rows
        assert torch.equal(store.gather(INDEX), want)
    features = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    store = FeatureStore(features, device="cpu")
    both = copy.deepcopy({"x": features, "store": store})  # copied with its features, as before
    assert both["store"]._table is both["x"]


def test_deepcopy_of_a_shared_mapping_is_independent_of_the_original(tmp_path):
    # Mapped again, the copy of a store over np.memmap(mode="r+") changed with the original's
    # features: an edit of them reaches the file, which the copy read its rows from.
    a = table_file(tmp_path)
    want = torch.from_numpy(a)[INDEX]
    features = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="r+"))
    twin = copy.deepcopy(FeatureStore(features, device="cpu"))
    features[5] = -1.0
    assert torch.equal(twin.gather(INDEX), want)
    assert mapped_file(twin._table) != str(tmp_path / "x.npy")  # a copy in memory


def test_written_pages_swapped_out_pickle_by_value(tmp_path, monkeypatch):
    # An edited copy-on-write page that was swapped out counts under Swap, not Anonymous:
    # read as unwritten, the worker mapped the file again and got the rows before the edit.
    table_file(tmp_path)
    edited = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c"))
    assert file_region(edited) is not None
    start = edited.data_ptr()
    smaps, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= start < hi
            elif inside and head[0] == "Swap:":
                line = "Swap:                  8 kB\n"  # as the kernel shows a swapped edit
            smaps.append(line)
    (tmp_path / "smaps").write_text("".join(smaps))
    monkeypatch.setattr(file_table, "_SMAPS", str(tmp_path / "smaps"))
    assert file_region(edited) is None
    assert by_file(edited) is edited
