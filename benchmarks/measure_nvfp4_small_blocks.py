"""NVFP4 blocks far below their tensor's amax: flush them to zero, or keep them at the smallest
E4M3 block scale? Measured on the activations and gradients of a small GPT.

  PYTHONPATH=python python benchmarks/measure_nvfp4_small_blocks.py            # ~10 s on 2 CPUs

A block's ideal E4M3 scale is t = amax_b / 6 * s_t (s_t = 2688 / tensor amax). Where t <= 2^-10
(amax_b below ~2.2e-6 of the tensor amax) round-to-nearest gives the scale code 0:
TransformerEngine then zeroes the whole block ("flush"); tierlift clamps the code to 1, the
smallest subnormal 2^-9 ("clamp"), so the block's largest values (|x| * s_t / 2^-9 up to 3)
still reach the E2M1 grid. Both rules give the same codes everywhere else, so "flush" here is
tierlift's quantization with those blocks zeroed.

Model: a config-only transformers GPT2 (2 layers, 128 wide, byte vocabulary, random init)
trained for --steps AdamW steps on the bytes of this repository's docs, then one more step
captures every Linear/Conv1D input x and output gradient g (forward/backward hooks). Operands as
the nvfp4 recipe quantizes them, 1x16 blocks along: x rows (forward, along K), g rows (dgrad,
along N), g^T rows (wgrad, along M; also with the recipe's random-signed Hadamard 16).
Errors are ||dequant - ref|| / ||ref||: per affected block then averaged ("mean"), over all
affected blocks together ("pooled"), and over whole tensors; "affected" = blocks where the two
rules differ (t <= 2^-10); "kept by clamp" = those of them with a non-zero code under "clamp".
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import torch

from tierlift.reference import lowp_fp4 as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def byte_corpus() -> torch.Tensor:
    data = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                               "*.md"))))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def build_model(layers: int, dim: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=seq, n_embd=dim, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def batch(data: torch.Tensor, bs: int, seq: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq, (bs,), generator=g)
    return torch.stack([data[s:s + seq] for s in starts.tolist()])


def capture(model, tokens: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """{layer name: {"x": input, "g": grad_output}} as 2-D fp32 [tokens, features]."""
    from transformers.pytorch_utils import Conv1D

    got: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Linear, Conv1D)):
            continue

        def fwd(m, args, out, name=name):
            got.setdefault(name, {})["x"] = args[0].detach().reshape(-1, args[0].shape[-1])

        def bwd(m, gin, gout, name=name):
            got.setdefault(name, {})["g"] = gout[0].detach().reshape(-1, gout[0].shape[-1])

        handles += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd)]
    model(tokens, labels=tokens).loss.backward()
    for h in handles:
        h.remove()
    return got


def compare(y: torch.Tensor) -> dict[str, float]:
    """Sums of squares for both rules on one already-rotated operand (rows quantized by 16)."""
    codes, scales, st, _ = ref.fp4_quantize(y, "nv")
    back = ref.fp4_dequantize(codes, scales, st, "nv")
    rows, cols = y.shape
    blocks = y.abs().reshape(rows, cols // 16, 16)
    amax = blocks.amax(dim=-1)
    t = (amax / torch.full_like(amax, 6.0)) * st  # the reference's ideal scale, same fp32 ops
    hit = (t <= 2.0**-10) & (amax > 0)  # where "flush" zeroes the block and "clamp" keeps it
    assert (scales[hit] == 1).all()
    hit_el = hit.repeat_interleave(16, dim=1)
    flush = torch.where(hit_el, torch.zeros_like(back), back)
    d = y.double()
    per_block = ((back.double() - d) ** 2).reshape(rows, cols // 16, 16).sum(-1)[hit]
    per_block = (per_block / (d.reshape(rows, cols // 16, 16) ** 2).sum(-1)[hit]).sqrt()
    return {
        "clamp_block_sum": float(per_block.sum()),
        "blocks": float(hit.numel()), "hit": float(hit.sum()),
        "hit_kept": float((back.reshape(rows, cols // 16, 16) != 0).any(-1)[hit].sum()),
        "ref_hit": float((d[hit_el] ** 2).sum()), "ref": float((d ** 2).sum()),
        "flush_hit": float(((flush.double() - d)[hit_el] ** 2).sum()),
        "clamp_hit": float(((back.double() - d)[hit_el] ** 2).sum()),
        "flush": float(((flush.double() - d) ** 2).sum()),
        "clamp": float(((back.double() - d) ** 2).sum()),
    }


def operands(x: torch.Tensor, g: torch.Tensor, signs: int):
    yield "x (fwd, along K)", x
    yield "g (dgrad, along N)", g
    gt = g.t().contiguous()
    yield "g^T (wgrad, along M)", gt
    yield "g^T + H16 (wgrad, recipe)", ref.hadamard(gt, 16, signs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    data = byte_corpus()
    model = build_model(args.layers, args.dim, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(args.steps):
        tok = batch(data, args.batch, args.seq, g)
        loss = model(tok, labels=tok).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"GPT2 {args.layers}x{args.dim}, {args.steps} steps, final loss {loss.item():.3f}")
    got = capture(model, batch(data, args.batch, args.seq, g))

    rows: dict[tuple[str, str], dict[str, float]] = {}
    for name, t in got.items():
        kind = "lm_head" if name == "lm_head" else name.split(".", 3)[-1]  # e.g. attn.c_attn
        signs = int(torch.randint(0, 1 << 16, (1,), generator=g))
        for op, y in operands(t["x"].float(), t["g"].float(), signs):
            acc = rows.setdefault((op, kind), {})
            for k, v in compare(y).items():
                acc[k] = acc.get(k, 0.0) + v
    total: dict[str, dict[str, float]] = {}
    for (op, _), acc in rows.items():
        for k, v in acc.items():
            total.setdefault(op, {})[k] = total.get(op, {}).get(k, 0.0) + v

    def line(label, a):
        hit = int(a["hit"])
        pct = 100.0 * a["hit"] / a["blocks"]
        err_hit = "- | -"
        if hit:
            pooled = {k: (a[f"{k}_hit"] / a["ref_hit"]) ** 0.5 for k in ("flush", "clamp")}
            err_hit = (f"1 / {pooled['flush']:.3f} | "
                       f"{a['clamp_block_sum'] / hit:.3f} / {pooled['clamp']:.3f}")
        print(f"| {label} | {int(a['blocks'])} | {hit} ({pct:.3f}%) | {int(a['hit_kept'])} | "
              f"{err_hit} | {(a['flush'] / a['ref']) ** 0.5:.5f} | "
              f"{(a['clamp'] / a['ref']) ** 0.5:.5f} |")

    print("\n| operand / layer | blocks | affected (t <= 2^-10) | kept by clamp | affected "
          "error, flush (mean / pooled) | affected error, clamp (mean / pooled) | tensor error, "
          "flush | tensor error, clamp |")
    print("|---|---|---|---|---|---|---|---|")
    for op in total:
        line(f"**{op}**", total[op])
        for (o, kind), acc in sorted(rows.items()):
            if o == op and acc["hit"]:
                line(f"  {kind}", acc)
    print(f"\n({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
