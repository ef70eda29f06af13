"""Why is Quartet (mxfp4-quartet) not closer to bf16 than plain round-to-nearest MXFP4? A study.

  PYTHONPATH=python python benchmarks/study_fp4_recipes.py            # full (~40 min, 1 thread)
  PYTHONPATH=python python benchmarks/study_fp4_recipes.py --quick    # smoke run (~1 min)

Three parts, each printed as a table and written to benchmarks/results/study_fp4_recipes*.json:
1. train: the tiny GPT of tests/python/test_lowp_train.py (64 wide, Markov-chain data), 300 CPU
   steps per recipe and seed; final loss = mean of the last 20 steps; the gap of each recipe to
   bf16 is paired by seed (same init, data) and given with a 95% t confidence interval. The same
   for a wider model (--wide-dim) whose LayerNorm outputs carry injected outlier features: fixed
   per-channel gains of 10-100x on a few channels, as in LLM activations.
2. layer: forward GEMM relative error vs fp32 of each quantizer (Hadamard+QuEST, RTN floor,
   RCEIL, and the ablations between them) on activations/weights captured from the trained bf16
   models and on synthetic data with outlier channels; backward: bias and spread of the gradient
   GEMM estimate (stochastic vs round-to-nearest) over many draws.
3. quest: the QuEST clip constant (2.92 x RMS) against the E8M0 rounding of the scale: the
   quantization error of Gaussian data (what the Hadamard produces) for a sweep of clip ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from tierlift import ops
from tierlift.lowp import convert
from tierlift.lowp.fp4 import _FP4MatmulFn, _gemm_operand_pair
from tierlift.lowp.fp4_recipe import FP4_RECIPES
from tierlift.reference import lowp_fp4 as ref

RECIPES = ("bf16", "mxfp4-quartet", "nvfp4", "mxfp4-rtn")
_Q = FP4_RECIPES["mxfp4-quartet"]
ABLATIONS = {  # one component swapped in or out, to see which one costs
    # forward: Hadamard + RCEIL amax scale instead of QuEST (nothing clips, so no mask)
    "quartet-fwd-rceil": replace(_Q, name="quartet-fwd-rceil", forward_rule="rceil",
                                 clip_mask=False),
    # backward: round-to-nearest, fixed (no) signs, instead of SR with random-signed Hadamard
    # forward: QuEST without the Hadamard (so the backward has no rotation to undo either)
    "quartet-fwd-noH": replace(_Q, name="quartet-fwd-noH", forward_hadamard=0),
    "quartet-bwd-rne": replace(_Q, name="quartet-bwd-rne", random_signs=False,
                               stochastic_grad=False, stochastic_other=False),
    # the other way round: plain RTN plus only the forward Hadamard (undone on the gradients)
    "rtn-fwd-H32": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-fwd-H32", forward_hadamard=32),
    # plain RTN plus only the backward Hadamards (fixed signs), or only the RCEIL backward scale
    "rtn-bwd-H32": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-bwd-H32", dgrad_hadamard=32,
                           wgrad_hadamard=32),
    "rtn-bwd-rceil": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-bwd-rceil",
                             backward_rule="rceil"),
    # plain RTN plus only stochastic rounding in the backward (RCEIL so that SR is unbiased)
    "rtn-bwd-sr": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-bwd-sr", backward_rule="rceil",
                          stochastic_grad=True, stochastic_other=True),
    # rtn-fwd-H32 with Quartet's forward quantizer: QuEST scale and its clip mask
    "rtn-fwd-H32-quest": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-fwd-H32-quest",
                                 forward_hadamard=32, forward_rule="quest", clip_mask=True),
    "rtn-fwd-H32-quest-nomask": replace(FP4_RECIPES["mxfp4-rtn"], name="rtn-fwd-H32-quest-nomask",
                                        forward_hadamard=32, forward_rule="quest"),
}
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass(kw_only=True)
class ModelConfig:
    dim: int = 64
    heads: int = 4
    layers: int = 2
    vocab: int = 64
    seq: int = 32
    batch: int = 16
    outliers: int = 0  # channels of every LayerNorm output multiplied by a fixed gain 10-100x


class Block(nn.Module):
    def __init__(self, c: ModelConfig, gain: torch.Tensor):
        super().__init__()
        self.c = c
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv, self.proj = nn.Linear(c.dim, 3 * c.dim), nn.Linear(c.dim, c.dim)
        self.fc, self.out = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)
        self.register_buffer("gain", gain)

    def forward(self, x):
        b, t, d = x.shape
        h = self.c.heads
        q, k, v = self.qkv(self.ln1(x) * self.gain).view(b, t, 3, h, d // h).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x) * self.gain)))


class TinyGPT(nn.Module):
    """test_lowp_train.TinyGPT with a configurable width and optional outlier gains."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        gain = torch.ones(c.dim)
        if c.outliers:  # fixed (independent of the seed): channels and gains log-uniform 10..100
            g = torch.Generator().manual_seed(1234)
            ch = torch.randperm(c.dim, generator=g)[:c.outliers]
            gain[ch] = 10 ** (1 + torch.rand(c.outliers, generator=g))
        self.tok, self.pos = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.seq, c.dim)
        self.blocks = nn.Sequential(*[Block(c, gain) for _ in range(c.layers)])
        self.ln, self.head = nn.LayerNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def markov_batches(c: ModelConfig, steps: int, seed: int):
    """As test_lowp_train.markov_batches: sequences of a fixed random peaked Markov chain."""
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(c.vocab, c.vocab, generator=g) * 3).softmax(-1)
    out = []
    for _ in range(steps):
        seq = [torch.randint(c.vocab, (c.batch,), generator=g)]
        for _ in range(c.seq):
            seq.append(torch.multinomial(probs[seq[-1]], 1, generator=g).squeeze(1))
        s = torch.stack(seq, 1)
        out.append((s[:, :-1], s[:, 1:]))
    return out


def train(c: ModelConfig, recipe: str, seed: int, batches, lr: float = 3e-3):
    """(final loss = mean of the last 20 steps, model, seconds). Seed 0 = the test's run."""
    torch.manual_seed(seed)
    model = TinyGPT(c)
    if recipe != "bf16":
        convert(model, ABLATIONS.get(recipe, recipe),
                module_filter_fn=lambda m, fqn: fqn != "head")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().view(-1, c.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tail = losses[-20:]
    return sum(tail) / len(tail), model, time.perf_counter() - t0


def mean_ci(v: list[float]) -> tuple[float, float, float]:
    """(mean, sample std, 95% t half-width)."""
    n = len(v)
    m = sum(v) / n
    sd = math.sqrt(sum((a - m) ** 2 for a in v) / (n - 1)) if n > 1 else float("nan")
    return m, sd, T95.get(n - 1, 1.96) * sd / math.sqrt(n) if n > 1 else float("nan")


def study_training(label: str, c: ModelConfig, steps: int, seeds: int, recipes, log) -> dict:
    runs: dict[str, list[float]] = {r: [] for r in recipes}
    secs: dict[str, float] = {r: 0.0 for r in recipes}
    captured = None
    for seed in range(seeds):
        batches = markov_batches(c, steps, seed)
        for r in recipes:
            loss, model, dt = train(c, r, seed, batches)
            runs[r].append(loss)
            secs[r] += dt
            log(f"  [{label}] seed {seed} {r:18s} loss {loss:.4f} ({dt:.1f} s)")
            if r == "bf16" and seed == 0:
                captured = capture(model, batches[-1][0])
    base = runs["bf16"]
    rows = {}
    for r in recipes:
        m, sd, _ = mean_ci(runs[r])
        gap = [(a - b) / b * 100 for a, b in zip(runs[r], base)]
        gm, gsd, ghw = mean_ci(gap)
        rows[r] = dict(losses=runs[r], mean=m, std=sd, gap_pct=gm, gap_std_pct=gsd,
                       gap_ci95_pct=ghw, seconds=secs[r] / seeds)
    if "mxfp4-quartet" in runs and "mxfp4-rtn" in runs:
        d = [(a - b) / b * 100 for a, b in zip(runs["mxfp4-quartet"], runs["mxfp4-rtn"])]
        m, _, hw = mean_ci(d)
        rows["quartet_minus_rtn"] = dict(diff_pct=d, mean_pct=m, ci95_pct=hw)
    print(f"\n{label}: {c.dim} wide, {c.layers} layers, {c.outliers} outlier channels, "
          f"{steps} steps, {seeds} seeds (final loss = mean of the last 20 steps)")
    print(f"{'recipe':18s} {'loss mean':>9s} {'std':>7s} {'gap vs bf16 (paired)':>22s} "
          f"{'s/run':>6s}")
    for r in recipes:
        x = rows[r]
        gap = "" if r == "bf16" else f"{x['gap_pct']:+.2f}% +- {x['gap_ci95_pct']:.2f}%"
        print(f"{r:18s} {x['mean']:9.4f} {x['std']:7.4f} {gap:>22s} {x['seconds']:6.1f}")
    if "quartet_minus_rtn" in rows:
        q = rows["quartet_minus_rtn"]
        print(f"quartet - rtn (paired): {q['mean_pct']:+.2f}% +- {q['ci95_pct']:.2f}% (95% CI)")
    return dict(config=asdict(c), steps=steps, seeds=seeds, recipes=rows), captured


def capture(model: nn.Module, x: torch.Tensor) -> dict:
    """Input, weight and output gradient of every Linear but the head, on one batch."""
    acts, grads, hooks = {}, {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "head":
            hooks.append(m.register_forward_hook(
                lambda mod, i, o, n=name: acts.__setitem__(n, i[0].detach().float())))
            hooks.append(m.register_full_backward_hook(
                lambda mod, gi, go, n=name: grads.__setitem__(n, go[0].detach().float())))
    logits = model(x)
    logits.float().logsumexp(-1).mean().backward()  # any scalar: we need realistic shapes/stats
    for h in hooks:
        h.remove()
    mods = dict(model.named_modules())
    gain = model.blocks[0].gain.float()  # the outlier gains behind qkv's and fc's inputs
    return {n: (acts[n].reshape(-1, acts[n].shape[-1]), mods[n].weight.detach().float(),
                grads[n].reshape(-1, grads[n].shape[-1]),
                gain if n.endswith(("qkv", "fc")) else torch.ones(acts[n].shape[-1]))
            for n in acts}


# ---- layer level ----

def qdq_rule(t: torch.Tensor, rule: str, had: int, block_2d: bool = False) -> torch.Tensor:
    """Dequantized RNE FP4 copy (rotated when had). Rules "quest-floor" (Quartet's own kernels:
    E8M0 scale = 2.92 x RMS / 6 rounded down) and "quest-ceil" (tierlift before this study:
    rounded up) are emulated here; the others run the tierlift op."""
    if rule in ("quest-floor", "quest-ceil"):
        y = ref.hadamard(t, had) if had else t.float()
        rms = y.reshape(y.shape[0], -1, 32).square().mean(-1).sqrt()
        rnd = torch.floor if rule == "quest-floor" else torch.ceil
        e = rnd(torch.log2(rms * ref.QUEST_CLIP / 6 + 1e-30)).clamp(-127, 127)
        s = torch.exp2(e).repeat_interleave(32, dim=1)
        codes = ref.e2m1_encode_rne(y / s)
        return ref.e2m1_decode(codes.reshape(-1, 1))[:, 0].reshape(y.shape) * s
    codes, scales, ts, _ = ops.fp4_quantize(t, rule, had, 0, False, 0, 0, block_2d, False)
    return ref.fp4_dequantize(codes, scales, ts, rule, block_2d)


FORWARD = {  # name: (rule, hadamard, W in 16x16 blocks)
    "rtn floor (mxfp4-rtn)": ("floor", 0, False),
    "rceil": ("rceil", 0, False),
    "quest": ("quest", 0, False),
    "H32 + floor": ("floor", 32, False),
    "H32 + rceil": ("rceil", 32, False),
    "H32 + quest (mxfp4-quartet)": ("quest", 32, False),
    "H32 + quest-ceil (before)": ("quest-ceil", 32, False),
    "H32 + quest-floor (Quartet repo)": ("quest-floor", 32, False),
    "nvfp4": ("nv", 0, True),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def forward_errors(x: torch.Tensor, w: torch.Tensor) -> dict:
    exact = x.double() @ w.double().t()
    out = {}
    for name, (rule, had, b2) in FORWARD.items():
        xq = qdq_rule(x, rule, had)
        wq = qdq_rule(w, rule, had, block_2d=b2)
        out[name] = rel(xq @ wq.t(), exact)
    return out


BACKWARD = ("mxfp4-rtn", "mxfp4-quartet", "nvfp4")


def gradient_estimates(g: torch.Tensor, x: torch.Tensor, draws: int) -> dict:
    """wgrad GEMM g^T x (reduction over tokens) as each recipe's backward estimates it: relative
    bias of the mean over draws, relative spread of one draw, relative RMS error of one draw."""
    exact = g.double().t() @ x.double()
    out = {}
    for name in BACKWARD:
        r = FP4_RECIPES[name]
        ests = torch.stack([_gemm_operand_pair(g.t().contiguous(), x.t().contiguous(), r,
                                               r.wgrad_hadamard, True).double()
                            for _ in range(draws if (r.stochastic_grad or r.random_signs) else 1)])
        mean = ests.mean(0)
        n = exact.norm().item()
        spread = (ests - mean).square().sum((1, 2)).mean().sqrt().item() / n
        rmse = (ests - exact).square().sum((1, 2)).mean().sqrt().item() / n
        out[name] = dict(bias=(mean - exact).norm().item() / n, spread=spread, rmse=rmse,
                         draws=ests.shape[0])
    return out


DGRAD = ("mxfp4-rtn", "rtn-fwd-H32", "rtn-fwd-H32-quest", "mxfp4-quartet", "quartet-bwd-rne",
         "nvfp4")


def dgrad_errors(x, w, gy, gain, draws: int) -> dict:
    """grad_input as FP4Linear's backward computes it (clip mask and rotation back included):
    relative RMS error of one draw, plain and weighted by the per-channel gain the gradient is
    multiplied by on its way back through `LayerNorm(x) * gain` (outlier channels)."""
    exact = gy.double() @ w.double()
    out = {}
    for name in DGRAD:
        r = ABLATIONS.get(name) or FP4_RECIPES[name]
        errs, errs_gain = [], []
        for _ in range(draws if (r.stochastic_grad or r.random_signs) else 1):
            xx = x.clone().requires_grad_()
            _FP4MatmulFn.apply(xx, w, r).backward(gy)
            errs.append(rel(xx.grad, exact) ** 2)
            errs_gain.append(rel(xx.grad * gain, exact * gain) ** 2)
        out[name] = dict(rmse=math.sqrt(sum(errs) / len(errs)),
                         rmse_gain=math.sqrt(sum(errs_gain) / len(errs_gain)))
    return out


def synthetic(tokens: int, dim: int, outliers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    gain = torch.ones(dim)
    if outliers:
        ch = torch.randperm(dim, generator=g)[:outliers]
        gain[ch] = 10 ** (1 + torch.rand(outliers, generator=g))
    x = x * gain  # outlier columns, as LayerNorm output times a per-channel gain
    w = torch.randn(dim, dim, generator=g) * 0.02
    gy = torch.randn(tokens, dim, generator=g) * 1e-3
    return x, w, gy, gain


def study_layers(captures: dict[str, dict], draws: int) -> dict:
    cases = {f"{label}/{n}": c for label, caps in captures.items() for n, c in caps.items()}
    for outl in (0, 4):
        cases[f"synthetic 512x256, {outl} outlier cols"] = synthetic(512, 256, outl)
    res = {}
    for name, (x, w, gy, gain) in cases.items():
        res[name] = dict(forward=forward_errors(x, w),
                         wgrad=gradient_estimates(gy, x, draws),
                         dgrad=dgrad_errors(x, w, gy, gain, max(4, draws // 8)),
                         kurtosis_x=(x.pow(4).mean() / x.pow(2).mean() ** 2).item())
    print("\nforward GEMM relative error vs fp32, ||Q(x) Q(W)^T - x W^T|| / ||x W^T||")
    keys = list(FORWARD)
    print(f"{'case':34s} {'kurt':>6s} " + " ".join(f"{k[:13]:>13s}" for k in keys))
    for name, v in res.items():
        print(f"{name[:34]:34s} {v['kurtosis_x']:6.1f} " +
              " ".join(f"{v['forward'][k]:13.4f}" for k in keys))
    print(f"\nwgrad GEMM g^T x: relative bias of the mean of {draws} draws / spread of one draw "
          "/ RMS error of one draw")
    print(f"{'case':34s} " + " ".join(f"{k:>26s}" for k in BACKWARD))
    for name, v in res.items():
        cells = [f"{d['bias']:.4f}/{d['spread']:.4f}/{d['rmse']:.4f}"
                 for d in (v["wgrad"][k] for k in BACKWARD)]
        print(f"{name[:34]:34s} " + " ".join(f"{c:>26s}" for c in cells))
    print("\ndgrad (grad_input) relative RMS error of one draw: plain / weighted by the gains")
    print(f"{'case':34s} " + " ".join(f"{k:>17s}" for k in DGRAD))
    for name, v in res.items():
        cells = [f"{d['rmse']:.3f}/{d['rmse_gain']:.3f}" for d in (v["dgrad"][k] for k in DGRAD)]
        print(f"{name[:34]:34s} " + " ".join(f"{c:>17s}" for c in cells))
    return res


# ---- QuEST clip constant ----

def study_quest(n: int = 1 << 16) -> dict:
    """Relative MSE of E2M1 RNE on Gaussian blocks of 32 (the Hadamard's output) with the clip
    at alpha x RMS, the scale kept exact, rounded up (tierlift 'quest') or down (Quartet repo) to
    a power of two; and the amax rules for comparison."""
    g = torch.Generator().manual_seed(7)
    y = torch.randn(n // 32, 32, generator=g)
    rms = y.square().mean(-1, keepdim=True).sqrt()

    def err(scale):
        q = ref.e2m1_decode(ref.e2m1_encode_rne(y / scale).reshape(-1, 1))[:, 0]
        return ((q.reshape(y.shape) * scale - y).square().sum() / y.square().sum()).item()

    out = {"alpha": {}}
    for a in (2.0, 2.2, 2.5, 2.92247856, 3.5, 4.0, 4.5, 5.0):
        s = rms * a / 6
        out["alpha"][f"{a:.2f}"] = dict(exact=err(s), ceil=err(torch.exp2(torch.ceil(s.log2()))),
                                        floor=err(torch.exp2(torch.floor(s.log2()))))
    s = torch.exp2(torch.ceil((rms * ref.QUEST_ALPHA / 6).log2()))
    out["tierlift quest"] = err(s)
    amax = y.abs().amax(-1, keepdim=True)
    out["amax floor (OCP)"] = err(torch.exp2(torch.floor(amax.log2()) - 2))
    out["amax rceil"] = err(torch.exp2(torch.ceil((amax / 6).log2())))
    print("\nE2M1 relative MSE on Gaussian blocks of 32, scale from alpha x RMS / 6")
    print(f"{'alpha':>6s} {'exact scale':>12s} {'E8M0 ceil':>10s} {'E8M0 floor':>11s}")
    for a, v in out["alpha"].items():
        print(f"{a:>6s} {v['exact']:12.5f} {v['ceil']:10.5f} {v['floor']:11.5f}")
    print(f"tierlift 'quest' (ceil at {ref.QUEST_ALPHA:.4f} = nearest to 2.92): "
          f"{out['tierlift quest']:.5f}; amax rules: OCP floor {out['amax floor (OCP)']:.5f}, "
          f"rceil {out['amax rceil']:.5f}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 seeds, few steps, small")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--wide-dim", type=int, default=128)
    p.add_argument("--wide-steps", type=int, default=150)
    p.add_argument("--recipes",
                   default=",".join(RECIPES + ("quartet-fwd-rceil", "quartet-bwd-rne")))
    p.add_argument("--wide-recipes", default=",".join(RECIPES + tuple(ABLATIONS)))
    p.add_argument("--outliers", type=int, default=4)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--parts", default="quest,train,wide,layer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", action="store_true", help="draw the loss gaps (needs matplotlib)")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.wide_steps, a.wide_dim, a.draws = 2, 30, 10, 64, 4
    torch.set_num_threads(a.threads)
    parts = set(a.parts.split(","))
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res: dict = dict(machine=f"{os.cpu_count()}-core CPU, torch {torch.__version__}",
                     args=vars(a))
    captures = {}
    if "quest" in parts:
        res["quest"] = study_quest()
    if "train" in parts:
        res["train"], captures["tiny64"] = study_training("tiny GPT", ModelConfig(), a.steps,
                                                          a.seeds, a.recipes.split(","), log)
    if "wide" in parts:
        c = ModelConfig(dim=a.wide_dim, heads=a.wide_dim // 32, outliers=a.outliers)
        res["wide"], captures["wide"] = study_training("wide GPT + outliers", c, a.wide_steps,
                                                       a.seeds, a.wide_recipes.split(","), log)
    if "layer" in parts:
        torch.manual_seed(0)
        res["layer"] = study_layers(captures, a.draws)
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                "study_fp4_recipes" + ("-quick" if a.quick else "") + ".json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {out}")
    if a.plot:
        plot(res, out.replace(".json", ".png"))
    return 0


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r for r in RECIPES if r != "bf16"]
    for i, part in enumerate(k for k in ("train", "wide") if k in res):
        rows = res[part]["recipes"]
        ax.errorbar([j + 0.15 * i for j in range(len(names))],
                    [rows[r]["gap_pct"] if r in rows else float("nan") for r in names],
                    [rows[r]["gap_ci95_pct"] if r in rows else 0.0 for r in names],
                    fmt="o", capsize=4, label=part)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_ylabel("final loss vs bf16 (%), 95% CI")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
