"""torch_geometric's FeatureStore interface over tierlift FeatureStores, so PyG's loaders
(NeighborLoader with a (feature_store, graph_store) pair) fetch rows with tierlift's gather, and
a GraphStore whose file-backed edge arrays reach spawned DataLoader workers as their files.

    fs = PyGFeatureStore()
    fs["paper", "x", None] = tierlift.gnn.FeatureStore(x, cache=0.1, degrees=deg)   # or a tensor
    loader = NeighborLoader((fs, graph_store), num_neighbors=[10, 5], input_nodes=...,
                            filter_per_worker=False)   # CUDA stores gather in the main process

Importing this module needs torch_geometric.
"""

from __future__ import annotations

import numpy as np
import torch
from torch_geometric.data import EdgeAttr, GraphStore, TensorAttr
from torch_geometric.data import FeatureStore as _PyGFeatureStore

from tierlift.gnn.file_table import FileBackedPickling, MappedFiles, WatchesItsFiles
from tierlift.gnn.store import FeatureStore


class PyGFeatureStore(_PyGFeatureStore):
    """A PyG FeatureStore whose tensors are tierlift FeatureStores (keyed by group and attr)."""

    def __init__(self, **store_kwargs):
        """store_kwargs (pin, cache, device, ...) are used when a plain tensor is put."""
        super().__init__()
        self._stores: dict[tuple, FeatureStore] = {}
        self._store_kwargs = store_kwargs

    @staticmethod
    def _key(attr: TensorAttr) -> tuple:
        return (attr.group_name, attr.attr_name)

    def _put_tensor(self, tensor, attr: TensorAttr) -> bool:
        _whole_tensors_only(attr, "put")
        if isinstance(tensor, np.ndarray):  # PyG's stores take arrays too; no copy
            tensor = torch.from_numpy(tensor)
        store = tensor if isinstance(tensor, FeatureStore) else FeatureStore(
            tensor, **self._store_kwargs)
        self._drop(self._key(attr), keep=store)
        self._stores[self._key(attr)] = store
        return True

    def update_tensor(self, tensor, *args, **kwargs) -> bool:
        """Replaces a whole tensor. PyG's default removes the old one first, so a new tensor
        that is refused (or rows given with an index, which a store cannot take) lost the old
        rows; here the new store is built first and the old one dropped only then."""
        return self.put_tensor(tensor, *args, **kwargs)

    def _drop(self, key: tuple, keep: FeatureStore | None = None) -> FeatureStore | None:
        """Removes `key`; closes its store unless it is `keep` or another key still serves it."""
        old = self._stores.pop(key, None)
        if old is not None and old is not keep \
                and not any(store is old for store in self._stores.values()):
            old.close()
        return old

    def _get_tensor(self, attr: TensorAttr):
        store = self._stores.get(self._key(attr))
        if store is None:
            return None
        index = attr.index if attr.is_set("index") else None
        if index is None:
            index = torch.arange(store.num_rows)
        elif isinstance(index, slice):
            index = torch.arange(store.num_rows)[index]
        elif not isinstance(index, torch.Tensor):
            index = torch.as_tensor(index)  # its own dtype: gather refuses floats
        if index.dtype == torch.bool:  # a mask, as tensor[mask] reads it
            if index.shape != (store.num_rows,):
                raise IndexError(f"PyGFeatureStore: a boolean index must have shape "
                                 f"({store.num_rows},), one per row, got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        if index.dim() == 0:  # an int (PyG's index may be one): one row, as x[i] gives
            return store.gather(index.reshape(1))[0]
        return store.gather(index)

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        _whole_tensors_only(attr, "remove")
        return self._drop(self._key(attr)) is not None

    def _get_tensor_size(self, attr: TensorAttr):
        store = self._stores.get(self._key(attr))
        return None if store is None else store.shape

    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        return [TensorAttr(group_name=g, attr_name=a) for g, a in self._stores]

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()


class PyGGraphStore(WatchesItsFiles, GraphStore, FileBackedPickling):
    """A PyG GraphStore (edge indices kept as put) whose edge arrays that are a mapped file
    (np.memmap, torch.from_file) reach spawned DataLoader workers as a reference to the file.
    PyG's loaders pickle their (feature_store, graph_store) into spawned workers, and by value
    torch's pickling copies the graph into /dev/shm (an OOM for a graph larger than RAM; for
    torch.from_file arrays it fails with 'Bad file descriptor'); here a worker maps the same
    file again, which must then be reachable and unchanged. Plain pickle and torch.save carry
    the edges by value. Edge arrays that are a mapping of a file are watched for a rewrite of
    the file in place (another process writing some of its bytes), which is refused when they
    are read next (get_edge_index, csc(), PyG's loaders) or pickled.

        gs = PyGGraphStore()
        gs.put_edge_index((row, colptr), edge_type=None, layout="csc", size=(n, n))
    """

    # An edge index is put as a (row, col) pair, or (PyG allows it) as one tensor.
    _file_state_keys = ("_edges",)
    _file_names = {"owner": "PyGGraphStore", "what": "graph file", "holder": "graph store"}

    def __init__(self):
        super().__init__()
        self._edges: dict[tuple, tuple] = {}
        self._files: dict[tuple, MappedFiles] = {}  # the files each edge index maps

    @staticmethod
    def _key(attr: EdgeAttr) -> tuple:
        return (attr.edge_type, attr.layout.value, attr.is_sorted, attr.size)

    @staticmethod
    def _watch_edges(edge_index) -> MappedFiles:
        arrays = edge_index if isinstance(edge_index, (tuple, list)) else (edge_index,)
        return MappedFiles(arrays, what="graph file", holder="graph store")

    def _watch_files(self) -> dict[tuple, MappedFiles]:
        return {key: self._watch_edges(edges) for key, edges in self._edges.items()}

    def _check_files(self, key: tuple | None = None) -> None:
        """A rewrite in place of a file that an edge index maps (another process writing some
        bytes of it) changes the edges read from then on, silently. Before each read: a stat
        and a read of the process's fanotify queue per file; nothing for arrays in memory.
        `key`: that edge index only (default: all)."""
        for files in self._files.values() if key is None else (self._files.get(key),):
            problem = None if files is None else files.problem()
            if problem is not None:
                raise RuntimeError(
                    f"PyGGraphStore: {problem}. Refused: put the edge index again, mapped from "
                    "its file as it is now (and build the loaders and samplers that use it "
                    "again); to change the graph under a running job, write new files and "
                    "os.replace() them onto the paths")

    def _put_edge_index(self, edge_index, edge_attr: EdgeAttr) -> bool:
        key = self._key(edge_attr)
        files = self._watch_edges(edge_index)
        self._edges[key], self._files[key] = edge_index, files
        return True

    def _get_edge_index(self, edge_attr: EdgeAttr):
        key = self._key(edge_attr)
        self._check_files(key)
        return self._edges.get(key)

    def _remove_edge_index(self, edge_attr: EdgeAttr) -> bool:
        self._files.pop(self._key(edge_attr), None)
        return self._edges.pop(self._key(edge_attr), None) is not None

    def get_all_edge_attrs(self) -> list[EdgeAttr]:
        return [EdgeAttr(*key) for key in self._edges]

def _whole_tensors_only(attr: TensorAttr, action: str) -> None:
    # Rows cannot be put into or taken out of a FeatureStore, and acting on the whole tensor
    # instead of the rows asked for would silently drop the others.
    if attr.is_set("index") and attr.index is not None:
        raise ValueError(f"PyGFeatureStore: {action} whole tensors only (index must be None); "
                         "to change rows, put a whole new tensor")
