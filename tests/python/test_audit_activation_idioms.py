"""tierlift.activations under ordinary torch script lines, each against the same lines without
tierlift (gradients equal bit for bit): a forward that raises while the caller keeps the exception
(a retry inside `except ... as e`, a notebook's last traceback) then a retry at the same budget;
`torch.compile` of an offloaded block; autocast, no_grad and inference_mode forwards, views,
complex, channels-last and integer saved tensors, tensor hooks, in-place ReLU, several forwards
before one backward, two different offloads nested, torch's checkpoint around offloaded blocks,
dropout in the recompute tier, and two models trained in two threads."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierlift
from tierlift.activations import offload, offload_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.usefixtures("one_thread"),
]


def make_model(layers=2):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, dim=32, seq_len=16, n_head=2))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randint(0, 256, (2, 16), generator=g),
            torch.randint(0, 256, (2, 16), generator=g))


def grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


def assert_same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


TIERS = {
    "ram": lambda tmp: offload(cpu_budget=1 << 30, min_bytes=0),
    "nvme": lambda tmp: offload(cpu_budget=0, nvme_path=tmp, min_bytes=0),
    "spill": lambda tmp: offload(cpu_budget=20000, nvme_path=tmp, min_bytes=0),
}


class Boom(Exception):
    pass


def raise_in(block):
    def hook(module, args, output):
        raise Boom("the user's forward hook fails")

    return block.register_forward_hook(hook)


@pytest.mark.parametrize("form", ["context", "blocks"])
def test_a_retry_while_the_exception_is_kept_gets_the_cpu_budget_back(form):
    model = make_model()
    ref = grads(model, model(*batch(0)))
    probe = offload(cpu_budget=1 << 30, min_bytes=0)
    with probe:
        loss = model(*batch(0))
    need = probe.last_stats["ram_bytes"]  # exactly what one forward keeps in RAM
    del loss
    if form == "context":
        tl = offload(cpu_budget=need, min_bytes=0)
        pool = tl._host_pool

        def forward():
            with tl:
                return model(*batch(0))
    else:
        handle = offload_blocks(model, "ram", cpu_budget=need, min_bytes=0)
        pool = handle._offload._host_pool
        forward = lambda: model(*batch(0))  # noqa: E731
    hook = raise_in(model.blocks[1])
    try:
        forward()
    except Boom as e:
        hook.remove()
        # Retried inside the except: `e` (its traceback, the failed forward's graph) is alive.
        # Was: BudgetError, the dead forward still holding its RAM bytes of cpu_budget.
        assert e.__traceback__ is not None
        assert pool.held == 0
        loss = forward()
    assert_same(grads(model, loss), ref)
    assert pool.held == 0


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_compiled_block_in_offload_blocks(tmp_path, when):
    model = make_model()
    ref = grads(model, model(*batch(0)))
    torch._dynamo.reset()
    if when == "before":
        model.blocks[1].compile(backend="aot_eager")
    handle = offload_blocks(model, ["nvme", "ram"], cpu_budget=1 << 30, nvme_path=tmp_path,
                            min_bytes=0)
    if when == "after":
        model.blocks[1].compile(backend="aot_eager")
    from torch._dynamo.utils import counters

    counters.clear()
    # Was: RecursionError (dynamo rebuilt the block's forward as the wrapper itself).
    assert_same(grads(model, model(*batch(0))), ref)
    assert counters["stats"]["unique_graphs"] > 0  # the block's own forward is still compiled
    assert handle.last_stats["nvme_bytes"] > 0 and handle.last_stats["ram_bytes"] > 0
    handle.remove()


def script_lines(model):
    """(name, what it computes: a loss), each an ordinary line of a training script."""

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*batch(0))

    def evaluations_first():
        with torch.no_grad():
            model(*batch(1))
        with torch.inference_mode():
            model(*batch(2))
        return model(*batch(0))

    def hooked():
        idx, targets = batch(0)
        x = model.blocks[0](model.tok(idx) + model.pos(torch.arange(16)))
        x.register_hook(lambda g: g * 2)
        x = model.blocks[1](x)
        x.retain_grad()
        return F.cross_entropy(model.head(model.ln_f(x)).flatten(0, 1), targets.flatten())

    def accumulated():
        return sum(model(*batch(i)) for i in range(3))  # three forwards, one backward

    return {"autocast": autocast, "evaluations_first": evaluations_first, "hooked": hooked,
            "accumulated": accumulated}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("line", ["autocast", "evaluations_first", "hooked", "accumulated"])
def test_ordinary_script_lines_inside_the_context_are_exact(tmp_path, tier, line):
    model = make_model()
    f = script_lines(model)[line]
    ref = grads(model, f())
    tl = TIERS[tier](tmp_path)
    with tl:
        loss = f()
    assert_same(grads(model, loss), ref)
    assert tl.last_stats["tensors"] > 0


def odd_saved_tensors(w, v, conv, z):
    a = torch.view_as_real((z @ w) * (z @ w).conj()).pow(2).sum()  # complex
    x = (v * 2)[:, :, ::2, 1:].transpose(2, 3)  # a strided view with gaps
    b = (x.sin() * x).pow(2).sum()
    c = conv((v * 3).contiguous(memory_format=torch.channels_last)).tanh().sum()
    idx = torch.arange(16).reshape(4, 4) % 3  # int64 indices
    d = torch.gather((v * 1.5).reshape(16, -1)[:, :4], 1, idx).exp().sum()
    torch.manual_seed(1)  # the same weights each call
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    e = net(v[0, 0, :, :4] * 1.0).sum()  # ReLU(inplace=True) on a saved output
    return a + b + c + d + e


@pytest.mark.parametrize("tier", TIERS)
def test_views_complex_channels_last_int_and_inplace_relu_are_exact(tmp_path, tier):
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.complex64, requires_grad=True)
    v = torch.randn(4, 3, 16, 16, requires_grad=True)
    conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    z = torch.randn(8, 8, dtype=torch.complex64)
    ps = [w, v, *conv.parameters()]
    ref = torch.autograd.grad(odd_saved_tensors(w, v, conv, z), ps)
    with TIERS[tier](tmp_path):
        loss = odd_saved_tensors(w, v, conv, z)
    assert_same(torch.autograd.grad(loss, ps), ref)


def test_two_different_offloads_nested_are_exact(tmp_path):
    model = make_model()
    ref = grads(model, model(*batch(0)) + model(*batch(1)))
    outer = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    inner = offload(cpu_budget=1 << 30, min_bytes=0)
    with outer:
        first = model(*batch(0))
        with inner:
            second = model(*batch(1))
    assert_same(grads(model, first + second), ref)
    assert outer.last_stats["nvme_bytes"] > 0 and inner.last_stats["ram_bytes"] > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_around_offloaded_blocks_is_exact(tmp_path, reentrant):
    model = make_model(layers=3)

    def forward():
        idx, targets = batch(0)
        x = model.tok(idx) + model.pos(torch.arange(16))
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        return F.cross_entropy(model.head(model.ln_f(x)).flatten(0, 1), targets.flatten())

    def run():
        model.zero_grad(set_to_none=True)
        forward().backward()  # the reentrant form gives no grads to autograd.grad
        return [p.grad for p in model.parameters()]

    ref = run()
    handle = offload_blocks(model, ["nvme", "ram", "recompute"], cpu_budget=1 << 30,
                            nvme_path=tmp_path, min_bytes=0)
    assert_same(run(), ref)
    assert handle.last_stats["nvme_bytes"] > 0
    handle.remove()


def test_dropout_in_the_recompute_tier_draws_the_forwards_mask():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.GELU())
                          for _ in range(3)])
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    ref = torch.autograd.grad(net(x).sum(), list(net.parameters()))
    handle = offload_blocks(net, "recompute", cpu_budget=0, blocks=list(net), min_bytes=0)
    torch.manual_seed(5)
    loss = net(x).sum()
    torch.rand(100)  # the RNG moves on between forward and backward
    assert_same(torch.autograd.grad(loss, list(net.parameters())), ref)
    handle.remove()


def test_two_models_trained_in_two_threads(tmp_path):
    models = [make_model(layers=3), make_model(layers=3)]
    refs = [grads(m, m(*batch(i))) for i, m in enumerate(models)]
    handles = [offload_blocks(m, "auto", cpu_budget=30000, nvme_path=tmp_path, min_bytes=0)
               for m in models]
    got, errors = {}, []
    start = threading.Barrier(2, timeout=20)

    def train(i):
        try:
            start.wait()
            got[i] = [grads(models[i], models[i](*batch(i))) for _ in range(4)]
        except BaseException as e:  # noqa: BLE001 - raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    for i in range(2):
        for g in got[i]:
            assert_same(g, refs[i])
    assert all(h.last_stats["nvme_bytes"] > 0 for h in handles)
    for h in handles:
        h.remove()
