"""tierlift.activations: an exception in forward or backward takes the spill file and its
descriptors at once, while the caller still holds the exception (its traceback keeps the
graph) and `loss`, and the next step trains exactly as without offload."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

import tierlift
from tierlift.activations import ActivationsDiscardedError, offload, offload_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

SMALL = 1024  # min_bytes: every activation of the tiny model is offloaded


class UserError(Exception):
    pass


def make_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, dim=64, seq_len=32, n_head=4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def spill_fds(directory) -> int:
    """This process's descriptors of files under `directory` (the spill file has no name)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    return n


def grads_of_one_step(model, context, step=1):
    model.zero_grad(set_to_none=True)
    with context():
        loss = model(*batch(step))
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def setup(form, model, tmp_path):
    if form == "blocks":
        handle = offload_blocks(model, "nvme", cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
        tl, context = handle._offload, contextlib.nullcontext
    else:
        tl = offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=SMALL)
        context = lambda: tl  # noqa: E731
    tl._engines.get()  # the engine's own descriptors are there before and after
    return context


def raise_in(module):
    def hook(*_):
        raise UserError("user code failed")

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("where", ["inside-block", "block-hook", "loss"])
def test_forward_error_in_offload_blocks_takes_the_spill_at_once(tmp_path, where):
    model = make_model()
    want = grads_of_one_step(copy.deepcopy(model), contextlib.nullcontext)
    context = setup("blocks", model, tmp_path)
    gc.collect()  # earlier tests' garbage (engines in reference cycles) freed now, not mid-test
    fds = n_fds()
    x, y = batch(0)
    if where == "inside-block":  # in the wrapped forward of block 1 (block 0 has spilled)
        hook = raise_in(model.blocks[1].fc)
    elif where == "block-hook":  # after block 1's forward returned, in its forward hook
        hook = raise_in(model.blocks[1])
    else:  # the loss, after the last block finished the forward's writes
        hook, y = None, y[:, :5]
    with pytest.raises((UserError, RuntimeError, ValueError)) as info:
        model(x, y)
    assert info.traceback  # still held, with the frames that reference the graph
    assert spill_fds(tmp_path) == 0 and n_fds() == fds, "spill kept after a failed forward"
    assert os.listdir(tmp_path) == []
    if hook is not None:
        hook.remove()
    got = grads_of_one_step(model, context)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert spill_fds(tmp_path) == 0 and n_fds() == fds


@pytest.mark.parametrize("form", ["context", "blocks"])
def test_backward_error_takes_the_spill_at_once(tmp_path, form):
    model = make_model()
    want = grads_of_one_step(copy.deepcopy(model), contextlib.nullcontext)
    context = setup(form, model, tmp_path)
    gc.collect()  # earlier tests' garbage (engines in reference cycles) freed now, not mid-test
    fds = n_fds()

    def fail(grad):
        raise UserError("user hook failed in backward")

    hook = model.blocks[1].register_forward_hook(
        lambda m, a, out: out.register_hook(fail) and None)
    with context():
        loss = model(*batch(0))
    assert spill_fds(tmp_path) == 3  # the spill file, and the engine's two descriptors of it
    with pytest.raises(UserError):
        loss.backward()
    # `loss` (the graph) is still held: the spill and the engine's descriptors of it are gone.
    assert spill_fds(tmp_path) == 0 and n_fds() == fds, "spill kept after a failed backward"
    with pytest.raises((ActivationsDiscardedError, RuntimeError)):
        loss.backward()  # nothing half-read is ever used
    hook.remove()
    got = grads_of_one_step(model, context)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    del loss
    assert spill_fds(tmp_path) == 0 and n_fds() == fds


def test_reading_a_saved_tensor_outside_backward_does_not_discard(tmp_path):
    """Only a backward arms the failure watch: an unpack outside one leaves the forward alone."""
    x = torch.randn(256, 256, requires_grad=True)
    y = x.exp()
    (y * y.sin()).sum().backward()
    want, x.grad = x.grad, None
    with offload(cpu_budget=0, nvme_path=tmp_path, min_bytes=0):
        y = x.exp()
        out = (y * y.sin()).sum()
    assert torch.equal(y.grad_fn._saved_result, x.exp())  # an unpack outside any backward
    out.backward()
    assert torch.equal(x.grad, want)
