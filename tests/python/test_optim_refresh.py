"""The Adam ops' refresh_from_copies (the CUDA kernels refresh masters from edited bf16/fp16
weights in the step's own pass; tierlift.optim.AdamW relies on it there instead of
refresh_master): the CPU op and the pure-torch reference give what refresh_master followed by a
plain step gives, it is refused without copies, and AdamW's fused path (forced onto the CPU op
here) keeps masters and weights identical to its refresh_master path. The CUDA kernels
themselves: tests/cudasim/test_kernel_adam_refresh.cc, and the gpu test at the end."""

from __future__ import annotations

import copy

import pytest
import torch

import tierlift
from tierlift import ops, reference
from tierlift.offload.masters import refresh_master
from tierlift.optim import AdamW
from tierlift.optim import adam as adam_module

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="needs the extension")
SIZES = [1, 300, 1031]
KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
          maximize=False)


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same(a, b, what):
    """Bit for bit, except that NaNs only need to be NaN in both: torch and core round and widen
    NaN payloads differently, and the kernels' NaN masters stay NaN whichever payload."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), f"{what}: NaNs at different places"
    assert torch.equal(bits(a)[~nan], bits(b)[~nan]), f"{what}: differ"


def state(copy_dtype, compact, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = dict(p=[torch.randn(n, generator=gen) for n in SIZES],
             g=[torch.randn(n, generator=gen) * 1e-2 for n in SIZES])
    s["c"] = [p.to(copy_dtype, copy=True) for p in s["p"]]
    if compact:
        s["m"] = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
        s["v"] = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
        s["s"] = [torch.zeros(reference.optim_compact.scale_count(n)) for n in SIZES]
    else:
        s["m"] = [torch.zeros(n) for n in SIZES]
        s["v"] = [torch.zeros(n) for n in SIZES]
    return s


def edit(copies, round_):
    """Edits about half of each copy: new values, NaN, the sign flipped (the other signed zero
    too), the master's own rounding written back (which must change nothing)."""
    for c in copies:
        i = torch.arange(c.numel())
        k = (i + round_) % 7
        c[k == 0] = (c[k == 0].float() * 0.5 + 0.25).to(c.dtype)
        c[k == 1] = float("nan")
        c[k == 2] = -c[k == 2]
        c[k == 3] = c[k == 3].clone()
        c[i % 50 == 4] = 0.0
        c[i % 50 == 5] = -0.0


def step(fn, s, compact, step_, **extra):
    if compact:
        fn(s["p"], s["g"], s["m"], s["v"], s["s"], s["c"], **KW, step=step_, **extra)
    else:
        fn(s["p"], s["g"], s["m"], s["v"], [], s["c"], **KW, step=step_, amsgrad=False, **extra)


def ref_fn(compact):
    fn = reference.adam_compact_step_ if compact else reference.adam_step_
    return lambda *a, **kw: fn(*a[:6], **kw)


@needs_ext
@pytest.mark.parametrize("compact", [False, True], ids=["fp32-state", "compact"])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_refresh_from_copies_is_refresh_master_then_step(compact, copy_dtype, impl):
    op = ops.adam_compact_step_ if compact else ops.adam_step_
    fused_fn = op if impl == "kernel" else ref_fn(compact)
    fused, plain = state(copy_dtype, compact), state(copy_dtype, compact)
    for t in range(1, 4):
        if t > 1:
            edit(fused["c"], t)
            edit(plain["c"], t)
        for p, c in zip(plain["p"], plain["c"]):
            refresh_master(p, c)
        step(op, plain, compact, t)
        step(fused_fn, fused, compact, t, refresh_from_copies=True)
        for key in ("p", "c", "m"):
            for i, (a, b) in enumerate(zip(fused[key], plain[key])):
                assert_same(a, b, f"step {t}, {key}[{i}]")
        if t == 2:
            after_two = fused["p"][2].clone()
    # The edits reached the masters: without the refresh they would differ.
    stale = state(copy_dtype, compact)
    step(op, stale, compact, 1)
    edit(stale["c"], 2)
    step(op, stale, compact, 2)
    assert not torch.equal(stale["p"][2].nan_to_num(), after_two.nan_to_num())


@needs_ext
@pytest.mark.parametrize("compact", [False, True], ids=["fp32-state", "compact"])
def test_refresh_without_copies_is_refused_before_any_change(compact):
    s = state(torch.bfloat16, compact)
    s["c"] = []
    before = [p.clone() for p in s["p"]]
    for fn in (ops.adam_compact_step_ if compact else ops.adam_step_, ref_fn(compact)):
        with pytest.raises(ValueError, match="refresh_from_copies=True needs param_copies"):
            step(fn, s, compact, 1, refresh_from_copies=True)
        assert all(torch.equal(p, b) for p, b in zip(s["p"], before))


@needs_ext
def test_opcheck_with_refresh():
    s = state(torch.bfloat16, False)
    torch.library.opcheck(
        torch.ops.tierlift.adam_step_.default,
        (s["p"], s["g"], s["m"], s["v"], [], s["c"], 1e-2, 0.9, 0.999, 1e-8, 0.1, 1, True, False,
         False), {"refresh_from_copies": True})


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(dtype)
    # A non-contiguous weight: stepped through a contiguous copy of itself.
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().t().contiguous().t())
    return model


def _train(model, opt, steps=4):
    """Steps with seeded gradients (the same on any device), editing weights between steps."""
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device, p.dtype)
        opt.step()
        with torch.no_grad():  # weights edited outside the optimizer, by any route
            w = model[0].weight
            w[t % 4::4] *= -0.5
            model[1].weight[0].fill_(0.125)
            model[1].bias.add_(1.0)


@needs_ext
@pytest.mark.filterwarnings("ignore:.*non-contiguous parameters:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_adamw_fused_refresh_path_matches_refresh_master(monkeypatch, dtype, state_dtype):
    """AdamW refreshes in the op where a compiled kernel runs the step (the CPU op here); it
    must give the bits of the refresh_master path (forced here, as for the reference ops)."""
    models = [_model(dtype), _model(dtype)]
    opts = [AdamW(m.parameters(), lr=1e-2, state_dtype=state_dtype) for m in models]
    with monkeypatch.context() as patch:
        patch.setattr(ops, "runs_kernel", lambda t: False)
        _train(models[0], opts[0])
    calls = []
    real = adam_module.refresh_master
    monkeypatch.setattr(adam_module, "refresh_master", lambda *a: calls.append(1) or real(*a))
    _train(models[1], opts[1])
    assert not calls, "the fused path must not refresh in Python"
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(bits(a.detach()), bits(b.detach())), name
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert torch.equal(bits(sa["master"]), bits(sb["master"])), f"{name} master"


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:.*non-contiguous parameters:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_cuda_fused_refresh_matches_cpu(dtype, state_dtype):
    """On a GPU: AdamW on edited bf16/fp16 weights (the CUDA kernel's fused refresh) gives the
    CPU optimizer's (refresh_master) weights and masters bit for bit."""
    cpu = _model(dtype)
    gpu = copy.deepcopy(cpu).cuda()
    opts = [AdamW(m.parameters(), lr=1e-2, state_dtype=state_dtype) for m in (cpu, gpu)]
    for model, opt in zip((cpu, gpu), opts):
        _train(model, opt)
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.equal(bits(a.detach()), bits(b.detach().cpu())), name
        assert_same(opts[0].state[a]["master"], opts[1].state[b]["master"].cpu(), name)
