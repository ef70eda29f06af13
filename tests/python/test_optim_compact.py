"""tierlift.optim.Adam/AdamW with state_dtype="bf16" (compact state: bf16 m, 8-bit v codes with
one fp32 scale per 256 elements): the kernel against the pure-torch reference bit for bit, the
v code's error bound, the optimizer API (state layout, state_dict conversions, errors), and a
small training run against fp32 state."""

import copy

import pytest
import torch

import tierlift
from tierlift.optim import Adam, AdamW
from tierlift.reference import optim_compact as ref

needs_ext = pytest.mark.skipif(not tierlift._extension.available(), reason="needs the extension")


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16, torch.uint8: torch.uint8}[t.dtype])


def wide_range(n, gen, lo=-14.0, hi=2.0):
    """Normal values times 2^U(lo, hi): 16 binades inside every block."""
    return torch.randn(n, generator=gen) * torch.exp2(torch.empty(n).uniform_(lo, hi,
                                                                               generator=gen))


def compact_state(n, gen):
    """bf16 m and encoded v with exact zeros and every fifth block all zero."""
    dead = (torch.arange(n) // ref.BLOCK) % 5 == 3
    m = torch.where(dead, 0.0, torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    v = torch.where(dead | (torch.arange(n) % 41 == 0), 0.0, wide_range(n, gen, -12, 2) ** 2)
    codes, scales = ref.quantize_exp_avg_sq(v)
    return m, codes, scales, dead


# ---- the v code ----


def test_code_keeps_zero_and_never_rounds_a_nonzero_v_to_zero():
    v = torch.tensor([0.0, 1.0, 1e-30, 1e-45, 0.5, 0.0] + [0.0] * 300)
    codes, scales = ref.quantize_exp_avg_sq(v)
    assert scales.tolist() == [1.0, 0.0]
    assert codes[:6].tolist() == [0, 255, 1, 1, 247, 0]
    back = ref.dequantize_exp_avg_sq(codes, scales)
    assert (back[v == 0] == 0).all() and (back[v != 0] > 0).all()
    assert (back[2:4] >= v[2:4]).all()  # below the code's range: rounded up, never down


def test_code_relative_error_bound_over_31_binades():
    gen = torch.Generator().manual_seed(3)
    v = torch.exp2(torch.empty(256 * 400).uniform_(-31, 0, generator=gen)).view(400, 256)
    v = v * torch.exp2(torch.empty(400, 1).uniform_(-40, 40, generator=gen))
    v[:, 0] = v.amax(dim=1) * 1.0000001  # each block's max sets its scale
    codes, scales = ref.quantize_exp_avg_sq(v.reshape(-1))
    back = ref.dequantize_exp_avg_sq(codes, scales).view(400, 256)
    rel = ((back.double() - v.double()).abs() / v.double()).max().item()
    assert rel <= 2.0**-4 + 1e-6  # the bound in csrc/core/optim/adam_compact.h
    assert rel > 0.05


def test_every_code_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    for scale in (1.0, 3e-7, 6e30):
        scale = torch.tensor([scale])
        v = ref.dequantize_exp_avg_sq(codes, scale)
        assert (v[1:] > v[:-1]).all()
        again, s = ref.quantize_exp_avg_sq(v)
        assert torch.equal(s, scale) and torch.equal(again, codes)


def test_non_finite_block_reads_back_nan():
    v = torch.ones(600)
    v[300] = torch.inf
    codes, scales = ref.quantize_exp_avg_sq(v)
    assert scales[1].isnan() and not scales[0].isnan() and not scales[2].isnan()
    assert (codes[256:512] == 255).all()
    assert ref.dequantize_exp_avg_sq(codes, scales)[256:512].isnan().all()


# ---- the kernel against the reference, bit for bit ----

SIZES = [1, 255, 256, 257, 1031, 5000]
OPTIONS = [
    dict(decoupled=True, weight_decay=0.1, maximize=False),
    dict(decoupled=False, weight_decay=0.05, maximize=False),
    dict(decoupled=False, weight_decay=0.0, maximize=True),
    dict(decoupled=True, weight_decay=0.0, maximize=True),
]


def run_both(device, grad_dtype, copy_dtype, options, steps=3):
    """The kernel on `device`, the reference always on the CPU: torch's own CUDA kernels fuse
    multiply-adds, so the reference's bits hold only there."""
    gen_state = [compact_state(n, torch.Generator().manual_seed(n)) for n in SIZES]
    p0 = [torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) for n in SIZES]
    state = {}
    for side in ("kernel", "reference"):
        dev = device if side == "kernel" else "cpu"
        state[side] = dict(
            p=[p.clone().to(dev) for p in p0],
            m=[s[0].clone().to(dev) for s in gen_state],
            c=[s[1].clone().to(dev) for s in gen_state],
            s=[s[2].clone().to(dev) for s in gen_state],
            cp=[torch.empty(n, dtype=copy_dtype, device=dev) for n in SIZES]
            if copy_dtype else [],
        )
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(100 + step)
        grads = []
        for n, st in zip(SIZES, gen_state):
            g = torch.where(st[3] | (torch.arange(n) % 37 == 0), 0.0, wide_range(n, gen))
            grads.append(g.to(grad_dtype))
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=step, **options)
        for side, fn in (("kernel", tierlift.ops.adam_compact_step_),
                         ("reference", ref.adam_compact_step_)):
            st = state[side]
            if side == "kernel":
                fn(st["p"], [g.to(device) for g in grads], st["m"], st["c"], st["s"], st["cp"],
                   **kw)
            else:
                fn(st["p"], grads, st["m"], st["c"], st["s"], st["cp"], kw["lr"], kw["beta1"],
                   kw["beta2"], kw["eps"], kw["weight_decay"], step, kw["decoupled"],
                   kw["maximize"])
    a, b = state["kernel"], state["reference"]
    for key in ("p", "m", "c", "s", "cp"):
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(bits(x.cpu()), bits(y.cpu())), f"{key}[{i}] (numel {SIZES[i]})"


@needs_ext
@pytest.mark.parametrize("simd", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", OPTIONS, ids=["adamw-wd", "adam-l2", "adam-max", "adamw-max"])
def test_cpu_kernel_matches_reference_bitwise(monkeypatch, simd, grad_dtype, options):
    monkeypatch.setenv("TIERLIFT_SIMD", simd)
    run_both("cpu", grad_dtype, torch.bfloat16 if grad_dtype == torch.bfloat16 else None,
             options)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference_bitwise(grad_dtype):
    if not tierlift._extension.has_cuda_kernels():
        pytest.skip("extension built without CUDA kernels")
    run_both("cuda", grad_dtype, torch.bfloat16, OPTIONS[0])
    run_both("cuda", grad_dtype, None, OPTIONS[2])


@needs_ext
def test_opcheck():
    n = 300
    args = ([torch.randn(n)], [torch.randn(n, dtype=torch.bfloat16)],
            [torch.zeros(n, dtype=torch.bfloat16)], [torch.zeros(n, dtype=torch.uint8)],
            [torch.zeros(2)], [torch.empty(n, dtype=torch.bfloat16)],
            1e-3, 0.9, 0.999, 1e-8, 0.01, 1, True, False)
    torch.library.opcheck(torch.ops.tierlift.adam_compact_step_.default, args)


@needs_ext
def test_op_rejects_bad_state():
    p, g = torch.randn(300), torch.randn(300)
    m, c, s = torch.zeros(300, dtype=torch.bfloat16), torch.zeros(300, dtype=torch.uint8), \
        torch.zeros(2)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
              decoupled=True, maximize=False)
    with pytest.raises(ValueError, match="exp_avg_sq_scales.*expected 2"):
        tierlift.ops.adam_compact_step_([p], [g], [m], [c], [torch.zeros(1)], [], **kw)
    with pytest.raises(TypeError, match="exp_avgs.*BFloat16"):
        tierlift.ops.adam_compact_step_([p], [g], [m.float()], [c], [s], [], **kw)
    with pytest.raises(TypeError, match="exp_avg_sqs.*Byte"):
        tierlift.ops.adam_compact_step_([p], [g], [m], [c.float()], [s], [], **kw)


# ---- the optimizer ----


def test_state_layout_and_bytes_per_param():
    p = torch.nn.Parameter(torch.randn(1000, 3))
    p.grad = torch.randn_like(p)
    opt = AdamW([p], state_dtype="bf16")
    opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg"].shape == p.shape
    assert "exp_avg_sq" not in st  # torch's key: its optimizers would read the codes as moments
    assert st["exp_avg_sq_codes"].dtype == torch.uint8 and st["exp_avg_sq_codes"].shape == p.shape
    assert st["exp_avg_sq_scale"].dtype == torch.float32
    assert st["exp_avg_sq_scale"].numel() == 12  # ceil(3000 / 256)
    state_bytes = sum(t.numel() * t.element_size() for k, t in st.items() if k != "step")
    assert state_bytes / p.numel() == pytest.approx(2 + 1 + 4 / 256, abs=0.01)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_step_matches_reference_and_stays_close_to_fp32_state(param_dtype):
    torch.manual_seed(0)
    shapes = [(33, 65), (4099,), (7,)]
    params = [torch.nn.Parameter(torch.randn(s).to(param_dtype)) for s in shapes]
    fp32 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, base = AdamW(params, lr=1e-3, state_dtype="bf16"), AdamW(fp32, lr=1e-3)
    masters = [p.detach().float().clone() for p in params]
    m = [torch.zeros(p.numel(), dtype=torch.bfloat16) for p in params]
    c = [torch.zeros(p.numel(), dtype=torch.uint8) for p in params]
    s = [torch.zeros(ref.scale_count(p.numel())) for p in params]
    for step in range(1, 21):
        grads = [torch.randn(p.shape).to(param_dtype) * 0.1 for p in params]
        for p, q, g in zip(params, fp32, grads):
            p.grad, q.grad = g, g.clone()
        ours.step()
        base.step()
        ref.adam_compact_step_([x.view(-1) for x in masters], [g.view(-1) for g in grads], m, c,
                               s, [], 1e-3, 0.9, 0.999, 1e-8, 1e-2, step, True, False)
    for p, q, master in zip(params, fp32, masters):
        got = ours.state[p]["master"] if param_dtype != torch.float32 else p.detach()
        assert torch.equal(bits(got.reshape(-1)), bits(master.view(-1)))
        torch.testing.assert_close(p.float(), q.float(), rtol=0.02, atol=2e-3)


def test_state_dict_roundtrip_and_conversions():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def train(m, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    # torch fp32 state -> compact: quantized on load.
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, torch_opt, 3)
    twin = copy.deepcopy(model)
    compact = AdamW(twin.parameters(), lr=1e-2, state_dtype="bf16")
    compact.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for p_id, saved in torch_opt.state_dict()["state"].items():
        st = compact.state_dict()["state"][p_id]
        codes, scales = ref.quantize_exp_avg_sq(saved["exp_avg_sq"])
        assert torch.equal(st["exp_avg"], saved["exp_avg"].to(torch.bfloat16))
        assert "exp_avg_sq" not in st  # the codes' state-dict key is not torch's
        assert torch.equal(st["exp_avg_sq_codes"], codes)
        assert torch.equal(st["exp_avg_sq_scale"], scales)
    train(twin, compact, 3)
    # compact -> compact: exact.
    sd = copy.deepcopy(compact.state_dict())
    again = AdamW(copy.deepcopy(twin).parameters(), lr=1e-2, state_dtype="bf16")
    again.load_state_dict(copy.deepcopy(sd))
    for p_id, st in sd["state"].items():
        got = again.state_dict()["state"][p_id]
        assert set(got) == set(st)
        for key in st:
            assert got[key].dtype == st[key].dtype and torch.equal(got[key], st[key]), key
    # compact -> fp32 (ours, then torch's): dequantized.
    fp32 = AdamW(copy.deepcopy(twin).parameters(), lr=1e-2)
    fp32.load_state_dict(copy.deepcopy(sd))
    for p_id, st in sd["state"].items():
        got = fp32.state_dict()["state"][p_id]
        assert "exp_avg_sq_scale" not in got
        assert torch.equal(got["exp_avg"], st["exp_avg"].float())
        v = ref.dequantize_exp_avg_sq(st["exp_avg_sq_codes"], st["exp_avg_sq_scale"])
        assert torch.equal(got["exp_avg_sq"], v)
    back = torch.optim.AdamW(copy.deepcopy(twin).parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(fp32.state_dict()))


def test_bad_arguments_are_refused_clearly():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        AdamW([p], state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_dtype='bf16'"):
        Adam([p], amsgrad=True, state_dtype="bf16")
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_dtype='bf16'"):
        Adam([p], amsgrad=True, state_dtype="bf16", offload="cpu")
    opt = AdamW([p], state_dtype="bf16")
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.step()


def test_default_state_dtype_is_fp32():
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.ones(4)
    opt = AdamW([p])
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert "exp_avg_sq_scale" not in opt.state[p]


@pytest.mark.gpu
def test_cuda_params_with_compact_state():
    p = torch.nn.Parameter(torch.randn(3000, device="cuda", dtype=torch.bfloat16))
    q = torch.nn.Parameter(p.detach().cpu().clone())
    ours, cpu = AdamW([p], state_dtype="bf16"), AdamW([q], state_dtype="bf16")
    for _ in range(5):
        g = torch.randn(3000, dtype=torch.bfloat16)
        p.grad, q.grad = g.cuda(), g
        ours.step()
        cpu.step()
    for key in ("master", "exp_avg", "exp_avg_sq_codes", "exp_avg_sq_scale"):
        assert torch.equal(ours.state[p][key].cpu(), cpu.state[q][key]), key


# ---- training ----


def train_mlp(state_dtype, steps=400):
    """A 2-layer MLP fitting a random teacher's outputs plus noise (so the loss settles at a
    floor instead of at ~0, where relative gaps are meaningless); returns the final loss on the
    whole training set."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x = torch.randn(4096, 32)
    with torch.no_grad():
        y = teacher(x) + 0.3 * torch.randn(4096, 8)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 8))
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=state_dtype)
    for step in range(steps):
        batch = slice((step * 128) % 4096, (step * 128) % 4096 + 128)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def test_training_with_compact_state_matches_fp32_state_within_1_percent():
    fp32, compact = train_mlp("fp32"), train_mlp("bf16")
    gap = abs(compact - fp32) / fp32
    print(f"final loss fp32 state {fp32:.6f}, compact state {compact:.6f}, gap {gap:.4%}")
    assert gap < 0.01
