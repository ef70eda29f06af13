"""Zero-copy GNN feature gathering.

    store = tierlift.gnn.FeatureStore(features, cache=0.1, degrees=deg)   # host-resident rows
    x = store.gather(node_ids)                 # GPU tensor read straight from pinned host memory

`FeatureStore` gathers on the GPU from pinned, mapped host memory (hot rows from a GPU cache),
or on the CPU with a multithreaded C++ gather. `PyGFeatureStore` exposes stores through
torch_geometric's FeatureStore interface and `NeighborSampler` samples neighbourhoods for PyG's
NodeLoader without pyg-lib (both import torch_geometric on first use); `rmat_graph` makes
synthetic power-law graphs.
"""

from tierlift.gnn.graphs import rmat_graph, to_csr
from tierlift.gnn.store import FeatureStore, FeatureStoreOptions

__all__ = ["FeatureStore", "FeatureStoreOptions", "NeighborSampler", "PyGFeatureStore",
           "PyGGraphStore", "rmat_graph", "to_csr"]


def __getattr__(name):
    if name == "PyGFeatureStore":  # imports torch_geometric only when asked for
        from tierlift.gnn.pyg import PyGFeatureStore

        return PyGFeatureStore
    if name == "PyGGraphStore":  # the same: a GraphStore whose file-backed arrays pickle as files
        from tierlift.gnn.pyg import PyGGraphStore

        return PyGGraphStore
    if name == "NeighborSampler":
        from tierlift.gnn.sampler import NeighborSampler

        return NeighborSampler
    raise AttributeError(name)
