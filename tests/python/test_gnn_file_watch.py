"""A FeatureStore's feature file written by another process under the running job
(io/file_watch.py's FileWatch through gnn/file_table.py's WatchedFile): some bytes overwritten in
place, the size kept and the modification time set back, so that stat alone sees nothing. The
next gather refuses before reading a row, in the store, its deepcopy, its copy sent to a spawned
worker and in a forked worker; where fanotify is unavailable a warning says so once and the stat
check still runs."""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import subprocess
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore
from tierlift.io import file_watch

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

INDEX = torch.tensor([39, 1, 20])

_OVERWRITE = """
import os, sys
path = sys.argv[1]
st = os.stat(path)
with open(path, "r+b") as f:  # dd conv=notrunc: some bytes of the rows, in place
    f.seek(st.st_size - 64)
    f.write(b"\\x7f" * 64)
os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time set back
"""


def overwrite(path) -> None:
    """Another process overwrites the last 64 bytes (rows 36..39) of `path`, same size, and
    sets its modification time back."""
    before = os.stat(path)
    subprocess.run([sys.executable, "-c", _OVERWRITE, str(path)], check=True)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def watched() -> bool:
    return file_watch._notifier() is not None


def table_file(tmp_path):
    a = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    np.save(tmp_path / "x.npy", a)
    return a, tmp_path / "x.npy"


def refused(store, path) -> None:
    out = torch.zeros(len(INDEX), 4)
    with pytest.raises(RuntimeError, match="was written by another process") as e:
        store.gather(INDEX, out=out)
    assert str(path) in str(e.value) and "build a new FeatureStore" in str(e.value)
    assert not out.any()  # refused before a row was read


def test_another_process_overwriting_the_file_in_place_is_refused(tmp_path):
    # Was: the same size and modification time passed the stat check, and gather served the
    # other process's bytes as rows 36..39 (wrong features, silently).
    if not watched():
        pytest.skip("fanotify is unavailable here")
    a, path = table_file(tmp_path)
    want = torch.from_numpy(a)[INDEX]
    store = FeatureStore(path, device="cpu")
    sent = pickle.loads(ForkingPickler.dumps(store))  # as a spawned worker gets it: the file
    twin = copy.deepcopy(store)  # the file mapped again
    gone = copy.deepcopy(store)
    archived = pickle.loads(pickle.dumps(store))  # by value: its own rows
    for s in (store, sent, twin, gone, archived):
        assert torch.equal(s.gather(INDEX), want)
    gone.close()  # another store of the file closed: the others still watch it
    overwrite(path)
    for s in (store, sent, twin):
        refused(s, path)
        refused(s, path)  # and every later gather
    with pytest.raises(RuntimeError, match="was written by another process"):
        pickle.dumps(store)
    assert torch.equal(archived.gather(INDEX), want)
    # A store built from the file now serves what it holds now.
    fresh = FeatureStore(path, device="cpu")
    assert torch.equal(fresh.gather(INDEX), torch.from_numpy(np.load(path))[INDEX])
    assert not torch.equal(fresh.gather(INDEX), want)


def _gather_overwrite_gather(store, path, results) -> None:
    try:
        results.put(("before", store.gather(INDEX).tolist()))
        overwrite(path)
        store.gather(INDEX)
        results.put(("after", "served rows"))
    except RuntimeError as e:
        results.put(("after", str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put(("after", f"{type(e).__name__}: {e}"))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="needs fork")
def test_a_forked_worker_watches_the_file_with_its_own_group(tmp_path):
    # A forked DataLoader worker does not read its parent's fanotify queue: without a group of
    # its own, the worker's gathers saw only the (unchanged) stat.
    if not watched():
        pytest.skip("fanotify is unavailable here")
    a, path = table_file(tmp_path)
    store = FeatureStore(path, device="cpu")
    assert torch.equal(store.gather(INDEX), torch.from_numpy(a)[INDEX])
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    worker = ctx.Process(target=_gather_overwrite_gather, args=(store, path, results))
    worker.start()
    got = dict(results.get(timeout=120) for _ in range(2))
    worker.join(timeout=120)
    assert worker.exitcode == 0
    assert got["before"] == torch.from_numpy(a)[INDEX].tolist()
    assert "was written by another process" in got["after"] and str(path) in got["after"], got
    refused(store, path)  # the parent's own group saw it too


def test_without_fanotify_a_warning_once_and_the_stat_check(tmp_path, monkeypatch):
    monkeypatch.setattr(file_watch, "_notifier", lambda: None)
    monkeypatch.setattr(file_watch, "_NOTIFIER_ERROR", "fanotify is unavailable: test")
    monkeypatch.setattr(file_watch, "_warned", False)
    a, path = table_file(tmp_path)
    with pytest.warns(RuntimeWarning, match="GNN feature files.*not watched.*overwritten in"):
        store = FeatureStore(path, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        FeatureStore(path, device="cpu").close()
        in_memory = FeatureStore(torch.zeros(4, 2), device="cpu")  # no file: no watch
    assert in_memory._file is None
    assert torch.equal(store.gather(INDEX), torch.from_numpy(a)[INDEX])
    np.save(path, a[:8])  # fewer rows: its size tells
    with pytest.raises(RuntimeError, match="rewritten in place since the store mapped it"):
        store.gather(INDEX)
