"""bench_offload.py --recipes: what the overlapped offload optimizer keeps of the chunks it
stepped during backward under the training recipes people use, and what checking them costs:
as a share of step() (what is left of the step after the overlap) and of the whole iteration
(forward + backward + step, what the user waits for).

For each recipe and tier, a stack of Linear layers trains for --repeats steps (plus one
warm-up) with tierlift.optim.AdamW(overlap=True); the table gives the fraction of speculative
chunks kept (the rest were stepped again in step()), the step time, and the content check's
share of it (the content fingerprints of the kept chunks' gradients and parameters that no
other pass of step() reads, `overlap_check_s`), and the two passes the rest of the check rides
on: the finite check of the gradients (`grad_check_s`, which fingerprints the host gradients
of the chunks stepped ahead) and the publish of the kept chunks (`publish_s`, which compares
each fp32 host parameter with its fingerprint as it copies the new value over it).
Recipes:
  hf-default   bf16 autocast + torch.nn.utils.clip_grad_norm_(1.0) (Hugging Face Trainer's)
  scaler-clip  fp16 autocast + GradScaler, scaler.unscale_ + clip_grad_norm_(1.0)
  scaler       fp16 autocast + GradScaler, scaler.step(opt) (no unscale_), max_grad_norm=1.0
  scaler-noclip  the same without any clipping
  own-clip     no autocast, the optimizer's max_grad_norm=1.0
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from common import machine, print_table, write_json
from tierlift.optim import AdamW

RECIPES = ("hf-default", "scaler-clip", "scaler", "scaler-noclip", "own-clip")


def _model(params: float) -> torch.nn.Module:
    width = 1024
    layers = max(2, round(params / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _run(recipe: str, tier: str, params: float, steps: int, directory: str) -> dict:
    model = _model(params)
    kw = dict(offload=tier, overlap=True, chunk_bytes=4 << 20, lr=1e-4)
    if tier == "nvme":
        kw["nvme_path"] = directory
    if recipe in ("scaler", "own-clip"):
        kw["max_grad_norm"] = 1.0
    opt = AdamW(model.parameters(), **kw)
    amp = {"hf-default": torch.bfloat16, "own-clip": None}.get(recipe, torch.float16)
    scaler = torch.amp.GradScaler("cpu") if recipe.startswith("scaler") else None
    x = torch.randn(64, 1024)
    kept = redone = 0
    times, iters, checks, finite, publish = [], [], [], [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss = model(x).float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        t = time.perf_counter()
        if recipe == "hf-default":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if recipe == "scaler-clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        end = time.perf_counter()
        dt = end - t
        st = opt.last_step_stats
        opt.zero_grad(set_to_none=True)
        if i == 0:  # the first step has no scale to assume and initialises the masters
            continue
        kept += st.get("overlap_kept_chunks", 0)
        redone += st.get("overlap_redone_chunks", 0)
        times.append(dt)
        iters.append(end - t0)
        checks.append(st.get("overlap_check_s", 0.0))
        finite.append(st.get("grad_check_s", 0.0))
        publish.append(st.get("publish_s", 0.0))
    opt.close()
    total = max(kept + redone, 1)
    step, it, check = (statistics.median(v) for v in (times, iters, checks))
    return {"recipe": recipe, "tier": tier, "kept": kept / total, "redone_chunks": redone,
            "step_ms": step * 1e3, "iter_ms": it * 1e3, "check_ms": check * 1e3,
            "finite_ms": statistics.median(finite) * 1e3,
            "publish_ms": statistics.median(publish) * 1e3,
            "check_share": check / step, "check_share_iter": check / it}


def bench_recipes(args) -> int:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for recipe in RECIPES:
            for tier in ("cpu", "nvme"):
                rows.append(_run(recipe, tier, args.params, args.repeats, directory))
                r = rows[-1]
                print(f"  {recipe:13s} {tier:5s} kept {r['kept']:.0%}", flush=True)
    table = [dict(r, kept=f"{r['kept']:.0%}", check_share=f"{r['check_share']:.1%}",
                  check_share_iter=f"{r['check_share_iter']:.1%}") for r in rows]
    print_table(table, ["recipe", "tier", "kept", "iter_ms", "step_ms", "check_ms",
                        "check_share", "check_share_iter", "finite_ms", "publish_ms"],
                f"Overlap under training recipes ({args.params / 1e6:.0f}M params, "
                f"{args.repeats} steps; {machine()['cpu']})")
    write_json("offload_recipes", {"machine": machine(), "params": args.params, "rows": rows})
    return 0
