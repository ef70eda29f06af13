"""Uniform neighbour sampling over a CSC graph, in pure torch, as a PyG `BaseSampler`.

    sampler = tierlift.gnn.NeighborSampler((fs, gs), num_neighbors=[10, 5], seed=0)
    loader = torch_geometric.loader.NodeLoader((fs, gs), node_sampler=sampler,
                                               input_nodes=train_ids, batch_size=1024)

PyG's own NeighborSampler needs pyg-lib or torch-sparse; this one needs neither. For every
node added at hop h-1 it draws min(degree, fanout[h]) distinct incoming neighbours uniformly
(fanout -1: all), PyG's directed, non-disjoint semantics: seeds are `node[:batch_size]`, new
nodes are appended in order of first appearance, `row`/`col` are local source/destination ids.

Vectorised per hop, no Python loop per node: nodes whose degree is at most the fanout take all
their edges; nodes with degree up to 8x the fanout rank their edges by random keys and keep the
k smallest (a top-k over a padded matrix); higher degrees draw k offsets and redraw the
duplicates (a round or two, as collisions are rare there). Every step is equivariant under
relabelling a node's edges, so each k-subset is equally likely. Randomness comes from a
generator seeded by (seed, epoch, the batch's seed nodes), so a batch's sample does not depend
on which DataLoader worker draws it, or on how many workers there are; `set_epoch` changes it
from one epoch to the next.
"""

from __future__ import annotations

import torch
from torch_geometric.data import Data, GraphStore
from torch_geometric.sampler import BaseSampler, NodeSamplerInput, SamplerOutput

from tierlift.gnn.file_table import FileBackedPickling, MappedFiles, WatchesItsFiles

_HASH_PRIME = (1 << 31) - 1
_KEYS_UP_TO = 8  # degrees up to this x fanout rank all their edges; above, draw and redraw


def _csc_from_edge_index(edge_index: torch.Tensor, num_nodes: int):
    """(colptr, row, perm): edges sorted by destination, perm maps CSC position -> edge id."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    _check_node_ids(src, num_nodes, "an edge source")
    _check_node_ids(dst, num_nodes, "an edge destination")
    perm = torch.argsort(dst, stable=True)
    colptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
    return colptr, src[perm], perm


def _csc_from_graph_store(graph_store: GraphStore):
    attrs = graph_store.get_all_edge_attrs()
    if len(attrs) != 1:
        raise ValueError(f"graph: NeighborSampler samples homogeneous graphs (one edge type), "
                         f"the graph store holds {len(attrs)}")
    row, colptr, perm = graph_store.csc()
    if isinstance(row, dict):  # keyed by edge type
        key = attrs[0].edge_type
        row, colptr, perm = row[key], colptr[key], perm.get(key)
    if attrs[0].size is None and row.numel() and int(row.max()) >= colptr.numel() - 1:
        # Put without size=, PyG sizes the CSC by the largest destination: sources past it
        # (nodes with out-edges only) are nodes with no in-edges, not ids outside the graph.
        colptr = torch.cat([colptr, colptr[-1:].expand(int(row.max()) + 2 - colptr.numel())])
    _check_node_ids(row, colptr.numel() - 1, "an edge source")
    return colptr.long(), row.long(), perm


def _check_node_ids(ids: torch.Tensor, num_nodes: int, what: str) -> None:
    """A negative id would be sampled as a node that plain indexing reads from the end of x, and
    an id past num_nodes as one no feature row has: refused once, when the sampler is built."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_nodes):
        bad = ids[(ids < 0) | (ids >= num_nodes)][0]
        raise ValueError(f"graph: {what} is node {int(bad)}, outside [0, {num_nodes}) (the "
                         f"graph's num_nodes); node ids must be in that range")


def _check_fanouts(num_neighbors) -> list[int]:
    if not isinstance(num_neighbors, (list, tuple)) or len(num_neighbors) == 0:
        raise ValueError(f"num_neighbors must be a non-empty list of ints (one fanout per hop, "
                         f"-1 for all neighbours), got {num_neighbors!r}")
    for k in num_neighbors:
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"num_neighbors must hold ints >= -1 (-1: all neighbours), "
                             f"got {num_neighbors!r}")
    return list(num_neighbors)


class NeighborSampler(WatchesItsFiles, BaseSampler, FileBackedPickling):
    """Uniform neighbour sampling without replacement, one fanout per hop, seeded.

    Args:
        graph: a PyG `GraphStore` (one edge type), a `(feature_store, graph_store)` pair, a PyG
            `Data` with `edge_index`, or an `edge_index` tensor (2, E) of (source, destination)
            rows (then give `num_nodes`). Messages flow source -> destination, so a node's
            sampled neighbours are its sources (for an undirected graph: all its neighbours).
        num_neighbors: fanout per hop, outermost first (seeds' neighbours); -1 takes them all.
        num_nodes: number of nodes, for an `edge_index` (default: max id + 1).
        seed: base seed; the same seed, epoch and batch give the same sample.
    """

    def __init__(self, graph, num_neighbors, *, num_nodes: int | None = None, seed: int = 0):
        self.num_neighbors = _check_fanouts(num_neighbors)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        # In shared memory, so set_epoch reaches DataLoader workers that already exist
        # (persistent_workers=True), forked or spawned, and not only those started afterwards.
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()
        if isinstance(graph, tuple) and len(graph) == 2 and isinstance(graph[1], GraphStore):
            graph = graph[1]
        perm = None
        if isinstance(graph, Data):  # (a Data is also a GraphStore)
            if graph.edge_index is None:
                raise ValueError("graph: the Data object has no edge_index")
            colptr, row, perm = _csc_from_edge_index(graph.edge_index, graph.num_nodes)
        elif isinstance(graph, GraphStore):
            colptr, row, perm = _csc_from_graph_store(graph)
        elif isinstance(graph, torch.Tensor):
            if graph.dim() != 2 or graph.shape[0] != 2 or graph.dtype.is_floating_point:
                raise ValueError(f"graph: an edge_index must be an integer tensor of shape (2, E), "
                                 f"got {graph.dtype} {tuple(graph.shape)}")
            graph = graph.cpu()
            top = int(graph.max()) + 1 if graph.numel() else 0
            if graph.numel() and int(graph.min()) < 0:
                raise ValueError("graph: edge_index holds negative node ids")
            if num_nodes is None:
                num_nodes = top
            elif num_nodes < top:
                raise ValueError(f"num_nodes = {num_nodes} but edge_index refers to node "
                                 f"{top - 1}")
            colptr, row, perm = _csc_from_edge_index(graph, num_nodes)
        else:
            raise TypeError("graph must be a GraphStore, (FeatureStore, GraphStore), Data or an "
                            f"edge_index tensor, got {type(graph).__name__}")
        self.colptr, self.row, self._perm = colptr.cpu(), row.cpu(), perm
        self.num_nodes = self.colptr.numel() - 1
        self._files = self._watch_files()

    # CSC arrays that are a mapped file (a GraphStore holding np.memmap or torch.from_file
    # tensors) reach a spawned DataLoader worker as a reference to the file, which it maps
    # again: by value, torch's pickling for workers copies the graph into /dev/shm (for
    # torch.from_file arrays it fails). Plain pickle and torch.save carry the edges.
    _file_state_keys = ("colptr", "row", "_perm")
    _file_names = {"owner": "NeighborSampler", "what": "graph file", "holder": "sampler"}

    def _watch_files(self) -> MappedFiles:
        """The files the CSC arrays are mappings of (a GraphStore's np.memmap or torch.from_file
        arrays, kept as they are: no copy), watched from here on; none for arrays in memory."""
        return MappedFiles((self.colptr, self.row, self._perm), what="graph file",
                           holder="sampler")

    def _check_files(self) -> None:
        """A rewrite in place of a file the CSC arrays map (another process writing some bytes
        of it, np.save to its path) changes the neighbourhoods sampled from then on, silently,
        and can put node ids past those checked when the sampler was built. Before each sample:
        a stat and a read of the process's fanotify queue per file; nothing for arrays in
        memory. A file replaced at its path (os.replace) or removed is not seen by the mapping,
        which keeps the old file's bytes: not refused."""
        problem = self._files.problem()
        if problem is not None:
            raise RuntimeError(
                f"NeighborSampler: {problem}. Refused: build a new NeighborSampler from the "
                "graph as its files hold it now; to change the graph under a running sampler, "
                "write new files and os.replace() them onto the paths")

    @property
    def edge_permutation(self):
        """CSC position -> edge id in the graph as given (PyG maps `e_id` through it)."""
        if self._perm is not None:
            self._check_files()
        return self._perm

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Mix `epoch` into the randomness (call before iterating a loader, as with
        DistributedSampler; the loader's workers see it, persistent ones too)."""
        self._epoch.fill_(int(epoch))

    # ---- PyG BaseSampler ----

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs) -> SamplerOutput:
        if index.time is not None:
            raise ValueError("input_time: tierlift.gnn.NeighborSampler does not sample "
                             "temporally; leave input_time unset")
        seeds = index.node.cpu()  # sample() checks the dtype (a cast would truncate 1.7 to 1)
        node, row, col, edge, nodes_per_hop, edges_per_hop = self.sample(seeds)
        return SamplerOutput(node=node, row=row, col=col, edge=edge, batch=None,
                             num_sampled_nodes=nodes_per_hop, num_sampled_edges=edges_per_hop,
                             metadata=(index.input_id, index.time))

    def sample_from_edges(self, index, neg_sampling=None):
        raise NotImplementedError("tierlift.gnn.NeighborSampler samples from nodes only "
                                  "(NodeLoader); link-level loaders are not supported")

    # ---- sampling ----

    def sample(self, seeds: torch.Tensor):
        """Samples around `seeds` (1-D int tensor of node ids). Returns (node, row, col, edge,
        num_sampled_nodes, num_sampled_edges) in PyG's SamplerOutput conventions. Refused
        (RuntimeError) once a file the graph's arrays map was rewritten in place."""
        self._check_files()
        if seeds.dim() != 1 or seeds.dtype.is_floating_point or seeds.dtype.is_complex \
                or seeds.dtype == torch.bool:
            raise ValueError(f"seeds must be a 1-D integer tensor, got {seeds.dtype} "
                             f"{tuple(seeds.shape)}")
        seeds = seeds.long()
        if seeds.numel() and (int(seeds.min()) < 0 or int(seeds.max()) >= self.num_nodes):
            raise IndexError(f"seed nodes must be in [0, {self.num_nodes}), got "
                             f"[{int(seeds.min())}, {int(seeds.max())}]")
        gen = torch.Generator().manual_seed(self._batch_seed(seeds))
        node = seeds
        rows, cols, edges = [], [], []
        nodes_per_hop, edges_per_hop = [seeds.numel()], []
        start = 0
        for k in self.num_neighbors:
            frontier = node[start:]
            owner, pos = self._sample_hop(frontier, k, gen)
            local_nbr, added = self._relabel(node, self.row[pos])
            rows.append(local_nbr)
            cols.append(owner + start)
            edges.append(pos)
            start = node.numel()
            node = torch.cat([node, added])
            nodes_per_hop.append(added.numel())
            edges_per_hop.append(pos.numel())
        return (node, torch.cat(rows), torch.cat(cols), torch.cat(edges), nodes_per_hop,
                edges_per_hop)

    def _batch_seed(self, seeds: torch.Tensor) -> int:
        """A 62-bit seed from (seed, epoch, the seed nodes in order), computed without overflow."""
        n = seeds.numel()
        weights = (torch.arange(1, n + 1, dtype=torch.long) * 2654435761) % _HASH_PRIME + 1
        digest = int((((seeds % _HASH_PRIME) + 1) * weights % _HASH_PRIME).sum()) % _HASH_PRIME
        mixed = (self.seed * 1_000_003 + self.epoch) * 1_000_033 + digest * 7919 + n
        return mixed % (1 << 62)

    def _sample_hop(self, frontier: torch.Tensor, k: int, gen: torch.Generator):
        """For each frontier node, up to k distinct in-edges. Returns (owner, pos): the frontier
        position each edge belongs to and its CSC position."""
        begin = self.colptr[frontier]
        deg = self.colptr[frontier + 1] - begin
        if k < 0:
            k = int(deg.max()) if deg.numel() else 0
        ids = torch.arange(frontier.numel())
        owners, offsets = [], []
        # Degree <= k: every edge.
        take_all = ids[deg <= k]
        o, off = _expand(take_all, deg[take_all])
        owners.append(o)
        offsets.append(off)
        # k < degree <= 8k: random keys over all edges, the k smallest per node.
        mid = ids[(deg > k) & (deg <= _KEYS_UP_TO * k)]
        if mid.numel():
            d = deg[mid]
            keys = torch.rand(mid.numel(), int(d.max()), generator=gen)
            keys.masked_fill_(torch.arange(keys.shape[1]) >= d[:, None], 2.0)  # past the end
            owners.append(mid.repeat_interleave(k))
            offsets.append(keys.topk(k, dim=1, largest=False).indices.flatten())
        # degree > 8k: k draws, duplicates redrawn until all distinct.
        big = ids[deg > _KEYS_UP_TO * k]
        if big.numel() and k > 0:
            owners.append(big.repeat_interleave(k))
            offsets.append(_distinct_draws(deg[big], k, gen).flatten())
        owner = torch.cat(owners)
        return owner, begin[owner] + torch.cat(offsets)

    @staticmethod
    def _relabel(node: torch.Tensor, nbr: torch.Tensor):
        """Local ids of `nbr` given the current `node` list (first occurrence wins), and the
        nodes not seen before, in order of first appearance."""
        both = torch.cat([node, nbr])
        uniq, inv = torch.unique(both, return_inverse=True)
        first = torch.full((uniq.numel(),), both.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inv, torch.arange(both.numel()), reduce="amin")
        local = first.clone()
        is_new = (first >= node.numel()).nonzero().flatten()
        is_new = is_new[torch.argsort(first[is_new])]
        local[is_new] = node.numel() + torch.arange(is_new.numel())
        return local[inv[node.numel():]], uniq[is_new]


def _expand(owner: torch.Tensor, deg: torch.Tensor):
    """(owner repeated deg times, 0..deg-1 per owner)."""
    rep = torch.repeat_interleave(owner, deg)
    first = torch.cumsum(deg, 0) - deg
    return rep, torch.arange(rep.numel()) - torch.repeat_interleave(first, deg)


def _distinct_draws(deg: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """(len(deg), k) offsets, each row k distinct values uniform in [0, deg[i]) (deg > k)."""
    d = deg[:, None].double()
    draw = (torch.rand(deg.numel(), k, generator=gen, dtype=torch.float64) * d).long()
    draw = torch.minimum(draw, deg[:, None] - 1)
    active = torch.arange(deg.numel())
    while active.numel():
        vals, _ = torch.sort(draw[active], dim=1)
        dup = torch.zeros_like(vals, dtype=torch.bool)
        dup[:, 1:] = vals[:, 1:] == vals[:, :-1]
        has_dup = dup.any(1)
        draw[active] = vals
        active, vals, dup = active[has_dup], vals[has_dup], dup[has_dup]
        if not active.numel():
            break
        r, c = dup.nonzero(as_tuple=True)
        redraw = (torch.rand(r.numel(), generator=gen, dtype=torch.float64)
                  * deg[active[r]].double()).long()
        vals[r, c] = torch.minimum(redraw, deg[active[r]] - 1)
        draw[active] = vals
    return draw
