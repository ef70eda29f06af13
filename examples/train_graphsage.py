# Run (CPU, ~20 s):   PYTHONPATH=python python examples/train_graphsage.py --scale 13 --steps 60
# Run (GPU machine):  python examples/train_graphsage.py --scale 24 --features 1024 --cache 0.05
#   (2^24 nodes x 1024 fp32 = 64 GiB of features in host memory, gathered zero-copy by the GPU)
"""GraphSAGE with neighbour sampling on a synthetic R-MAT power-law graph whose node features
live in host memory and are fetched with tierlift.gnn.FeatureStore.

Labels are a fixed random function of a node's own and neighbours' features, so the loss can
only fall if the sampled neighbourhoods and gathered features are right.
"""

from __future__ import annotations

import argparse
import time
from itertools import pairwise

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tierlift.gnn import FeatureStore, rmat_graph, to_csr


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=13, help="graph has 2**scale nodes")
    p.add_argument("--edge-factor", type=int, default=8)
    p.add_argument("--features", type=int, default=64, help="feature width")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--fanout", type=int, nargs="+", default=[10, 5])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cache", type=float, default=0.0, help="GPU cache fraction (by degree)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_labels(x, rowptr, col, classes, seed):
    """argmax of a random projection of (own features + mean of neighbours' features)."""
    n = x.shape[0]
    deg = (rowptr[1:] - rowptr[:-1]).clamp(min=1)
    src = torch.repeat_interleave(torch.arange(n), rowptr[1:] - rowptr[:-1])
    agg = torch.zeros_like(x).index_add_(0, src, x[col]) / deg[:, None]
    w = torch.randn(x.shape[1], classes, generator=torch.Generator().manual_seed(seed + 1))
    return ((x + agg) @ w).argmax(1)


def sample(seeds, fanouts, rowptr, col, gen):
    """Uniform neighbour sampling with replacement, layer by layer. Returns the nodes whose
    features are needed and, outermost layer first, (self positions, neighbour positions)."""
    nodes, layers = seeds, []
    for k in fanouts:
        start = rowptr[nodes]
        deg = rowptr[nodes + 1] - start
        off = (torch.rand(len(nodes), k, generator=gen) * deg[:, None]).long()
        nbr = col[(start[:, None] + off).clamp(max=len(col) - 1)]
        nbr = torch.where(deg[:, None] > 0, nbr, nodes[:, None])  # isolated: itself
        frontier, inv = torch.unique(torch.cat([nodes, nbr.flatten()]), return_inverse=True)
        layers.append((inv[: len(nodes)], inv[len(nodes):].view(-1, k)))
        nodes = frontier
    return nodes, layers[::-1]


class SAGE(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.self_lin = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in pairwise(dims))
        self.nbr_lin = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False)
                                           for a, b in pairwise(dims))

    def forward(self, h, layers):
        for i, (self_pos, nbr_pos) in enumerate(layers):
            h = self.self_lin[i](h[self_pos]) + self.nbr_lin[i](h[nbr_pos].mean(1))
            if i < len(layers) - 1:
                h = F.relu(h)
        return h


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    t0 = time.time()
    n = 1 << args.scale
    edge_index = rmat_graph(args.scale, args.edge_factor, seed=args.seed)
    rowptr, col = to_csr(edge_index, n)
    degrees = rowptr[1:] - rowptr[:-1]
    x = torch.randn(n, args.features)  # host memory: the store reads it in place
    y = make_labels(x, rowptr, col, args.classes, args.seed)
    store = FeatureStore(x, device=device, cache=args.cache if device.type == "cuda" else 0.0,
                         degrees=degrees)
    print(f"graph: {n} nodes, {edge_index.shape[1]} edges, max degree {int(degrees.max())}; "
          f"features {tuple(x.shape)} ({x.numel() * 4 / 2**20:.0f} MiB) on the host; "
          f"built in {time.time() - t0:.1f} s; store {store}")

    model = SAGE([args.features] + [args.hidden] * (len(args.fanout) - 1)
                 + [args.classes]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 2)
    losses = []
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        seeds = torch.randint(0, n, (args.batch_size,), generator=gen)
        nodes, layers = sample(seeds, args.fanout, rowptr, col, gen)
        h = store.gather(nodes)
        layers = [(s.to(device), b.to(device)) for s, b in layers]
        loss = F.cross_entropy(model(h, layers), y[seeds].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", rows=len(nodes))
    store.close()
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
          f"({time.time() - t0:.1f} s total)")


if __name__ == "__main__":
    main()
