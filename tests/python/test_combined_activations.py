"""tierlift.activations combined with the rest of an ordinary training script, each compared
bit for bit with the same script in plain PyTorch: gradient accumulation and torch's
checkpoint with backward inside the offload context, ..."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tierlift
from tierlift.activations import offload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(
    not tierlift._extension.available(), reason="compiled extension not loaded"
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: torch's intra-op threads only contend on a shared CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SMALL = 256  # min_bytes: every activation of the tiny model is offloaded


def make_model(layers=2):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, dim=32, seq_len=16, n_head=2))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return (
        torch.randint(0, 256, (2, 16), generator=g),
        torch.randint(0, 256, (2, 16), generator=g),
    )


def checkpointed(model, reentrant):
    def forward(idx, targets):
        x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        logits = model.head(model.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return forward


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def accumulate(context, forward=None, steps=2, micro=2):
    """Micro-batches forward and backward inside one context per step."""
    model = make_model()
    forward = forward(model) if forward else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with context():
            for m in range(micro):
                loss = forward(*batch(step * micro + m)) / micro
                loss.backward()
                losses.append(loss.item())
        opt.step()
    return losses, params(model)


def test_micro_batches_with_backward_inside_the_context(tmp_path):
    """The next micro-batch's forward saves into the session a backward already read from:
    its writes must land before backward reads them (it read past the file's end before)."""
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
    got = accumulate(lambda: tl)
    ref = accumulate(contextlib.nullcontext)
    assert got[0] == ref[0]
    assert_same(got[1], ref[1])
    assert tl.last_stats["nvme_bytes"] > 0


def test_reentrant_checkpoint_with_backward_inside_the_context(tmp_path):
    """torch's reentrant checkpoint recomputes in backward, under the context's hooks when
    backward runs inside it: the recomputation's saves go to NVMe after the forward ended."""
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)

    def forward(model):
        return checkpointed(model, reentrant=True)

    got = accumulate(lambda: tl, forward, micro=1)
    ref = accumulate(contextlib.nullcontext, forward, micro=1)
    assert got[0] == ref[0]
    assert_same(got[1], ref[1])
