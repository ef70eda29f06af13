"""What runs only on the GPU, run here with a stand-in: the recompute tier's buffer handling,
which on a GPU keeps every buffer's forward value instead of comparing values after each
forward (torch.equal on a CUDA tensor waits for the device: one host sync per buffer of every
recompute block at every forward)."""

import pytest
import torch
from test_combined_activations import NormNet, train_norm_net

from tierlift.activations import blocks, offload_blocks


@pytest.fixture
def as_on_gpu(monkeypatch):
    """Buffers treated as a GPU's (no value comparison), and torch.equal counted."""
    monkeypatch.setattr(blocks, "_compared", lambda b: False)
    calls = []
    equal = torch.equal

    def counted(a, b):
        calls.append(1)
        return equal(a, b)

    monkeypatch.setattr(torch, "equal", counted)
    return calls


def test_recompute_tier_on_gpu_reads_no_buffer_values_and_matches_torch(as_on_gpu):
    ref_state, ref_out = train_norm_net(None)
    as_on_gpu.clear()
    state, out = train_norm_net("recompute")
    assert not as_on_gpu  # no value read back from the device per forward
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k
    assert torch.equal(out, ref_out)


def _grads_after_shift_edit(policy):
    model = NormNet()
    if policy is not None:
        offload_blocks(model, policy, cpu_budget=0, min_bytes=0)
    torch.manual_seed(3)
    loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        model.blocks[0].shift.add_(1.0)
    loss.backward()
    return [p.grad for p in model.parameters()], model.state_dict()


def test_recompute_tier_on_gpu_recomputes_with_a_constant_buffers_forward_value(as_on_gpu):
    """On the CPU this is refused (the forward value of `shift` is not kept); a GPU block
    keeps it, so the recomputation computes what the forward did, and `shift` keeps the edit."""
    ref_grads, ref_state = _grads_after_shift_edit(None)
    grads, state = _grads_after_shift_edit("recompute")
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k


@pytest.mark.gpu
def test_gpu_recompute_tier_forward_makes_no_host_sync_and_matches_torch():
    """On the GPU: the recompute tier's forward of BatchNorm/spectral-norm blocks (buffers
    changed without their version counter, and a constant one) reads nothing back from the
    device, and two steps match torch without the tier bit for bit."""
    def run(policy):
        torch.manual_seed(0)
        model = NormNet().cuda()
        if policy is not None:
            offload_blocks(model, policy, cpu_budget=0, min_bytes=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(2):
            opt.zero_grad()
            x = torch.randn(8, 16, device="cuda", generator=g)
            torch.cuda.set_sync_debug_mode("error" if policy else "default")
            try:
                loss = model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            loss.backward()
            opt.step()
        return model.state_dict()

    ref, got = run(None), run("recompute")
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
