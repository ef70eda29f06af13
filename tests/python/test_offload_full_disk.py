"""A drive that fills up between steps (a real tmpfs, so every write path sees ENOSPC): a step
either succeeds (the state files are allocated up front) or raises an OSError that names the
file and the bytes it needed, with parameters, state and step counts as before the step; a
retry once space is freed gives the uninterrupted run's weights. Where state was already
rewritten in place (one generation), the error says so and steps are refused."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from tmpfs import mounted_tmpfs

from tierlift.optim import AdamW

LAYOUTS = {
    "nvme-2gen": dict(offload="nvme"),
    "nvme-1gen": dict(offload="nvme", nvme_generations=1),
    "hybrid-2gen": dict(offload="hybrid", cpu_budget=1 << 20),
    "hybrid-1gen": dict(offload="hybrid", cpu_budget=1 << 20, nvme_generations=1),
}


@pytest.fixture
def small_drive(tmp_path):
    """A 16 MiB tmpfs (tmpfs.py)."""
    with mounted_tmpfs(tmp_path, "16m") as path:
        yield path


def _fill(path: str) -> str:
    filler = os.path.join(path, "filler")
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 64))


def _step(model, opt, i):
    g = torch.Generator().manual_seed(i)
    model(torch.randn(4, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("layout", "durable"), [
    (layout, durable) for layout in LAYOUTS for durable in (False, True)
    if not (durable and layout.startswith("hybrid"))])  # durable state is NVMe only
def test_a_full_drive_fails_a_step_cleanly(small_drive, layout, durable):
    ref = _model()
    ref_opt = AdamW(ref.parameters(), lr=1e-2)
    for i in range(3):
        _step(ref, ref_opt, i)

    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, nvme_path=small_drive, durable=durable,
                chunk_bytes=64 << 10, **LAYOUTS[layout])
    _step(model, opt, 0)
    filler = _fill(small_drive)
    before = [p.detach().clone() for p in model.parameters()]
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    try:
        _step(model, opt, 1)
        failed = None
    except (OSError, RuntimeError) as err:
        failed = err
    if failed is None:  # the files were allocated up front: nothing new was needed
        assert not durable, "a durable step writes a new manifest"
    elif isinstance(failed, OSError):
        assert small_drive in str(failed) and "bytes needed" in str(failed), failed
        assert "as they were before this step" in str(failed)
        for a, b in zip(before, model.parameters()):
            assert torch.equal(a, b)
        assert [float(opt.state[p]["step"]) for p in model.parameters()] == steps
    else:  # rewritten in place (one generation), then the commit failed
        assert layout.endswith("1gen") and "partly at the new step" in str(failed), failed
        with pytest.raises(RuntimeError, match="partly at the new step"):
            _step(model, opt, 1)
        opt.close()
        return
    os.unlink(filler)
    if failed is not None:
        model.zero_grad(set_to_none=True)
        _step(model, opt, 1)  # the retry
    _step(model, opt, 2)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
