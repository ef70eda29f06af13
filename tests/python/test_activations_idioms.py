"""tierlift.activations under everyday autograd idioms, against plain autograd (gradients equal
bit for bit): a backward that stops early (backward(inputs=...), a partial autograd.grad) leaves
saved tensors read ahead and never consumed, whose bytes leave the read-ahead window (and buffers
go back) when autograd lets go of them; a graph dropped without a full backward (retain_graph=True,
backward(inputs=...), none at all) is freed at once, with its spill file; micro-batches
backpropagated inside one context share cpu_budget and cost the same work each.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from test_activations_cleanup import spill_fds

import tierlift
import tierlift.activations.session as session_module
from tierlift.activations import BudgetError, offload

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def chain(ws, x):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)  # saves h and tanh's output: 4 KiB each
    return h.pow(2).sum()


def stops_early(ws, loss, how):
    if how == "inputs":
        loss.backward(inputs=[ws[-1]])
        return ws[-1].grad
    grad, = torch.autograd.grad(loss, ws[-1])
    return grad


@pytest.mark.parametrize("how", ["inputs", "grad"])
def test_reads_ahead_never_consumed_leave_the_window(tmp_path, how):
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(6)]
    xs = [torch.randn(16, 64) for _ in range(3)]
    want = []
    for x in xs:
        want.append(stops_early(ws, chain(ws, x), how).clone())
        ws[-1].grad = None
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0, io_bytes=64 << 10)
    reads = []
    with tl:
        session = tl._local.active[0]
        for x, expected in zip(xs, want, strict=True):
            before = session.stats["reads_ahead"]
            loss = chain(ws, x)
            got = stops_early(ws, loss, how)
            assert torch.equal(got, expected)
            ws[-1].grad = None
            del loss, got
            gc.collect()
            reads.append(session.stats["reads_ahead"] - before)
            # Was: the bytes read ahead for the blocks below stayed counted (24 KiB a step)
            # and their reads (and buffers) stayed held by the file until the context ended.
            assert session.read_window == 0
            assert session._file.handles == []
    assert reads[0] > 0 and reads == [reads[0]] * len(xs), reads  # was [6, 6, 4]


def drop_without_full_backward(w1, w2, x, how):
    h = torch.tanh(x @ w1)  # x and tanh's output (64 KiB each) go to NVMe
    y = torch.sigmoid(h @ w2)  # sigmoid saves its output: 8 KiB, under min_bytes: kept
    loss = y.sum()
    if how == "retain_graph":  # as a GAN step that backpropagates one loss twice, then drops it
        loss.backward(retain_graph=True)
    elif how == "inputs":
        loss.backward(inputs=[w2])
    return weakref.ref(y)


@pytest.mark.parametrize("how", ["retain_graph", "inputs", "no_backward"])
def test_a_graph_dropped_without_a_full_backward_is_freed(tmp_path, how):
    # A kept saved output used to hold its own grad_fn (a cycle through C++ that no collector
    # breaks): the graph, the session and its spill file lived until the process ended.
    torch.manual_seed(0)
    w1 = torch.randn(128, 128, requires_grad=True)
    w2 = torch.randn(128, 16, requires_grad=True)
    xs = [torch.randn(128, 128) for _ in range(3)]
    want = [drop_without_full_backward(w1, w2, x, how) for x in xs]
    assert all(r() is None for r in want)  # plain autograd frees each graph at once
    grads = [w.grad for w in (w1, w2)]
    w1.grad = w2.grad = None
    tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=32 << 10)
    for x in xs:
        with tl:
            alive = drop_without_full_backward(w1, w2, x, how)
        assert alive() is None, "the graph outlived its last reference"
        assert spill_fds(tmp_path) == 0
    assert tl.last_stats["nvme_bytes"] == 2 * 128 * 128 * 4
    for got, expected in zip((w1.grad, w2.grad), grads, strict=True):
        assert (got is None and expected is None) or torch.equal(got, expected)


def micro_batches(ctx, w, xs):
    """Gradient accumulation with each micro-batch's backward inside the context."""
    with ctx:
        for x in xs:
            torch.tanh(torch.tanh(x @ w) @ w).sum().backward()
    return w.grad


def test_micro_batches_in_one_context_share_the_cpu_budget(tmp_path):
    # Each micro-batch's RAM goes back as its backward ends; the RAM tier used to count every
    # micro-batch's bytes as held: a BudgetError naming 3x the bytes needed, or a spill to NVMe.
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(16, 64) for _ in range(3)]
    want = micro_batches(contextlib.nullcontext(), w, xs).clone()
    w.grad = None
    with pytest.raises(BudgetError) as e:
        micro_batches(offload(cpu_budget=1000, min_bytes=0), w, xs)
    # What one micro-batch saves: x, tanh(x @ w) (saved twice: by tanh and by the matmul,
    # counted once) and the output: was 3 micro-batches' worth, tanh(x @ w) in each twice.
    one = e.value.smallest
    assert one == 3 * 16 * 64 * 4
    for ctx in (offload(cpu_budget=one, min_bytes=0),
                offload(cpu_budget=one, nvme_path=tmp_path, min_bytes=0)):
        w.grad = None
        assert torch.equal(micro_batches(ctx, w, xs), want)
        assert ctx.last_stats["ram_bytes"] == 3 * one and ctx.last_stats["nvme_bytes"] == 0


def test_micro_batches_in_one_context_do_not_rescan_the_earlier_ones(tmp_path, monkeypatch):
    # The read-ahead walked every earlier micro-batch's saved tensors at each one's backward:
    # work per step grew with the steps run in the context (14, 28, 42, ... checks).
    checks = [0]
    wants = session_module.Session._wants

    def counted(self, j):
        checks[0] += 1
        return wants(self, j)

    monkeypatch.setattr(session_module.Session, "_wants", counted)
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(6)]
    xs = [torch.randn(16, 64) for _ in range(8)]
    want = []
    for x in xs:
        want.append(torch.autograd.grad(chain(ws, x), ws))
    per_step = []
    with offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0):
        for x, expected in zip(xs, want, strict=True):
            checks[0] = 0
            got = torch.autograd.grad(chain(ws, x), ws)
            per_step.append(checks[0])
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert per_step[-1] == per_step[1], per_step
