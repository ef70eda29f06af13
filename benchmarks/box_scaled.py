"""The GPU machine users get (80 GB GPU, 128 GB RAM, a 64 GB drive) shrunk by --scale: every
budget and the pipeline's chunk size divided by it, the drive a loop-mounted ext4 image of the
scaled size (root only; or --dir on a drive you sized yourself). It plans the layout for the
scaled 13B model with `tierlift.plan`, trains that Llama-shaped model a few steps on the CPU
with the planned offload, trains it again with torch.optim.AdamW in another process, and
compares: the weights bit for bit with tierlift's AdamW keeping its state in memory, and within
a tolerance with torch's (the losses too); the optimizer's host memory (peak RSS over that of the
same training with a stateless SGD) under the scaled RAM budget; the bytes on the drive under its
size.

With --state-dtype bf16 it plans and trains compact Adam state (bf16 exp_avg, 8-bit exp_avg_sq;
tierlift.optim's state_dtype="bf16") and compares bit for bit with the in-memory compact
optimizer; torch's fp32-state AdamW is then only shown (loss and weight gaps), not checked. The
model is the largest the planner takes at these budgets when that is smaller than 13B/scale,
else 13B/scale (with compact state the GPU holding the bf16 weights and gradients is the bound).

    sudo python benchmarks/box_scaled.py                 # 1/64: 203M params, ~1 GiB drive
    sudo python benchmarks/box_scaled.py --state-dtype bf16
    python benchmarks/box_scaled.py --scale 1024 --dir /mnt/small-drive
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import machine, print_table, write_json  # noqa: E402
from llama_model import Llama, LlamaConfig  # noqa: E402

BOX = {"gpu": 80 << 30, "cpu": 128 << 30, "disk": 64 << 30, "params": 13e9}
CHUNK_BYTES = 32 << 20  # the default chunk_bytes, scaled with the rest
VOCAB, SEQ, BATCH = 256, 64, 2


def model_config(n: float) -> LlamaConfig:
    """The Llama shape (width a multiple of 64, 4 to 32 layers) with the most parameters <= n."""
    best = None
    for d in range(64, 8193, 64):
        for layers in range(4, 33):
            cfg = LlamaConfig(vocab_size=VOCAB, dim=d, n_layer=layers, n_head=max(1, d // 64),
                              n_kv_head=max(1, d // 64), ffn_dim=-(-8 * d // 3 // 64) * 64,
                              max_seq_len=SEQ)
            if cfg.num_params() <= n and (best is None or cfg.num_params() > best.num_params()):
                best = cfg
    return best


@contextlib.contextmanager
def scaled_drive(nbytes: int, given: str | None):
    """A directory on a file system of `nbytes` (an ext4 image without journal or reserved
    blocks, loop-mounted), or `given` as it is."""
    if given is not None:
        yield given
        return
    work = tempfile.mkdtemp(prefix="tierlift-box-")
    image, mnt = os.path.join(work, "drive.img"), os.path.join(work, "mnt")
    os.mkdir(mnt)
    try:
        with open(image, "wb") as f:
            f.truncate(nbytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-N", "64",
                        image], check=True)
        subprocess.run(["mount", "-o", "loop", image, mnt], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"could not mount a {nbytes >> 20} MiB drive image ({e}); run as root "
                         "or give --dir on a drive of that size") from e
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        shutil.rmtree(work, ignore_errors=True)


def train(case: dict) -> dict:
    """One run in this process: case["opt"] is "torch", "sgd" or tierlift AdamW kwargs."""
    import tierlift  # every run loads the extension: its code and threads are not state

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = LlamaConfig(**case["cfg"])
    model = Llama(cfg)
    data = torch.randint(0, VOCAB, (case["steps"], BATCH, SEQ + 1),
                         generator=torch.Generator().manual_seed(1))

    def loss_of(i):
        return model(data[i, :, :-1], data[i, :, 1:])

    if case["opt"] == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    elif case["opt"] == "sgd":  # no state: the memory of everything but the optimizer's state
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **case["opt"])
    losses, times, disk = [], [], 0
    for i in range(case["steps"]):
        t0 = time.perf_counter()
        loss = loss_of(i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    off = getattr(opt, "_offload", None)
    held = 0 if off is None else off.pool_bytes + sum(t.resident_bytes for t in off.tiers)
    if off is not None and off._dir is not None:
        disk = sum(os.stat(os.path.join(off._dir, f)).st_blocks * 512
                   for f in os.listdir(off._dir))
    torch.save([p.detach() for p in model.parameters()], case["weights"])
    return {"losses": losses, "step_s": times, "peak_rss": peak, "held_bytes": held,
            "state_disk_bytes": disk,
            "stats": {k: v for k, v in getattr(opt, "last_step_stats", {}).items()
                      if isinstance(v, (int, float))}}


def run_child(case: dict, reuse: str | None = None) -> dict:
    """One run in a process of its own. With `reuse` (a folder), a run of the same case (all but
    its weights path) kept there by an earlier invocation is taken instead, and a new one kept."""
    kept = None
    if reuse is not None:
        same = json.dumps({k: v for k, v in case.items() if k != "weights"}, sort_keys=True)
        kept = Path(reuse) / hashlib.sha256(same.encode()).hexdigest()[:16]
        if kept.with_suffix(".json").exists():
            shutil.copyfile(kept.with_suffix(".pt"), case["weights"])
            return json.loads(kept.with_suffix(".json").read_text())
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)],
                         capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    if out.returncode != 0:
        raise SystemExit(f"{case['opt']!r} run failed:\n{out.stdout}\n{out.stderr}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if kept is not None:
        shutil.copyfile(case["weights"], kept.with_suffix(".pt"))
        kept.with_suffix(".json").write_text(json.dumps(got))  # last: it marks the run kept
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=None, help="a drive of the scaled size (default: mount one)")
    ap.add_argument("--probe-mib", type=int, default=16)
    ap.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="optimizer state of the planned and in-memory tierlift runs")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    ap.add_argument("--reuse-runs", default=None, metavar="DIR",
                    help="keep each run in DIR and take one of the same case (model, steps, "
                         "optimizer) from an earlier invocation instead of running it again: "
                         "the torch AdamW and SGD runs do not depend on --state-dtype")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(train(json.loads(args.child))))
        return 0
    from tierlift.plan import PlanInput, make_plan, max_params
    from tierlift.plan.measure import measure
    from tierlift.plan.planner import POOL_BYTES

    s, sd = args.scale, args.state_dtype
    gpu, cpu, disk = BOX["gpu"] // s, BOX["cpu"] // s, BOX["disk"] // s
    chunk = max(4096, CHUNK_BYTES // s // 4096 * 4096)
    with scaled_drive(disk, args.dir) as drive, tempfile.TemporaryDirectory() as tmp:
        free = shutil.disk_usage(drive).free
        inp = PlanInput(params=BOX["params"] / s, gpu_mem=gpu, cpu_mem=cpu, nvme=drive,
                        nvme_free=free, pool_bytes=POOL_BYTES * chunk // CHUNK_BYTES,
                        chunk_bytes=chunk, state_dtype=sd,
                        overlap=False)  # the runs below step in place
        bw = measure(drive, args.probe_mib << 20)
        limit, _ = max_params(inp, bw)
        gpu_bound = 4 * limit >= 0.999 * gpu * (1 - inp.gpu_reserve)  # bf16 weights + grads
        cfg = model_config(min(limit, BOX["params"] / s))
        n = cfg.num_params()
        plan = make_plan(dataclasses.replace(inp, params=n), bw)
        budget = int(cpu * 0.8)
        kw = {"offload": plan.offload, "chunk_bytes": chunk, "state_dtype": sd}
        if plan.offload in ("nvme", "hybrid"):
            kw.update(nvme_path=drive, cpu_budget=budget, nvme_generations=plan.generations)
        print(f"1/{s} box: GPU {gpu >> 20} MiB, RAM {cpu >> 20} MiB (optimizer budget "
              f"{budget >> 20} MiB), drive {disk >> 20} MiB ({free >> 20} MiB free); model "
              f"{n / 1e6:.1f}M params (dim {cfg.dim}, {cfg.n_layer} layers) = "
              f"{n * s / 1e9:.1f}B/{s}; {sd} state; the planner's largest model here "
              f"{limit / 1e6:.1f}M ({'GPU' if gpu_bound else 'RAM + drive'}-bound); plan: "
              f"{plan.note}", flush=True)
        common = {"cfg": vars(cfg), "steps": args.steps}
        tag = "" if sd == "fp32" else f", {sd} state"
        planned, in_memory = f"tierlift {plan.offload}{tag}", f"tierlift in memory{tag}"
        runs = {planned: kw, in_memory: {"state_dtype": sd}, "torch AdamW": "torch",
                "SGD (no state)": "sgd"}
        res, weights = {}, {}
        for i, (name, opt) in enumerate(runs.items()):
            path = os.path.join(tmp, f"{i}.pt")
            res[name] = run_child({**common, "opt": opt, "weights": path}, args.reuse_runs)
            weights[name] = torch.load(path)
    got, mem, ref, sgd = res.values()
    a, b, c = weights[planned], weights[in_memory], weights["torch AdamW"]
    max_diff = max(float((x - y).abs().max()) for x, y in zip(a, c))
    loss_gap = max(abs(x - y) / abs(y) for x, y in zip(got["losses"], ref["losses"]))
    rows = [{"run": name, "loss_first": f"{r['losses'][0]:.5f}",
             "loss_last": f"{r['losses'][-1]:.5f}",
             "step_s": f"{sorted(r['step_s'])[len(r['step_s']) // 2]:.2f}",
             "peak_rss_MiB": f"{r['peak_rss'] / 2**20:.0f}",
             "state_rss_MiB": f"{(r['peak_rss'] - sgd['peak_rss']) / 2**20:.0f}",
             "state_on_drive_MiB": f"{r['state_disk_bytes'] / 2**20:.0f}"}
            for name, r in res.items()]
    print_table(rows, list(rows[0]), title=f"{args.steps} steps, 1/{s} of the box, {sd} state "
                                           "(state_rss: peak RSS over the SGD run's)")
    ok = {"weights bit-identical to tierlift in memory": all(
              torch.equal(x, y) for x, y in zip(a, b)),
          "pool + RAM part <= budget": got["held_bytes"] <= budget,
          # RSS also counts allocator and thread noise (torch's own AdamW shows ~10 MiB)
          "measured state RSS <= budget + 8 MiB":
              got["peak_rss"] - sgd["peak_rss"] <= budget + (8 << 20),
          "state on the drive <= its size": got["state_disk_bytes"] <= disk}
    if sd == "fp32":  # compact state is not torch's AdamW: its gaps are only shown
        ok["weights within atol 1e-4 of torch's AdamW"] = max_diff <= 1e-4
    print(f"largest loss difference to torch {loss_gap:.2e} (relative), weights max |diff| "
          f"{max_diff:.2e}; " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in ok.items()))
    result = {
        "machine": machine(), "scale": s, "state_dtype": sd, "params": n,
        "max_params": {"params": limit, "gpu_bound": gpu_bound}, "config": vars(cfg),
        "plan": plan.note, "planned": planned, "in_memory": in_memory,
        "offload": kw | {"nvme_path": None}, "budgets": {"gpu": gpu, "cpu": cpu, "disk": disk,
                                                        "optimizer": budget, "drive_free": free},
        "runs": res, "loss_gap": loss_gap, "max_weight_diff": max_diff,
        "checks": ok}
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), **result}, indent=2))
    else:
        write_json(f"box_scaled-{s}" + ("" if sd == "fp32" else f"-{sd}"), result)
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
