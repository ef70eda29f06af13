# Run (CPU, ~20 s):   PYTHONPATH=python python examples/train_graphsage.py --scale 13 --steps 60
# Run (GPU machine, H100 80 GB + 128 GB RAM; features exceed GPU memory):
#   python examples/train_graphsage.py --scale 24 --features-gib 96 --cache 0.05 --steps 200 \
#       --workers 4
#   (2^24 nodes x 1536 fp32 = 96 GiB of features in host memory, gathered zero-copy by the GPU)
"""GraphSAGE with neighbour sampling on a synthetic R-MAT power-law graph whose node features
live in host memory, trained through PyG's NodeLoader with tierlift's NeighborSampler and the
features fetched by a tierlift FeatureStore (PyG FeatureStore interface).

Labels are a fixed random function of a node's own and neighbours' features, so the loss can
only fall if the sampled neighbourhoods and gathered features are right.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch_geometric.loader import NodeLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.testing import MyGraphStore
from tqdm import tqdm

from tierlift.gnn import FeatureStore, NeighborSampler, PyGFeatureStore, rmat_graph

CHUNK_ROWS = 1 << 16  # rows per feature-fill / label chunk


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=13, help="graph has 2**scale nodes")
    p.add_argument("--edge-factor", type=int, default=8)
    p.add_argument("--features", type=int, default=64, help="feature width (fp32)")
    p.add_argument("--features-gib", type=float, default=None,
                   help="size the feature table to about this many GiB (sets the width)")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--fanout", type=int, nargs="+", default=[10, 5])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cache", type=float, default=0.0, help="GPU cache fraction (by degree)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers that sample")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.features_gib is not None:
        if args.features_gib <= 0:
            p.error("--features-gib must be positive")
        args.features = max(1, int(args.features_gib * 2**30) // ((1 << args.scale) * 4))
    return args


def fill_features(n: int, width: int, seed: int) -> torch.Tensor:
    """An (n, width) fp32 table of N(0, 1) values, filled by all cores chunk by chunk (one
    generator per chunk, so the result does not depend on the number of threads)."""
    x = torch.empty(n, width)

    def fill(start):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
        x[start:start + CHUNK_ROWS].normal_(generator=gen)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(fill, range(0, n, CHUNK_ROWS)))
    return x


def make_labels(x, edge_index, classes, seed):
    """argmax of (own + mean of in-neighbours') random projection of the features. Linear, so
    the projection is taken first: nothing of size edges x width is ever built."""
    n = x.shape[0]
    w = torch.randn(x.shape[1], classes, generator=torch.Generator().manual_seed(seed + 1))
    proj = torch.cat([x[i:i + CHUNK_ROWS] @ w for i in range(0, n, CHUNK_ROWS)])
    src, dst = edge_index
    agg = torch.zeros(n, classes)
    for i in range(0, src.numel(), CHUNK_ROWS * 64):
        agg.index_add_(0, dst[i:i + CHUNK_ROWS * 64], proj[src[i:i + CHUNK_ROWS * 64]])
    deg = torch.bincount(dst, minlength=n).clamp(min=1)
    return (proj + agg / deg[:, None]).argmax(1)


class SAGE(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.convs = torch.nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    t0 = time.time()
    n = 1 << args.scale
    edge_index = rmat_graph(args.scale, args.edge_factor, seed=args.seed)
    x = fill_features(n, args.features, args.seed)  # host memory: the store reads it in place
    y = make_labels(x, edge_index, args.classes, args.seed)
    degrees = torch.bincount(edge_index[1], minlength=n)
    store = FeatureStore(x, device=device, cache=args.cache if device.type == "cuda" else 0.0,
                         degrees=degrees)
    fs = PyGFeatureStore()
    fs[None, "x", None] = store
    gs = MyGraphStore()
    gs.put_edge_index(edge_index, edge_type=None, layout="coo", size=(n, n))
    sampler = NeighborSampler((fs, gs), args.fanout, seed=args.seed)
    print(f"graph: {n} nodes, {edge_index.shape[1]} edges, max degree {int(degrees.max())}; "
          f"features {tuple(x.shape)} ({x.numel() * 4 / 2**30:.2f} GiB) on the host; "
          f"built in {time.time() - t0:.1f} s; store {store}")
    del edge_index

    # A CUDA store gathers in the main process (CUDA does not survive fork); workers sample.
    loader = NodeLoader((fs, gs), node_sampler=sampler,
                        input_nodes=torch.arange(n), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers,
                        filter_per_worker=device.type == "cpu" and args.workers > 0)
    model = SAGE([args.features] + [args.hidden] * (len(args.fanout) - 1)
                 + [args.classes]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, rows, t_data, t_step = [], 0, 0.0, 0.0
    bar = tqdm(total=args.steps, desc="train", unit="step")
    epoch = 0
    while len(losses) < args.steps:
        sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for batch in loader:
            if len(losses) == args.steps:
                break
            edge = batch.edge_index.to(device, non_blocking=True)
            target = y[batch.n_id[:batch.batch_size]].to(device, non_blocking=True)
            t1 = time.perf_counter()
            out = model(batch.x, edge)[:batch.batch_size]
            loss = F.cross_entropy(out, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())  # synchronises: t_step includes the GPU's work
            t2 = time.perf_counter()
            t_data, t_step = t_data + t1 - tick, t_step + t2 - t1
            rows += batch.x.shape[0]
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", rows=batch.x.shape[0])
            tick = time.perf_counter()
        epoch += 1
    bar.close()
    fs.close()
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    row_bytes = args.features * 4
    print(f"loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; per step: sample + "
          f"gather {1e3 * t_data / len(losses):.1f} ms, train {1e3 * t_step / len(losses):.1f} "
          f"ms; gathered {rows * row_bytes / t_data / 1e9:.2f} GB/s incl. sampling "
          f"({time.time() - t0:.1f} s total)")


if __name__ == "__main__":
    main()
