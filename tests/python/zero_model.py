"""A tiny GPT for the ZeRO and checkpoint tests, with every awkward case the sharding must
survive: numel that does not divide by the world size, a tied embedding/LM head, a frozen
parameter, a buffer and a parameter the forward never uses."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 61, 20, 2, 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a k bias has no gradient
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)
        self.unused = nn.Linear(DIM, 3)  # never called: no gradient, not stepped (as torch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1, requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("logit_scale", torch.tensor(0.9))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.logit_scale


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def batches(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def train(model, opt, data, *, accum: int, clip: float | None, world: int = 1, rank: int = 0,
          zero: bool = False, twice: bool = False, group=None):
    """Steps over `data` (global batches); each rank takes its slice of every micro-batch.
    Returns the global loss of every step. twice=True calls the model twice per micro-batch."""
    import tierlift

    losses = []
    for seq in data:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=seq.device)
        for m, micro in enumerate(seq.chunk(accum)):
            local = micro.chunk(world)[rank]
            idx, tgt = local[:, :-1], local[:, 1:]
            sync = not zero or m == accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                if twice:
                    half = idx.shape[1] // 2
                    l1 = F.cross_entropy(model(idx[:, :half]).flatten(0, 1),
                                         tgt[:, :half].flatten())
                    l2 = F.cross_entropy(model(idx[:, half:]).flatten(0, 1),
                                         tgt[:, half:].flatten())
                    loss = (l1 + l2) / (2 * accum)
                else:
                    loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()) / accum
                loss.backward()
            total += loss.detach()
        if zero:
            if world > 1:
                dist.all_reduce(total, group=group)
            total /= world
            if clip is not None:
                tierlift.zero.clip_grad_norm_(model, clip)
        else:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total.item())
    return losses


def raised(fn, exc=Exception) -> str:
    """`fn()`'s error as "Type: message" (what the rank cases send back and the tests read),
    or "<no error>"."""
    try:
        fn()
    except exc as e:
        return f"{type(e).__name__}: {e}"
    return "<no error>"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    import datetime

    os.environ.setdefault("TIERLIFT_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    """End a spawned rank: destroy the process group and leave without interpreter teardown.

    gloo's worker threads release the buffers of finished collectives a moment after wait()
    returns; if the interpreter is finalizing by then, the thread dies taking the GIL and the
    process aborts ("terminate called without an active exception", seen in ~20% of runs with
    torch 2.15). Results are written before this is called."""
    dist.destroy_process_group()
    os._exit(0)


def spawn_ranks(cases, tmp: str, world: int = 2) -> list:
    """Runs `cases(rank, world, tmp) -> dict` (a module-level function) on `world` gloo ranks in
    one torch.multiprocessing spawn and returns each rank's dict."""
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(world, free_port(), tmp, cases), nprocs=world)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False)
            for r in range(world)]


def _spawned(rank: int, world: int, port: int, tmp: str, cases) -> None:
    init_gloo(rank, world, port)
    out = cases(rank, world, tmp)
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    shutdown()


_TORCHRUN_PRELUDE = """\
import os, sys, tempfile, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
"""
_TORCHRUN_EPILOGUE = """
if rank == 0:
    torch.save(out, {out!r})
dist.destroy_process_group()
os._exit(0)  # torch 2.15's gloo can abort at interpreter exit
"""


def run_torchrun(body: str, root, *, timeout: int = 300, weights_only: bool = False,
                 nnodes: int = 1, nproc: int = 2, check: bool = True, **fields):
    """Runs `body` on `nnodes` x `nproc` gloo ranks under `python -m torch.distributed.run`
    and returns the `out` it leaves on rank 0. Several nodes are several torchrun agents on
    this machine meeting at a c10d rendezvous on 127.0.0.1, as on a real cluster (each worker
    sees its agent's GROUP_RANK). The body runs after the process group is up, with `rank`,
    `world` and the tests folder on sys.path, and is formatted with `fields` (so literal braces
    are doubled). check=False: agents may fail (a test that kills a node)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path, out = os.path.join(root, "torchrun_script.py"), os.path.join(root, "torchrun_out.pt")
    script = _TORCHRUN_PRELUDE + body + _TORCHRUN_EPILOGUE
    with open(path, "w") as f:
        f.write(script.format(tests=tests, out=out, **fields))
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERLIFT_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(tests, "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1:
        cmds = [[*run, "--standalone", path]]
    else:
        rdzv = [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={os.getpid()}"]
        # Agent 0 hosts the store (a test that kills a node kills agent 1's, TEST_AGENT=1).
        cmds = [[*run, *rdzv, f"--rdzv-conf=is_host={str(i == 0).lower()}", path]
                for i in range(nnodes)]
    # Unnamed files: tests check that `root` holds only what the script wrote.
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs = [subprocess.Popen(c, env=dict(env, TEST_AGENT=str(i)), stdout=lg,
                              stderr=subprocess.STDOUT)
             for i, (c, lg) in enumerate(zip(cmds, logs, strict=True))]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            # A failed agent's peers wait out torchrun's exit barrier: once rank 0's result
            # is there and an agent has failed, the rest has nothing more to say.
            if not check and os.path.exists(out) and any(p.poll() for p in procs):
                time.sleep(1.0)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    text = []
    for lg in logs:
        lg.seek(0)
        text.append(lg.read()[-3000:])
        lg.close()
    if check:
        for p, t in zip(procs, text, strict=True):
            assert p.returncode == 0, t
    assert os.path.exists(out), "\n".join(text)
    return torch.load(out, weights_only=weights_only)
