"""End to end: a tiny GPT trained 300 steps on CPU with each FP8 recipe ends within 3% of the
bf16 (autocast) run's loss. Data: sequences from a fixed random Markov chain, so the loss has
somewhere to go (its floor is the chain's entropy)."""

import functools
import math

import pytest
import torch
from torch import nn

from tierlift.lowp import RECIPES, Float8Linear, convert

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 64, 4, 2, 32, 16, 300


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


@functools.cache
def markov_batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3  # peaked transitions
    probs = logits.softmax(-1)
    batches = []
    for _ in range(steps):
        seq = [torch.randint(VOCAB, (BATCH,), generator=g)]
        for _ in range(SEQ):
            seq.append(torch.multinomial(probs[seq[-1]], 1, generator=g).squeeze(1))
        s = torch.stack(seq, 1)
        batches.append((s[:, :-1], s[:, 1:]))
    return batches


def train(recipe, steps: int = STEPS):
    torch.manual_seed(0)
    model = TinyGPT()
    if recipe is not None:
        report = convert(model, recipe, module_filter_fn=lambda m, fqn: fqn != "head")
        assert len(report.converted) == 4 * LAYERS and list(report.skipped) == ["head"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for x, y in markov_batches(STEPS)[:steps]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20, model


@functools.cache
def bf16_loss() -> float:
    """The bf16 run's final loss, trained once per session: the FP8 and FP4 tests compare with
    the same run (both train with 2 threads)."""
    return train(None)[0]


@pytest.mark.slow
def test_tiny_gpt_fp8_recipes_track_bf16(record_property):
    torch.set_num_threads(2)
    base = bf16_loss()
    record_property("bf16", round(base, 4))
    assert base < math.log(VOCAB) * 0.7  # it learned something
    for name in sorted(RECIPES):
        loss, model = train(name)
        record_property(name, round(loss, 4))
        assert isinstance(model.blocks[0].qkv, Float8Linear)
        assert abs(loss - base) / base <= 0.03, (name, loss, base)
