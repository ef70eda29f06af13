"""Synthetic power-law graphs: R-MAT (Chakrabarti et al. 2004) as Graph500 generates them.

Each edge picks its source and destination bit by bit: at every one of `scale` levels the
adjacency matrix is split into quadrants chosen with probabilities (a, b, c, d), which gives the
skewed, community-like degree distribution of real graphs. Vertex ids are then permuted (as in
Graph500) so high-degree vertices are not clustered at low ids. Vectorised over all edges at
once: `scale` rounds of tensor ops, no Python loop over edges.
"""

from __future__ import annotations

import torch


def rmat_graph(scale: int, edge_factor: int = 16, *, a: float = 0.57, b: float = 0.19,
               c: float = 0.19, seed: int = 0, undirected: bool = True,
               remove_self_loops: bool = True) -> torch.Tensor:
    """Edge index (2, E) of an R-MAT graph with 2**scale vertices and ~edge_factor * 2**scale
    edges (Graph500 defaults a=0.57, b=c=0.19, d=0.05). Duplicates are removed; undirected graphs
    hold both directions of every edge."""
    if not isinstance(scale, int) or not 1 <= scale <= 31:  # the edge key src * n + dst: int64
        raise ValueError(f"scale must be an int in [1, 31], got {scale!r}")
    if not isinstance(edge_factor, int) or edge_factor < 1:
        raise ValueError(f"edge_factor must be a positive int, got {edge_factor!r}")
    d = 1.0 - a - b - c
    if min(a, b, c, d) < 0:
        raise ValueError(f"a + b + c must be <= 1 with each >= 0, got a={a}, b={b}, c={c}")
    n, m = 1 << scale, edge_factor << scale
    gen = torch.Generator().manual_seed(seed)
    src = torch.zeros(m, dtype=torch.long)
    dst = torch.zeros(m, dtype=torch.long)
    for level in range(scale):
        r = torch.rand(m, generator=gen)
        # Quadrant: a -> (0,0), b -> (0,1), c -> (1,0), d -> (1,1).
        src_bit = (r >= a + b).long()
        dst_bit = (((r >= a) & (r < a + b)) | (r >= a + b + c)).long()
        src |= src_bit << level
        dst |= dst_bit << level
    perm = torch.randperm(n, generator=gen)
    src, dst = perm[src], perm[dst]
    if remove_self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    if undirected:
        src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    key = torch.unique(src * n + dst)
    return torch.stack([key // n, key % n])


def to_csr(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowptr, col) of the graph, rows = sources (edges sorted by source)."""
    src, dst = edge_index.long()  # the sort key src * num_nodes + dst overflows int32
    order = torch.argsort(src * num_nodes + dst)
    col = edge_index[1][order]  # in the dtype given
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    rowptr[1:] = torch.cumsum(torch.bincount(src, minlength=num_nodes), 0)
    return rowptr, col
