"""tierlift.activations under gradient accumulation and model teardown: gpu_budget is one budget
for every forward of an offload alive at once, given back as each backward drops its saved
tensors; dropping a model and its offload_blocks handle frees both at once (no cycle left for
the garbage collector); torch's checkpoint and double backward inside offloaded blocks are
exact."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import weakref

import pytest
import torch
from torch import nn

import tierlift
from tierlift.activations import BudgetError, offload, offload_blocks

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

ONE = 16 * 64 * 4  # bytes of one saved activation of the chain below


def chain(w, x):
    return torch.tanh(torch.tanh(x @ w) @ w).sum()  # saves x, tanh(x @ w) and the output


def plain_grad(w, xs):
    w.grad = None
    for x in xs:
        chain(w, x).backward()
    grad, w.grad = w.grad.clone(), None
    return grad


def test_gpu_budget_goes_back_after_each_micro_batch_in_one_context():
    # The first micro-batch's kept bytes were never given back: the next ones kept nothing
    # and moved everything (on a GPU: copies out and back that the budget was meant to save).
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(16, 64) for _ in range(3)]
    want = plain_grad(w, xs)
    tl = offload(cpu_budget=1 << 20, gpu_budget=3 * ONE, min_bytes=0)
    kept = []
    with tl:
        for x in xs:
            before = tl.last_stats["kept_bytes"]
            chain(w, x).backward()
            kept.append(tl.last_stats["kept_bytes"] - before)
            assert tl._kept.used == 0
    assert kept == [3 * ONE] * 3, kept  # was [3 * ONE, 0, 0]
    assert tl.last_stats["ram_bytes"] == 0
    assert torch.equal(w.grad, want)


def test_a_tensor_kept_in_place_costs_no_finalizer_per_tensor():
    # gpu_budget's account registered a weakref.finalize for every saved tensor it kept: about
    # 4 us more per tensor in a forward (allocations the garbage collector then walks).
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    tl = offload(cpu_budget=1 << 20, gpu_budget=1 << 20, min_bytes=0)
    registered = len(weakref.finalize._registry)
    with tl:
        y = x
        for _ in range(50):
            y = torch.sin(y)  # saves its input, kept in place
    assert tl.last_stats["kept_bytes"] == 49 * 64 * 4
    assert len(weakref.finalize._registry) - registered < 10  # the session's own, not 50
    y.sum().backward()
    assert tl._kept.used == 0
    want = x.detach().clone().requires_grad_()
    z = want
    for _ in range(50):
        z = torch.sin(z)
    z.sum().backward()
    assert torch.equal(x.grad, want.grad)


def test_a_sparse_tensor_or_a_subclass_saved_in_the_context_is_left_in_place():
    # gpu_budget's account asked every saved tensor left in place for its storage: a sparse
    # one raised NotImplementedError and a wrapper subclass RuntimeError, in the forward.
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    sparse = torch.randn(6, 8).relu().to_sparse().requires_grad_()
    b = torch.randn(4, 4)
    pair = TwoTensor(b, b.clone()).requires_grad_()

    def loss(w, sparse, pair):
        return torch.sparse.mm(sparse, w).sum() + (pair.sin() * 2).sum()

    want = [t.detach().clone().requires_grad_() for t in (w, sparse)]
    want.append(TwoTensor(b, b.clone()).requires_grad_())
    loss(*want).backward()
    tl = offload(cpu_budget=1 << 20, gpu_budget=1 << 20, min_bytes=0)
    with tl:
        out = loss(w, sparse, pair)
    out.backward()
    assert tl._kept.used == 0
    assert torch.equal(w.grad, want[0].grad)
    assert torch.equal(sparse.grad.to_dense(), want[1].grad.to_dense())
    assert torch.equal(pair.grad.a, want[2].grad.a) and torch.equal(pair.grad.b, want[2].grad.b)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))  # saves the block's input and its output
        return x.sum()


def _chain_and_reference():
    """A Chain, two inputs, and a copy of the chain backpropagated through both without
    offloading (its gradients are the reference)."""
    torch.manual_seed(0)
    model = Chain()
    xs = [torch.randn(16, 64) for _ in range(2)]
    ref = copy.deepcopy(model)
    for x in xs:
        ref(x).backward()
    return model, ref, xs


@pytest.mark.parametrize("form", ["context", "blocks"])
def test_gpu_budget_holds_for_forwards_alive_together(form):
    # Two forwards, then two backwards: each forward had a budget of its own, so the graphs
    # held twice gpu_budget on the device.
    model, ref, xs = _chain_and_reference()
    budget = 2 * ONE if form == "blocks" else 3 * ONE
    if form == "blocks":
        tl = offload_blocks(model, "auto", cpu_budget=1 << 20, gpu_budget=budget, min_bytes=0)
        kept = tl._offload._kept
    else:
        tl = offload(cpu_budget=1 << 20, gpu_budget=budget, min_bytes=0)
        kept = tl._kept
    losses, in_place = [], 0
    for x in xs:
        with contextlib.nullcontext() if form == "blocks" else tl:
            losses.append(model(x))
        in_place += tl.last_stats["kept_bytes"]
        assert kept.used <= budget
    assert in_place == budget  # was 2 * budget
    for loss in losses:
        loss.backward()
    assert kept.used == 0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("spill", [False, True])
def test_cpu_budget_holds_for_forwards_alive_together(tmp_path, spill):
    # Each forward of offload_blocks had a cpu_budget of its own: two forwards before their
    # backwards held twice the budget in RAM (documented: at most cpu_budget + io_bytes).
    model, ref, xs = _chain_and_reference()
    one = 2 * ONE  # what one forward keeps in RAM
    handle = offload_blocks(model, "ram" if not spill else "auto", cpu_budget=one,
                            nvme_path=tmp_path if spill else None, min_bytes=0)
    pool = handle._offload._host_pool
    first = model(xs[0])
    assert pool.held == one
    if spill:  # the second forward goes to NVMe
        second = model(xs[1])
        assert handle.last_stats["ram_bytes"] == 0 and handle.last_stats["nvme_bytes"] == one
        second.backward()
    else:
        with pytest.raises(BudgetError, match=f"they take {2 * one} bytes \\({one} of them held "
                           "by other forwards") as e:
            model(xs[1])
        assert e.value.smallest == 2 * one
    first.backward()
    assert pool.held == 0
    if not spill:
        model(xs[1]).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_forward_that_failed_in_offload_blocks_is_freed():
    # The abandoned session kept the exception, whose traceback held the forward's frames and
    # so its graph, which held the session: a cycle through autograd no collector breaks (the
    # failed forward's graph, buffers and share of cpu_budget stayed for good).
    model = Chain()
    saved = []  # block 1's input: saved for backward, so alive as long as the graph is
    model.blocks[1].register_forward_pre_hook(lambda m, args: saved.append(weakref.ref(args[0])))
    handle = offload_blocks(model, "ram", cpu_budget=ONE, min_bytes=0)
    with pytest.raises(BudgetError):
        model(torch.randn(16, 64))
    gc.collect()
    assert saved[0]() is None
    assert handle._offload._host_pool.held == 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("policy", ["auto", "nvme", "recompute"])
def test_dropping_the_model_and_its_handle_frees_them_at_once(tmp_path, policy):
    # Each block's wrapped forward was a method bound to the block in its own __dict__, and
    # the handle held the blocks: the weights, RAM buffers and io engine lived until a gc pass.
    gc.collect()
    fds = open_fds()
    gc.disable()
    try:
        model = Chain()
        handle = offload_blocks(model, policy, cpu_budget=0 if policy == "nvme" else 1 << 20,
                                nvme_path=tmp_path, min_bytes=0)
        model(torch.randn(16, 64)).backward()
        if policy == "nvme":
            assert handle.last_stats["nvme_bytes"] > 0
        alive = [weakref.ref(x) for x in (model.blocks[0].weight, model.blocks[1], handle,
                                          handle._offload)]
        del model, handle
        assert [ref() is None for ref in alive] == [True] * len(alive)
        assert open_fds() == fds  # the io engine's descriptors went with the handle
    finally:
        gc.enable()


def test_deepcopy_and_remove_with_weak_blocks():
    model = Chain()
    handle = offload_blocks(model, "ram", cpu_budget=1 << 20, min_bytes=0)
    twin = copy.deepcopy(model)  # an EMA copy runs its own weights through the same handle
    assert [b for _, b in handle.blocks] == list(model.blocks)
    x = torch.randn(4, 64)
    assert torch.equal(twin(x), model(x))
    twin.blocks[0].weight.data.add_(1.0)
    assert not torch.equal(twin(x), model(x))
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__


class CheckpointedBlock(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(32, 64), nn.Linear(64, 32), reentrant

    def inner(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))

    def forward(self, x):
        if self.reentrant is None:
            return x + torch.tanh(self.inner(x))
        return x + torch.tanh(torch.utils.checkpoint.checkpoint(self.inner, x,
                                                                use_reentrant=self.reentrant))


def penalized_step(model, x, penalty):
    x = x.clone().requires_grad_(True)
    out = x
    for block in model:
        out = block(out)
    loss = out.pow(2).mean()
    if penalty:  # a gradient penalty: double backward through every tier
        g, = torch.autograd.grad(out.pow(3).sum(), x, create_graph=True)
        loss = loss + (g.norm(2, dim=1) - 1).pow(2).mean()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("reentrant", "penalty"), [(None, True), (False, True), (True, False)])
def test_checkpoint_inside_blocks_and_gradient_penalty_are_exact(tmp_path, reentrant, penalty):
    # (Reentrant checkpoint refuses autograd.grad in plain torch too.)
    torch.manual_seed(0)
    base = nn.ModuleList(CheckpointedBlock(reentrant) for _ in range(3))
    x = torch.randn(8, 32)
    want = penalized_step(copy.deepcopy(base), x, penalty)
    model = copy.deepcopy(base)
    handle = offload_blocks(model, ["nvme", "recompute", "ram"], cpu_budget=1 << 20,
                            nvme_path=tmp_path, min_bytes=0)
    got = penalized_step(model, x, penalty)
    assert handle.last_stats["nvme_bytes"] > 0 and handle.last_stats["ram_bytes"] > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
