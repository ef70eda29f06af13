"""tierlift.activations under everyday autograd idioms inside one offload context: a backward
that stops early (backward(inputs=...), a partial autograd.grad) leaves saved tensors read ahead
and never consumed; their bytes leave the read-ahead window (and their buffers go back) when
autograd lets go of them, so later steps read ahead as far as the first one did. Gradients equal
plain autograd's bit for bit."""

from __future__ import annotations

import gc

import pytest
import torch

import tierlift
from tierlift.activations import offload

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
