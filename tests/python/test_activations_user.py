"""tierlift.activations as users of torch.utils.checkpoint, save_on_cpu and Hugging Face gradient
checkpointing use it, against plain autograd: what autograd accepts (nested tensors, double
backward, masks and indices, HF checkpointing, a forward that skips its last block) gives the same
gradients, and what autograd refuses (a saved tensor changed after it was saved, by the caller,
by a backward, or while a GPU copy of it was in flight) is refused too."""

from __future__ import annotations

import contextlib
import copy
import gc
import os

import pytest
import torch

import tierlift
import tierlift.activations.session as session_module
from tierlift.activations import ActivationsDiscardedError, BudgetError, offload, offload_blocks
from tierlift.activations.device import CpuCopier

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

TIERS = {
    "ram": lambda tmp: offload(cpu_budget=1 << 30, min_bytes=0),
    "nvme": lambda tmp: offload(cpu_budget=0, nvme_path=tmp, min_bytes=0),
}


def nested_softmax(ctx):
    torch.manual_seed(0)
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    with ctx:
        nt = torch.nested.as_nested_tensor([a * 2, b * 2])  # strided layout: no sizes
        out = torch.nn.functional.softmax(nt * nt, dim=-1)
        loss = torch.nested.to_padded_tensor(out, 0.0).pow(2).sum()
    loss.backward()
    return a.grad, b.grad


@pytest.mark.parametrize("tier", TIERS)
def test_nested_tensors_are_left_in_place_with_exact_gradients(tmp_path, tier):
    ctx = TIERS[tier](tmp_path)
    got = nested_softmax(ctx)
    want = nested_softmax(contextlib.nullcontext())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert ctx.last_stats["tensors"] > 0  # the dense tensors of the same forward still moved


class GradInSavedMemory(torch.autograd.Function):
    """A memory-saving backward: builds the gradient in its saved input's memory (exact only
    while nothing else needs that tensor, which autograd's version check enforces)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return x.mul_(2).mul_(g)


def edits_saved_in_backward(ctx, form):
    torch.manual_seed(0)
    a = torch.randn(32, 32, requires_grad=True)
    with ctx:
        h = a * 3
        if form == "retain":
            loss = GradInSavedMemory.apply(h).sum()
        else:  # sin saves h too; the custom backward, which runs first, edits it
            s = h.sin().sum()
            loss = GradInSavedMemory.apply(h).sum() + s
        del h
    if form == "retain":
        loss.backward(retain_graph=True)
    loss.backward()
    return a.grad


@pytest.mark.parametrize("form", ["retain", "shared"])
@pytest.mark.parametrize("tier", TIERS)
def test_a_saved_tensor_edited_by_a_backward_is_refused_when_needed_again(tmp_path, tier, form):
    # Without offload autograd refuses; with it, the edited bytes came back (the second
    # gradient 100% off in the RAM tier), or the refusal must be just as clear.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edits_saved_in_backward(contextlib.nullcontext(), form)
    ctx = TIERS[tier](tmp_path)
    if tier == "nvme" and form == "retain":  # read back afresh from the file: exact
        torch.manual_seed(0)
        a = torch.randn(32, 32, requires_grad=True)
        want = 36 * a.detach()  # two backwards of sum((3a)^2): 2 * 18a
        assert torch.allclose(edits_saved_in_backward(ctx, form), want)
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edits_saved_in_backward(ctx, form)
    # The same context runs the next step exactly.
    assert all(torch.equal(g, w) for g, w in zip(
        nested_softmax(ctx), nested_softmax(contextlib.nullcontext()), strict=True))


class SideStreamCopier(CpuCopier):
    """The GPU's D2H side stream, on the CPU: a copy to host runs later (when the next one is
    queued, or when waited for), reading the tensor as it is then, as a copy on a side stream
    reads memory the compute stream may have changed since."""

    def __init__(self):
        self.queued = []

    def to_host(self, t, host):
        self.flush()
        event = [t, host]
        self.queued.append(event)
        return event

    def flush(self, upto=None):
        while self.queued:
            event = self.queued.pop(0)
            t, host = event
            host[:t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
            event.clear()
            if event is upto:
                return

    def done(self, event):
        return event is None or not event

    def wait(self, event):
        if event:
            self.flush(event)


def edited_while_copied(ctx, edit, copier=None):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    with ctx:
        h = torch.randn(8, 16) @ w
        loss = (h * h).sum()  # saves h; its copy is queued
        if edit:
            h.add_(1)
        del h  # only the copy can tell now
        loss = loss + torch.tanh(torch.randn(8, 16) @ w).sum()  # the stream moves on
    if copier is not None:
        copier.flush()  # the device synchronized before backward
    loss.backward()
    return w.grad


def test_a_gpu_tensor_modified_while_copied_to_host_and_dropped_is_refused(monkeypatch):
    # Plain autograd refuses the edit; before the check the RAM tier's copy held it and the
    # gradient was silently wrong.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edited_while_copied(contextlib.nullcontext(), edit=True)
    copier = SideStreamCopier()
    monkeypatch.setattr(session_module, "copier_for", lambda device: copier)
    ctx = offload(cpu_budget=1 << 30, min_bytes=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edited_while_copied(ctx, edit=True, copier=copier)
    # Not edited: exact, with the copies seen done at backward or waited for there.
    want = edited_while_copied(contextlib.nullcontext(), edit=False)
    assert torch.equal(edited_while_copied(ctx, edit=False, copier=copier), want)
    assert torch.equal(edited_while_copied(ctx, edit=False), want)


def spill_fds(directory) -> int:
    """This process's descriptors of files under `directory` (the spill file has no name)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    return n


class SkipsLast(torch.nn.Module):
    """Runs its blocks but the last (layer drop, early exit) or all of them in reverse."""

    def __init__(self, order):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
            for _ in range(3))
        self.order = order

    def forward(self, x):
        blocks = list(self.blocks)
        for b in blocks[:-1] if self.order == "skip-last" else blocks[::-1]:
            x = x + b(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("order", ["skip-last", "reverse"])
def test_a_forward_that_does_not_end_on_the_last_block_ends_with_the_model(tmp_path, order):
    torch.manual_seed(0)
    model = SkipsLast(order)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 32)
    handle = offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    loss = model(x)
    del loss  # a step given up before backward (a NaN loss, an evaluation with grad)
    gc.collect()
    assert spill_fds(tmp_path) == 0  # was: the whole forward's file, until the next forward
    loss = model(x)
    loss.backward()
    ref(x).backward()
    assert all(torch.equal(p.grad, q.grad) if q.grad is not None else p.grad is None
               for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert spill_fds(tmp_path) == 0
    handle.close()
    # A budget too small is an error of this forward, as with the last block run.
    model = copy.deepcopy(ref)
    offload_blocks(model, "ram", cpu_budget=1000, min_bytes=0)
    with pytest.raises(BudgetError, match="cpu_budget=1000"):
        model(x)


ALL_TIERS = dict(TIERS, mix=lambda tmp: offload(cpu_budget=20000, nvme_path=tmp, min_bytes=0))


def gradient_penalty(ctx, inside):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 1))
    x = torch.randn(32, 16, requires_grad=True)
    mask = torch.rand(32, 64) > 0.5  # a bool saved tensor
    idx = torch.randint(0, 32, (40,))  # an int64 saved tensor

    def penalty(out):
        g, = torch.autograd.grad(out.pow(3).sum(), x, create_graph=True)
        return 10 * (g.norm(2, dim=1) - 1).pow(2).mean()

    with ctx:
        h = model[:2](x).masked_fill(mask, 0.0)
        out = model[2:](h).index_select(0, idx)
        loss = out.mean() + (penalty(out) if inside else 0)
    if not inside:
        loss = loss + penalty(out)
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("tier", ALL_TIERS)
def test_double_backward_with_masks_and_indices_is_exact(tmp_path, tier, inside):
    got = gradient_penalty(ALL_TIERS[tier](tmp_path), inside)
    want = gradient_penalty(contextlib.nullcontext(), inside)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_inside_the_context_and_offload_blocks(tmp_path, reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=16, resid_pdrop=0.2, attn_pdrop=0.2)
    base = transformers.GPT2LMHeadModel(config)
    base.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 64, (2, 16))

    def step(model, ctx=None):
        torch.manual_seed(1)  # dropout, replayed by the checkpoints
        with ctx or contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    want = step(copy.deepcopy(base))
    got = step(copy.deepcopy(base), offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    model = copy.deepcopy(base)
    offload_blocks(model, ["nvme", "recompute"], cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    got = step(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert spill_fds(tmp_path) == 0


def test_backward_after_close_names_the_close(tmp_path):
    ctx = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0)
    w = torch.randn(16, 16, requires_grad=True)
    with ctx:
        loss = torch.tanh(torch.randn(8, 16) @ w).exp().sum()
    ctx.close()
    with pytest.raises(ActivationsDiscardedError, match="after their offload was closed"):
        loss.backward()
    assert w.grad is None
    assert spill_fds(tmp_path) == 0
    with ctx:  # the next forward opens a new engine
        loss = torch.tanh(torch.randn(8, 16) @ w).exp().sum()
    loss.backward()
    assert w.grad is not None
