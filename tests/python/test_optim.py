"""tierlift.optim.Adam/AdamW against torch.optim.Adam/AdamW.

What limits exactness: the kernels follow torch's operation order (bias corrections in double,
then fp32 tensor math) but update m with a fused multiply-add as torch's vectorized lerp does,
while torch's scalar tail and other code paths may not; so single elements can differ by an ulp
per step, and 100 steps keep the weights within 1e-6 relative (plus 1e-6 * max|w| absolute for
weights that pass near zero, where relative error is meaningless).
"""

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch

import tierlift
from tierlift.optim import Adam, AdamW

SHAPES = [(1,), (7,), (16,), (17,), (33, 65), (1000, 3), (4099,)]


def make_params(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]


def grads_for(params, steps, dtype):
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randn(p.shape, generator=g).to(dtype) * 0.1 for p in params] for _ in range(steps)
    ]


def assert_close_rel(actual, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1.0))


CONFIGS = [
    dict(cls="AdamW", weight_decay=0.1),
    dict(cls="AdamW", weight_decay=0.0),
    dict(cls="Adam", weight_decay=0.0),
    dict(cls="Adam", weight_decay=0.05),
    dict(cls="AdamW", weight_decay=0.1, amsgrad=True),
    dict(cls="Adam", weight_decay=0.05, amsgrad=True, maximize=True),
    dict(cls="AdamW", weight_decay=0.1, maximize=True, betas=(0.8, 0.99), eps=1e-6),
]


def check_matches_torch(params, config, steps):
    """Steps `params` with ours and an fp32 copy with torch's, then compares weights and state."""
    config = dict(config)
    cls_name = config.pop("cls")
    ours_cls = {"Adam": Adam, "AdamW": AdamW}[cls_name]
    torch_cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[cls_name]
    dtype = params[0].dtype
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = ours_cls(params, lr=1e-2, **config)
    ref = torch_cls(ref_params, lr=1e-2, foreach=False, **config)
    for step_grads in grads_for(params, steps, dtype):
        for p, r, g in zip(params, ref_params, step_grads):
            p.grad = g
            r.grad = g.float()
        ours.step()
        ref.step()
    for p, r in zip(params, ref_params):
        master = ours.state[p].get("master", p)
        assert master.dtype == torch.float32
        assert_close_rel(master, r.detach())
        if dtype != torch.float32:
            # The low-precision weight is the master rounded once, in the same fused pass.
            torch.testing.assert_close(p.detach(), master.to(dtype), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_rel(ours.state[p][key], ref.state[r][key])


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_over_100_steps(simd_path, config, dtype):
    check_matches_torch(make_params(dtype), config, 100)


def noncontiguous_params(dtype):
    """Transposed, permuted and strided-slice views as parameters, with the tensors they view."""
    bases = [torch.randn(8, 6), torch.randn(3, 33, 65), torch.randn(10, 14)]
    bases = [b.to(dtype) for b in bases]
    views = [bases[0].t(), bases[1].permute(2, 0, 1), bases[2][::2, 1:]]
    return [torch.nn.Parameter(v) for v in views], bases


@pytest.mark.parametrize(
    "config", CONFIGS[1:5], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noncontiguous_params_match_torch(config, dtype):
    odd, bases = noncontiguous_params(dtype)
    outside = bases[2].clone()  # the slice's base also holds elements that are no parameter's
    params = make_params(dtype)[:4] + odd
    strides = [p.stride() for p in params]
    with pytest.warns(RuntimeWarning, match="non-contiguous parameters take a slower path"):
        check_matches_torch(params, config, 20)
    # Updated in place: same memory, same layout, and nothing around a sliced view touched.
    assert [p.stride() for p in params] == strides
    for p, base in zip(odd, bases):
        assert p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    mask = torch.ones(bases[2].shape, dtype=torch.bool)
    mask[::2, 1:] = False
    assert torch.equal(bases[2][mask], outside[mask])


def test_simd_paths_agree_bitwise(monkeypatch):
    results = {}
    for path in ("scalar", "avx2", "avx512"):
        monkeypatch.setenv("TIERLIFT_SIMD", path)
        torch.manual_seed(0)
        params = make_params()
        opt = AdamW(params, lr=1e-2, amsgrad=True)
        for step_grads in grads_for(params, 5, torch.float32):
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
        results[tierlift._extension._C.active_simd_level()] = [p.detach().clone() for p in params]
    first = next(iter(results.values()))
    for other in results.values():
        for a, b in zip(first, other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_op_matches_reference(simd_path, grad_dtype, copy_dtype):
    n = 1037
    base = [
        torch.randn(n),
        torch.randn(n).to(grad_dtype),
        torch.randn(n) * 0.1,
        torch.rand(n) * 0.01,
        torch.rand(n) * 0.02,
    ]
    copies = lambda: [torch.empty(n, dtype=copy_dtype)] if copy_dtype else []
    ours = [t.clone() for t in base] + [copies()]
    ref = [t.clone() for t in base] + [copies()]
    kw = dict(
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        step=3,
        decoupled=True,
        amsgrad=True,
        maximize=False,
    )
    for args, fn in ((ours, tierlift.ops.adam_step_), (ref, tierlift.reference.adam_step_)):
        p, g, m, v, vmax, cp = args
        if fn is tierlift.reference.adam_step_:
            fn([p], [g], [m], [v], [vmax], cp, *kw.values())
        else:
            fn([p], [g], [m], [v], [vmax], cp, **kw)
    for a, b in zip(ours[:5], ref[:5]):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-9)
    if copy_dtype:
        torch.testing.assert_close(ours[5][0], ours[0].to(copy_dtype), rtol=0, atol=0)


def test_opcheck():
    n = 300
    args = (
        [torch.randn(n)],
        [torch.randn(n, dtype=torch.bfloat16)],
        [torch.zeros(n)],
        [torch.zeros(n)],
        [],
        [torch.empty(n, dtype=torch.bfloat16)],
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.01,
        1,
        True,
        False,
        False,
    )
    torch.library.opcheck(torch.ops.tierlift.adam_step_.default, args)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_state_dict_roundtrip_with_torch(transposed):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if transposed:  # weights stored column-major, as a checkpoint of a transposed layer may be
        for layer in (model[0], model[2]):
            layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
    twin = copy.deepcopy(model)
    assert all(p.is_contiguous() != transposed for p in twin.parameters() if p.dim() == 2)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def train(m, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, torch_opt, 3)
    # torch -> tierlift: continue training from torch's state.
    twin.load_state_dict(model.state_dict())
    ours = AdamW(twin.parameters(), lr=1e-2)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as after torch.save/load
    train(model, torch_opt, 5)
    slower = pytest.warns(RuntimeWarning, match="non-contiguous") if transposed else nullcontext()
    with slower:
        train(twin, ours, 5)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_close_rel(b.detach(), a.detach())
    # tierlift -> torch: same keys, same tensors.
    back = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    sd_ours, sd_back = ours.state_dict(), back.state_dict()
    assert sd_ours["param_groups"] == sd_back["param_groups"]
    for k, st in sd_ours["state"].items():
        assert set(st) == set(sd_back["state"][k])
        for key in st:
            torch.testing.assert_close(st[key], sd_back["state"][k][key])


def test_noncontiguous_warning_once_per_optimizer_naming_the_params():
    odd, _ = noncontiguous_params(torch.float32)
    plain = torch.nn.Parameter(torch.randn(5))
    opt = AdamW([{"params": [odd[0], plain]}, {"params": [odd[2]], "lr": 0.1}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for p in (*odd, plain):
                p.grad = torch.ones_like(p)
            opt.step()
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert caught[0].category is RuntimeWarning and msg.startswith("AdamW: non-contiguous")
    assert "param_groups[0]['params'][0] (shape (6, 8), stride (1, 6))" in msg
    assert "param_groups[1]['params'][0] (shape (5, 13), stride (28, 1))" in msg
    assert "['params'][1]" not in msg and odd[1] not in opt.state
    assert caught[0].filename == __file__, "points at the caller of step(), past torch's wrappers"
    # Each optimizer warns for itself; one with contiguous parameters only never does.
    with pytest.warns(RuntimeWarning, match=r"param_groups\[0\]\['params'\]\[0\] \(shape"):
        Adam([odd[1]]).step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamW([plain]).step()


def test_scheduler_closure_zero_grad_and_tensor_lr():
    model = torch.nn.Linear(4, 1)
    opt = AdamW(model.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    losses = []
    for _ in range(5):
        losses.append(opt.step(closure).item())
        sched.step()
    assert losses[-1] < losses[0]
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1 * 0.5**5)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_param_groups_with_different_hyperparameters():
    a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
    opt = AdamW([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.0}])
    a.grad, b.grad = torch.ones(10), torch.ones(10)
    opt.step()
    assert torch.all(a < 1) and torch.equal(b.detach(), torch.ones(10) * (1 - 0.0 * 0.01))


def test_params_without_grad_are_skipped_and_keep_their_step():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([a, b])
    a.grad = torch.ones(3)
    opt.step()
    b.grad = torch.ones(3)
    opt.step()
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 1


def test_rejects_sparse_gradients():
    p = torch.nn.Parameter(torch.ones(4))
    opt = AdamW([p])
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match=r"params'\]\[0\] has a sparse gradient"):
        opt.step()


def test_rejects_complex_parameters():
    with pytest.raises(TypeError, match="complex"):
        AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])


def test_rejects_float64_parameters_when_built():
    with pytest.raises(TypeError, match=r"params'\]\[1\] has dtype torch.float64"):
        AdamW([torch.nn.Parameter(torch.ones(2)),
               torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])
    opt = AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(TypeError, match=r"param_groups\[1\].*float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


def test_a_bad_group_leaves_every_group_unchanged():
    # The second group's bad learning rate (a scheduler gone wrong) is found before the first
    # group is stepped: no weight, moment or step count moves.
    good, bad = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = AdamW([{"params": [good]}, {"params": [bad]}], lr=0.1)
    good.grad, bad.grad = torch.ones(4), torch.ones(4)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    assert torch.equal(good, torch.ones(4)) and not opt.state
    opt.param_groups[1]["lr"] = 0.1
    opt.step()
    assert int(opt.state[good]["step"]) == int(opt.state[bad]["step"]) == 1


def test_add_param_group_with_offload_is_refused(tmp_path):
    opt = AdamW([torch.nn.Parameter(torch.ones(4))], offload="cpu")
    try:
        with pytest.raises(RuntimeError, match="pass every group to the constructor"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4))]})
    finally:
        opt.close()


def test_rejects_mixed_devices_in_one_group():
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2, device="meta"))
    opt = AdamW([a, b])
    a.grad = torch.ones(2)
    b.grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError, match=r"\['params'\]\[1\] is on meta"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(2)), "nothing is updated when the group is invalid"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=float("nan")),
        dict(eps=float("inf")),
        dict(betas=(0.9, float("nan"))),
        dict(weight_decay=-1.0),
        dict(betas=(1.0, 0.999)),
    ],
)
def test_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_nan_lr_set_later_is_caught_before_any_update():
    p = torch.nn.Parameter(torch.ones(2))
    opt = AdamW([p])
    opt.param_groups[0]["lr"] = float("nan")
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2))


def test_op_rejects_bad_tensors():
    n = 8
    good = lambda: ([torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], [], [])
    kw = (1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, False, False)
    p, g, m, v, mx, cp = good()
    with pytest.raises(TypeError, match=r"grads\[0\] must be float32, bfloat16 or float16|grads"):
        torch.ops.tierlift.adam_step_(p, [torch.zeros(n, dtype=torch.int32)], m, v, mx, cp, *kw)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has 7 elements"):
        torch.ops.tierlift.adam_step_(p, g, [torch.zeros(7)], v, mx, cp, *kw)
    with pytest.raises(TypeError, match=r"params\[0\] must be float32"):
        torch.ops.tierlift.adam_step_([torch.zeros(n, dtype=torch.float64)], g, m, v, mx, cp, *kw)
    with pytest.raises(ValueError, match="amsgrad needs"):
        torch.ops.tierlift.adam_step_(p, g, m, v, [], cp, *kw[:7], True, False)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.tierlift.adam_step_(
            [torch.zeros(4, 2).t()],
            [torch.zeros(2, 4)],
            [torch.zeros(2, 4)],
            [torch.zeros(2, 4)],
            mx,
            cp,
            *kw,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "noncontiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_cpu_kernel(dtype, noncontiguous):
    params = make_params(dtype) + (noncontiguous_params(dtype)[0] if noncontiguous else [])
    gpu_params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    cpu_opt, gpu_opt = (
        AdamW(params, lr=1e-2, amsgrad=True),
        AdamW(gpu_params, lr=1e-2, amsgrad=True),
    )
    slower = pytest.warns(RuntimeWarning) if noncontiguous else nullcontext()
    with slower:
        for step_grads in grads_for(params, 20, dtype):
            for p, q, g in zip(params, gpu_params, step_grads):
                p.grad, q.grad = g, g.cuda()
            cpu_opt.step()
            gpu_opt.step()
    assert not noncontiguous or not gpu_params[-2].is_contiguous(), "the layout went to the GPU"
    for p, q in zip(params, gpu_params):
        # Same operation order with explicitly rounded intrinsics: bit-identical.
        assert torch.equal(p.detach(), q.detach().cpu())
        assert torch.equal(cpu_opt.state[p]["exp_avg"], gpu_opt.state[q]["exp_avg"].cpu())


@pytest.mark.gpu
def test_cuda_kernel_many_tensors_across_packs():
    # More tensors than one kernel launch takes (64), of one and of several chunks.
    params = [
        torch.nn.Parameter(torch.randn(n, device="cuda")) for n in [1, 70000] * 33 + [5_000_000]
    ]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = AdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for p, r in zip(params, ref):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    ours.step()
    theirs.step()
    for p, r in zip(params, ref):
        assert_close_rel(p.detach(), r.detach())
