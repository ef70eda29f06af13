"""Per-rank model-state memory and step time of tierlift.zero stages 1/2/3 against torch DDP and
FSDP2 (fully_shard), same model, same ranks, same optimizer (torch.optim.AdamW), one run.

    python benchmarks/bench_zero.py                       # 2 gloo ranks on CPU
    python benchmarks/bench_zero.py --nproc 4 --dim 512 --layers 8
    python benchmarks/bench_zero.py --cuda                # NCCL, one GPU per rank

Model-state bytes = live parameter storage (shards plus any gathered unit) + gradients +
optimizer state on the rank, measured right after a backward (the per-rank peak of model
state between steps). Time is the median step (forward, backward, optimizer) after warm-up.
Prints a table with ratios to FSDP2 and writes JSON (--out).

Across nodes (--nnodes N > 1, gloo on CPU): the benchmark starts N torchrun agents on this
machine meeting at a c10d rendezvous on 127.0.0.1 (each worker sees its agent's GROUP_RANK as
its node), --nproc ranks each, and compares plain ZeRO-3 (sharded over every rank), ZeRO-3
sharded within the node (hierarchy="node"), the same with FP8 weight gathers and int8 gradient
sums across nodes, and torch FSDP2 as HSDP (a (nodes, nproc) DeviceMesh):

    python benchmarks/bench_zero.py --nnodes 2 --nproc 2

Bytes per step are counted for every mode alike by a shim around torch.distributed's
collectives (CollectiveCounter): each call's logical per-rank volume as a direct exchange (the
rule of tierlift/zero/comm.py), split by whether the peer is on this rank's node; for the
tierlift modes it is checked against tierlift.zero.last_step_stats.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import inspect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODES = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
NODE_MODES = ["zero3", "zero3-hier", "zero3-hier-q", "fsdp2-hsdp"]  # --nnodes > 1
FP8_RECIPE = "fp8-tensorwise"  # zero3-hier-q's tierlift.lowp.convert recipe


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.data_ptr() in seen and s.nbytes():
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _model_state_bytes(mode, model, opt) -> dict:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    if mode.startswith("zero"):
        # The gathered buffers and gradients too (stage 1/2 fp32 shards live inside them).
        units = model._tierlift_zero.units
        params += [u.full for u in units]
        grads += [u.full.grad for u in units] + [u.full_grad for u in units]
    optim = _storage_bytes(v for s in opt.state.values() for v in s.values()
                           if torch.is_tensor(v) and v.dim() > 0)
    p = _storage_bytes(params)
    g = _storage_bytes(grads)
    return {"params": p, "grads": g, "optim": optim, "total": p + g + optim}


def _build(mode, args, device):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        import tierlift

        tierlift.zero.shard(model, stage=int(mode[-1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def _worker(rank, world, port, args, out):
    device = torch.device("cuda", rank) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if args.cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    results = {}
    for mode in args.modes:
        model, opt = _build(mode, args, device)
        times, mem = [], None
        for step in range(args.warmup + args.steps):
            idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            if args.cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            if step == args.warmup + args.steps - 1:
                mem = _model_state_bytes(mode, model, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        step_s = torch.tensor(statistics.median(times))
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[mode] = {"step_s": step_s.item(), "bytes": mem}
        del model, opt
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads may still be releasing collective buffers,
    # which aborts a finalizing interpreter (torch 2.15).
    os._exit(0)


# ---- across nodes (--nnodes > 1) ----


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _peer_of(ranks: list[int], rank, group_rank) -> int:
    """Group rank of a peer named by global `rank` or by `group_rank`."""
    return group_rank if group_rank is not None else ranks.index(rank)


def _to_one(nbytes: int, peer: int, w: int) -> list[int]:
    return [nbytes if r == peer else 0 for r in range(w)]


def _all_to_all_single(a, w, me, ranks):
    inp = a["input"]
    splits = a.get("input_split_sizes")
    if not splits:
        return [inp.numel() // w * inp.element_size()] * w
    row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
    return [s * row for s in splits]


def _broadcast(a, w, me, ranks):
    src = _peer_of(ranks, a.get("src"), a.get("group_src"))
    return [_nbytes(a["tensor"])] * w if src == me else [0] * w


def _scatter(a, w, me, ranks):
    src = _peer_of(ranks, a.get("src"), a.get("group_src"))
    return [_nbytes(t) for t in a["scatter_list"]] if src == me else [0] * w


def _to_dst(a, w, me, ranks):
    dst = _peer_of(ranks, a.get("dst"), a.get("group_dst"))
    return _to_one(_nbytes(a["tensor"]), dst, w)


def _batch_p2p(a, w, me, ranks):
    out = [0] * w
    for op in a["p2p_op_list"]:
        if getattr(op.op, "__name__", "") in ("isend", "send"):
            out[_peer_of(ranks, op.peer, op.group_peer)] += _nbytes(op.tensor)
    return out


def _all_reduce_bytes(t: torch.Tensor, w: int) -> int:
    return 2 * -(-t.numel() // w) * t.element_size()


# Per collective: bytes this rank sends to each rank of the group (own entry ignored), as a
# direct exchange: each peer gets from this rank what it needs (its piece of a reduce-scatter,
# this rank's piece of an all-gather, both halves of an all-reduce) -- tierlift/zero/comm.py's
# rule, independent of the algorithm the backend picks.
_RULES = {
    "all_gather_single": lambda a, w, me, r: [_nbytes(a["input_tensor"])] * w,
    "all_gather_into_tensor": lambda a, w, me, r: [_nbytes(a["input_tensor"])] * w,
    "_all_gather_base": lambda a, w, me, r: [_nbytes(a["input_tensor"])] * w,
    "all_gather": lambda a, w, me, r: [_nbytes(a["tensor"])] * w,
    "all_gather_coalesced": lambda a, w, me, r: [sum(map(_nbytes, a["input_tensor_list"]))] * w,
    "reduce_scatter_single": lambda a, w, me, r: [_nbytes(a["output"])] * w,
    "reduce_scatter_tensor": lambda a, w, me, r: [_nbytes(a["output"])] * w,
    "_reduce_scatter_base": lambda a, w, me, r: [_nbytes(a["output"])] * w,
    "reduce_scatter": lambda a, w, me, r: [_nbytes(t) for t in a["input_list"]],
    "all_reduce": lambda a, w, me, r: [_all_reduce_bytes(a["tensor"], w)] * w,
    "all_reduce_coalesced": lambda a, w, me, r: [sum(_all_reduce_bytes(t, w)
                                                     for t in a["tensors"])] * w,
    "all_to_all_single": _all_to_all_single,
    "all_to_all": lambda a, w, me, r: [_nbytes(t) for t in a["input_tensor_list"]],
    "broadcast": _broadcast,
    "scatter": _scatter,
    "reduce": _to_dst,
    "gather": _to_dst,
    "gather_single": _to_dst,
    "gather_into_tensor": _to_dst,
    "send": _to_dst,
    "isend": _to_dst,
    "batch_isend_irecv": _batch_p2p,
}


class CollectiveCounter:
    """While installed (a context manager), counts the bytes this rank sends in
    torch.distributed's collectives, split by whether the peer is on this rank's node.

    It wraps every function of _RULES in torch.distributed and in distributed_c10d (where the
    aliases call each other: all_gather_into_tensor calls all_gather_single), counting the
    outermost call only. `nodes` is the node of every global rank. `calls` counts the calls by
    function name, which shows what a library actually uses (FSDP2 in torch 2.15: all_gather_single,
    reduce_scatter_single and, for HSDP, all_reduce)."""

    def __init__(self, nodes: list[int]):
        self.nodes = list(nodes)
        self.sent = {"intra_node": 0, "inter_node": 0}
        self.calls: collections.Counter = collections.Counter()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved: list = []

    def reset(self) -> None:
        with self._lock:
            self.sent = {"intra_node": 0, "inter_node": 0}
            self.calls = collections.Counter()

    def _count(self, name: str, sig, args, kwargs) -> None:
        a = sig.bind(*args, **kwargs).arguments
        group = a.get("group")
        if name == "batch_isend_irecv":
            ops = a["p2p_op_list"]
            group = ops[0].group if ops else None
        group = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        per_rank = _RULES[name](a, len(ranks), me, ranks)
        mine = self.nodes[ranks[me]]
        with self._lock:
            self.calls[name] += 1
            for r, nbytes in enumerate(per_rank):
                if r != me:
                    key = "intra_node" if self.nodes[ranks[r]] == mine else "inter_node"
                    self.sent[key] += nbytes

    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            self._count(name, sig, args, kwargs)
            self._local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0

        return counted

    def __enter__(self) -> CollectiveCounter:
        from torch.distributed import distributed_c10d

        wrapped = {}
        for mod in (dist, distributed_c10d):
            for name in _RULES:
                fn = getattr(mod, name, None)
                if fn is None:
                    continue
                if id(fn) not in wrapped:
                    wrapped[id(fn)] = self._wrap(name, fn)
                self._saved.append((mod, name, fn))
                setattr(mod, name, wrapped[id(fn)])
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()


def _node_groups(nodes: list[int]) -> list[list[int]]:
    by_node: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        by_node.setdefault(n, []).append(r)
    return list(by_node.values())


def _build_across(mode, args, nodes):
    """(model, optimizer, number of parameters) of a --nnodes mode."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    numel = sum(p.numel() for p in model.parameters())
    if mode == "fsdp2-hsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", torch.tensor(_node_groups(nodes)),
                          mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        import tierlift

        kw = {}
        if mode in ("zero3-hier", "zero3-hier-q"):
            kw["hierarchy"] = "node"
        if mode == "zero3-hier-q":
            tierlift.lowp.convert(model, recipe=FP8_RECIPE, min_features=0)
            kw.update(fp8_all_gather=True, grad_comm="int8")
        tierlift.zero.shard(model, stage=3, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt, numel


def _measure_across(mode, args, nodes) -> dict:
    """One mode on every rank: per measured step, the bytes the shim counted, tierlift's own
    count (tierlift modes) and the step time; then the last step's global mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model, opt, numel = _build_across(mode, args, nodes)
        error = None
    except Exception as exc:  # e.g. FSDP2 HSDP not running on this torch/backend
        model = opt = numel = None
        error = f"{type(exc).__name__}: {exc}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        return {"unavailable": next(e for e in errors if e)}
    tierlift_mode = mode.startswith("zero")
    g = torch.Generator().manual_seed(1000 + rank)  # the same data for every mode
    counter = CollectiveCounter(nodes)
    times, shim, own, calls = [], [], [], None
    loss = None
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        measured = step >= args.warmup
        dist.barrier()
        counter.reset()
        with counter if measured else contextlib.nullcontext():
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
        if measured:
            times.append(elapsed)
            shim.append(dict(counter.sent))
            calls = dict(counter.calls)
            if tierlift_mode:
                import tierlift

                st = tierlift.zero.last_step_stats(model)
                own.append({"intra_node": st["intra_node_bytes"],
                            "inter_node": st["inter_node_bytes"]})
    # Outside the measured steps: the loss all-reduce and the exchange of results.
    total = loss.detach().clone()
    dist.all_reduce(total)
    step_s = torch.tensor(statistics.median(times))
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    mine = {"shim": shim, "tierlift": own or None, "calls": calls}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    del model, opt
    return {"params": numel, "step_s": step_s.item(), "loss": total.item() / world,
            "ranks": everyone}


def _worker_across(args) -> None:
    """One torchrun worker of --nnodes > 1: every mode in turn; rank 0 writes the results."""
    from tierlift.zero.topology import node_map

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    nodes = node_map()
    results = {mode: _measure_across(mode, args, nodes) for mode in args.modes}
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"nodes": nodes, "results": results}, f)
    dist.destroy_process_group()
    os._exit(0)  # as _worker: gloo may abort a finalizing interpreter (torch 2.15)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_agents(args, argv: list[str], raw: str, tmp: str) -> None:
    """Starts --nnodes torchrun agents of --nproc workers each on this machine, meeting at a
    c10d rendezvous on 127.0.0.1 as on a cluster; each worker runs this script's measurement."""
    here = os.path.dirname(os.path.abspath(__file__))
    python_dir = os.path.join(here, "..", "python")
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERLIFT_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (python_dir, os.environ.get("PYTHONPATH"))
                                          if p))
    rdzv = [f"--nnodes={args.nnodes}", f"--nproc_per_node={args.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            f"--rdzv-id=bench_zero_{os.getpid()}"]
    # The workers read the arguments from a file: torchrun would take --nproc for its own.
    with open(raw + ".args.json", "w") as f:
        json.dump(argv, f)
    script = [os.path.abspath(__file__), "--worker-out", raw]
    logs, procs = [], []
    for i in range(args.nnodes):
        logs.append(open(os.path.join(tmp, f"agent{i}.log"), "w+"))
        cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv,
               f"--rdzv-conf=is_host={str(i == 0).lower()}", *script]
        procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                break  # one agent failed: the others would wait out their timeouts
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if failed or not os.path.exists(raw):
        tails = []
        for i, lg in enumerate(logs):
            lg.seek(0)
            tails.append(f"--- agent {i} (exit {procs[i].returncode}) ---\n{lg.read()[-4000:]}")
        raise RuntimeError("torchrun agents failed:\n" + "\n".join(tails))
    for lg in logs:
        lg.close()


def _summarize_across(results: dict) -> None:
    """Adds to each mode its per-step bytes (the largest of any rank's), whether every measured
    step sent the same and whether the shim and tierlift's last_step_stats agree."""
    for r in results.values():
        if "unavailable" in r:
            continue
        per_rank = r["ranks"]
        for key in ("intra_node", "inter_node"):
            r[f"{key}_bytes"] = max(s[key] for rk in per_rank for s in rk["shim"])
        r["steps_alike"] = all(s == rk["shim"][0] for rk in per_rank for s in rk["shim"])
        if per_rank[0]["tierlift"] is not None:
            r["tierlift_matches_shim"] = all(rk["tierlift"] == rk["shim"] for rk in per_rank)
            r["tierlift_inter_node_bytes"] = max(s["inter_node"] for rk in per_rank
                                                 for s in rk["tierlift"])
            r["tierlift_intra_node_bytes"] = max(s["intra_node"] for rk in per_rank
                                                 for s in rk["tierlift"])


def _print_across(args, machine, results) -> None:
    print(f"bench_zero: {args.nnodes} torchrun agents x {args.nproc} gloo ranks on {machine}; "
          f"GPT d={args.dim} L={args.layers} vocab={args.vocab}; batch {args.batch}x{args.seq} "
          f"per rank; {args.steps} measured steps after {args.warmup}; torch {torch.__version__}")
    print("bytes: sent per rank and step (largest rank), counted by one shim around "
          "torch.distributed for every mode; tierlift modes also by last_step_stats")
    base = results.get("zero3")
    base = base if base and "unavailable" not in base else None
    print(f"{'mode':13} {'params M':>8} {'intra MB':>9} {'inter MB':>9} {'vs zero3':>8} "
          f"{'step ms':>8} {'vs zero3':>8} {'final loss':>10}  last_step_stats")
    for mode, r in results.items():
        if "unavailable" in r:
            print(f"{mode:13} unavailable: {r['unavailable']}")
            continue
        inter_ratio = r["inter_node_bytes"] / base["inter_node_bytes"] if base else float("nan")
        t_ratio = r["step_s"] / base["step_s"] if base else float("nan")
        if "tierlift_matches_shim" in r:
            check = (f"{r['tierlift_intra_node_bytes'] / 1e6:.3f} / "
                     f"{r['tierlift_inter_node_bytes'] / 1e6:.3f} MB, "
                     f"{'= shim' if r['tierlift_matches_shim'] else 'DIFFERS from shim'}")
        else:
            check = "-"
        print(f"{mode:13} {r['params'] / 1e6:8.3f} {r['intra_node_bytes'] / 1e6:9.3f} "
              f"{r['inter_node_bytes'] / 1e6:9.3f} {inter_ratio:8.3f} {r['step_s'] * 1e3:8.1f} "
              f"{t_ratio:8.2f} {r['loss']:10.5f}  {check}")
    calls = {m: r["ranks"][0]["calls"] for m, r in results.items() if "unavailable" not in r}
    print("collective calls per step (rank 0): " +
          "; ".join(f"{m}: {dict(sorted(c.items()))}" for m, c in calls.items()))


def _main_across(args, argv) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "r.json")
        _launch_agents(args, argv, raw, tmp)
        with open(raw) as f:
            payload = json.load(f)
    results = payload["results"]
    _summarize_across(results)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one "
               "machine")
    _print_across(args, machine, results)
    if args.out is None:
        results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(results_dir, exist_ok=True)
        args.out = os.path.join(results_dir, "bench_zero_nodes-cpu.json")
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "args": vars(args), "nodes": payload["nodes"],
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (per node with --nnodes)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="> 1: that many torchrun agents on this machine, one per node, "
                        f"comparing {', '.join(NODE_MODES)} (gloo on CPU)")
    p.add_argument("--timeout", type=int, default=900,
                   help="seconds for the whole --nnodes run (and each collective)")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the torchrun workers
    p.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo on CPU")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8191)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=None, choices=MODES + NODE_MODES[1:],
                   help=f"default {' '.join(MODES)}; with --nnodes > 1: {' '.join(NODE_MODES)}")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/bench_zero-{cpu,gpu}.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the results as a PNG here (needs matplotlib)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.worker_out:  # a torchrun worker of --nnodes > 1: the arguments are in a file
        with open(args.worker_out + ".args.json") as f:
            args = p.parse_args([*json.load(f), "--worker-out", args.worker_out])
    if args.nnodes < 1 or args.nproc < 1:
        p.error("--nnodes and --nproc must be at least 1")
    if args.nnodes > 1 and args.cuda:
        p.error("--nnodes > 1 runs gloo ranks on CPU (drop --cuda)")
    allowed = NODE_MODES if args.nnodes > 1 else MODES
    if args.modes is None:
        args.modes = allowed
    elif any(m not in allowed for m in args.modes):
        p.error(f"with --nnodes {args.nnodes} the modes are {', '.join(allowed)}")
    if args.worker_out:
        _worker_across(args)
    if args.nnodes > 1:
        return _main_across(args, argv)
    if args.cuda and torch.cuda.device_count() < args.nproc:
        p.error(f"--cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "r.json")
        mp.spawn(_worker, args=(args.nproc, port, args, raw), nprocs=args.nproc)
        with open(raw) as f:
            results = json.load(f)
    machine = (torch.cuda.get_device_name(0) if args.cuda else
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, gloo")
    print(f"bench_zero: {args.nproc} ranks on {machine}; GPT d={args.dim} L={args.layers} "
          f"vocab={args.vocab}; batch {args.batch}x{args.seq} per rank; torch {torch.__version__}")
    base = results.get("fsdp2")
    print(f"{'mode':8} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'state MB':>9} "
          f"{'vs fsdp2':>8} {'step ms':>8} {'vs fsdp2':>8}")
    for mode, r in results.items():
        b = r["bytes"]
        mem_ratio = b["total"] / base["bytes"]["total"] if base else float("nan")
        t_ratio = r["step_s"] / base["step_s"] if base else float("nan")
        print(f"{mode:8} {b['params'] / 1e6:10.2f} {b['grads'] / 1e6:9.2f} "
              f"{b['optim'] / 1e6:9.2f} {b['total'] / 1e6:9.2f} {mem_ratio:8.2f} "
              f"{r['step_s'] * 1e3:8.1f} {t_ratio:8.2f}")
    if args.out is None:
        results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(results_dir, exist_ok=True)
        args.out = os.path.join(results_dir, f"bench_zero-{'gpu' if args.cuda else 'cpu'}.json")
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plots import plot_json, plot_zero

        print(f"wrote {plot_json(plot_zero, args.out, args.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
