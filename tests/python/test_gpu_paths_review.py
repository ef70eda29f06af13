"""What only a GPU shows in the offloaded step's master refresh (offload/masters.py): the
master is in host memory and its parameter on the GPU, so refreshing one from the other must
not put tensors of two devices in one op (torch.where refuses that).

On a CPU the parameter is a fake CUDA tensor (FakeTensorMode checks devices as CUDA does, no
GPU needed); the GPU test edits device weights between backward and step() and compares the
offloaded steps with offload="none" bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_offload_h2d import gpu_bf16_model, gpu_steps
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import tierlift
from tierlift.offload.masters import _same_bits, refresh_master

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _fake_cuda(mode: FakeTensorMode, n: int, dtype: torch.dtype) -> torch.Tensor:
    return FakeTensor(mode, torch.empty(n, dtype=dtype, device="meta"), torch.device("cuda", 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_host_master_of_a_gpu_parameter_is_refreshed_on_the_host(dtype):
    mode = FakeTensorMode()
    master = mode.from_tensor(torch.zeros(64))
    p = _fake_cuda(mode, 64, dtype)
    with mode:
        assert _same_bits(master, p).device == p.device  # the check stays on the GPU
        refresh_master(master, p)  # raised a device mismatch before (torch.where)
    assert master.device.type == "cpu"


def test_the_fake_device_check_catches_a_mixed_device_op():
    """Control: the stand-in refuses what torch refuses on a GPU."""
    mode = FakeTensorMode()
    master = mode.from_tensor(torch.zeros(8))
    p = _fake_cuda(mode, 8, torch.bfloat16)
    with mode, pytest.raises(RuntimeError, match="same device|different devices"):
        torch.where(p.view(torch.int16) == 0, master, master)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_weights_edited_before_step_refresh_their_host_masters(overlap):
    """bf16 weights on the GPU halved between backward and step() of the second step: the
    offloaded optimizer refreshes their host masters from them (on the host) and gives,
    bit for bit, what offload="none" gives (its kernel refreshes the device masters)."""

    def run(**kw):
        model = gpu_bf16_model()
        calls = []

        def halve():
            calls.append(1)
            if len(calls) == 2:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)

        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=1 << 16, **kw)
        stats = gpu_steps(model, opt, before_step=halve)
        return [p.detach().cpu() for p in model.parameters()], stats

    ref, _ = run()
    got, stats = run(offload="cpu", overlap=overlap)
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert sum(s.get("masters_refreshed", 0) for s in stats) > 0


@pytest.mark.gpu
def test_training_on_a_stream_of_its_own_steps_exactly():
    """Forward, backward and step() under a side stream, with a ~50 ms kernel queued ahead of
    backward there: the overlap's worker (on its thread's own current stream) waits for the
    streams that produced the gradients before its device work, and the weights are bit for
    bit offload="none"'s."""

    def run(**kw):
        model = gpu_bf16_model()
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=1 << 16, **kw)
        side = torch.cuda.Stream()
        g = torch.Generator().manual_seed(1)
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                x = torch.randn(64, 256, generator=g).cuda().to(torch.bfloat16)
                loss = model(x).square().mean()
                torch.cuda._sleep(50_000_000)  # the gradients come late on this stream
                loss.backward()
                opt.step()
        torch.cuda.synchronize()
        opt.close()
        return [p.detach().cpu() for p in model.parameters()]

    ref = run()
    got = run(offload="cpu", overlap=True)
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
