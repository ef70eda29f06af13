"""tierlift.optim.Adam/AdamW under torch's AMP GradScaler (without offload), and torch's
constructor error inputs run against tierlift.

The optimizer declares `_step_supports_amp_scaling`, so GradScaler.step() hands it the scale and
its inf/NaN verdict (`grad_scale`, `found_inf`) instead of unscaling the gradients itself: the
kernel unscales each gradient as it reads it, or the step is skipped. The reference for each run
is the same optimizer with that protocol switched off, which GradScaler drives the way it drives
torch.optim.AdamW: `unscale_` (gradients multiplied in place by float32(1 / scale)), then step()
unless it found inf/NaN. fp32 parameters must match it bit for bit; torch.optim.AdamW itself is
matched to the tolerance of tests/python/test_optim.py (its kernels round a few elements
differently, with or without a scaler).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    optim_error_inputs_func_adam,
    optim_error_inputs_func_adamw,
)

import tierlift
from tierlift.optim import Adam, AdamW

needs_kernels = pytest.mark.skipif(not tierlift._extension.available(),
                                   reason="compiled extension not loaded")

STEPS = 8
INF_STEPS = (3, 6)  # a gradient is made inf / NaN after backward at these steps


class _UnscaledAdamW(AdamW):
    """tierlift's AdamW with the AMP protocol off: GradScaler unscales .grad itself first."""

    _step_supports_amp_scaling = False


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 5)).to(dtype)


def _train(model, opt, scaler, *, unscale_first=False, clip=None, steps=STEPS, inf_steps=INF_STEPS,
           on_step=None):
    """GradScaler's recipe; returns the scale seen at each step."""
    scales = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(12, 24, generator=g).to(next(model.parameters()).dtype)
        y = torch.randn(12, 5, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in inf_steps:
            w = next(model.parameters())
            w.grad.view(-1)[7] = float("inf") if step == inf_steps[0] else float("nan")
        if unscale_first:
            scaler.unscale_(opt)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        if on_step is not None:
            on_step(step)
    return scales


def _scaler(init_scale, growth_interval=2):
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _state(opt):
    return [(k, v.clone()) for s in opt.state.values() for k, v in sorted(s.items())]


def _assert_same_state(a, b):
    sa, sb = _state(a), _state(b)
    assert [k for k, _ in sa] == [k for k, _ in sb]
    for (k, x), (_, y) in zip(sa, sb):
        assert x.dtype == y.dtype and torch.equal(x, y), f"state {k!r} differs"


def _twin_runs(dtype=torch.float32, init_scale=2.0**16, **kw):
    """(native model, opt, scales), (reference model, opt, scales): the same training with the
    kernel unscaling and with GradScaler's unscale_."""
    opt_kw = kw.pop("opt_kw", {})
    out = []
    for cls in (AdamW, _UnscaledAdamW):
        model = _model(dtype)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kw)
        scales = _train(model, opt, _scaler(init_scale), **kw)
        out.append((model, opt, scales))
    return out


@needs_kernels
@pytest.mark.parametrize("init_scale", [2.0**16, 1000.0], ids=["pow2", "1000"])
@pytest.mark.parametrize("recipe", ["step", "unscale_clip"])
def test_fp32_matches_unscale_then_step_bitwise_and_torch(init_scale, recipe):
    kw = dict(unscale_first=True, clip=0.5) if recipe == "unscale_clip" else {}
    (m1, o1, s1), (m2, o2, s2) = _twin_runs(init_scale=init_scale, **kw)
    assert s1 == s2
    # Backoff after each inf/NaN step, growth after growth_interval=2 clean ones.
    assert s1[3] == s1[2] * 0.5 and s1[4] == s1[3] and s1[5] == s1[4] * 2.0
    assert torch.equal(_flat(m1), _flat(m2))
    _assert_same_state(o1, o2)
    assert all(float(s["step"]) == STEPS - len(INF_STEPS) for s in o1.state.values())

    model = _model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert _train(model, ref, _scaler(init_scale), **kw) == s1
    torch.testing.assert_close(_flat(m1), _flat(model), rtol=0,
                               atol=1e-6 * _flat(model).abs().max().item())


@needs_kernels
@pytest.mark.parametrize("init_scale", [2.0**16, 1000.0], ids=["pow2", "1000"])
def test_bf16_params_master_within_one_bf16_rounding(init_scale):
    (m1, o1, s1), (m2, o2, s2) = _twin_runs(torch.bfloat16, init_scale)
    assert s1 == s2
    a, b = _flat(m1), _flat(m2)
    masters = [torch.cat([s["master"].reshape(-1) for s in o.state.values()]) for o in (o1, o2)]
    if init_scale == 2.0**16:
        # A power-of-two unscale is exact: unscale_'s rounding of the bf16 gradient changes
        # nothing, so both runs are the same bits.
        assert torch.equal(a, b) and torch.equal(*masters)
        return
    # unscale_ rounds each unscaled gradient to bf16 (relative error <= 2^-9); the kernel keeps
    # it in fp32. Through Adam that moves each update (at most ~lr) by about that much: the
    # masters stay within 2^-7 * lr per step taken (measured: 2^-8), and the bf16 weights round
    # alike or one bf16 ulp apart, except weights so close to zero (|w| < 0.01 = lr) that a
    # fraction of one update is several of their ulps.
    taken = STEPS - len(INF_STEPS)
    assert (masters[0] - masters[1]).abs().max().item() <= taken * 1e-2 * 2.0**-7
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())
    away = torch.maximum(a.abs(), b.abs()) >= 1e-2
    assert bool(((a - b).abs() <= ulp)[away].all()), "bf16 weights more than one rounding apart"
    assert (a == b).float().mean().item() >= 0.85


@needs_kernels
@pytest.mark.parametrize("recipe", ["step", "unscale_clip"])
def test_compact_state_matches_unscale_then_step_bitwise(recipe):
    kw = dict(unscale_first=True, clip=0.5) if recipe == "unscale_clip" else {}
    (m1, o1, s1), (m2, o2, s2) = _twin_runs(init_scale=1000.0, opt_kw=dict(state_dtype="bf16"),
                                            **kw)
    assert s1 == s2
    assert torch.equal(_flat(m1), _flat(m2))
    _assert_same_state(o1, o2)


@needs_kernels
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipped_step_changes_nothing(dtype, state_dtype):
    model = _model(dtype)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    snaps = {}

    def record(step):
        snaps[step] = (_flat(model).clone(), _state(opt))

    _train(model, opt, _scaler(1000.0), steps=4, inf_steps=(3,), on_step=record)
    w2, st2 = snaps[2]
    w3, st3 = snaps[3]
    assert torch.equal(w2, w3)
    assert [k for k, _ in st2] == [k for k, _ in st3]
    for (_, x), (_, y) in zip(st2, st3):
        assert torch.equal(x, y)
    assert not torch.equal(snaps[4][0], w3), "the step after a skipped one is taken"
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@needs_kernels
def test_skipped_first_step_creates_no_state():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    before = _flat(model).clone()
    _train(model, opt, _scaler(1000.0), steps=1, inf_steps=(1,))
    assert len(opt.state) == 0
    assert torch.equal(_flat(model), before)


@needs_kernels
def test_protocol_attributes_as_torch_fused_adam_gets_them():
    """What GradScaler hands over, asserted so a change in torch shows here first."""
    model = _model()
    opt = AdamW(model.parameters())
    seen = {}
    step = AdamW.step

    def spy(self, closure=None):
        seen.update(scale=self.grad_scale, found_inf=self.found_inf)
        return step(self, closure)

    opt.step = spy.__get__(opt)
    scaler = _scaler(1000.0)
    scaler.scale(model(torch.ones(2, 24)).sum()).backward()
    scaler.step(opt)
    assert seen["scale"].dtype == torch.float32 and float(seen["scale"]) == 1000.0
    assert float(seen["found_inf"]) == 0.0


def _set_amp(opt, grad_scale):
    opt.grad_scale, opt.found_inf = grad_scale, torch.zeros(())


@needs_kernels
@pytest.mark.parametrize(
    "grad_scale, error",
    [
        (torch.tensor(0.0), ValueError),
        (torch.tensor(float("inf")), ValueError),
        (torch.tensor(float("nan")), ValueError),
        (torch.tensor(1e-40), ValueError),  # 1 / scale overflows float32
        (torch.tensor(2.0, dtype=torch.float64), TypeError),
        (torch.tensor([2.0, 2.0]), ValueError),
    ],
    ids=["zero", "inf", "nan", "tiny", "float64", "two-elements"],
)
def test_bad_grad_scale_refused_before_any_change(grad_scale, error):
    model = _model()
    opt = AdamW(model.parameters())
    model(torch.ones(2, 24)).sum().backward()
    before = _flat(model).clone()
    _set_amp(opt, grad_scale)
    with pytest.raises(error, match="grad_scale"):
        opt.step()
    assert torch.equal(_flat(model), before) and len(opt.state) == 0
    # Left behind, GradScaler's next step would multiply its scale into the stale one.
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@needs_kernels
def test_grad_scale_without_found_inf_unscales():
    """grad_scale alone (no verdict) unscales; equal to a step on unscaled gradients."""
    models = [_model(), _model()]
    opts = [AdamW(m.parameters()) for m in models]
    for i, (m, o) in enumerate(zip(models, opts)):
        m(torch.ones(2, 24)).sum().backward()
        if i == 0:
            for p in m.parameters():
                p.grad.mul_(1000.0)
            o.grad_scale = torch.tensor(1000.0)
        else:
            for p in m.parameters():
                p.grad.mul_(1000.0).mul_(torch.tensor(1.0 / 1000.0, dtype=torch.float32))
        o.step()
    assert torch.equal(_flat(models[0]), _flat(models[1]))


# ---- the ops' grad_scale argument ----


def _op_args(n=300, grad_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 1000.0).to(grad_dtype)
    return [p], [grad], [torch.zeros(n)], [torch.zeros(n)], [], []


KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, decoupled=True,
          amsgrad=False, maximize=False)


@needs_kernels
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [65536.0, 1000.0, 0.375])
def test_op_unscale_matches_reference_and_prescaled(grad_dtype, scale):
    scale_t = torch.tensor([scale])
    kernel, ref, pre = (_op_args(grad_dtype=grad_dtype) for _ in range(3))
    tierlift.ops.adam_step_(*kernel, **KW, grad_scale=scale_t)
    tierlift.reference.adam_step_(*ref, *KW.values(), grad_scale=scale_t)
    inv = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    pre[1][0] = pre[1][0].float() * inv
    tierlift.ops.adam_step_(*pre, **KW)
    for a, b, c in zip(kernel[0] + kernel[2], ref[0] + ref[2], pre[0] + pre[2]):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_kernels
def test_op_compact_unscale_matches_reference():
    n = 600
    outs = []
    for fn in (tierlift.ops.adam_compact_step_, tierlift.reference.adam_compact_step_):
        p, g, *_ = _op_args(n, torch.bfloat16)
        m, c, s = [torch.zeros(n, dtype=torch.bfloat16)], [torch.zeros(n, dtype=torch.uint8)], \
            [torch.zeros(3)]
        kw = {k: v for k, v in KW.items() if k != "amsgrad"}
        if fn is tierlift.ops.adam_compact_step_:
            fn(p, g, m, c, s, [], **kw, grad_scale=torch.tensor(1000.0))
        else:
            fn(p, g, m, c, s, [], *kw.values(), grad_scale=torch.tensor(1000.0))
        outs.append((p[0], m[0], c[0], s[0]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize(
    "grad_scale, error, match",
    [
        (torch.tensor(2.0, dtype=torch.float64), TypeError, "grad_scale must be float32"),
        (torch.ones(2), ValueError, "1-element"),
        (torch.tensor(0.0), ValueError, "finite and > 0"),
        (torch.tensor(float("nan")), ValueError, "finite and > 0"),
    ],
)
@pytest.mark.parametrize("op", ["adam_step_", "adam_compact_step_"])
def test_op_rejects_bad_grad_scale(op, grad_scale, error, match):
    n = 8
    if op == "adam_step_":
        args = _op_args(n)
        kw = KW
    else:
        p, g, *_ = _op_args(n)
        args = (p, g, [torch.zeros(n, dtype=torch.bfloat16)], [torch.zeros(n, dtype=torch.uint8)],
                [torch.zeros(1)], [])
        kw = {k: v for k, v in KW.items() if k != "amsgrad"}
    before = args[0][0].clone()
    with pytest.raises(error, match=match):
        getattr(torch.ops.tierlift, op)(*args, *kw.values(), grad_scale=grad_scale)
    with pytest.raises(error, match=match):  # the pure-torch reference checks the same
        getattr(tierlift.reference, op)(*args, *kw.values(), grad_scale=grad_scale)
    assert torch.equal(args[0][0], before)


@needs_kernels
def test_opcheck_with_grad_scale():
    args = _op_args(40)
    torch.library.opcheck(torch.ops.tierlift.adam_step_.default,
                          (*args, *KW.values()), {"grad_scale": torch.tensor(1000.0)})
    p, g, *_ = _op_args(40)
    kw = [v for k, v in KW.items() if k != "amsgrad"]
    torch.library.opcheck(
        torch.ops.tierlift.adam_compact_step_.default,
        (p, g, [torch.zeros(40, dtype=torch.bfloat16)], [torch.zeros(40, dtype=torch.uint8)],
         [torch.zeros(1)], [], *kw), {"grad_scale": torch.tensor(1000.0)})


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_cuda_kernel_unscale_matches_cpu_kernel(state_dtype):
    """The CUDA kernels read the scale from device memory: the CPU kernel's bits, skipped steps
    and scale updates included."""
    cpu = _model()
    gpu = copy.deepcopy(cpu).cuda()
    opts = [AdamW(m.parameters(), lr=1e-2, state_dtype=state_dtype) for m in (cpu, gpu)]
    scalers = [_scaler(1000.0), torch.amp.GradScaler("cuda", init_scale=1000.0, growth_interval=2)]
    for step in range(1, 6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 24, generator=g), torch.randn(12, 5, generator=g)
        for o in opts:
            o.zero_grad()
        scalers[0].scale(nn.functional.mse_loss(cpu(x), y)).backward()
        scalers[1].scale(torch.zeros((), device="cuda"))  # creates its scale tensor (lazily)
        if step == 3:
            next(cpu.parameters()).grad.view(-1)[7] = float("inf")
        for p, q in zip(cpu.parameters(), gpu.parameters()):
            q.grad = p.grad.cuda()
        for o, s in zip(opts, scalers):
            s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert torch.equal(_flat(cpu), _flat(gpu).cpu()), f"step {step}"


# ---- torch's constructor error inputs ----


def _construct(cls, params, kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls(params, **kwargs)
    return [w.category for w in caught]


ERROR_INPUTS = [
    pytest.param(ours, theirs, e, id=f"{ours.__name__}-{e.optimizer_error_input.desc}")
    for ours, theirs, fn in ((Adam, torch.optim.Adam, optim_error_inputs_func_adam),
                             (AdamW, torch.optim.AdamW, optim_error_inputs_func_adamw))
    for e in fn("cpu", torch.float32)
]


@pytest.mark.parametrize("ours, theirs, error_input", ERROR_INPUTS)
def test_torch_error_inputs(ours, theirs, error_input):
    """torch's own test_errors inputs (common_optimizers): the same exception or warning type,
    with params as torch gives them and with a real parameter list."""
    oi = error_input.optimizer_error_input
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
    params_variants = [oi.params] if oi.params is not None else \
        [None, [nn.Parameter(torch.randn(2))]]
    for params in params_variants:
        if issubclass(error_input.error_type, Warning):
            assert error_input.error_type in _construct(theirs, params, oi.kwargs)
            assert error_input.error_type in _construct(ours, params, oi.kwargs)
            continue
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            theirs(params, **oi.kwargs)
        with pytest.raises(error_input.error_type):
            ours(params, **oi.kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(fused=True, foreach=True),
        dict(fused=True, differentiable=True),
        dict(lr=torch.tensor([1e-3, 1e-3])),
        dict(betas=(0.9, torch.tensor(0.99))),
        dict(betas=(0, 0.999)),  # torch takes floats or tensors, not ints
        dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),
        dict(lr=torch.tensor(1e-3), foreach=True),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_configurations_torch_refuses_are_refused_alike(kwargs):
    """Including torch's CUDA-only error inputs, which its constructor raises on any device."""
    params = [nn.Parameter(torch.randn(3))]
    with pytest.raises(Exception) as theirs:
        torch.optim.AdamW(params, **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        AdamW(params, **kwargs)
    assert str(ours.value).split(",")[0].split(":")[0] == \
        str(theirs.value).split(",")[0].split(":")[0]


def test_configurations_torch_accepts_stay_accepted():
    params = [nn.Parameter(torch.randn(3))]
    for kwargs in (dict(lr=torch.tensor(1e-3)), dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
                   dict(lr=torch.tensor(1e-3), foreach=True, capturable=True), dict(fused=True),
                   dict(foreach=True)):
        torch.optim.AdamW(params, **kwargs)
        opt = AdamW(params, **kwargs)
        params[0].grad = torch.ones(3)
        opt.step()
